"""The embedded GRPO demo's prompts: the embedded word-reversal conversations, each user turn a conversational
prompt and its reversal the "answer" column, which the word-position reward scores."""

from __future__ import annotations

from pathlib import Path

from wgpu_train.assets import default_data_dir
from wgpu_train.data.kinds import DataKind
from wgpu_train.data.sources import DataSplits, resolve_data

DEMO_REWARD = "word_positions"  # the reward of the demo: the share of words in their right place


def demo_prompt_splits(data_dir: str | Path | None = None) -> DataSplits:
    """The embedded dataset's train / valid / test files (or another folder of such conversations, `data_dir`)
    read as prompts: [{"role": "user", "content": "Reverse the order of these words: ..."}], with the answer
    column holding the words reversed. Nothing is drawn at random, so every run and evaluation sees the same."""
    splits = resolve_data(default_data_dir() if data_dir is None else data_dir, valid_split=0.0,
                          kind=DataKind.PROMPTS)
    splits.format = "prompts (the embedded task: reverse the words; the reversal is the answer column)"
    return splits
