"""The small op pairs of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next) around the delta rule itself (delta_rule.py):
SiLU after the causal conv1d, the decay g and beta of the projections a and b (with the gradients of A_log and
dt_bias for full fine-tuning), and the gated RMSNorm of the rule's output. The NumPy engine runs them; GPU kernels
are checked against them."""
from __future__ import annotations

import numpy as np

CHUNK = 64      # the chunked delta rule's chunk: transformers' torch_chunk_gated_delta_rule's and flash-linear-attention's


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu_forward(x):
    """x sigmoid(x), elementwise."""
    return x * _sigmoid(x)


def silu_backward(dy, x):
    """Gradient of silu_forward: dx."""
    s = _sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


def _softplus(x):
    """log(1 + exp(x)) without overflow (torch's softplus, whose threshold 20 changes it by under 2e-9)."""
    return np.logaddexp(0.0, x).astype(x.dtype, copy=False)


def decay_forward(a, b, a_log, dt_bias):
    """a, b (N, Hv) (the in-projections' outputs), a_log, dt_bias (Hv,) -> g (N, Hv) = -exp(A_log) softplus(a +
    dt_bias), the rule's log-decay (<= 0), and beta (N, Hv) = sigmoid(b)."""
    return -np.exp(a_log) * _softplus(a + dt_bias), _sigmoid(b)


def decay_backward(dg, dbeta, a, b, a_log, dt_bias, need_weight_grad: bool = True):
    """Gradients of decay_forward: da, db (N, Hv), and d A_log, d dt_bias (Hv,) (None unless need_weight_grad: they
    train only in full fine-tuning)."""
    x = a + dt_bias
    sp, s = _softplus(x), _sigmoid(b)
    da = -np.exp(a_log) * _sigmoid(x) * dg                                          # softplus' = sigmoid
    db = dbeta * s * (1.0 - s)
    if not need_weight_grad:
        return da, db, None, None
    return da, db, np.sum(dg * -np.exp(a_log) * sp, axis=0), np.sum(da, axis=0)


def gated_rmsnorm_forward(x, z, weight, eps):
    """x, z (N, D) (one row per token and value head), weight (D,) -> y (N, D) = rmsnorm(x) weight silu(z)."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)            # (N, 1)
    return x * rstd * weight * silu_forward(z)


def gated_rmsnorm_backward(dy, x, z, weight, eps, need_weight_grad: bool = True):
    """Gradients of gated_rmsnorm_forward: dx, dz (N, D), dweight (D,) (None unless need_weight_grad)."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    gate = silu_forward(z)
    dz = silu_backward(dy * xhat * weight, z)
    dxhat = dy * gate * weight
    dx = rstd * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx, dz, np.sum(dy * gate * xhat, axis=0) if need_weight_grad else None
