"""The vision part of Gemma 3 and of SmolVLM / Idefics3 as data: the SigLIP tower's and the projector's config
(vision_config; Gemma 3's mm_tokens_per_image and image token ids, SmolVLM's pixel-shuffle scale_factor), their
tensors' names in a checkpoint (any layout) with their shapes, and where an image's tokens lie in a token stream
(Gemma 3's bidirectional blocks; SmolVLM's are causal)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.tower_tensors import checked_names, encoder_shapes
from wgpu_train.models.lfm2_vl import LFM2_VL, Lfm2VlVision
from wgpu_train.models.qwen3_vl import QWEN3_5, QWEN3_VL, QWEN3_VL_MOE, VISUAL, Qwen3VLVision

# the tower's and the projector's tensors: the old layout (hub files, save_pretrained) and transformers' live one;
# the hub's files put the tower's own under vision_tower.vision_model., transformers 5 under vision_tower.
_PREFIXES = (("vision_tower.", "multi_modal_projector."), ("model.vision_tower.", "model.multi_modal_projector."),
             ("model.vision_model.", "model.connector."))       # SmolVLM's / Idefics3's, its connector our projector
TOWER = "vision_tower."
PROJ = "multi_modal_projector."
CONNECTOR = PROJ + "modality_projection.proj"     # SmolVLM's / Idefics3's connector projection, a LoRA target
_SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
_GEMMA3_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
                    "image_token_index": 262_144}
SMOLVLM = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
_SMOLVLM_DEFAULTS = {**_SIGLIP_DEFAULTS, "hidden_size": 1152, "num_attention_heads": 16, "patch_size": 32}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A Gemma3ForConditionalGeneration's vision part: the SigLIP tower (hidden, intermediate, layers, heads,
    channels, image and patch size, the layer norms' eps), the projector's pooled tokens per image, the text
    model's hidden size it projects to, and the token ids of an image's placeholder, its start and its end.
    SmolVLM's / Idefics3's (scale_factor > 0): the connector's pixel shuffle by scale_factor and its projection;
    mm_tokens_per_image is then a tile's tokens (image_seq_len), and boi / eoi are -1 (the tokenizer names its
    image tokens)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    scale_factor: int = 0

    @classmethod
    def from_config(cls, raw: dict, source: str = "config.json") -> VisionConfig:
        """From a multimodal config.json (raw dict); what the tower's math here does not implement is refused.
        Qwen3-VL's and Qwen3.5's are their own class, models/qwen3_vl.Qwen3VLVision."""
        arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
        if arch in (QWEN3_VL, "qwen3_vl", QWEN3_VL_MOE, "qwen3_vl_moe", *QWEN3_5,
                    "qwen3_5", "qwen3_5_moe"):   # models/qwen3_vl.py
            return Qwen3VLVision.from_config(raw, source)
        if arch in (LFM2_VL, "lfm2_vl"):       # models/lfm2_vl.py
            return Lfm2VlVision.from_config(raw, source)
        if arch not in ("Gemma3ForConditionalGeneration", "gemma3", *SMOLVLM):
            raise ConfigError(f"{source}: images are not supported for {arch} (Gemma3ForConditionalGeneration, "
                              f"{', '.join(SMOLVLM)}, {QWEN3_VL}, {QWEN3_VL_MOE}, {', '.join(QWEN3_5)}, {LFM2_VL} only)")
        v = {**(_SMOLVLM_DEFAULTS if arch in SMOLVLM else _SIGLIP_DEFAULTS), **(raw.get("vision_config") or {})}
        if v["hidden_act"] != "gelu_pytorch_tanh":
            raise ConfigError(f"{source}: not supported: vision_config.hidden_act {v['hidden_act']!r} "
                              f"(gelu_pytorch_tanh only)")
        if v["hidden_size"] % v["num_attention_heads"]:
            raise ConfigError(f"{source}: vision_config.hidden_size is not a multiple of its num_attention_heads")
        patches = v["image_size"] // v["patch_size"]
        tower = (v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"], v["num_attention_heads"],
                 v["num_channels"], v["image_size"], v["patch_size"], float(v["layer_norm_eps"]))
        text = raw.get("text_config") or {}
        if arch in SMOLVLM:
            scale = int(raw.get("scale_factor", 2))
            if scale < 1 or patches % scale:
                raise ConfigError(f"{source}: scale_factor {scale} does not divide the {patches} x {patches} grid "
                                  f"of patches")
            return cls(*tower, (patches // scale) ** 2, int(text.get("hidden_size", 4096)),
                       int(raw.get("image_token_id", 128_257)), -1, -1, scale)
        top = {**_GEMMA3_DEFAULTS, **raw}
        side = int(round(top["mm_tokens_per_image"] ** 0.5))
        if side * side != top["mm_tokens_per_image"] or patches % side:
            raise ConfigError(f"{source}: mm_tokens_per_image {top['mm_tokens_per_image']} does not pool a "
                              f"{patches} x {patches} grid of patches evenly")
        return cls(*tower, int(top["mm_tokens_per_image"]), int(text.get("hidden_size", 2304)),
                   int(top.get("image_token_id", top["image_token_index"])),
                   int(top.get("boi_token_id", top["boi_token_index"])),
                   int(top.get("eoi_token_id", top["eoi_token_index"])))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens see each other both ways in the text layers (Gemma 3's; SmolVLM's do not)."""
        return not self.scale_factor


