"""Layer 3, PEFT's LoRA: LoraConfig, where LoRA goes (layout), its initialisations, DoRA, modules_to_save, adapter
files."""
