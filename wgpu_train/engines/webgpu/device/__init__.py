"""The thin WebGPU runtime: adapters and the device, caches, one kernel descriptor and launch path, the per-step
recorder, timing."""
