"""The reference mixture-of-experts op pairs both engines hold to: the router's top-k (softmax over the experts,
or LFM2-MoE's sigmoid with a choosing bias and a scale; the k largest, renormalised or not), the routed experts' gated MLPs with each expert's own LoRA pair (gpt-oss's:
with biases and its clamped SwiGLU), and transformers' load-balancing loss. The NumPy engine runs them; the WebGPU
kernels are checked against them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation, over gate_up rows that alternate gate (2j) and up (2j + 1): the gate clamped
    above at `limit`, the up within [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


def _softmax(logits):
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# what a router's renormalisation adds to the chosen scores' sum: transformers' sigmoid routers add 1e-6
_EPS = {"softmax": 0.0, "sigmoid": 1e-6}


def moe_route_forward(logits, top_k: int, normalize: bool, scoring: str = "softmax", bias=None,
                      scale: float = 1.0):
    """logits (N, E) -> weights (N, k), experts (N, k) int32: each expert's score (softmax over the experts, or
    LFM2-MoE's sigmoid of each), the k largest of score + bias (bias (E,) or None: it chooses, it does not weigh) in
    descending order (the lower index first among equals, as torch.topk on the CPU), their scores divided by their
    sum when `normalize` (norm_topk_prob; Mixtral's softmax over the chosen logits is the same; a sigmoid's sum
    plus 1e-6, as transformers'), times `scale` (routed_scaling_factor)."""
    probs = _softmax(logits) if scoring == "softmax" else _sigmoid(logits)           # (N, E)
    choose = probs if bias is None else probs + bias
    experts = np.argsort(-choose, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    weights = np.take_along_axis(probs, experts, axis=-1)                          # (N, k)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + _EPS[scoring])
    return (weights * scale).astype(logits.dtype), experts


def moe_route_backward(dweights, logits, experts, normalize: bool, dprobs=None, scoring: str = "softmax",
                       scale: float = 1.0):
    """dweights (N, k) -> dlogits (N, E), through the scale, the renormalisation and the scores (a softmax's
    over every expert; a sigmoid's only the chosen experts' own logits: the bias that chose them has no
    gradient); dprobs (N, E), if given, adds a gradient on every expert's score (the load-balancing loss's)."""
    probs = _softmax(logits) if scoring == "softmax" else _sigmoid(logits)           # (N, E)
    chosen = np.take_along_axis(probs, experts, axis=-1)                           # (N, k)
    dweights = dweights * scale
    if normalize:
        total = chosen.sum(axis=-1, keepdims=True) + _EPS[scoring]
        weights = chosen / total
        dchosen = (dweights - np.sum(dweights * weights, axis=-1, keepdims=True)) / total
    else:
        dchosen = dweights
    dp = np.zeros_like(probs) if dprobs is None else np.array(dprobs, dtype=probs.dtype)
    np.add.at(dp, (np.arange(len(dp))[:, None], experts), dchosen)
    if scoring == "sigmoid":
        return (dp * probs * (1.0 - probs)).astype(logits.dtype)
    return (probs * (dp - np.sum(dp * probs, axis=-1, keepdims=True))).astype(logits.dtype)


def _expert_rows(experts, num_experts: int):
    """For each expert, the (token, slot) pairs routed to it, tokens ascending: [(tokens (n_e,), slots (n_e,))]."""
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(num_experts + 1))
    k = experts.shape[1]
    return [(order[bounds[e]:bounds[e + 1]] // k, order[bounds[e]:bounds[e + 1]] % k) for e in range(num_experts)]


def _with_lora(x, weight, lora, e):
    """x (n, in) through expert e's weight (out, in) and its LoRA pair (A (E, r, in), B (E, out, r), scale) or
    None: (y (n, out), h (n, r) or None)."""
    y = x @ weight.T
    if lora is None:
        return y, None
    a, b, scale = lora
    h = x @ a[e].T
    return y + scale * (h @ b[e].T), h


def _glu_forward(gu, activation):
    """The gated activation h (n, I) of gate / up projections gu (n, 2I): SwiGLU ("silu": gate rows then up rows)
    or a ClampedSwiGLU (rows interleaved)."""
    if activation == "silu":
        inter = gu.shape[1] // 2
        return gu[:, :inter] * _sigmoid(gu[:, :inter]) * gu[:, inter:]
    gate = np.minimum(gu[:, 0::2], activation.limit)
    up = np.clip(gu[:, 1::2], -activation.limit, activation.limit)
    return (up + 1.0) * gate * _sigmoid(activation.alpha * gate)


def _glu_backward(dh, gu, activation):
    """dgu (n, 2I) of _glu_forward from dh (n, I); the clamps pass the gradient where the value lies within them
    (bounds included), as torch.clamp's backward."""
    if activation == "silu":
        inter = gu.shape[1] // 2
        gate, up = gu[:, :inter], gu[:, inter:]
        s = _sigmoid(gate)
        return np.concatenate([dh * up * (s * (1.0 + gate * (1.0 - s))), dh * gate * s], axis=-1)
    a, limit = activation.alpha, activation.limit
    raw_gate, raw_up = gu[:, 0::2], gu[:, 1::2]
    gate, up = np.minimum(raw_gate, limit), np.clip(raw_up, -limit, limit)
    s = _sigmoid(a * gate)
    dgu = np.empty_like(gu)
    dgu[:, 0::2] = dh * (up + 1.0) * (s + a * gate * s * (1.0 - s)) * (raw_gate <= limit)
    dgu[:, 1::2] = dh * gate * s * ((raw_up >= -limit) & (raw_up <= limit))
    return dgu


def moe_experts_forward(x, weights, experts, gate_up, down, lora_gate_up=None, lora_down=None, gate_up_bias=None,
                        down_bias=None, activation="silu"):
    """The routed experts' gated MLPs, each token's k outputs weighted and summed.

    x (N, C), weights (N, k), experts (N, k) int; gate_up (E, 2I, C) with the gate's rows first, down (E, C, I)
    (transformers 5's fused layout); lora_gate_up / lora_down: (A (E, r, in), B (E, out, r), scale) or None;
    gate_up_bias (E, 2I) / down_bias (E, C) or None; activation: "silu" (SwiGLU) or a ClampedSwiGLU (gpt-oss:
    gate_up's rows, and its bias's, alternate gate and up) -> y (N, C), gate_up_out (N, k, 2I): every routed
    pair's gate / up projections (bias included), which the backward reads."""
    n, k = experts.shape
    inter = down.shape[2]
    y = np.zeros_like(x)
    gate_up_out = np.zeros((n, k, 2 * inter), dtype=x.dtype)
    for e, (tokens, slots) in enumerate(_expert_rows(experts, gate_up.shape[0])):
        if len(tokens) == 0:
            continue
        gu, _ = _with_lora(x[tokens], gate_up[e], lora_gate_up, e)                # (n_e, 2I)
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e]
        gate_up_out[tokens, slots] = gu
        h = _glu_forward(gu, activation)                                           # (n_e, I)
        out, _ = _with_lora(h, down[e], lora_down, e)                              # (n_e, C)
        if down_bias is not None:
            out = out + down_bias[e]
        np.add.at(y, tokens, out * weights[tokens, slots][:, None])
    return y, gate_up_out


def moe_experts_backward(dy, x, weights, experts, gate_up_out, gate_up, down, lora_gate_up=None, lora_down=None,
                         need_weight_grad: bool = False, gate_up_bias=None, down_bias=None, activation="silu"):
    """Gradients of moe_experts_forward: dx (N, C), dweights (N, k), and a dict of the trained tensors'
    gradients: "gate_up" / "down" (the experts' weights, when need_weight_grad, and "gate_up_bias" / "down_bias"
    where biases are given) and "gate_up.lora_A", "gate_up.lora_B", "down.lora_A", "down.lora_B" (where a LoRA
    pair is given), each of its tensor's shape."""
    dx = np.zeros_like(x)
    dweights = np.zeros_like(weights)
    grads = {}
    if need_weight_grad:
        grads["gate_up"], grads["down"] = np.zeros_like(gate_up), np.zeros_like(down)
        for name, bias in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
            if bias is not None:
                grads[name] = np.zeros_like(bias)
    for name, lora in (("gate_up", lora_gate_up), ("down", lora_down)):
        if lora is not None:
            grads[name + ".lora_A"], grads[name + ".lora_B"] = np.zeros_like(lora[0]), np.zeros_like(lora[1])
    for e, (tokens, slots) in enumerate(_expert_rows(experts, gate_up.shape[0])):
        if len(tokens) == 0:
            continue
        xe, gu = x[tokens], gate_up_out[tokens, slots]                             # (n_e, C), (n_e, 2I)
        h = _glu_forward(gu, activation)                                           # (n_e, I)
        out, h_down = _with_lora(h, down[e], lora_down, e)                         # (n_e, C)
        if down_bias is not None:
            out = out + down_bias[e]
        dye = dy[tokens]                                                            # (n_e, C)
        dweights[tokens, slots] = np.sum(dye * out, axis=-1)
        dout = dye * weights[tokens, slots][:, None]
        dh = dout @ down[e]
        if need_weight_grad:
            grads["down"][e] += dout.T @ h
            if down_bias is not None:
                grads["down_bias"][e] += dout.sum(axis=0)
        if lora_down is not None:
            a, b, scale = lora_down
            dhl = scale * dout @ b[e]                                               # (n_e, r)
            grads["down.lora_B"][e] += scale * dout.T @ h_down
            grads["down.lora_A"][e] += dhl.T @ h
            dh = dh + dhl @ a[e]
        dgu = _glu_backward(dh, gu, activation)                                    # (n_e, 2I)
        dxe = dgu @ gate_up[e]
        if need_weight_grad:
            grads["gate_up"][e] += dgu.T @ xe
            if gate_up_bias is not None:
                grads["gate_up_bias"][e] += dgu.sum(axis=0)
        if lora_gate_up is not None:
            a, b, scale = lora_gate_up
            hg = xe @ a[e].T                                                        # (n_e, r)
            dhg = scale * dgu @ b[e]
            grads["gate_up.lora_B"][e] += scale * dgu.T @ hg
            grads["gate_up.lora_A"][e] += dhg.T @ xe
            dxe = dxe + dhg @ a[e]
        np.add.at(dx, tokens, dxe)
    return dx, dweights, grads


def load_balancing_counts(logits, experts, mask):
    """One layer's share of transformers' load_balancing_loss_func: logits (N, E), experts (N, k) (the router's
    top-k, which equals the loss's own), mask (N,) 1 for a real token -> (assignments per expert (E,), the
    probabilities' sums per expert (E,), real tokens)."""
    probs = _softmax(logits)
    counts = np.zeros(logits.shape[1], dtype=np.float64)
    np.add.at(counts, experts.reshape(-1), np.repeat(mask, experts.shape[1]))
    return counts, (probs * mask[:, None]).sum(axis=0), float(mask.sum())


def load_balancing_loss(counts, prob_sums, rows: float, num_experts: int) -> float:
    """transformers' load_balancing_loss_func from every layer's counts summed (load_balancing_counts): E times
    the sum over experts of (assignments / rows) * (probability sums / rows)."""
    return float(num_experts * np.sum((counts / rows) * (prob_sums / rows)))


def load_balancing_dprobs(counts, rows: float, num_experts: int, mask, coef: float):
    """The gradient (N, E) of coef * load_balancing_loss on one layer's probabilities: the assignments are
    constants (top-k has no gradient), so each real token's probability of expert e gets coef E counts_e /
    rows^2."""
    return (coef * num_experts * counts / rows ** 2)[None, :] * mask[:, None]


class RouterLoss:
    """The load-balancing loss of one training forward: every sparse layer's assignments and probabilities summed
    as the forward reaches it (load_balancing_counts), then the loss and each layer's gradient on its router's
    probabilities, with `weight` (the coefficient, times the forward's share of the step's gradient) on it."""

    def __init__(self, num_experts: int, weight: float):
        self.num_experts, self.weight = num_experts, weight
        self.counts = np.zeros(num_experts)
        self.prob_sums = np.zeros(num_experts)
        self.rows = 0.0

    def add(self, logits, experts, mask):
        """One sparse layer's router logits (N, E), top-k experts (N, k) and real-token mask (N,)."""
        counts, prob_sums, rows = load_balancing_counts(logits, experts, mask)
        self.counts += counts
        self.prob_sums += prob_sums
        self.rows += rows

    @property
    def value(self) -> float:
        """transformers' load_balancing_loss_func over the layers added (0 before any real token)."""
        return load_balancing_value(self.stats(), self.num_experts)

    def dprobs(self, mask):
        """The gradient (N, E) of weight * value on one layer's probabilities."""
        return load_balancing_dprobs(self.counts, max(self.rows, 1.0), self.num_experts, mask, self.weight)

    def stats(self) -> np.ndarray:
        """(2E + 1,) float64: [assignments per expert, probability sums per expert, real tokens] of the layers
        added (the WebGPU kernels' layout): a pipeline stage's share, which the stages' sums are made of."""
        return np.concatenate([self.counts, self.prob_sums, [self.rows]])

    def use_stats(self, stats, weight: float):
        """Take `stats` (2E + 1,) (every pipeline stage's shares summed: the whole forward's) and `weight` for the
        backward, so that dprobs is one process's."""
        e = self.num_experts
        stats = np.asarray(stats, np.float64)
        self.counts, self.prob_sums, self.rows, self.weight = stats[:e], stats[e:2 * e], float(stats[2 * e]), weight


def load_balancing_value(stats, num_experts: int) -> float:
    """RouterLoss.value from its stats (2E + 1,) (a forward's over every pipeline stage): 0 before any real token."""
    stats = np.asarray(stats, np.float64)
    rows = float(stats[2 * num_experts])
    return load_balancing_loss(stats[:num_experts], stats[num_experts:2 * num_experts], rows,
                               num_experts) if rows else 0.0


def check_router_aux_loss(cfg: ModelConfig, coef: float) -> float:
    """set_router_aux_loss's coefficient, checked: a number >= 0, and 0 for a model without experts."""
    coef = float(coef)
    if not coef >= 0:
        raise ConfigError(f"router_aux_loss_coef must be a number >= 0, got {coef}")
    if coef and cfg.moe is None:
        raise ConfigError(f"router_aux_loss_coef {coef:g}: {cfg.label} is not a mixture of experts (it has no router)")
    if coef and cfg.moe.scoring != "softmax":
        raise ConfigError(f"router_aux_loss_coef {coef:g}: {cfg.label}'s {cfg.moe.scoring} router has no "
                          f"load-balancing loss in transformers; leave it 0")
    return coef
