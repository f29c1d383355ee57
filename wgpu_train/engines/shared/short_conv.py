"""The reference causal depthwise convolution of LFM2's short-convolution layers (transformers' Conv1d with groups =
channels, padding size - 1, its first T outputs): the op pair over a batch of sequences (a new segment's window
starts from zero, as each sequence alone), with its weight's gradient, and the cached form generation runs over a
row's recurrent state (its last size - 1 inputs). The NumPy engine runs it; GPU kernels are checked against it."""
from __future__ import annotations

import numpy as np


def _same_sequence(segment_ids, lag: int):
    """(B, T) bool: whether the input `lag` positions back lies in the same sequence as position t (segment ids,
    0 = padding: a padding input is never in a window, as transformers zeroes padding before the convolution)."""
    b, t = segment_ids.shape
    out = np.zeros((b, t), dtype=bool)
    if lag < t:
        back = segment_ids[:, :t - lag]
        out[:, lag:] = (segment_ids[:, lag:] == back) & (back != 0)
    return out


def short_conv_forward(x, weight, segment_ids):
    """x (B, T, C), weight (C, 1, K) as the checkpoint stores it, segment_ids (B, T) -> y (B, T, C):
    y[t] = sum_k weight[:, 0, K-1-k] x[t-k] over the lags k whose input lies in t's sequence."""
    w = weight[:, 0, :]                                                  # (C, K)
    k_size = w.shape[1]
    y = np.zeros_like(x)
    for lag in range(min(k_size, x.shape[1])):
        mask = _same_sequence(segment_ids, lag)[..., None]              # (B, T, 1)
        shifted = np.zeros_like(x)
        shifted[:, lag:] = x[:, :x.shape[1] - lag]
        y += np.where(mask, shifted, 0) * w[:, k_size - 1 - lag]
    return y


def short_conv_backward(dy, x, weight, segment_ids, need_weight_grad: bool = True):
    """The gradients of short_conv_forward: dy (B, T, C) -> dx (B, T, C), dweight (C, 1, K) (None unless
    need_weight_grad: the weight trains only in full fine-tuning)."""
    w = weight[:, 0, :]
    k_size, t = w.shape[1], x.shape[1]
    dx = np.zeros_like(x)
    dw = np.zeros_like(weight) if need_weight_grad else None
    for lag in range(min(k_size, t)):
        masked = np.where(_same_sequence(segment_ids, lag)[..., None], dy, 0)     # dy where x[t - lag] counts
        dx[:, :t - lag] += masked[:, lag:] * w[:, k_size - 1 - lag]
        if need_weight_grad:
            dw[:, 0, k_size - 1 - lag] = np.einsum("btc,btc->c", masked[:, lag:], x[:, :t - lag])
    return dx, dw


def short_conv_cached_forward(x, state, weight):
    """One row's next tokens in generation: x (n, C) its inputs at consecutive positions, state (K-1, C) the K-1
    inputs before them (zeros for a row's first tokens) -> y (n, C) and the new state (K-1, C), its last K-1
    inputs."""
    w = weight[:, 0, :]                                                  # (C, K)
    k_size, n = w.shape[1], x.shape[0]
    window = np.concatenate([state, x])                                  # (K-1+n, C)
    y = sum(window[j:j + n] * w[:, j] for j in range(k_size))
    return y.astype(x.dtype, copy=False), window[n:]
