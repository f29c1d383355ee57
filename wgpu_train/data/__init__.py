"""Layer 2, data: records read from files in any of five shapes, tokenized with loss masks, batched or packed."""
