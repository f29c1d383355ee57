"""Activations and their gradients at a pipeline stage's boundary, as they travel between stages: in the run's
precision (bf16: the uint16 top halves, f16: float16, fp32: float32), exactly the values the stage stored."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.protocol import Precision
from wgpu_train.engines.shared.quant import bfloat16_bits, bfloat16_values


def pack_boundary(x, precision: Precision | str) -> np.ndarray:
    """x (N, C) float32, already rounded to `precision` where the engine stores it, in its transfer format: a
    16-bit precision travels in two bytes an element, and packing it loses nothing."""
    precision = Precision.parse(precision)
    if precision is Precision.BF16:
        return bfloat16_bits(x)
    if precision is Precision.F16:
        return np.asarray(x, np.float32).astype(np.float16)
    return np.asarray(x, np.float32)


def unpack_boundary(packed: np.ndarray) -> np.ndarray:
    """pack_boundary's array as float32 values (N, C)."""
    if packed.dtype == np.uint16:
        return bfloat16_values(packed).reshape(packed.shape)
    return packed.astype(np.float32, copy=False)
