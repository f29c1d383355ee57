"""NumPy op pairs: each `<op>_forward` returns its outputs, each `<op>_backward` the gradients of its inputs.

Argument order mirrors shaders/<op>.wgsl and webgpu/kernels.py, where the outputs come first
(here they are returned instead): inputs and weights, then sizes. Arrays keep the dtype they
are given (float32 by default, float64 for gradient checks).
"""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


# ---- embedding -------------------------------------------------------------------------------

def embedding_forward(ids, weight):
    """ids (N,) int, weight (V, C) -> (N, C)."""
    return weight[ids]


def embedding_backward(dout, ids, vocab_size):
    """dout (N, C) -> dweight (V, C): scatter-add of each row into its token's row."""
    dweight = np.zeros((vocab_size, dout.shape[-1]), dtype=dout.dtype)
    np.add.at(dweight, ids, dout)
    return dweight


def row_gather_forward(x, rows):
    """x (M, C), rows (N,) int distinct -> (N, C): the rows of x that rows names (the loss head's trained rows)."""
    return x[rows]


def row_gather_backward(dout, rows, m):
    """dout (N, C) -> dx (m, C): each row written back to its index, zero elsewhere."""
    dx = np.zeros((m, dout.shape[-1]), dtype=dout.dtype)
    dx[rows] = dout
    return dx


# ---- rmsnorm ---------------------------------------------------------------------------------

