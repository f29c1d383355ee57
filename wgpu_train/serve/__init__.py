"""wgpu-train serve: an OpenAI-compatible HTTP server over one Model, its base and many LoRA adapters."""
