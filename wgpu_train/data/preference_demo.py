"""The embedded demo's preference pairs, built from the embedded word-reversal task: the correct reversal is
chosen, a wrong order of the same words rejected."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from wgpu_train.data.preference_records import PreferenceRecord
from wgpu_train.data.records import Message


def wrong_order(answer: str, rng: np.random.Generator) -> str | None:
    """The words of `answer` in a random order other than their own (None when every order reads the same:
    fewer than two distinct words)."""
    words = answer.split()
    if len(set(words)) < 2:
        return None
    while True:
        shuffled = " ".join(words[i] for i in rng.permutation(len(words)))
        if shuffled != " ".join(words):
            return shuffled


def demo_preference_records(records: Sequence[Sequence[Message]], rng: np.random.Generator) -> list[PreferenceRecord]:
    """Conversational pairs from SFT conversations (the embedded dataset's records, read with resolve_data): the
    messages before its last answer are the prompt, the answer is chosen, and the same words in another order
    (drawn from `rng`, so a seeded generator gives the same pairs) are rejected. A conversation whose answer has
    no other order is left out."""
    pairs = []
    for record in records:
        last = max(i for i, m in enumerate(record) if m["role"] == "assistant")
        prompt, answer = record[:last], record[last]
        rejected = wrong_order(answer["content"], rng)
        if rejected is None:
            continue
        pairs.append(PreferenceRecord([dict(m) for m in prompt], [dict(answer)],
                                      [{"role": "assistant", "content": rejected}], getattr(record, "source", "")))
    return pairs


def demo_preference_splits(splits, seed: int, unpaired: bool, names: Sequence[str] = ("train", "valid")):
    """The embedded dataset's DataSplits (read with resolve_data) with the splits `names`, in that order, turned
    into the demo's pairs (unpaired: KTO's examples), one default_rng(seed) drawing every rejected order: a run and
    `wgpu-train eval` of the same seed build the same pairs."""
    from wgpu_train.data.preference_records import unpair_preferences

    rng = np.random.default_rng(seed)
    for name in names:
        pairs = demo_preference_records(getattr(splits, name), rng)
        setattr(splits, name, unpair_preferences(pairs) if unpaired else pairs)
    kind = "unpaired" if unpaired else "preference"
    splits.format = f"{kind} (the embedded task: the right word order chosen, a wrong one rejected)"
    return splits
