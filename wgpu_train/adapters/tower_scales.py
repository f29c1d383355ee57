"""Each vision-tower LoRA module's rank and scale under PEFT's rank_pattern / alpha_pattern and use_rslora, the
patterns matched on the module's full name in the multimodal model (as PEFT matches the language model's)."""
from __future__ import annotations

import math

from wgpu_train.adapters.layout import pattern_key
from wgpu_train.models.vision import tower_lora_key


def tower_scales(paths, vc, r: int, alpha: float, rslora: bool = False, rank_pattern=None,
                 alpha_pattern=None) -> dict:
    """{path: (r, scale)} of the tower's LoRA modules `paths` (ours) on the multimodal class of `vc`: r and
    alpha from the first rank_pattern / alpha_pattern key PEFT's get_pattern_key matches to the module's full
    name (else r, alpha); scale alpha / r, or alpha / sqrt(r) with rsLoRA."""
    out = {}
    for path in paths:
        name = tower_lora_key(path, "A", vc).removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        r_key, a_key = pattern_key(rank_pattern or {}, name), pattern_key(alpha_pattern or {}, name)
        rank = int(rank_pattern[r_key]) if r_key is not None else int(r)
        scaled = float(alpha_pattern[a_key]) if a_key is not None else float(alpha)
        out[path] = (rank, scaled / (math.sqrt(rank) if rslora else rank))
    return out
