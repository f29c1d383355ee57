"""LFM2 and LFM2-MoE in config.json (Lfm2ForCausalLM, Lfm2MoeForCausalLM): which layers are double-gated short
convolutions and which attention, the convolution's kernel, the feed-forward width (LFM2's derived from the block_*
fields), LFM2-MoE's sigmoid-routed experts after its dense layers, and the field names that differ from Llama's
(norm_eps, tie_embedding, block_ff_dim); the variants not implemented refused by field."""
from __future__ import annotations

from wgpu_train.errors import ConfigError, positive_field
from wgpu_train.models.layer_types import checked_layer_types
from wgpu_train.models.moe import MoeConfig, positive_count

FAMILIES = ("lfm2", "lfm2_moe")     # the families with LFM2's layer names and short convolutions

# transformers 5's Lfm2Config defaults, for fields a config.json leaves out
DEFAULTS = {"vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
            "norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
            "rope_theta": 1000000.0, "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True}
# transformers 5's Lfm2MoeConfig defaults (LFM2-8B-A1B's sizes)
MOE_DEFAULTS = {**DEFAULTS, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
                "block_auto_adjust_ff_dim": False, "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32,
                "use_expert_bias": True, "routed_scaling_factor": 1.0, "norm_topk_prob": True}
LAYER_KINDS = ("conv", "full_attention")


def lfm2_raw(raw: dict) -> dict:
    """config.json with transformers' aliases resolved (tie_embedding, block_ff_dim) and norm_eps as rms_norm_eps."""
    out = dict(raw)
    if "tie_embedding" in out:
        out["tie_word_embeddings"] = out.pop("tie_embedding")
    if "block_ff_dim" in out:
        out["intermediate_size"] = out.pop("block_ff_dim")
    out["rms_norm_eps"] = out.get("norm_eps", 1e-5)
    return out


def feed_forward_size(raw: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it: with block_auto_adjust_ff_dim, two thirds of
    intermediate_size, then (with a block_ffn_dim_multiplier) times it, rounded up to block_multiple_of."""
    size = int(raw["intermediate_size"])
    if raw.get("block_auto_adjust_ff_dim"):
        size = int(2 * size / 3)
        multiplier = raw.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = int(raw["block_multiple_of"])
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def conv_layers(raw: dict, layers: int, source: str) -> tuple:
    """Per layer, whether it is a short convolution (layer_types "conv"), from layer_types or full_attn_idxs (the
    attention layers; every layer without either, as transformers' default)."""
    types = raw.get("layer_types")
    if types is None:
        attention = raw.get("full_attn_idxs")
        attention = range(layers) if attention is None else attention
        types = ["full_attention" if i in attention else "conv" for i in range(layers)]
    return tuple(t == "conv" for t in checked_layer_types(types, layers, LAYER_KINDS, source))


def lfm2_fields(raw: dict, family: str, layers: int, source: str) -> dict:
    """The ModelConfig fields of an LFM2 or LFM2-MoE config (lfm2_raw's) beyond Llama's (LFM2-MoE's dense layers
    take intermediate_size as it is: its Lfm2MoeMLP adjusts nothing)."""
    if raw.get("conv_bias"):
        raise ConfigError(f"{source}: field 'conv_bias' is true; only convolutions without biases are supported")
    kernel = int(positive_field(raw, "conv_L_cache", source))
    size = feed_forward_size(raw) if family == "lfm2" else int(positive_field(raw, "intermediate_size", source))
    return {"conv_kernel": kernel, "conv_layers": conv_layers(raw, layers, source), "intermediate_size": size}


def lfm2_moe_settings(raw: dict, layers: int, source: str) -> MoeConfig:
    """LFM2-MoE's experts (transformers' Lfm2MoeSparseMoeBlock under feed_forward): the layers from
    num_dense_layers on are sparse; the router scores each expert by a sigmoid, chooses the top k of score +
    expert_bias (a buffer, when use_expert_bias), weighs by the chosen scores over their sum + 1e-6
    (norm_topk_prob), times routed_scaling_factor; no load-balancing loss."""
    experts, top_k = positive_count(raw, "num_experts", source), positive_count(raw, "num_experts_per_tok", source)
    if top_k > experts:
        raise ConfigError(f"{source}: field 'num_experts_per_tok' ({top_k}) is larger than 'num_experts' ({experts})")
    dense = raw["num_dense_layers"]
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ConfigError(f"{source}: field 'num_dense_layers' must be an integer >= 0, got {dense!r}")
    scale = raw["routed_scaling_factor"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ConfigError(f"{source}: field 'routed_scaling_factor' must be a positive number, got {scale!r}")
    return MoeConfig(num_experts=experts, top_k=top_k, expert_size=positive_count(raw, "moe_intermediate_size", source),
                     normalize=bool(raw["norm_topk_prob"]), sparse=tuple(i >= dense for i in range(layers)),
                     router="feed_forward.gate", block="feed_forward", scoring="sigmoid",
                     expert_bias=bool(raw["use_expert_bias"]), scaling=float(scale))
