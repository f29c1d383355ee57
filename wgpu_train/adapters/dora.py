"""DoRA (weight-decomposed LoRA, PEFT's use_dora) on the host: the weight norm, the magnitude's
initialisation, the merge, the PEFT tensor names and the engines' module entries. The engines' op pairs
are engines/numpy/ops.py's dora_* (shaders/dora.wgsl on the GPU)."""
from __future__ import annotations

import numpy as np

MAGNITUDE = "lora_magnitude_vector"     # PEFT's name of the magnitude m (out,) under a module


def magnitude_key(path: str) -> str:
    """The PEFT file key of a module's magnitude (no ".weight": PEFT strips it on save)."""
    return f"base_model.model.{path}.{MAGNITUDE}"


def weight_norm(w, a, b, scale) -> np.ndarray:
    """||W + scale * B A|| over the input dim (out,), in float64: W (out, in), A (r, in), B (out, r)."""
    full = np.asarray(w, np.float64) + scale * (np.asarray(b, np.float64) @ np.asarray(a, np.float64))
    return np.linalg.norm(full, axis=1)


def merged(w, a, b, scale, magnitude) -> np.ndarray:
    """PEFT's DoRA merge, float32: (m / ||W + s B A||)[:, None] * (W + s B A)."""
    full = np.asarray(w, np.float64) + scale * (np.asarray(b, np.float64) @ np.asarray(a, np.float64))
    return ((np.asarray(magnitude, np.float64) / np.linalg.norm(full, axis=1))[:, None] * full).astype(np.float32)


def split_entry(entry) -> tuple:
    """An engine's set_lora entry (A, B, scale, dropout) or (A, B, scale, dropout, magnitude) as five values,
    magnitude None for a plain LoRA module."""
    a, b, scale, dropout, *rest = entry
    return a, b, scale, dropout, (rest[0] if rest else None)