def rmsnorm_forward(x, weight, eps, offset=0.0):
    """x (N, C), weight (C,) -> y (N, C) = x * rstd * (weight + offset), rstd (N,)."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + eps)
    return (x * rstd[:, None]) * (weight + offset), rstd.astype(x.dtype)


def rmsnorm_backward(dy, x, weight, rstd, offset=0.0):
    """Gradients of rmsnorm_forward: dx (N, C), dweight (C,)."""
    xhat = x * rstd[:, None]                                     # (N, C)
    dweight = np.sum(dy * xhat, axis=0)
    dxhat = dy * (weight + offset)
    c = x.shape[-1]
    dx = rstd[:, None] * (dxhat - xhat * (np.sum(dxhat * xhat, axis=-1, keepdims=True) / c))
    return dx, dweight


# ---- linear and LoRA -------------------------------------------------------------------------

def linear_forward(x, weight, bias=None):
    """x (N, in), weight (out, in), bias (out,) or None -> (N, out)."""
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    return y


def linear_backward(dy, x, weight, need_weight_grad=True):
    """dy (N, out) -> dx (N, in), dweight (out, in) or None, dbias (out,) or None."""
    dx = dy @ weight
    if not need_weight_grad:
        return dx, None, None
    return dx, dy.T @ x, dy.sum(axis=0)


def lora_forward(x, lora_a, lora_b, scale):
    """The low-rank branch: x (N, in), A (r, in), B (out, r) -> y (N, out) = scale * x A^T B^T, h (N, r)."""
    h = x @ lora_a.T
    return scale * (h @ lora_b.T), h


def lora_backward(dy, x, h, lora_a, lora_b, scale):
    """Gradients of lora_forward: dx (N, in), dA (r, in), dB (out, r)."""
    dys = scale * dy                                             # (N, out)
    dlora_b = dys.T @ h
    dh = dys @ lora_b                                            # (N, r)
    dlora_a = dh.T @ x
    return dh @ lora_a, dlora_a, dlora_b


# ---- DoRA (weight-decomposed LoRA, PEFT's formulation) ----------------------------------------

def dora_norm(weight_sq, pt, g, lora_b, scale):
    """1 / ||W + scale * B A|| per output row, from ||W||^2 (out,), P^T = A W^T (r, out), G = A A^T (r, r) and
    B (out, r): ||W_j + s (BA)_j||^2 = ||W_j||^2 + 2 s B_j . P_j + s^2 B_j G B_j^T. Forward only: PEFT detaches
    the norm, so it has no backward."""
    sq = weight_sq + 2 * scale * np.sum(lora_b * pt.T, axis=1) + scale * scale * np.sum((lora_b @ g) * lora_b, axis=1)
    return 1 / np.sqrt(sq)


def dora_forward(z, magnitude, rnorm, bias=None, offset=0.0):
    """y (N, out) = (magnitude * rnorm - offset) * z + bias: z (N, out) the module's W x + scale B A x (of the
    dropped-out x while training with dropout), magnitude m and rnorm = 1 / ||W + scale B A|| (out,)."""
    y = (magnitude * rnorm - offset) * z
    return y + bias if bias is not None else y


def dora_backward(dy, z, magnitude, rnorm, offset=0.0):
    """Gradients of dora_forward: dz (N, out) and dmagnitude (out,) (rnorm is detached)."""
    return (magnitude * rnorm - offset) * dy, rnorm * np.sum(dy * z, axis=0)


def pcg_hash(v):
    """The PCG output hash on uint32 (wrapping), identical to pcg_hash in shaders/lora_dropout.wgsl."""
    v = np.asarray(v, dtype=np.uint32)
    with np.errstate(over="ignore"):
        s = v * np.uint32(747796405) + np.uint32(2891336453)
        w = ((s >> ((s >> np.uint32(28)) + np.uint32(4))) ^ s) * np.uint32(277803737)
    return (w >> np.uint32(22)) ^ w


def dropout_mask(seed, shape, p, dtype=np.float32):
    """Inverted-dropout mask of `shape`: 0 with probability p, else 1/(1-p), from a counter-based hash of
    (seed, element index), so that the GPU draws exactly the same mask."""
    n = int(np.prod(shape))
    u = pcg_hash(np.arange(n, dtype=np.uint32) ^ pcg_hash(seed))
    keep = (u >> np.uint32(8)) >= np.uint32(int(p * (1 << 24)))
    return (keep.astype(dtype) / np.asarray(1.0 - p, dtype=dtype)).reshape(shape)


# ---- rope ------------------------------------------------------------------------------------

def _rope_cos_sin(positions, inv_freq, scale, dtype):
    angles = positions[..., None].astype(np.float64) * inv_freq  # (B, T, R/2)
    cos, sin = np.cos(angles) * scale, np.sin(angles) * scale
    return cos.astype(dtype)[:, :, None, :], sin.astype(dtype)[:, :, None, :]


def rope_forward(x, positions, inv_freq, scale=1.0):
    """Hugging Face half-rotation RoPE: x (B, T, H, D), positions (B, T) int, inv_freq (R/2,) -> (B, T, H, D).
    The leading R dims of each head rotate (pairs d, d + R/2), times scale (longrope's attention factor);
    the other D - R pass through (partial rotary)."""
    cos, sin = _rope_cos_sin(positions, inv_freq, scale, x.dtype)
    half = inv_freq.shape[0]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def rope_backward(dy, positions, inv_freq, scale=1.0):
    """The rotation is orthogonal: the gradient is the rotation by the opposite angle (times scale)."""
    cos, sin = _rope_cos_sin(positions, inv_freq, scale, dy.dtype)
    half = inv_freq.shape[0]
    d1, d2, rest = dy[..., :half], dy[..., half:2 * half], dy[..., 2 * half:]
    return np.concatenate([d1 * cos + d2 * sin, d2 * cos - d1 * sin, rest], axis=-1)


# ---- split (a fused projection's output) -----------------------------------------------------

def split_forward(x, widths):
    """x (N, sum(widths)) -> its column blocks [(N, w) for w in widths], in order."""
    return np.split(x, np.cumsum(widths)[:-1], axis=-1)


def split_backward(dys):
    """The blocks' gradients [(N, w), ...] side by side: (N, sum(w))."""
    return np.concatenate(dys, axis=-1)


# ---- attention -------------------------------------------------------------------------------

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


# ---- swiglu ----------------------------------------------------------------------------------

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def swiglu_forward(gate, up):
    """silu(gate) * up, elementwise on (N, F)."""
    return gate * _sigmoid(gate) * up


def swiglu_backward(dh, gate, up):
    """Gradients of swiglu_forward: dgate, dup (N, F)."""
    s = _sigmoid(gate)
    silu = gate * s
    return dh * up * (s * (1.0 + gate * (1.0 - s))), dh * silu


# ---- geglu -----------------------------------------------------------------------------------

GELU_C = np.sqrt(2.0 / np.pi)       # gelu's tanh approximation: 0.5 x (1 + tanh(GELU_C (x + 0.044715 x^3)))


def geglu_forward(gate, up):
    """gelu_tanh(gate) * up, elementwise on (N, F) (transformers' gelu_pytorch_tanh)."""
    t = np.tanh(GELU_C * (gate + 0.044715 * gate ** 3))
    return 0.5 * gate * (1.0 + t) * up


def geglu_backward(dh, gate, up):
    """Gradients of geglu_forward: dgate, dup (N, F)."""
    t = np.tanh(GELU_C * (gate + 0.044715 * gate ** 3))
    gelu = 0.5 * gate * (1.0 + t)
    dgelu = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * gate ** 2)
    return dh * up * dgelu, dh * gelu


