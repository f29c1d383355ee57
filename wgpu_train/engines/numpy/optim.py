"""NumPy AdamW and global gradient-norm clipping, the oracle for shaders/adamw.wgsl."""
from __future__ import annotations

import numpy as np


def grad_norm(grads):
    """Global L2 norm over a list of gradient arrays (accumulated in float64)."""
    return float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads)))


def clip_scale(norm, max_norm):
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    """One decoupled-weight-decay Adam step in place (as torch.optim.AdamW); step counts from 1."""
    g = grad * grad_scale
    param *= 1.0 - lr * weight_decay
    m *= beta1
    m += (1.0 - beta1) * g
    v *= beta2
    v += (1.0 - beta2) * g * g
    m_hat = m / (1.0 - beta1 ** step)
    v_hat = v / (1.0 - beta2 ** step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)