def tensor_shapes(vc: VisionConfig) -> dict:
    """{our name: shape} of every tensor of the tower and the projector (the old layout's names)."""
    c, f = vc.hidden_size, vc.intermediate_size
    out = {TOWER + "embeddings.patch_embedding.weight": (c, vc.num_channels, vc.patch_size, vc.patch_size),
           TOWER + "embeddings.patch_embedding.bias": (c,),
           TOWER + "embeddings.position_embedding.weight": (vc.patches_per_side ** 2, c),
           TOWER + "post_layernorm.weight": (c,), TOWER + "post_layernorm.bias": (c,)}
    if vc.scale_factor:     # SmolVLM's connector: a projection (no bias) of the shuffled patches
        out[PROJ + "modality_projection.proj.weight"] = (vc.text_hidden_size, c * vc.scale_factor ** 2)
    else:
        out.update({PROJ + "mm_input_projection_weight": (c, vc.text_hidden_size),
                    PROJ + "mm_soft_emb_norm.weight": (c,)})
    out.update(encoder_shapes(TOWER, vc.num_layers, c, f))
    return out


def vision_names(names) -> dict:
    """{our name: file name} of a checkpoint's tower and projector tensors, in any of the layouts."""
    out = {}
    for name in names:
        for tower, proj in _PREFIXES:
            for prefix, ours in ((tower, TOWER), (proj, PROJ)):
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    out[ours + rest.removeprefix("vision_model.") if ours == TOWER else ours + rest] = name
    return out


def check_vision_tensors(tensors: dict, vc: VisionConfig, folder) -> dict:
    """{our name: file name} of the tower and projector in `tensors` ({file name: array-like}), every tensor
    present with its shape; one missing or misshapen refused in one line."""
    return checked_names(vision_names(tensors), tensor_shapes(vc), tensors, folder)


def image_blocks(ids, image_token_id: int, bidirectional: bool = True) -> np.ndarray:
    """ids (B, T) -> (B, T) int32: each run of image tokens its own block number (0, 1, ... per row), -1 for text;
    the tokens of one block see each other both ways in Gemma 3's text layers (transformers'
    get_block_sequence_ids_for_mask). Not bidirectional (SmolVLM): each image token a block of its own, which
    leaves the attention plainly causal."""
    is_image = np.asarray(ids) == image_token_id
    starts = is_image & ~np.pad(is_image, ((0, 0), (1, 0)))[:, :-1] if bidirectional else is_image
    return np.where(is_image, np.cumsum(starts, axis=1) - 1, -1).astype(np.int32)


# the vision tower's and projector's module names as LoRA target_modules name them (PEFT's names on Gemma 3)
VISION_TARGETS = ("fc1", "fc2", "patch_embedding", "mm_input_projection")
# a --lora-targets entry naming SmolVLM's / Idefics3's connector projection (PEFT's module names)
_CONNECTOR_ENTRY = re.compile(r"(?:model\.)?connector(?:\.modality_projection(?:\.proj)?)?|"
                              r"modality_projection(?:\.proj)?")


# Qwen3-VL's / Qwen3.5's tower modules as PEFT's target_modules name them (suffixes of their paths under visual.):
# only the tower has these, so a plain list's entry selects them there
QWEN_TARGETS = ("qkv", "attn.qkv", "attn.proj", "linear_fc1", "linear_fc2", "mlp.linear_fc1", "mlp.linear_fc2",
                "merger.linear_fc1", "merger.linear_fc2")


