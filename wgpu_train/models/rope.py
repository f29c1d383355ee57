"""RoPE as config.json describes it, in either spelling (transformers 5's rope_parameters block, or the hub's
rope_theta / rope_scaling): the base, the scaling (llama3 and linear; longrope on Phi-3; YaRN on gpt-oss), the
rotated dims (Phi-3's partial_rotary_factor), and each layer's inverse frequencies."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.errors import ConfigError, positive_field


def rope_settings(raw: dict, params, family: str, head_dim: int, max_pos: int, source: str) -> tuple:
    """(rope_theta, the scaling dict or None, rotary_dim) of a config dict (`params`: a family's own flat
    RoPE block, Gemma's global layers', if it has one); the scaling's rope_type normalised and checked (as
    transformers' configs allow it per family), longrope's fields completed."""
    # transformers 5 writes a rope_parameters block; hub checkpoints use rope_theta / rope_scaling.
    params = params or raw.get("rope_parameters")
    if isinstance(params, dict) and params and not isinstance(next(iter(params.values())), dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = dict(params) if rope_type != "default" else None
        rope_field = "rope_parameters"
    elif isinstance(params, dict) and params:
        raise ConfigError(f"{source}: field 'rope_parameters' holds per-layer-type RoPE, which is not supported")
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
        rope_field = "rope_scaling"
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = dict(scaling) if rope_type != "default" else None
    block = params if rope_field == "rope_parameters" else raw.get("rope_scaling") or {}
    rotary_dim = _rotary_dim(raw, block, family, int(head_dim), source)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if family == "phi3" and rope_type in ("su", "yarn"):    # transformers' Phi-3: old names of longrope
            rope_type = "longrope"
        allowed = {"phi3": ("longrope",), "gpt_oss": ("yarn",)}.get(family, ("llama3", "linear"))  # transformers'
        if rope_type not in allowed:
            raise ConfigError(f"{source}: field '{rope_field}' has type {rope_type!r}; {family} supports "
                              f"{' and '.join(map(repr, allowed))}")
        scaling = {**scaling, "rope_type": rope_type}
        if rope_type == "longrope":
            scaling = _longrope(scaling, raw, max_pos, (rotary_dim or int(head_dim)) // 2, rope_field, source)
        elif rope_type == "yarn":
            scaling = _yarn(scaling, raw, max_pos, source)
        elif "factor" not in scaling:
            raise ConfigError(f"{source}: field '{rope_field}' lacks 'factor'")
    return float(theta), scaling, rotary_dim


def _rotary_dim(raw: dict, params: dict, family: str, head_dim: int, source: str) -> int:
    """The rotated dims of each head under Phi-3's partial_rotary_factor (in the RoPE block, rope_parameters
    or rope_scaling, or at the top level, as transformers reads it); 0 for the whole head. Other families
    rotate the whole head."""
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if factor == 1.0:
        return 0
    if family not in ("phi3", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be 1.0 for {family}")
    dim = int(head_dim * float(positive_field({"partial_rotary_factor": factor}, "partial_rotary_factor", source)))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' {factor} rotates {dim} of {head_dim} dims per "
                          f"head; it must be an even number from 2 to head_dim")
    return dim


def _longrope(scaling: dict, raw: dict, max_pos: int, pairs: int, rope_field: str, source: str) -> dict:
    """Phi-3's longrope parameters completed as transformers completes them: short_factor / long_factor (one
    per rotated pair), original_max_position_embeddings (the top-level field, default 4096, wins over the
    one in the RoPE block), factor (default max_position_embeddings over it) and the attention factor
    (default sqrt(1 + ln factor / ln original), 1 for a factor up to 1)."""
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not (isinstance(value, list) and len(value) == pairs and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value)):
            raise ConfigError(f"{source}: field '{rope_field}' needs '{key}': a list of {pairs} positive numbers")
    original = raw.get("original_max_position_embeddings", 4096)
    if not isinstance(original, int) or isinstance(original, bool) or original < 2:
        raise ConfigError(f"{source}: longrope needs 'original_max_position_embeddings' (a whole number >= 2), got "
                          f"{original!r}")
    factor = scaling.get("factor")
    factor = max_pos / original if factor is None else positive_field(scaling, "factor", source)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**scaling, "original_max_position_embeddings": original, "factor": float(factor),
            "attention_factor": float(positive_field({"attention_factor": attention}, "attention_factor", source))}


def _number(scaling: dict, key: str, default, source: str) -> float:
    value = scaling.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: YaRN's '{key}' must be a number, got {value!r}")
    return float(value)


def _yarn(scaling: dict, raw: dict, max_pos: int, source: str) -> dict:
    """YaRN's parameters completed as transformers 5's _compute_yarn_parameters completes them:
    original_max_position_embeddings (a top-level field wins, else the block's, else max_position_embeddings),
    factor (default max_position_embeddings over it), beta_fast / beta_slow (32 and 1 when absent or 0), truncate
    (default true) and the attention factor (default 0.1 ln(factor) + 1, or mscale / mscale_all_dim's ratio of
    the same form when both are given)."""
    original = raw.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings", max_pos))
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ConfigError(f"{source}: YaRN needs 'original_max_position_embeddings' (a whole number >= 1), got "
                          f"{original!r}")
    factor = _number(scaling, "factor", max_pos / original, source)
    if not factor > 0:
        raise ConfigError(f"{source}: YaRN's 'factor' must be positive, got {factor!r}")

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale(1.0)
    return {**scaling, "original_max_position_embeddings": original, "factor": float(factor),
            "beta_fast": _number(scaling, "beta_fast", 0.0, source) or 32.0,
            "beta_slow": _number(scaling, "beta_slow", 0.0, source) or 1.0,
            "truncate": bool(scaling.get("truncate", True)),
            "attention_factor": float(positive_field({"attention_factor": attention}, "attention_factor", source))}


def _yarn_inv_freq(inv: np.ndarray, s: dict, base: float, dim: int) -> np.ndarray:
    """YaRN's blend of the unscaled (extrapolated) and factor-scaled (interpolated) frequencies: a linear ramp
    over the pairs between the dims that make beta_fast and beta_slow rotations over the original context."""
    def correction_dim(rotations):
        return dim * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001        # as transformers, against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    return inv / s["factor"] * (1.0 - extrapolation) + inv * extrapolation


def inv_freq(cfg, layer: int = 0, long: bool = False) -> np.ndarray:
    """Layer `layer`'s RoPE inverse frequencies (rotary_dim/2,), float64: the local base unscaled where the
    layer uses it, else rope_theta with the configured scaling (llama3, linear, YaRN, longrope: its short
    factors, or its long ones with `long`)."""
    d = cfg.rotary_dim or cfg.head_dim
    local = bool(cfg.local_rope) and cfg.local_rope[layer]
    inv = 1.0 / ((cfg.local_rope_theta if local else cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_scaling is None or local:
        return inv
    s = cfg.rope_scaling
    if s["rope_type"] == "longrope":
        return inv / np.asarray(s["long_factor" if long else "short_factor"], np.float64)
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(inv, s, cfg.rope_theta, d)
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return inv / factor
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)
