"""What the vision tower families (models/vision.py's SigLIP, qwen3_vl.py's, lfm2_vl.py's) share about their
checkpoint tensors: the one check that each tensor a family's shapes name is present with its shape, and the SigLIP
encoder layers' shapes (SigLIP's and LFM2-VL's SigLIP2 towers)."""
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


def encoder_shapes(tower: str, layers: int, c: int, f: int) -> dict:
    """{name: shape} of a SigLIP encoder's `layers` layers under `tower` (the tower's prefix): their two LayerNorms,
    the attention's q / k / v / out projections and the MLP's fc1 / fc2, with biases; c the width, f the MLP's."""
    out = {}
    for i in range(layers):
        p = f"{tower}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            out.update({f"{p}{norm}.weight": (c,), f"{p}{norm}.bias": (c,)})
        for m in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out.update({f"{p}self_attn.{m}.weight": (c, c), f"{p}self_attn.{m}.bias": (c,)})
        out.update({f"{p}mlp.fc1.weight": (f, c), f"{p}mlp.fc1.bias": (f,), f"{p}mlp.fc2.weight": (c, f),
                    f"{p}mlp.fc2.bias": (c,)})
    return out
