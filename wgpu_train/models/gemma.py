"""Gemma 2 and Gemma 3 (text) in config.json: their sliding and global layers, and the fields beyond Llama's (soft-caps,
GeGLU, norms scaling by 1 + w, the embedding scale, the query scale, sandwich norms, the local RoPE base)."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.errors import ConfigError, positive_field


def gemma_layer_types(raw: dict, layers: int, family: str) -> list:
    """Gemma's layer types: its layer_types, or every sliding_window_pattern-th layer global (Gemma 3's
    default 6; Gemma 2 alternates)."""
    if raw.get("layer_types") is not None:
        return list(raw["layer_types"])
    key = "sliding_window_pattern" if "sliding_window_pattern" in raw else "_sliding_window_pattern"
    if family == "gemma2" or key not in raw:     # transformers' Gemma 2 always alternates
        pattern = 2 if family == "gemma2" else 6
    else:
        pattern = int(positive_field(raw, key, "config.json"))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def gemma_fields(raw: dict, source: str, family: str, layers: int, hidden: int, head_dim: int) -> dict:
    """The ModelConfig fields of Gemma 2 and Gemma 3 (text) beyond Llama's, and the (global layers') RoPE
    parameters as a flat rope_parameters dict. Gemma 2's soft-caps default as transformers' config does."""
    caps = {}
    for key, field_name, default in (("attn_logit_softcapping", "attn_softcap", 50.0),
                                     ("final_logit_softcapping", "logit_softcap", 30.0)):
        cap = raw.get(key, default if family == "gemma2" else None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ConfigError(f"{source}: field '{key}' must be a positive number or null, got {cap!r}")
        caps[field_name] = float(cap or 0.0)
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention' is true; only causal attention is supported")
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: field 'hidden_activation' is {act!r}; only 'gelu_pytorch_tanh' is supported")
    types = gemma_layer_types(raw, layers, family)
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: field 'rope_parameters' scales the sliding layers' RoPE; not supported")
        local_theta, params = local.get("rope_theta", 10000.0), params["full_attention"]
    elif family == "gemma2":     # one RoPE for every layer
        local_theta, params = None, params or {"rope_theta": raw.get("rope_theta", 10000.0),
                                               **(raw.get("rope_scaling") or {})}
    else:
        local_theta = raw.get("rope_local_base_freq", 10000.0)
        params = {"rope_theta": raw.get("rope_theta", 1000000.0), **(raw.get("rope_scaling") or {})}
    scalar = float(positive_field({"query_pre_attn_scalar": 256, **raw}, "query_pre_attn_scalar", source))
    return {"hidden_act": "gelu_tanh", "norm_offset": 1.0, "embed_scale": float(np.float32(hidden ** 0.5)),
            "query_scale": math.sqrt(head_dim / scalar), "sandwich_norms": True,
            "local_rope": tuple(t == "sliding_attention" for t in types) if local_theta is not None else (),
            "local_rope_theta": float(local_theta or 10000.0), "rope_parameters": params, **caps}
