"""Layer 4, the engines behind one protocol (protocol.py): the NumPy oracle (numpy/), the WebGPU engine (webgpu/),
what both share (shared/), and Model, the facade users hold (model.py), loaded onto an engine (loading.py) that
backend auto chooses (backend_choice.py), with generation over either (generate.py) and the
adapters and memory a run needs (resources.py)."""
