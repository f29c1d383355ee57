"""The reference attention both engines hold to: causal grouped-query attention over a batch (forward and
backward from the saved logsumexp), over a KV cache (forward), Gemma 2's score soft-capping and gpt-oss's
attention sinks. The NumPy engine runs it; the WebGPU tuner checks every attention candidate against it on the
device."""
from __future__ import annotations

import numpy as np


def attention_allowed(segment_ids, window: int = 0, blocks=None):
    """(B, T) segment ids (0 = padding) -> (B, T, T) bool: query i may see key j.

    Causal, within a sliding window when window > 0 (i - j < window), and never across segments (padding
    or packed samples). blocks (B, T) (Gemma 3's images: a block number per image token, -1 for text), when
    given: the tokens of one block also see each other both ways, still within the window (transformers'
    AND(sliding window, OR(causal, block))). A padding query sees only itself so that its row stays finite;
    its output is never used.
    """
    t = segment_ids.shape[1]
    causal = np.tril(np.ones((t, t), dtype=bool))[None]
    if blocks is not None:
        causal = causal | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks >= 0)[:, :, None])
    if window > 0:
        causal = causal & ~np.tril(np.ones((t, t), dtype=bool), -window)
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


def _with_sinks(scores, sinks):
    """The row maxima (..., 1) of scores (B, H, Tq, Tk) with each head's sink logit (H,) among them, if given."""
    m = scores.max(axis=-1, keepdims=True)
    return m if sinks is None else np.maximum(m, sinks.astype(scores.dtype)[:, None, None])


def attention_forward(q, k, v, segment_ids, window: int = 0, softcap: float = 0.0, sinks=None, blocks=None):
    """Causal grouped-query attention (within a sliding window of `window` keys when window > 0; the scaled
    scores soft-capped at `softcap` when it is not 0; with sinks (Hq,), gpt-oss's: head h's softmax has
    exp(sinks[h]) in its denominator too, a key whose value is zero).

    q (B, T, Hq, D), k and v (B, T, Hkv, D), segment_ids (B, T) -> out (B, T, Hq, D), lse (B, Hq, T) (the
    sink's term included). Query head h reads key/value head h // (Hq / Hkv), as in Hugging Face's repeat_kv.
    """
    n_rep = q.shape[2] // k.shape[2]
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scale = 1.0 / np.sqrt(q.shape[-1])
    scores = softcap_forward(np.einsum("bihd,bjhd->bhij", q, ke) * scale, softcap)   # (B, H, T, T)
    allowed = attention_allowed(segment_ids, window, blocks)[:, None]
    scores = np.where(allowed, scores, -np.inf)
    m = _with_sinks(scores, sinks)
    p = np.exp(scores - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks.astype(scores.dtype)[:, None, None] - m)
    p = p / denom
    out = np.einsum("bhij,bjhd->bihd", p, ve)
    lse = (m + np.log(denom))[..., 0]                             # (B, H, T)
    return out.astype(q.dtype), lse.astype(q.dtype)


def attention_backward(dout, q, k, v, out, lse, segment_ids, window: int = 0, softcap: float = 0.0, sinks=None,
                       blocks=None):
    """Gradients of attention_forward from the saved logsumexp: dq (B, T, Hq, D), dk, dv (B, T, Hkv, D), and with
    sinks also dsinks (Hq,): a sink's probability exp(sink - lse) times minus its row's rowsum(dout * out), its
    value being zero, summed over the rows."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    n_rep = hq // hkv
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    scale = 1.0 / np.sqrt(d)
    raw = np.einsum("bihd,bjhd->bhij", q, ke) * scale
    allowed = attention_allowed(segment_ids, window, blocks)[:, None]
    p = np.where(allowed, np.exp(softcap_forward(raw, softcap) - lse[..., None]), 0.0)  # (B, H, T, T)
    dve = np.einsum("bhij,bihd->bjhd", p, dout)
    dp = np.einsum("bihd,bjhd->bhij", dout, ve)
    delta = np.einsum("bihd,bihd->bhi", dout, out)               # rowsum(dout * out)
    ds = softcap_backward(p * (dp - delta[..., None]), raw, softcap) * scale
    dq = np.einsum("bhij,bjhd->bihd", ds, ke)
    dke = np.einsum("bhij,bihd->bjhd", ds, q)
    dk = dke.reshape(b, t, hkv, n_rep, d).sum(axis=3)
    dv = dve.reshape(b, t, hkv, n_rep, d).sum(axis=3)
    grads = dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)
    if sinks is None:
        return grads
    return (*grads, attention_sink_backward(delta, lse, sinks))



def attention_sink_forward(out, lse, sinks):
    """attention_forward's result without sinks (out (B, T, Hq, D), lse (B, Hq, T)) -> its result with sinks (Hq,):
    the sink adds exp(sinks[h]) to each row's denominator, so lse' = logaddexp(lse, sink) and out is scaled by
    exp(lse - lse') (the WebGPU engine runs this after any attention kernel)."""
    s = sinks.astype(lse.dtype)[None, :, None]                                    # (1, Hq, 1)
    new = np.logaddexp(lse, s)                                                     # (B, Hq, T)
    factor = np.exp(lse - new).transpose(0, 2, 1)[..., None]                       # (B, T, Hq, 1)
    return (out * factor).astype(out.dtype), new.astype(lse.dtype)


def attention_sink_backward(delta, lse, sinks):
    """dsinks (Hq,) of attention_forward with sinks from its saved lse (B, Hq, T) (the sink's term included) and
    delta = rowsum(dout * out) (B, Hq, T): a sink's probability exp(sink - lse) times minus delta, summed over the
    rows (attention_backward's own dq, dk, dv need nothing more: lse already holds the sink)."""
    return -np.einsum("bhi,bhi->h", np.exp(sinks.astype(lse.dtype)[None, :, None] - lse), delta).astype(sinks.dtype)

# A KV cache holds B sequences (its rows) of up to L positions; a negative row marks a padding query, whose
# output stays zero.
def attention_cached_forward(q, k_cache, v_cache, rows, positions, window: int = 0, softcap: float = 0.0,
                             sinks=None, blocks=None):
    """New queries against a KV cache: q (N, Hq, D), query i in cache row rows[i] at position positions[i];
    k/v cache (B, L, Hkv, D) -> out (N, Hq, D). Query i sees keys 0..positions[i] of its own row (causal),
    only the last `window` of them when window > 0; sinks (Hq,) as in attention_forward; blocks (N,) or None:
    each query's image block (-1 for text), whose other tokens in this call it sees both ways (a prefill that
    holds each image whole, as attention_allowed's blocks)."""
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
        seen = keys <= pos[:, None]
        if blocks is not None:
            key_blocks = np.full(tk, -1)
            key_blocks[pos] = blocks[sel]
            seen = seen | ((key_blocks[None, :] == blocks[sel][:, None]) & (blocks[sel] >= 0)[:, None])
        seen = seen & ((keys > pos[:, None] - window) if window > 0 else True)
        scores = np.where(seen, scores, -np.inf)
        m = _with_sinks(scores, sinks)
        p = np.exp(scores - m)
        denom = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(sinks.astype(scores.dtype)[:, None, None] - m)
        p /= denom
        out[sel] = np.einsum("hij,jhd->ihd", p, ve)
    return out
