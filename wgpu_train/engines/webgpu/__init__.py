"""WebGPU backend: runtime (device, buffers, caches), kernel wrappers, the training engine."""
