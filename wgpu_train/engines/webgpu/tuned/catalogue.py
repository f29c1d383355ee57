"""Every kernel descriptor the tuned families can launch, and those an adapter's limits or features leave out
(the tuner then runs their twins within the limits): what the portability tests and `wgpu-train devices` read."""
from __future__ import annotations

from wgpu_train.engines.webgpu.device.launch import Kernel
from wgpu_train.engines.webgpu.tuned import decode_kernels, attention_kernels, gemm_kernels, quant_kernels


def tuned_kernels() -> list[Kernel]:
    """The GEMM, quantised GEMM, attention and cached-attention families' kernels, by label."""
    kernels = (gemm_kernels.all_kernels() + quant_kernels.all_kernels() + attention_kernels.all_kernels()
               + decode_kernels.all_kernels())
    return sorted(set(kernels), key=lambda k: k.label)


def left_out(limits: dict, features) -> list[Kernel]:
    """The tuned kernels an adapter with these limits and features cannot run."""
    return [k for k in tuned_kernels() if k.over_limits(limits) or not set(k.features) <= set(features)]