def vision_targets(targets) -> list:
    """The LoRA target_modules among `targets` that name the vision tower or the projector."""
    return [t for t in targets if t in VISION_TARGETS or t in QWEN_TARGETS or any(
        part in t for part in ("vision_tower", "multi_modal_projector", "vision_model", "connector", "visual",
                                "modality_projection"))]


# the linear modules of a tower encoder layer, the LoRA targets it offers (as PEFT names them under the layer)
ENCODER_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1",
                   "mlp.fc2")
_TOWER_ENTRY = re.compile(r"(?:model\.)?(?:vision_tower|vision_model)(?:\.(?:encoder\.)?(?P<name>.+))?")


def split_targets(targets) -> tuple:
    """--lora-targets (a comma-separated string or a list) -> (the language model's part, as given less the
    vision entries; the tower encoder's modules (ENCODER_MODULES' names) the vision entries select, in its order).
    A vision entry is fc1 / fc2 (only the tower has them, so PEFT's list puts them there), or vision_tower (Gemma
    3) / vision_model (SmolVLM) alone (every encoder module) or with a module (q_proj, ..., fc2, or
    self_attn.q_proj, mlp.fc1, ...), or SmolVLM's connector projection (connector, modality_projection.proj, ...:
    CONNECTOR's suffix modality_projection.proj, after the encoder's); Gemma 3's projector (an nn.Parameter, which
    PEFT's target_modules cannot wrap) and the patch embedding are refused in one line (not supported)."""
    given = [t.strip() for t in targets.split(",") if t.strip()] if isinstance(targets, str) else list(targets)
    vision = vision_targets(given)
    chosen, qwen = set(), []
    for entry in vision:
        if entry in QWEN_TARGETS or entry.removeprefix("model.").startswith("visual"):
            qwen.append(_qwen_target(entry))
            continue
        if _CONNECTOR_ENTRY.fullmatch(entry):
            chosen.add(CONNECTOR.removeprefix(PROJ))
            continue
        match = _TOWER_ENTRY.fullmatch(entry)
        name = entry if entry in ("fc1", "fc2") else match and match["name"]
        found = ENCODER_MODULES if match and name is None else [m for m in ENCODER_MODULES if name in
                                                                (m, m.split(".")[1])]
        if not found:
            raise ConfigError(f"LoRA target {entry!r}: not supported on the vision side: the tower encoder's linear "
                              f"modules only (fc1, fc2, vision_tower.q_proj ... vision_tower.out_proj, or "
                              f"vision_tower for all; vision_model for SmolVLM's) and SmolVLM's connector "
                              f"(connector.modality_projection.proj), not Gemma 3's projector (a parameter PEFT's "
                              f"target_modules cannot wrap) or the patch embedding")
        chosen.update(found)
    language = [t for t in given if t not in vision]
    if isinstance(targets, str):
        language = ",".join(language)
    connector = (CONNECTOR.removeprefix(PROJ),) if CONNECTOR.removeprefix(PROJ) in chosen else ()
    return language, tuple(m for m in ENCODER_MODULES if m in chosen) + connector + tuple(dict.fromkeys(qwen))


def _qwen_target(entry: str) -> str:
    """A --lora-targets entry naming Qwen3-VL's / Qwen3.5's tower -> the suffix of the module paths it selects
    (qkv, attn.proj, linear_fc1: every block's and merger's, mlp.linear_fc1: the blocks', merger.linear_fc1, ...);
    visual alone: every block's linear modules. The patch embedding refused in one line."""
    name = entry.removeprefix("model.").removeprefix("visual").removeprefix(".")
    if not name:
        return "blocks"
    if name.removeprefix("blocks.") not in QWEN_TARGETS and name not in ("merger", "deepstack_merger_list"):
        raise ConfigError(f"LoRA target {entry!r}: not supported on the vision side: the tower's blocks' and "
                          f"mergers' linear modules only (qkv, attn.proj, linear_fc1, linear_fc2, mlp.linear_fc1, "
                          f"merger.linear_fc1, ..., or visual for every block's), not the patch embedding")
    return name.removeprefix("blocks.")


