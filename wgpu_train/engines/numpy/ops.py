"""NumPy op pairs: each `<op>_forward` returns its outputs, each `<op>_backward` the gradients of its inputs.

Argument order mirrors shaders/<op>.wgsl and webgpu/kernels.py, where the outputs come first
(here they are returned instead): inputs and weights, then sizes. Arrays keep the dtype they
are given (float32 by default, float64 for gradient checks).
"""
from __future__ import annotations

import numpy as np

from wgpu_train.data.records import IGNORE_INDEX
# the attention pair (and its cached forward, and the score soft-capping) and the mixture of experts' pairs are
# written once in shared/, since the WebGPU kernels are checked against them; here they stand with the other op
# pairs
from wgpu_train.engines.shared.attention import (attention_backward, attention_cached_forward,  # noqa: F401
                                                 attention_forward, attention_sink_forward, softcap_forward)
from wgpu_train.engines.shared.delta_rule import (gated_delta_rule_backward, gated_delta_rule_forward,  # noqa: F401
                                                  gated_delta_rule_step, l2norm_backward, l2norm_forward)
from wgpu_train.engines.shared.dropout import pcg_hash
from wgpu_train.engines.shared.gated_deltanet import (decay_backward, decay_forward,  # noqa: F401
                                                      gated_rmsnorm_backward, gated_rmsnorm_forward, silu_backward,
                                                      silu_forward)
from wgpu_train.engines.shared.moe import (moe_experts_backward, moe_experts_forward,  # noqa: F401
                                           moe_route_backward, moe_route_forward)
from wgpu_train.engines.shared.short_conv import (short_conv_backward, short_conv_cached_forward,  # noqa: F401
                                                  short_conv_forward)


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


def dropout_mask(seed, shape, p, dtype=np.float32):
    """Inverted-dropout mask of `shape`: 0 with probability p, else 1/(1-p), from a counter-based hash of
    (seed, element index), so that the GPU draws exactly the same mask."""
    n = int(np.prod(shape))
    u = pcg_hash(np.arange(n, dtype=np.uint32) ^ pcg_hash(seed))
    keep = (u >> np.uint32(8)) >= np.uint32(int(p * (1 << 24)))
    return (keep.astype(dtype) / np.asarray(1.0 - p, dtype=dtype)).reshape(shape)


# ---- rope ------------------------------------------------------------------------------------

def _rope_cos_sin(positions, inv_freq, scale, dtype):
    # positions (B, T), or (B, T, R/2): each rotated pair's own (M-RoPE's 3-D positions, models/qwen3_vl.py)
    pairs = positions if positions.ndim == 3 else positions[..., None]
    angles = pairs.astype(np.float64) * inv_freq                                    # (B, T, R/2)
    cos, sin = np.cos(angles) * scale, np.sin(angles) * scale
    return cos.astype(dtype)[:, :, None, :], sin.astype(dtype)[:, :, None, :]


