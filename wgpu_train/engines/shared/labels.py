"""Labels -> the targets every engine scores: Hugging Face's shift by one position."""
from __future__ import annotations

import numpy as np

from wgpu_train.data.records import IGNORE_INDEX


def shift_labels(labels):
    """Hugging Face's convention: logits at t predict labels[t + 1]; (B, T) -> targets (B, T)."""
    targets = np.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets
