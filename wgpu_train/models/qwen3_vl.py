"""The Qwen-style vision part as data: Qwen3-VL's (Qwen3VLForConditionalGeneration, and
Qwen3VLMoeForConditionalGeneration: the same tower beside Qwen3-MoE's language layers) and Qwen3.5's
(Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration: the same tower without DeepStack): the tower's
config (vision_config, the image token ids, the text model's M-RoPE sections over its rotated pairs), its tensors'
names and shapes, and the 3-D M-RoPE positions of a token stream with images (transformers' get_rope_index) as each
rotated pair's position."""
from __future__ import annotations

import dataclasses

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.tower_tensors import checked_names

QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"
QWEN3_5 = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")   # the tower without DeepStack
VISUAL = "visual."          # our names: the file's model.visual. (transformers 5) or visual. (older files)
_PREFIXES = ("model.visual.", "visual.")
_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
             "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "out_hidden_size": 3584, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
_TOKENS = {"image_token_id": 151_655, "vision_start_token_id": 151_652, "vision_end_token_id": 151_653,
           "video_token_id": 151_656}
_QWEN3_5_TOKENS = {"image_token_id": 248_056, "vision_start_token_id": 248_053, "vision_end_token_id": 248_054,
                   "video_token_id": 248_057}
# the text model's defaults where its config.json leaves them out: (head_dim, partial_rotary_factor, mrope_section)
_TEXT_DEFAULTS = {"Qwen3-VL": (None, 1.0, (24, 20, 20)), "Qwen3.5": (256, 0.25, (11, 11, 10))}
LAYER_NORM_EPS = 1e-6       # the blocks' and the mergers' LayerNorms (fixed in transformers' modelling)


@dataclasses.dataclass(frozen=True)
class Qwen3VLVision:
    """A Qwen-style vision tower (Qwen3-VL's, or Qwen3.5's: `name`, no DeepStack): depth blocks of hidden / intermediate / heads, the Conv3d patch embedding
    (in_channels x temporal_patch_size x patch_size^2), a learned square position grid of num_position_embeddings
    bilinearly resampled to each image, the 2-D vision rotary (theta), the patch merger of spatial_merge_size^2
    patches to the text model's hidden size and a DeepStack merger per deepstack index; the image token ids; the
    text model's M-RoPE: mrope_section (pairs of t, h, w, interleaved) over head_dim / 2 rotated pairs; the video
    token id (a video's frame groups take its runs as an image takes image_token_id's)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    text_hidden_size: int
    num_position_embeddings: int
    deepstack_indexes: tuple
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple
    text_head_dim: int
    theta: float = 10000.0
    video_token_id: int = -1
    name: str = "Qwen3-VL"          # or "Qwen3.5", in messages
    # what VisionModel reads of every vision config: no pixel shuffle, an image's tokens plainly causal
    scale_factor = 0
    bidirectional = False

    @classmethod
    def from_config(cls, raw: dict, source: str = "config.json") -> Qwen3VLVision:
        """From a Qwen3-VL's (dense or MoE) or a Qwen3.5's (dense or MoE) config.json (raw dict); what the tower
        here does not implement (another activation or rotary) refused in one line naming the field."""
        arch = (raw.get("architectures") or [raw.get("model_type", "")])[0]
        name = "Qwen3.5" if arch in (*QWEN3_5, "qwen3_5", "qwen3_5_moe") else "Qwen3-VL"
        v = {**_DEFAULTS, **(raw.get("vision_config") or {})}
        if name == "Qwen3.5":       # Qwen3_5VisionModel has no DeepStack mergers, whatever the field says
            v["deepstack_visual_indexes"] = []
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: not supported: vision_config.hidden_act {v['hidden_act']!r} "
                              f"(gelu_pytorch_tanh only)")
        for field in ("patch_size", "temporal_patch_size"):
            if not isinstance(v[field], int):
                raise ConfigError(f"{source}: not supported: vision_config.{field} {v[field]!r} (one integer only)")
        rope = v.get("rope_parameters") or {"rope_type": "axial"}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{source}: not supported: vision_config.rope_parameters.rope_type "
                              f"{rope.get('rope_type')!r} (axial only)")
        if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
            raise ConfigError(f"{source}: vision_config.hidden_size over num_heads must be a multiple of 4")
        side = int(round(v["num_position_embeddings"] ** 0.5))
        if side * side != v["num_position_embeddings"]:
            raise ConfigError(f"{source}: vision_config.num_position_embeddings {v['num_position_embeddings']} is "
                              f"not a square grid")
        text = raw.get("text_config") or {}
        dim, factor, section = _TEXT_DEFAULTS[name]
        head_dim = int(text.get("head_dim") or dim or text.get("hidden_size", 4096) //
                       text.get("num_attention_heads", 32))
        params = text.get("rope_parameters") or text.get("rope_scaling") or {}
        pairs = int(head_dim * float(params.get("partial_rotary_factor", text.get("partial_rotary_factor",
                                                                                    factor)))) // 2
        section = tuple(int(s) for s in params.get("mrope_section", section))
        if len(section) != 3 or sum(section) != pairs:
            raise ConfigError(f"{source}: text_config's mrope_section {list(section)} must be three numbers adding "
                              f"up to the rotated pairs of a head ({pairs})")
        if params.get("mrope_interleaved") is False:
            raise ConfigError(f"{source}: not supported: text_config's mrope_interleaved false (Qwen2-VL's "
                              f"sectioned M-RoPE)")
        if int(v["out_hidden_size"]) != int(text.get("hidden_size", 4096)):
            raise ConfigError(f"{source}: vision_config.out_hidden_size {v['out_hidden_size']} is not the text "
                              f"model's hidden_size {text.get('hidden_size', 4096)}")
        indexes = tuple(int(i) for i in v["deepstack_visual_indexes"])
        if any(not 0 <= i < v["depth"] for i in indexes) or len(indexes) > int(text.get("num_hidden_layers", 32)):
            raise ConfigError(f"{source}: vision_config.deepstack_visual_indexes {list(indexes)} must name blocks "
                              f"of the tower, at most one per text layer")
        tokens = {k: int(raw.get(k, d)) for k, d in (_QWEN3_5_TOKENS if name == "Qwen3.5" else _TOKENS).items()}
        return cls(int(v["depth"]), int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_heads"]),
                   int(v["in_channels"]), int(v["patch_size"]), int(v["temporal_patch_size"]),
                   int(v["spatial_merge_size"]), int(v["out_hidden_size"]), int(v["num_position_embeddings"]),
                   indexes, tokens["image_token_id"], tokens["vision_start_token_id"],
                   tokens["vision_end_token_id"], section, head_dim, float(rope.get("rope_theta", 10000.0)),
                   tokens["video_token_id"], name)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One flattened patch of pixel_values: channels x temporal_patch_size x patch_size^2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per image token (spatial_merge_size^2)."""
        return self.spatial_merge_size ** 2


def tensor_shapes(vc: Qwen3VLVision) -> dict:
    """{our name (under visual.): shape} of every tensor of the tower, its merger and its DeepStack mergers."""
    c, f, merged = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.merge_unit
    out = {VISUAL + "patch_embed.proj.weight": (c, vc.in_channels, vc.temporal_patch_size, vc.patch_size,
                                                vc.patch_size),
           VISUAL + "patch_embed.proj.bias": (c,), VISUAL + "pos_embed.weight": (vc.num_position_embeddings, c)}
    for i in range(vc.depth):
        p = f"{VISUAL}blocks.{i}."
        out.update({p + "norm1.weight": (c,), p + "norm1.bias": (c,), p + "norm2.weight": (c,),
                    p + "norm2.bias": (c,), p + "attn.qkv.weight": (3 * c, c), p + "attn.qkv.bias": (3 * c,),
                    p + "attn.proj.weight": (c, c), p + "attn.proj.bias": (c,), p + "mlp.linear_fc1.weight": (f, c),
                    p + "mlp.linear_fc1.bias": (f,), p + "mlp.linear_fc2.weight": (c, f),
                    p + "mlp.linear_fc2.bias": (c,)})
    for p, norm in ((VISUAL + "merger.", c),
                    *((f"{VISUAL}deepstack_merger_list.{j}.", merged) for j in range(len(vc.deepstack_indexes)))):
        out.update({p + "norm.weight": (norm,), p + "norm.bias": (norm,), p + "linear_fc1.weight": (merged, merged),
                    p + "linear_fc1.bias": (merged,), p + "linear_fc2.weight": (vc.text_hidden_size, merged),
                    p + "linear_fc2.bias": (vc.text_hidden_size,)})
    return out


def visual_names(names) -> dict:
    """{our name: file name} of a checkpoint's tower tensors (model.visual. or visual.)."""
    return {VISUAL + n[len(p):]: n for n in names for p in _PREFIXES if n.startswith(p)}


