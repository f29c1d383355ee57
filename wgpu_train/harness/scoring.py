"""Log-likelihoods of token continuations on a Model, batched by length into the trainer's padded buckets (plain
NumPy over the Model: lm_eval's requests become token ids in harness/lm.py)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from wgpu_train.data.batching import Example, collate
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.errors import ConfigError
from wgpu_train.training.config import PAD_MULTIPLE


def model_input(context: Sequence[int], continuation: Sequence[int], max_length: int) -> tuple[int, ...]:
    """The tokens the model reads to score `continuation` after `context`: both joined, the last token left out
    (nothing is predicted after it), cut from the left to max_length tokens (lm_eval's rule for causal LMs); a
    continuation longer than max_length cannot be scored (a ConfigError)."""
    if len(continuation) > max_length:
        raise ConfigError(f"a continuation of {len(continuation)} tokens cannot be scored within the model's "
                          f"{max_length} positions")
    return tuple(int(t) for t in (list(context) + list(continuation))[-(max_length + 1):][:-1])


def continuation_scores(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int,
                        max_length: int, pad_id: int = 0, on_done: Callable[[int], None] | None = None
                        ) -> list[tuple[float, bool]]:
    """(log P(continuation | context), is_greedy) for each (context ids, continuation ids) pair, in order.

    The log-probabilities are the float64 sum of the log-softmax of the engine's float32 logits at the
    continuation's positions; is_greedy says whether the argmax at each of them is the continuation's token.
    Pairs whose model inputs are the same tokens (a multiple-choice question's one-token answers) are computed
    once. The inputs go longest first, `batch_size` rows per engine call, each batch right-padded to a multiple
    of PAD_MULTIPLE as the trainer's evaluation pads them, so the engine sees few distinct shapes.
    `on_done(n)` is called as n more pairs are scored (a progress bar).
    """
    inputs = [model_input(c, x, max_length) for c, x in pairs]
    unique = sorted(set(inputs), key=lambda ids: (-len(ids), ids))
    readers: dict[tuple, list[int]] = {}          # model input -> the pairs that read its logits
    for i, ids in enumerate(inputs):
        readers.setdefault(ids, []).append(i)
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    for b0 in range(0, len(unique), batch_size):
        group = unique[b0:b0 + batch_size]
        rows = [[Example(np.asarray(ids, np.int32), np.full(len(ids), IGNORE_INDEX, np.int64))] for ids in group]
        batch = collate(rows, pad_id=pad_id, pad_to_multiple=PAD_MULTIPLE)
        logits = model.logits(batch.input_ids, batch.attention_mask)                  # (B, T, V) float32
        for r, ids in enumerate(group):
            for i in readers[ids]:
                target = np.asarray(pairs[i][1], dtype=np.int64)
                n = target.size
                scored = logits[r, len(ids) - n:len(ids)].astype(np.float64)          # (n, V)
                top = scored.max(axis=-1, keepdims=True)
                log_probs = scored - (top + np.log(np.exp(scored - top).sum(axis=-1, keepdims=True)))
                chosen = log_probs[np.arange(n), target]                             # (n,)
                out[i] = (float(chosen.sum()), bool((scored.argmax(axis=-1) == target).all()))
            if on_done is not None:
                on_done(len(readers[ids]))
    return out  # type: ignore[return-value]
