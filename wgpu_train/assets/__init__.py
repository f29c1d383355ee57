"""The embedded default: a small pretrained Llama-architecture base model with its tokenizer, and an instruction
dataset that it cannot yet follow, so that `wgpu-train finetune` with no arguments shows LoRA learning a task.
Built by tools/build_assets.py; see README.md in this folder for the recipe and the measured numbers."""
from __future__ import annotations

from pathlib import Path

__all__ = ["TASK_DESCRIPTION", "TASK_INSTRUCTION", "WORDS", "default_data_dir", "default_model_dir", "default_recipe",
           "default_vision_model_dir"]

_HERE = Path(__file__).resolve().parent

TASK_INSTRUCTION = "Reverse the order of these words:"
TASK_DESCRIPTION = (
    "word reversal: the user asks 'Reverse the order of these words: red fox moon' (2 to 4 distinct words from a "
    "100-word list) and the answer is the words in reverse order, 'moon fox red'; scored by exact match of the "
    "greedy answer on held-out word combinations"
)

# The vocabulary of the task and of the pretraining corpus (each word is a single token, with or without a
# leading space).
WORDS = tuple("""
red blue green black white pink gray gold brown cat dog cow pig fox owl bee ant bat hen rat
eel yak elk ram fish bird frog duck goat lion wolf bear deer seal crab swan toad mole hawk apple
pear plum lime lemon grape melon peach mango kiwi sun moon star rain snow wind fire ice rock sand
tree leaf rose lake hill sea sky car bus ship boat train bike road door box cup bowl pen book
desk lamp bell ring key coin hat shoe sock coat bag map milk cake bread salt rice egg tea jam nut
""".split())


def default_model_dir() -> Path:
    """The embedded base model: a Hugging Face folder (config.json, model.safetensors, tokenizer files)."""
    return _HERE / "model"


def default_vision_model_dir() -> Path:
    """The image demo's tiny Gemma 3 vision-language model folder (built by tools/build_vision_demo.py)."""
    return _HERE / "vision_model"


def default_data_dir() -> Path:
    """The embedded dataset: a folder with train.jsonl, valid.jsonl and test.jsonl in chat format."""
    return _HERE / "data"


def default_recipe() -> dict:
    """TrainConfig values of the default run (recipe.toml): the LoRA recipe verified on this model and task."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib

    return tomllib.loads((_HERE / "recipe.toml").read_text())
