"""Layer 6, running a fine-tuning: finetune() in this process or data-parallel on Ray Train workers."""