def check_visual_tensors(tensors: dict, vc: Qwen3VLVision, folder) -> dict:
    """{our name: file name} of the tower in `tensors` ({file name: array-like}), every tensor present with its
    shape; one missing or misshapen refused in one line."""
    return checked_names(visual_names(tensors), tensor_shapes(vc), tensors, folder)


def frame_grids(grids) -> list:
    """Images' and videos' grids (N, 3) -> [(1, h, w)], each video's (t, h, w) as t frame groups: the tower
    attends within each (transformers' cu_seqlens per t) and the text takes each as a run of its own, set off
    by its timestamp (get_rope_index splits video_grid_thw so too)."""
    return [(1, int(h), int(w)) for t, h, w in np.asarray(grids, np.int64).reshape(-1, 3) for _ in range(int(t))]


def rope_index(ids, grids, vc: Qwen3VLVision) -> tuple:
    """One sequence's ids (T,) and the grids of its runs of image (or video) tokens [(t, h, w) in patches, in
    order; a video's frame groups each (1, h, w): frame_grids] -> (positions (3, T) int64:
    each token's t, h and w position, the next position after the sequence): text tokens count on from the
    largest position before them on all three axes; an image's tokens sit at its start on t, and its merged
    row / column added on h / w (transformers' get_rope_index), the text after it starting past its longer side."""
    ids = np.asarray(ids).reshape(-1)
    is_image = np.isin(ids, (vc.image_token_id, vc.video_token_id))
    out = np.zeros((3, ids.size), np.int64)
    grids, pos, i, merge = iter(grids), 0, 0, vc.spatial_merge_size
    while i < ids.size:
        j = i
        while j < ids.size and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
        else:
            t, h, w = next(grids)
            gh, gw = h // merge, w // merge
            if (j - i) != t * gh * gw:
                raise ValueError(f"a run of {j - i} image tokens for an image of {t * gh * gw}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            out[:, i:j] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos
            pos += max(gh, gw)
        i = j
    return out, pos


def mrope_axes(section) -> np.ndarray:
    """The axis (0 t, 1 h, 2 w) of each rotated pair under interleaved M-RoPE: pair j takes h where j % 3 == 1
    and j < 3 * section[1], w where j % 3 == 2 and j < 3 * section[2], t otherwise (transformers'
    recomposition_frequencies)."""
    j = np.arange(sum(section))
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def pair_positions(positions, section) -> np.ndarray:
    """positions (3, B, T) -> (B, T, pairs) int32: each rotated pair's position (RoPE's angle over its
    frequency), the pair's axis of mrope_axes."""
    return np.moveaxis(np.asarray(positions)[mrope_axes(section)], 0, -1).astype(np.int32)


def tower_parameters(vc: Qwen3VLVision) -> int:
    """The tower's weights, its merger's and its DeepStack mergers', counted (tensor_shapes)."""
    return sum(int(np.prod(shape)) for shape in tensor_shapes(vc).values())


def tower_activation_values(vc: Qwen3VLVision, images: int, patches: int, trained: bool = False) -> int:
    """Values the NumPy tower's forward over `images` images of `patches` patches each holds at its peak (all
    the images' patches at once, frozen; fitted to tracemalloc's peak, tests/test_qwen3_vl.py): a block's
    residual, norm, q / k / v, the attention's
    output and the rotations' copies (12 x hidden a patch), the MLP's fc1 output and GELU's temporaries
    (5 x intermediate), four (heads, patches, patches) score arrays of one image, and the merged and DeepStack
    features (text hidden a merged patch each) with a merger's transients (3 x its joined width). With LoRA on
    the tower (trained), every block's activations kept for the backward besides (16 x hidden + 2 x intermediate +
    heads a patch, fitted the same way: the residuals, the norms' outputs, qkv (v a view of it), the rotated q / k,
    the attention's output and its joined copy, the LoRA branches' inputs; fc1's output and GELU's; the log-sum-exp)."""
    p, h, i = images * patches, vc.hidden_size, vc.intermediate_size
    merged = p // vc.merge_unit
    features = (1 + len(vc.deepstack_indexes)) * merged * vc.text_hidden_size
    block = p * (12 * h + 5 * i) + 4 * vc.num_heads * patches * patches
    kept = vc.depth * p * (16 * h + 2 * i + vc.num_heads) if trained else 0
    return block + features + 3 * p * h + kept if images else 0
