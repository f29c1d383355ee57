"""Layer 2, the architectures as data: config.json read into ModelConfig, RoPE, multimodal wrappers, the decoder
layer plan, a model folder's weights, GGUF export."""
