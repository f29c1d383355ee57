"""The Gated DeltaNet layer's small op kernels (shaders/gated_deltanet.wgsl) as a kernel family: SiLU, the decay and
the gated RMSNorm, forward and backward, and the weight gradients' passes. One form each (no tuner candidates: they
are elementwise or per-row and cost little beside the delta rule); the op wrappers are
engines/webgpu/gated_deltanet.py."""
from __future__ import annotations

import functools

from wgpu_train.engines.webgpu.device.launch import Kernel
from wgpu_train.engines.webgpu.tuned.attention_kernels import CPU_LOOP_BUDGET
from wgpu_train.engines.webgpu.tuned.family import Family

WG = 64                      # invocations per workgroup (shaders/gated_deltanet.wgsl WG)
WEIGHT_PASS = 32768          # tokens per pass of the decay's weight gradients (llvmpipe's loop budget)

# (entry, bindings)
SILU_FORWARD = ("silu_forward", "y! x")
SILU_BACKWARD = ("silu_backward", "dx! dy x")
DECAY_FORWARD = ("decay_forward", "g! beta! a b a_log dt_bias")
DECAY_BACKWARD = ("decay_backward", "da! db! dg dbeta a b a_log dt_bias")
DECAY_WEIGHT_BACKWARD = ("decay_weight_backward", "d_a_log! d_dt_bias! dg a a_log dt_bias")
GATED_RMSNORM_FORWARD = ("gated_rmsnorm_forward", "y! x z weight")
GATED_RMSNORM_BACKWARD = ("gated_rmsnorm_backward", "dx! dz! dy x z weight")
GATED_RMSNORM_WEIGHT_BACKWARD = ("gated_rmsnorm_weight_backward", "dweight! dy x z")
ALL = (SILU_FORWARD, SILU_BACKWARD, DECAY_FORWARD, DECAY_BACKWARD, DECAY_WEIGHT_BACKWARD, GATED_RMSNORM_FORWARD,
       GATED_RMSNORM_BACKWARD, GATED_RMSNORM_WEIGHT_BACKWARD)


@functools.lru_cache(maxsize=None)
def kernel(spec: tuple) -> Kernel:
    """One entry point of shaders/gated_deltanet.wgsl."""
    return Kernel("gated_deltanet", *spec, invocations=WG)


def norm_weight_rows(d: int) -> int:
    """Rows one pass of the gated RMSNorm's weight gradient sums: each costs d + 2 loop iterations."""
    return max(1, (CPU_LOOP_BUDGET - 64) // (d + 2))


def all_kernels() -> list[Kernel]:
    return [kernel(spec) for spec in ALL]


FAMILY = Family("gated_deltanet", shaders=("gated_deltanet",), modules=(__file__,), all_kernels=all_kernels)
