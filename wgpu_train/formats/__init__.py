"""Layer 1, files and formats that know no model: safetensors, Hugging Face hub ids, tokenizers and chat templates."""
