"""Layer 2, data: records read from files in any of five shapes (or as preference pairs, unpaired records or GRPO's
prompts), tokenized with loss masks, batched or packed."""