def selects(path: str, target: str) -> bool:
    """Whether a split_targets tower name (self_attn.q_proj, qkv, merger.linear_fc1, blocks, ...) selects the
    tower's module path (vision_tower.encoder.layers.0.self_attn.q_proj, visual.blocks.0.attn.qkv, ...), as a
    suffix of its dotted path (PEFT's); Qwen's `blocks`, every block's module."""
    return path.endswith("." + target) or (target == "blocks" and path.startswith(VISUAL + "blocks."))


def tower_lora_path(key: str) -> str | None:
    """A PEFT adapter key on the tower (base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.
    lora_A.weight, any layout) -> our module path (vision_tower.encoder.layers.0.self_attn.q_proj); None for
    another key."""
    module = key.split(".lora_")[0].removeprefix("base_model.model.")
    for prefix in ("model.visual.", "visual."):     # Qwen3-VL's / Qwen3.5's
        if module.startswith(prefix):
            return VISUAL + module[len(prefix):]
    ours = vision_names([module])
    return next((o for o in ours if o.startswith(TOWER + "encoder.") or o == CONNECTOR), None)


def _tower_module(vc) -> str:
    """The tower's module path on the multimodal model (transformers 5's): Gemma 3's, SmolVLM's or Qwen's."""
    if isinstance(vc, Qwen3VLVision):
        return "model.visual."
    return "model.vision_model." if getattr(vc, "scale_factor", 0) else "model.vision_tower."   # LFM2-VL's has none


def _peft_module(path: str, vc) -> str:
    """Our tower (or connector) module path -> its path on transformers 5's multimodal class of `vc`."""
    if path.startswith(PROJ):       # SmolVLM's / Idefics3's connector
        return "model.connector." + path.removeprefix(PROJ)
    return _tower_module(vc) + path.removeprefix(TOWER).removeprefix(VISUAL)


def tower_lora_key(path: str, which: str, vc) -> str:
    """Our tower module path and "A" / "B" -> PEFT's key on transformers 5's multimodal class of `vc`."""
    return f"base_model.model.{_peft_module(path, vc)}.lora_{which}.weight"


def tower_target_regex(paths, vc) -> str:
    """PEFT target_modules (a regular expression on module paths) selecting the tower's LoRA module `paths`
    (ours) in every layer, on transformers 5's multimodal class of `vc`."""
    full = sorted({re.sub(r"\\.\d+\\.", r"\\.\\d+\\.", re.escape(_peft_module(p, vc))) for p in paths})
    return "(?:" + "|".join(full) + ")"


def tower_parameters(vc: VisionConfig) -> int:
    """The vision tower's and the projector's weights, counted: SigLIP's patch embedding (a convolution with its
    bias), position embeddings, encoder layers (two layer norms, q/k/v/out and fc1/fc2 with biases) and final
    norm; the projector's soft-embedding norm and projection."""
    h, i = vc.hidden_size, vc.intermediate_size
    patches = (vc.image_size // vc.patch_size) ** 2
    layer = 4 * h + 4 * (h * h + h) + (h * i + i) + (i * h + h)
    projector = h * vc.scale_factor ** 2 * vc.text_hidden_size if vc.scale_factor else h + h * vc.text_hidden_size
    return vc.num_channels * vc.patch_size ** 2 * h + h + patches * h + vc.num_layers * layer + 2 * h + projector


def tower_activation_values(vc: VisionConfig, images: int, trained: bool) -> int:
    """Values the NumPy tower's forward over `images` images holds at its peak (fitted to tracemalloc's peak
    within about 20%, tests/test_memory_vision.py): a layer's residual, norm, q / k / v and their head-major
    copies, the attention's output (12 x hidden a patch), fc1's output and GELU's temporaries (5 x intermediate),
    and four (heads, P, P) score arrays. Frozen, the tower runs one image at a time; with LoRA on it (trained),
    the images at once, every earlier layer's activations kept for the backward (7 x hidden + intermediate +
    heads a patch). Each image's pooled tokens and projection besides."""
    p, h, i, heads = (vc.image_size // vc.patch_size) ** 2, vc.hidden_size, vc.intermediate_size, vc.num_heads
    layer = p * (12 * h + 5 * i) + 4 * heads * p * p
    kept = (vc.num_layers - 1) * p * (7 * h + i + heads)     # the last layer's are the transients counted
    out = images * vc.mm_tokens_per_image * (h + vc.text_hidden_size)
    return out + (images * (kept + layer) if trained else layer if images else 0)
