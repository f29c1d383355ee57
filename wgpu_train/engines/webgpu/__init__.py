"""The WebGPU engine: the engine (engine.py) and its parts, the op wrappers, buffer planning (memory.py); tuned
kernel families in tuned/, the thin runtime in device/."""
