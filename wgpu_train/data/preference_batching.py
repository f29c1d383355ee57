"""Preference examples -> optimizer steps and engine rows: a resumable stream of steps over examples (pairs, or
KTO's unpaired examples read in order), each step's micro-batches of rows, and KTO's mismatched pairs."""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from wgpu_train.data.batching import Batch, Example, collate
from wgpu_train.errors import ConfigError, DataError


class PreferenceStream:
    """Endless, resumable stream of steps, each the indices of `per_step` examples: epoch e's order is
    np.random.default_rng([seed, e]).permutation(n), or with shuffle False the examples' own order (KTO, whose
    mismatched pairs TRL builds from neighbours in that order). A short last step keeps what is left.

    The Trainer reads it as it reads data.batching.BatchStream: epoch, position, epoch_batches(epoch), len(),
    state_dict() and load_state_dict()."""

    def __init__(self, examples: Sequence, per_step: int, seed: int, shuffle: bool = True):
        if not examples:
            raise DataError("no training examples left after tokenization")
        self.examples, self.per_step, self.seed, self.shuffle = examples, per_step, seed, shuffle
        self.epoch = 0
        self.position = 0
        self._cache: tuple[int, list] | None = None
        self._fingerprint: str | None = None

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The steps of `epoch`: arrays of example indices (deterministic in seed and epoch)."""
        if self._cache is None or self._cache[0] != epoch:
            n = len(self.examples)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._cache = (epoch, [order[i:i + self.per_step] for i in range(0, n, self.per_step)])
        return self._cache[1]

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch))

    @staticmethod
    def example_ids(ex) -> tuple:
        """The token id arrays the fingerprint hashes of one example."""
        return example_ids(ex)

    def fingerprint(self) -> str:
        """A hash of every example's token ids (and label), in order."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            for ex in self.examples:
                for ids in self.example_ids(ex):
                    h.update(np.int64(ids.size).tobytes())
                    h.update(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "n_examples": len(self.examples),
                "batch_size": self.per_step, "shuffle": self.shuffle, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict() of a stream over the same examples; ConfigError when they differ."""
        if state.get("n_examples") != len(self.examples) or state.get("fingerprint") != self.fingerprint():
            raise ConfigError("the training data changed since the checkpoint; resume with the data it was "
                              "trained on")
        if state.get("batch_size") != self.per_step:
            raise ConfigError(f"cannot resume the data stream: it was saved with {state.get('batch_size')} "
                              f"examples per step, now {self.per_step}")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])


def example_ids(ex) -> tuple:
    """The token id arrays of a preference example (PreferenceExample or UnpairedExample)."""
    if hasattr(ex, "chosen_ids"):
        return ex.prompt_ids, ex.chosen_ids, ex.rejected_ids
    return ex.prompt_ids, ex.completion_ids, np.array([int(ex.label)], np.int32)


def pair_rows(examples: Sequence) -> list[Example]:
    """The rows of P pairs: every chosen row, then every rejected row (TRL's concatenated batch order)."""
    rows = [ex.rows() for ex in examples]
    return [c for c, _ in rows] + [r for _, r in rows]


def kl_partners(n: int, batch_size: int) -> np.ndarray:
    """KTO's mismatched pairs (TRL's KL completions): in each run of batch_size consecutive examples, example i
    takes the completion of the example before it, the first the last's; (n,) partner indices."""
    partner = np.arange(n) - 1
    for start in range(0, n, batch_size):
        partner[start] = min(start + batch_size, n) - 1
    return partner


def row_batches(rows: Sequence[Example], rows_per_micro: int, pad_id: int, pad_to_multiple: int) -> list[Batch]:
    """Micro-batches of consecutive rows, each padded to its longest row."""
    if rows_per_micro < 1:
        raise ConfigError(f"rows per micro-batch must be at least 1, got {rows_per_micro}")
    return [collate([[r] for r in rows[i:i + rows_per_micro]], pad_id=pad_id, pad_to_multiple=pad_to_multiple)
            for i in range(0, len(rows), rows_per_micro)]
