"""LFM3 in config.json (Lfm3ForCausalLM): LFM2's short convolutions beside full and sliding attention layers, each
with its own RoPE block (rope_parameters per layer type: the sliding layers' plain, the full layers' plain or
proportional), sandwich norms and a per-head sigmoid gate on the attention (g_proj); the rest refused by field."""
from __future__ import annotations

from wgpu_train.errors import ConfigError
from wgpu_train.models import lfm2
from wgpu_train.models.layer_types import checked_layer_types

# transformers 5's Lfm3Config defaults (LFM3-1.7B), for fields a config.json leaves out
DEFAULTS = {**lfm2.DEFAULTS, "vocab_size": 128000, "hidden_size": 2048, "intermediate_size": 7680,
            "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
            "pad_token_id": 124893, "bos_token_id": 124894, "eos_token_id": 124900, "conv_L_cache": 7,
            "sliding_window": 256, "use_sandwich_norm": True, "use_attention_gate": True,
            "block_auto_adjust_ff_dim": False,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                   "partial_rotary_factor": 0.5}}}
LAYER_KINDS = ("conv", "sliding_attention", "full_attention")


def layer_types(raw: dict, layers: int, source: str) -> list:
    """Each layer's kind: layer_types, or transformers' default (full attention at i % 4 == 2, sliding at the other
    multiples of 4 but the first, conv elsewhere)."""
    types = raw.get("layer_types")
    if types is None:
        types = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
                 for i in range(layers)]
    return checked_layer_types(types, layers, LAYER_KINDS, source)


def lfm3_fields(raw: dict, layers: int, max_pos: int, source: str) -> dict:
    """The ModelConfig fields of an LFM3 config (lfm2.lfm2_raw's) beyond Llama's: LFM2's convolution fields (its
    MLP of intermediate_size as it is), the sliding layers' window, their RoPE base (local_rope), the full
    layers' RoPE block (rope_parameters, read by rope.rope_settings), the sandwich norms and the head gate."""
    types = layer_types(raw, layers, source)
    fields = lfm2.lfm2_fields({**raw, "layer_types": ["conv" if t == "conv" else "full_attention" for t in types]},
                              "lfm3", layers, source)
    window = raw.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer or null, got {window!r}")
    sliding = [t == "sliding_attention" for t in types]
    windows = tuple(window if s and window is not None and window < max_pos else 0 for s in sliding)
    params = raw.get("rope_parameters")
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in set(types) - {"conv"}):
        raise ConfigError(f"{source}: field 'rope_parameters' must hold a RoPE block for each attention layer type "
                          f"({', '.join(sorted(set(types) - {'conv'}))})")
    local = params.get("sliding_attention") or {}
    if any(sliding) and local.get("rope_type", "default") != "default":
        raise ConfigError(f"{source}: field 'rope_parameters' gives the sliding layers rope_type "
                          f"{local.get('rope_type')!r}; only 'default' is supported there")
    return {**fields, "layer_windows": windows if any(windows) else (), "sandwich_norms": bool(raw["use_sandwich_norm"]),
            "head_gate": bool(raw["use_attention_gate"]), "local_rope": tuple(sliding),
            "local_rope_theta": float(local.get("rope_theta", 10000.0)),
            "rope_parameters": params.get("full_attention") or {"rope_type": "default", "rope_theta": 1000000.0}}
