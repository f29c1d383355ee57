"""How far a correct GEMM candidate's result may be from float64's: float32 summation over K products, one
rounding of a 16-bit result to its format, and what float16 arithmetic adds (the GEMM and frozen-weight
families' tuner checks)."""
from __future__ import annotations

import numpy as np

# The unit roundoff of the 16-bit storage formats (8 and 11 significant bits): a value rounded to nearest in one
# moves by at most this fraction of its magnitude
ROUNDOFF = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}
F16_CHUNK = 4              # steps of k an f16-arithmetic kernel sums in f16 (gemm_core.wgsl's KC)
F16_SUBNORMAL_UNIT = 2.0 ** -24   # float16's smallest subnormal: an f16 rounding near zero errs by half of it

def f16_arithmetic_slack(alpha: float, K: int, A: np.ndarray, B: np.ndarray) -> float:
    """What float16 arithmetic may add to the error of alpha op(A) op(B) (A (..., M, K), B (..., K, N), float64).
    Each F16_CHUNK-step partial is summed in f16 by multiply-adds from zero, fused (each rounds the sum) or not
    (WGSL allows either; lavapipe rounds the product, then the sum). Fused: F16_CHUNK roundings; unfused:
    F16_CHUNK products and F16_CHUNK - 1 sums (the first sum, with zero, is exact); either way their errors add
    up to at most F16_CHUNK u (u the unit roundoff) times the chunk's sum of |products|, to first order (1% margin
    for the second). Over all chunks: F16_CHUNK u times sum_k |a_k b_k|, at most its largest element's; plus half
    a subnormal unit for each of the 2K roundings that may land near zero; all scaled by |alpha|, applied after."""
    products = float(np.max(np.matmul(np.abs(A), np.abs(B)), initial=0.0))
    return abs(alpha) * (1.01 * F16_CHUNK * ROUNDOFF["f16"] * products + K * F16_SUBNORMAL_UNIT)


def arithmetic_slack(cand, q) -> float:
    """What candidate cand's arithmetic adds to the tolerance of replica q (Problem or QProblem.replica's, which
    keep their float64 operands (op(A), op(B))): f16_arithmetic_slack for a float16-arithmetic one (cand.half),
    computed once per replica, else nothing."""
    if not getattr(cand, "half", False):
        return 0.0
    if q.f16_slack is None:
        q.f16_slack = f16_arithmetic_slack(q.alpha, q.K, *q.operands)
    return q.f16_slack


def gemm_tolerance(alpha: float, K: int, want: np.ndarray, fmt: str = "f32") -> float:
    """What a correct GEMM candidate may be off by, its result stored in format fmt: fp32 rounding over K
    products, with margin; plus, for a 16-bit result, its one rounding to the format (unit roundoff times the
    largest magnitude: the exact value is rounded once, after the float32 sum, so it moves by at most that),
    doubled for a float32 sum that lands on the other side of a rounding boundary. The operands' own rounding
    is no error: the replica's expected values come from the operands as stored."""
    big = float(np.max(np.abs(want))) if want.size else 0.0
    stored = 2 * ROUNDOFF[fmt] * big if fmt in ROUNDOFF else 0.0
    return 1e-5 * (1 + abs(alpha)) * K ** 0.5 * 4 * (1 + big) + stored
