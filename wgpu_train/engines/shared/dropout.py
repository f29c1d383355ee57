"""The counter-based hash of LoRA dropout both engines draw their masks and per-module seeds from, so that the
GPU drops exactly the elements the NumPy oracle drops."""
from __future__ import annotations

import numpy as np


def pcg_hash(v):
    """The PCG output hash on uint32 (wrapping), identical to pcg_hash in shaders/lora_dropout.wgsl."""
    v = np.asarray(v, dtype=np.uint32)
    with np.errstate(over="ignore"):
        s = v * np.uint32(747796405) + np.uint32(2891336453)
        w = ((s >> ((s >> np.uint32(28)) + np.uint32(4))) ^ s) * np.uint32(277803737)
    return (w >> np.uint32(22)) ^ w
