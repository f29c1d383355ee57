"""Layer 4, the engines behind one protocol (protocol.py): the NumPy oracle (numpy/), the WebGPU engine (webgpu/),
and Model, the facade users hold (model.py), with generation over either (generate.py)."""
