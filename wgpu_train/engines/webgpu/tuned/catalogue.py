"""The registry of tuned kernel families (FAMILIES: what the tuner's checksum, this catalogue and `wgpu-train
bench` loop over), every kernel descriptor they can launch, and those an adapter's limits or features leave out
(the tuner then runs their twins within the limits): what the portability tests and `wgpu-train devices` read."""
from __future__ import annotations

from wgpu_train.engines.webgpu.device.launch import Kernel
from wgpu_train.engines.webgpu.tuned import (attention_kernels, decode_kernels, delta_rule_kernels,
                                             gated_deltanet_kernels, gemm_kernels, mixed_lora_kernels, moe_kernels,
                                             quant_kernels, short_conv_kernels)

FAMILIES = (gemm_kernels.FAMILY, quant_kernels.FAMILY, attention_kernels.FAMILY, decode_kernels.FAMILY,
            mixed_lora_kernels.FAMILY, moe_kernels.FAMILY, delta_rule_kernels.FAMILY,
            gated_deltanet_kernels.FAMILY, short_conv_kernels.FAMILY)


def tuned_kernels() -> list[Kernel]:
    """Every family's kernels, by label."""
    return sorted({k for family in FAMILIES for k in family.all_kernels()}, key=lambda k: k.label)


def left_out(limits: dict, features) -> list[Kernel]:
    """The tuned kernels an adapter with these limits and features cannot run."""
    return [k for k in tuned_kernels() if k.over_limits(limits) or not set(k.features) <= set(features)]