def rope_forward(x, positions, inv_freq, scale=1.0):
    """Hugging Face half-rotation RoPE: x (B, T, H, D), positions (B, T) int (or (B, T, R/2): each pair's
    position), inv_freq (R/2,) -> (B, T, H, D).
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

def split_forward(x, widths, heads: int = 1):
    """x (N, sum(widths)) -> its column blocks [(N, w) for w in widths], in order; with heads H, each head's columns
    (N, H, sum(widths) / H) are split into its blocks of w / H, each block (N, w) the heads' parts in head order."""
    n = x.shape[0]
    parts = np.split(x.reshape(n, heads, x.shape[1] // heads), np.cumsum(widths)[:-1] // heads, axis=-1)
    return [p.reshape(n, w) for p, w in zip(parts, widths)]


def split_backward(dys, heads: int = 1):
    """The blocks' gradients [(N, w), ...] side by side (each head's, with heads H): (N, sum(w))."""
    n = dys[0].shape[0]
    return np.concatenate([d.reshape(n, heads, d.shape[1] // heads) for d in dys], axis=-1).reshape(
        n, sum(d.shape[1] for d in dys))


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


# ---- sigmoid gate (Qwen2-MoE's shared expert) ----------------------------------------------------

def _groups(x, g):
    """x (N, C) as (N, G, C / G) for g (N, G): each gate's columns."""
    return x.reshape(*x.shape[:-1], g.shape[-1], -1)


def sigmoid_gate_forward(x, g):
    """x (N, C) times sigmoid(g), g (N, G), each gate over C / G adjacent columns: G = 1 (one gate per token:
    Qwen2-MoE's shared expert), the heads (LFM3's g_proj) or C (one per element: Qwen3.5's attention output
    gate): y (N, C)."""
    return (_groups(x, g) * _sigmoid(g)[..., None]).reshape(x.shape)


def sigmoid_gate_backward(dy, x, g):
    """Gradients of sigmoid_gate_forward: dx (N, C), dg (g's shape)."""
    s = _sigmoid(g)
    dxs = np.sum(_groups(dy, g) * _groups(x, g), axis=-1)
    return (_groups(dy, g) * s[..., None]).reshape(x.shape), dxs * s * (1.0 - s)


# ---- mul (LFM2's gates of its short convolution) --------------------------------------------------

def mul_forward(a, b):
    """a * b, elementwise on (N, C)."""
    return a * b


def mul_backward(dy, a, b):
    """Gradients of mul_forward: da (N, C), db (N, C)."""
    return dy * b, dy * a


# ---- geglu -----------------------------------------------------------------------------------

GELU_C = np.sqrt(2.0 / np.pi)       # gelu's tanh approximation: 0.5 x (1 + tanh(GELU_C (x + 0.044715 x^3)))


def geglu_forward(gate, up):
    """gelu_tanh(gate) * up, elementwise on (N, F) (transformers' gelu_pytorch_tanh), in gate's dtype (GELU_C, a
    float64 scalar, would otherwise promote a float32 gate to float64, and every layer after it)."""
    t = np.tanh(gate.dtype.type(GELU_C) * (gate + 0.044715 * gate ** 3))
    return 0.5 * gate * (1.0 + t) * up


def geglu_backward(dh, gate, up):
    """Gradients of geglu_forward: dgate, dup (N, F)."""
    c = gate.dtype.type(GELU_C)
    t = np.tanh(c * (gate + 0.044715 * gate ** 3))
    gelu = 0.5 * gate * (1.0 + t)
    dgelu = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * gate ** 2)
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


def softmax_entropy_forward(logits, lse):
    """logits (N, V), lse (N,) their logsumexp -> (N,) the entropy of each row's softmax (a metric: no backward)."""
    gap = np.asarray(lse, np.float64)[:, None] - logits                                # (N, V) -log p
    return (np.exp(-gap) * gap).sum(axis=-1).astype(np.float32)


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


def _token_objective_parts(loss, terms, objective):
    """(token loss, d token loss / d logp) (N,) float64 of a TokenObjective (engines/protocol.py) from the loss
    head's rows loss (N,) = -logp and its terms (N, 4): [scale, advantage, old logp, reference logp]."""
    o = objective
    logp = -np.asarray(loss, np.float64)
    terms = np.asarray(terms, np.float64)
    adv = terms[:, 1]
    ratio = np.exp(logp - terms[:, 2]) if o.old_logps is not None else np.ones_like(logp)
    if o.loss == "cispo":     # the clamped ratio is a constant factor: the gradient flows through logp alone
        factor = -np.minimum(ratio, o.epsilon_high) * adv
        value, slope = factor * logp, factor
    elif o.loss == "sapo":
        tau = np.where(adv > 0, o.temperature_pos, o.temperature_neg)
        gate = 1.0 / (1.0 + np.exp(-tau * (ratio - 1.0)))
        value, slope = -gate * 4.0 / tau * adv, -4.0 * gate * (1.0 - gate) * ratio * adv
    else:                     # PPO's clipped surrogate: the gradient flows where the unclipped term is the smaller
        clipped = np.clip(ratio, 1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
        value = -np.minimum(ratio * adv, clipped * adv)
        slope = np.where(ratio * adv <= clipped * adv, -ratio * adv, 0.0)
    if o.beta:
        gap = terms[:, 3] - logp
        kl, dkl = np.exp(gap) - gap - 1.0, 1.0 - np.exp(gap)      # the k3 estimator and its derivative
        if o.bias_correction_kl:  # k3 times the ratio, both differentiated
            kl, dkl = kl * ratio, (dkl + kl) * ratio
        value, slope = value + o.beta * kl, slope + o.beta * dkl
    return value, slope


def token_objective_forward(loss, terms, objective):
    """Each token's loss (N,) float64 under a TokenObjective, from the loss head's rows loss (N,) = -logp and
    terms (N, 4) = objective.terms(): the per-token policy loss plus beta times the KL estimate (its scale not
    applied; the host weighs and sums them, GRPO.step_loss)."""
    return _token_objective_parts(loss, terms, objective)[0]


def token_objective_backward(loss, terms, objective):
    """The loss head's per-row gradient weights (N,) float32 of a TokenObjective: -scale * d(token loss) / d logp
    (0 where scale is 0), from loss (N,) = -logp and terms (N, 4) = objective.terms(); what
    cross_entropy_backward then takes as its per-row grad_scale."""
    scale = np.asarray(terms, np.float64)[:, 0]
    slope = _token_objective_parts(loss, terms, objective)[1]
    return np.where(scale != 0, -scale * slope, 0.0).astype(np.float32)


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
