"""The one check of a vision tower's tensors in a checkpoint, for every tower family (models/vision.py's SigLIP,
qwen3_vl.py's, lfm2_vl.py's): each tensor the family's shapes name present, with its shape."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import ModelFileError


def checked_names(names: dict, shapes: dict, tensors: dict, folder) -> dict:
    """names ({our name: file name}) after checking that every one of `shapes` ({our name: shape}) is there in
    `tensors` ({file name: array-like}) with that shape; one missing or misshapen refused in one line."""
    for ours, shape in shapes.items():
        if ours not in names:
            raise ModelFileError(f"{folder}: missing the vision tensor {ours}")
        got = tuple(np.shape(tensors[names[ours]]))
        if got != shape:
            raise ModelFileError(f"{folder}: vision tensor {ours} has shape {got}, expected {shape}")
    return names
