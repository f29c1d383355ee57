"""LFM2-VL's vision part as data (Lfm2VlForConditionalGeneration): the SigLIP2 NaFlex tower's vision_config and the
projector's (pixel unshuffle by downsample_factor, LayerNorm, Linear, GELU, Linear), the image token id, the tensors'
names in a checkpoint (hub and transformers 5 layouts) with their shapes; what the tower here does not implement
refused by field."""
from __future__ import annotations

import dataclasses

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.tower_tensors import checked_names, encoder_shapes

LFM2_VL = "Lfm2VlForConditionalGeneration"
TOWER, PROJ = "vision_tower.", "multi_modal_projector."      # our names' prefixes (models/vision.py's too)
# the checkpoint's prefixes: transformers 5's module tree and the older files' (the tower under vision_model.)
_PREFIXES = (("model.vision_tower.", TOWER), ("vision_tower.", TOWER), ("model.multi_modal_projector.", PROJ),
             ("multi_modal_projector.", PROJ))
# transformers 5.25's Siglip2VisionConfig and Lfm2VlConfig defaults
_SIGLIP2 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
            "num_channels": 3, "patch_size": 16, "num_patches": 256, "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6}
_LFM2_VL = {"image_token_id": 396, "projector_hidden_act": "gelu", "projector_hidden_size": 2560,
            "projector_bias": True, "projector_use_layernorm": True, "downsample_factor": 2}


@dataclasses.dataclass(frozen=True)
class Lfm2VlVision:
    """The tower (hidden, intermediate, layers, heads, channels, patch size, the learned position grid's
    num_patches, the layer norms' eps) and the projector (downsample_factor, its hidden size, bias and LayerNorm
    switches) of an LFM2-VL checkpoint, the text model's hidden size and the image token id."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    num_patches: int
    layer_norm_eps: float
    downsample_factor: int
    projector_hidden_size: int
    projector_bias: bool
    projector_use_layernorm: bool
    text_hidden_size: int
    image_token_id: int
    name: str = "LFM2-VL"

    @classmethod
    def from_config(cls, raw: dict, source: str = "config.json") -> Lfm2VlVision:
        """From config.json (raw dict); an activation, head or grid the tower here does not implement refused."""
        v = {**_SIGLIP2, **(raw.get("vision_config") or {})}
        top = {**_LFM2_VL, **raw}
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: not supported: vision_config.hidden_act {v['hidden_act']!r} "
                              f"(gelu_pytorch_tanh only)")
        if top["projector_hidden_act"] != "gelu":
            raise ConfigError(f"{source}: not supported: projector_hidden_act {top['projector_hidden_act']!r} "
                              f"(gelu only)")
        if v["hidden_size"] % v["num_attention_heads"]:
            raise ConfigError(f"{source}: vision_config.hidden_size is not a multiple of its num_attention_heads")
        side = int(round(v["num_patches"] ** 0.5))
        if side * side != v["num_patches"]:
            raise ConfigError(f"{source}: vision_config.num_patches {v['num_patches']} is not a square grid")
        return cls(int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_hidden_layers"]),
                   int(v["num_attention_heads"]), int(v["num_channels"]), int(v["patch_size"]),
                   int(v["num_patches"]), float(v["layer_norm_eps"]), int(top["downsample_factor"]),
                   int(top["projector_hidden_size"]), bool(top["projector_bias"]),
                   bool(top["projector_use_layernorm"]), int((raw.get("text_config") or {}).get("hidden_size", 2048)),
                   int(top["image_token_id"]))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """The learned position grid's side (num_patches is its square)."""
        return int(round(self.num_patches ** 0.5))


def tensor_shapes(vc: Lfm2VlVision) -> dict:
    """{our name: shape} of every tensor of the tower and the projector."""
    c, f, u = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.downsample_factor ** 2
    e = TOWER + "embeddings."
    out = {e + "patch_embedding.weight": (c, vc.num_channels * vc.patch_size ** 2), e + "patch_embedding.bias": (c,),
           e + "position_embedding.weight": (vc.num_patches, c),
           TOWER + "post_layernorm.weight": (c,), TOWER + "post_layernorm.bias": (c,),
           PROJ + "linear_1.weight": (vc.projector_hidden_size, u),
           PROJ + "linear_2.weight": (vc.text_hidden_size, vc.projector_hidden_size)}
    if vc.projector_bias:
        out.update({PROJ + "linear_1.bias": (vc.projector_hidden_size,),
                    PROJ + "linear_2.bias": (vc.text_hidden_size,)})
    if vc.projector_use_layernorm:
        out.update({PROJ + "layer_norm.weight": (u,), PROJ + "layer_norm.bias": (u,)})
    out.update(encoder_shapes(TOWER, vc.num_layers, c, f))
    return out


def lfm2_vl_names(names) -> dict:
    """{our name: file name} of a checkpoint's tower and projector tensors, in either layout (the unused SigLIP2
    pooling head, where a checkpoint keeps one, left out)."""
    out = {}
    for name in names:
        prefix, ours = next(((p, o) for p, o in _PREFIXES if name.startswith(p)), (None, None))
        if prefix is not None:
            rest = name[len(prefix):].removeprefix("vision_model.")
            if not rest.startswith("head."):
                out[ours + rest] = name
    return out


def check_lfm2_vl_tensors(tensors: dict, vc: Lfm2VlVision, folder) -> dict:
    """{our name: file name} of the tower and projector in `tensors` ({file name: array-like}), every tensor
    present with its shape; one missing or misshapen refused in one line."""
    return checked_names(lfm2_vl_names(tensors), tensor_shapes(vc), tensors, folder)


def tower_parameters(vc: Lfm2VlVision) -> int:
    """The tower's and the projector's weights, counted (the unused pooling head left out)."""
    return sum(int(np.prod(shape)) for shape in tensor_shapes(vc).values())


def tower_activation_values(vc: Lfm2VlVision, patches: int, tokens: int, kept_tiles: int = 0) -> int:
    """Values the NumPy tower's frozen forward holds at its peak, a tile at a time, the largest of `patches`
    patches (SigLIP's encoder layer, as models/vision.tower_activation_values counts it: 12 x hidden and 5 x
    intermediate a patch, four (heads, P, P) score arrays; the position grid and its resizing in float64, two
    values each; the tile's unshuffled and projected tokens), beside the `tokens` projected image tokens of the
    step's images so far. With LoRA on the tower, the forward keeps `kept_tiles` tiles' activations for the
    backward (9 x hidden + 2 x intermediate + heads a patch in each layer, every LoRA module's input among them,
    and the projector's; tracemalloc's peak was up to a quarter above it on the tiny config)."""
    p, h, i, f = patches, vc.hidden_size, vc.intermediate_size, vc.downsample_factor ** 2
    grid = 2 * (vc.num_patches + p) * h
    projector = p // f * (2 * f * h + vc.projector_hidden_size)
    kept = kept_tiles * (vc.num_layers * p * (9 * h + 2 * i + vc.num_heads) + p * h + projector)
    return p * (12 * h + 5 * i) + 4 * vc.num_heads * p * p + grid + projector + tokens * vc.text_hidden_size + kept
