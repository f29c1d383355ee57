"""The reference attention both engines hold to: causal grouped-query attention over a batch (forward and
backward from the saved logsumexp), over a KV cache (forward), and Gemma 2's score soft-capping. The NumPy
engine runs it; the WebGPU tuner checks every attention candidate against it on the device."""
from __future__ import annotations

import numpy as np


def attention_allowed(segment_ids, window: int = 0):
    """(B, T) segment ids (0 = padding) -> (B, T, T) bool: query i may see key j.

    Causal, within a sliding window when window > 0 (i - j < window), and never across segments (padding
    or packed samples). A padding query sees only itself so that its row stays finite; its output is never
    used.
    """
    t = segment_ids.shape[1]
    causal = np.tril(np.ones((t, t), dtype=bool))
    if window > 0:
        causal &= ~np.tril(np.ones((t, t), dtype=bool), -window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real_key = (segment_ids != 0)[:, None, :]
    allowed = causal & same & real_key
    pad_query = (segment_ids == 0)[:, :, None]
    return allowed | (pad_query & np.eye(t, dtype=bool))


def _expand_kv(k, n_rep):
    return np.repeat(k, n_rep, axis=2) if n_rep > 1 else k


def softcap_forward(x, cap: float):
    """Logit soft-capping: cap * tanh(x / cap) (Gemma 2), x itself when cap is 0."""
    return cap * np.tanh(x / cap) if cap else x


def softcap_backward(dy, x, cap: float):
    """Gradient of softcap_forward at x."""
    return dy * (1.0 - np.tanh(x / cap) ** 2) if cap else dy


def attention_forward(q, k, v, segment_ids, window: int = 0, softcap: float = 0.0):
    """Causal grouped-query attention (within a sliding window of `window` keys when window > 0; the scaled
    scores soft-capped at `softcap` when it is not 0).

    q (B, T, Hq, D), k and v (B, T, Hkv, D), segment_ids (B, T) -> out (B, T, Hq, D), lse (B, Hq, T).
    Query head h reads key/value head h // (Hq / Hkv), as in Hugging Face's repeat_kv.
    """
    n_rep = q.shape[2] // k.shape[2]
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scale = 1.0 / np.sqrt(q.shape[-1])
    scores = softcap_forward(np.einsum("bihd,bjhd->bhij", q, ke) * scale, softcap)   # (B, H, T, T)
    allowed = attention_allowed(segment_ids, window)[:, None]
    scores = np.where(allowed, scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / denom
    out = np.einsum("bhij,bjhd->bihd", p, ve)
    lse = (m + np.log(denom))[..., 0]                             # (B, H, T)
    return out.astype(q.dtype), lse.astype(q.dtype)


def attention_backward(dout, q, k, v, out, lse, segment_ids, window: int = 0, softcap: float = 0.0):
    """Gradients of attention_forward from the saved logsumexp: dq (B, T, Hq, D), dk, dv (B, T, Hkv, D)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    n_rep = hq // hkv
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scale = 1.0 / np.sqrt(d)
    raw = np.einsum("bihd,bjhd->bhij", q, ke) * scale
    allowed = attention_allowed(segment_ids, window)[:, None]
    p = np.where(allowed, np.exp(softcap_forward(raw, softcap) - lse[..., None]), 0.0)  # (B, H, T, T)
    dve = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, ve)
    delta = np.einsum("bihd,bihd->bhi", dout, out)               # rowsum(dout * out)
    ds = softcap_backward(p * (dp - delta[..., None]), raw, softcap) * scale
    dq = np.einsum("bhij,bjhd->bihd", ds, ke)
    dke = np.einsum("bhij,bihd->bjhd", ds, q)
    dk = dke.reshape(b, t, hkv, n_rep, d).sum(axis=3)
    dv = dve.reshape(b, t, hkv, n_rep, d).sum(axis=3)
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


# A KV cache holds B sequences (its rows) of up to L positions; a negative row marks a padding query, whose
# output stays zero.
def attention_cached_forward(q, k_cache, v_cache, rows, positions, window: int = 0, softcap: float = 0.0):
    """New queries against a KV cache: q (N, Hq, D), query i in cache row rows[i] at position positions[i];
    k/v cache (B, L, Hkv, D) -> out (N, Hq, D). Query i sees keys 0..positions[i] of its own row (causal),
    only the last `window` of them when window > 0."""
    n, hq, d = q.shape
    n_rep = hq // k_cache.shape[2]
    out = np.zeros_like(q)
    for r in np.unique(rows[rows >= 0]):
        sel = np.flatnonzero(rows == r)                               # this row's queries
        pos = positions[sel]
        tk = int(pos.max()) + 1
        ke, ve = _expand_kv(k_cache[r:r + 1, :tk], n_rep)[0], _expand_kv(v_cache[r:r + 1, :tk], n_rep)[0]
        scores = softcap_forward(np.einsum("ihd,jhd->hij", q[sel], ke) / np.sqrt(d), softcap)  # (Hq, Ni, Tk)
        keys = np.arange(tk)[None, :]
        seen = (keys <= pos[:, None]) & ((keys > pos[:, None] - window) if window > 0 else True)
        scores = np.where(seen, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[sel] = np.einsum("hij,jhd->ihd", p, ve)
    return out
