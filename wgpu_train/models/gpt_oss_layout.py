"""Where gpt-oss checkpoints keep an MoE layer's experts, against ours (gate_up_proj (E, 2I, hidden) with its rows
alternating gate and up, as gpt-oss interleaves them; down_proj (E, hidden, I)): transformers 5's save_pretrained
writes them transposed, gate_up_proj (E, hidden, 2I) and down_proj (E, I, hidden); the hub's checkpoints as MXFP4
(`<name>_blocks` and `<name>_scales`, formats/mxfp4.py) in our orientation. The biases, the router (mlp.router,
with its bias) and the attention sinks keep their names."""
from __future__ import annotations

from wgpu_train.errors import ModelFileError
from wgpu_train.formats.mxfp4 import Mxfp4
from wgpu_train.formats.safetensors import TensorMap, Transposed

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def _expert_names(num_layers: int):
    return [f"model.layers.{i}.mlp.experts.{p}" for i in range(num_layers) for p in EXPERT_TENSORS]


def read_experts(tensors: dict, num_layers: int, source: str) -> dict:
    """A gpt-oss checkpoint's raw tensors (name -> (bytes, dtype)) with each expert tensor in our layout: made
    from its MXFP4 blocks and scales (dequantised when read), or transposed from transformers' layout; ModelFileError
    for an MXFP4 tensor whose blocks or scales are missing."""
    out = dict(tensors)
    for name in _expert_names(num_layers):
        blocks, scales = name + "_blocks", name + "_scales"
        if blocks in out or scales in out:
            for part, other in ((blocks, scales), (scales, blocks)):
                if part not in out:
                    raise ModelFileError(f"{source}: MXFP4 tensor {other} has no {part}")
            out[name] = (Mxfp4(out.pop(blocks)[0], out.pop(scales)[0], name, source), "U8")
        elif name in out:
            raw, dtype = out[name]
            out[name] = (Transposed(raw), dtype)
    return out


def hub_layout(weights, num_layers: int) -> TensorMap:
    """Our tensors (name -> array, read one at a time) with the expert tensors transposed back to transformers'
    layout, as its save_pretrained writes a dequantised gpt-oss (and from_pretrained reads one)."""
    experts = set(_expert_names(num_layers))

    def fetch(name: str):
        x = weights[name]
        return x.transpose(0, 2, 1) if name in experts else x

    return TensorMap(list(weights), fetch)