# ---- cross-entropy ---------------------------------------------------------------------------

def cross_entropy_rows(logits, targets):
    """logits (N, V), targets (N,) int with IGNORE_INDEX -> (loss (N,): lse - logit[target], 0 on ignored rows;
    lse (N,)). A row's loss is minus the log-probability of its target."""
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    valid = targets != IGNORE_INDEX
    safe = np.where(valid, targets, 0)
    picked = logits[np.arange(logits.shape[0]), safe]
    return np.where(valid, lse - picked, 0.0), lse


def cross_entropy_forward(logits, targets):
    """logits (N, V), targets (N,) int with IGNORE_INDEX -> (loss_sum, count, lse (N,)).

    The sum over counted rows of lse - logit[target]; the caller divides by the token count.
    """
    rows, lse = cross_entropy_rows(logits, targets)
    return float(np.sum(rows)), int((targets != IGNORE_INDEX).sum()), lse


def cross_entropy_backward(logits, targets, lse, grad_scale, softcap: float = 0.0):
    """dlogits (N, V) = grad_scale * (softmax - onehot) on counted rows, zero elsewhere; grad_scale is one
    number or a weight per row (N,) (a preference objective's per-token coefficients). softcap > 0: the
    logits are soft-capped ones (softcap_forward) and dlogits is with respect to the uncapped logits, the
    cap's derivative 1 - (logits / softcap)^2 taken from the capped values."""
    valid = targets != IGNORE_INDEX
    dlogits = np.exp(logits - lse[:, None])
    dlogits[np.arange(logits.shape[0]), np.where(valid, targets, 0)] -= 1.0
    dlogits *= np.where(valid, grad_scale, 0.0).astype(logits.dtype)[:, None]
    return dlogits * (1.0 - (logits / softcap) ** 2) if softcap else dlogits


def shift_labels(labels):
    """Hugging Face's convention: logits at t predict labels[t + 1]; (B, T) -> targets (B, T)."""
    targets = np.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


# ---- KV cache and attention over it (generation; forward only) -------------------------------
# A cache holds B sequences (its rows) of up to L positions; every new token names its row and its
# position, so one call can prefill several ragged prompts packed together or advance every row by one
# token. A negative row marks a padding token: it writes nothing and its attention output is zero.

def kv_cache_write(k_cache, v_cache, k_new, v_new, rows, positions):
    """k_cache[rows[i], positions[i]] = k_new[i], v_cache likewise, in place: caches (B, L, Hkv, D),
    new keys and values (N, Hkv, D), rows and positions (N,) int."""
    keep = rows >= 0
    k_cache[rows[keep], positions[keep]] = k_new[keep]
    v_cache[rows[keep], positions[keep]] = v_new[keep]


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
