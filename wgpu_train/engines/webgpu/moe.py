"""The mixture-of-experts op pairs on the WebGPU engine (the grouped-expert kernel family, tuned/moe_kernels.py):
moe_route_forward / moe_route_backward and moe_experts_forward / moe_experts_backward, and the router's
load-balancing loss (load_balancing_counts / _loss / _dprobs), with the reference's names and argument order
(engines/shared/moe.py: outputs first, then inputs and weights, then sizes, then scratch). They record into a
Recorder and neither submit nor read back: the routing, the grouping of the pairs by expert (a counting sort) and
the grids (sized for the worst case, idle blocks exiting at once) are all on the device.

Buffers: activations, their gradients and expert weights are tensors in any storage format (device/storage.py:
float32, bfloat16 or float16; a 16-bit one of even width, stored by pairs); scratch, LoRA matrices, routing weights
and the trained tensors' gradients are float32; experts int32.
A pair q = n k + j is token n's slot j; "pair order" lays out (N, k, ..) as (N k, ..)."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned import moe_kernels as MK

WG = 64


@dataclass(frozen=True)
class MoeLora:
    """One expert parameter's LoRA pairs: a (E, r, in), b (E, out, r) float32 buffers, scale, rank r."""

    a: object
    b: object
    scale: float
    rank: int


def scratch_sizes(N: int, k: int, E: int, C: int, I: int, r: int = 0, staged: bool = False) -> dict:
    """Elements (4 bytes each) of each scratch buffer the MoE ops need, by MoeScratch field; r: the larger LoRA
    rank (0: no LoRA); staged (gpt-oss's experts, moe_experts_forward): gu, the float32 gate / up projections
    before their bias and activation. The forward uses group, perm, h, outp, (with LoRA) lora_in, lora_out and
    (staged) gu; the backward all."""
    nk = N * k
    return {**({"gu": nk * 2 * I} if staged else {}), "group": MK.group_size(nk, E), "perm": nk, "h": nk * I, "outp": nk * C, "dh": nk * I, "dgu": nk * 2 * I,
            "lora_in": max(1, nk * r), "lora_out": max(1, nk * r), "lora_g": max(1, nk * r),
            "lora_dh": max(1, nk * r), "part": max(1, MK.max_blocks(nk, E, min(MK.SPLITS)) * r * max(C, 2 * I)),
            "probs": N * E, "balance_part": MK.balance_blocks(N) * (2 * E + 1), "balance": 2 * E + 1}


class MoeScratch:
    """The scratch buffers of the MoE ops for up to N tokens (scratch_sizes), shared by every MoE layer of a step
    (the forward's are dead once it returns; the backward recomputes the grouping and h from gate_up_out)."""

    def __init__(self, rt, N: int, k: int, E: int, C: int, I: int, r: int = 0, staged: bool = False):
        self.sizes = scratch_sizes(N, k, E, C, I, r, staged)
        self.N, self.k, self.E, self.C, self.I, self.r = N, k, E, C, I, r
        for name, n in self.sizes.items():
            setattr(self, name, rt.buffer(4 * n, f"moe.{name}"))

    @classmethod
    def of(cls, buffers: dict, N: int, moe, C: int, r: int = 0) -> "MoeScratch":
        """The scratch over buffers allocated elsewhere (an engine's activation bucket, sized by scratch_sizes for
        N tokens of MoeConfig moe's layers): name -> buffer, the forward's alone in a forward-only bucket."""
        self = cls.__new__(cls)
        self.N, self.k, self.E, self.C, self.I, self.r = N, moe.top_k, moe.num_experts, C, moe.expert_size, r
        self.sizes = {name: n for name, n in scratch_sizes(N, self.k, self.E, C, self.I, r, True).items()
                      if name in buffers}
        for name, buf in buffers.items():
            setattr(self, name, buf)
        return self

    def buffers(self) -> list:
        return [getattr(self, name) for name in self.sizes]

    def release(self, rt):
        rt.release(*self.buffers())


def _zeros(rt):
    """One float32 zero: the binding of an optional tensor a kernel is told to ignore."""
    return rt.memo("moe.zero", lambda r: r.buffer(16, "moe.zero"))


def _f32(what: str, *tensors):
    for t in tensors:
        if storage.format_of(split(t)[0]) != "f32":
            raise ValueError(f"{what}: its outputs are float32 buffers")


def _launch(rec, kernel, n_invocations: int, tensors, **params):
    launch(rec, kernel, flat_grid(-(-n_invocations // WG)), tensors, **params)


SCORINGS = {"softmax": 0, "sigmoid": 1}      # the route kernels' scoring flag (shaders/moe.wgsl)


def _scoring(scoring: str) -> int:
    if scoring not in SCORINGS:
        raise ValueError(f"moe route: scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    return SCORINGS[scoring]


def moe_route_forward(rec, weights, experts, logits, N: int, E: int, top_k: int, normalize: bool,
                      scoring: str = "softmax", bias=None, scale: float = 1.0):
    """weights (N, k) f32, experts (N, k) i32 <- logits (N, E) (any format): each expert's score (softmax, or
    LFM2-MoE's sigmoid), the top-k of score + bias (bias (E,) any format, or None: it chooses, it does not weigh)
    in descending order (lower index first among equals), renormalised when `normalize` (a sigmoid's over the
    sum plus 1e-6), times `scale`. One invocation per token."""
    _f32("moe_route_forward", weights)
    flag = _scoring(scoring)
    extra = (bias, E) if bias is not None else (_zeros(rec.rt), 1)
    _launch(rec, MK.ROUTE_FORWARD, N, [(weights, N * top_k), (logits, N * E), extra, (experts, N * top_k)],
            s0=N, s1=E, s2=top_k, s3=int(normalize), s4=flag, s5=int(bias is not None), f0=float(scale))


def moe_route_backward(rec, dlogits, dweights, logits, experts, N: int, E: int, top_k: int, normalize: bool,
                       dprobs=None, scoring: str = "softmax", scale: float = 1.0):
    """dlogits (N, E) (one invocation per token row) <- dweights (N, k), logits (N, E), experts (N, k) i32,
    dprobs (N, E) f32 or None (a gradient on every score: the load-balancing loss's), through the scale, the
    renormalisation and the scores (a sigmoid's: the chosen experts' own logits alone). Overwrites dlogits."""
    flag = _scoring(scoring)
    extra = (dprobs, N * E) if dprobs is not None else (_zeros(rec.rt), 1)
    _launch(rec, MK.ROUTE_BACKWARD, N, [(dlogits, N * E), (dweights, N * top_k), (logits, N * E),
                                        (experts, N * top_k), extra],
            s0=N, s1=E, s2=top_k, s3=int(normalize), s4=int(dprobs is not None), s5=flag, f0=float(scale))


def moe_group(rec, experts, N: int, k: int, E: int, scratch: MoeScratch):
    """The routed pairs grouped by expert, a counting sort in three dispatches: scratch.group holds (blocks, E)
    counts then the offsets (E + 1) (offsets_view), scratch.perm the pair at each sorted row, stable in pair order."""
    nk, blocks = N * k, MK.group_blocks(N * k)
    _launch(rec, MK.GROUP_COUNT, blocks * E, [(scratch.group, blocks * E), (experts, nk)], s0=nk, s1=E, s2=blocks)
    launch(rec, MK.GROUP_OFFSETS, (1,), [(scratch.group, MK.group_size(nk, E))], s0=nk, s1=E, s2=blocks,
           s3=blocks * E)
    _launch(rec, MK.GROUP_SCATTER, nk, [(scratch.perm, nk), (experts, nk), (scratch.group, MK.group_size(nk, E))],
            s0=nk, s1=E, s3=blocks * E)


def offsets_view(scratch: MoeScratch, N: int, k: int, E: int):
    """The (E + 1) offsets in scratch.group, as a (buffer, element offset) view."""
    return scratch.group, MK.group_blocks(N * k) * E


def _lora_rows(rec, out, x, m, m_elems, experts, nk, in_f, r, k, by_token, strides, scale=1.0):
    """out (N k, r) = scale * x[row(q)] . M[e, j, :] for each pair q of expert e = experts[q]; strides: M's
    (expert, rank index, input index)."""
    rows = nk // k if by_token else nk
    _launch(rec, MK.LORA_ROWS, nk * r, [(out, nk * r), (x, rows * in_f), (m, m_elems), (experts, nk)],
            s0=nk, s1=in_f, s2=r, s3=k, s4=int(by_token), s5=strides[0], s6=strides[1], s7=strides[2], f0=scale)


def _glu(activation) -> dict:
    """The gated activation's fields of moe_swiglu, moe_swiglu_backward and moe_dweights: none for SwiGLU ("silu":
    gate rows first), f0 alpha and f1 limit for gpt-oss's shared.moe.ClampedSwiGLU (rows interleaved)."""
    if activation == "silu":
        return {}
    if not activation.limit > 0:
        raise ValueError(f"moe: a clamped SwiGLU needs a positive limit, got {activation.limit}")
    return {"f0": float(activation.alpha), "f1": float(activation.limit)}


def _pair_bias(rec, bias, experts, nk: int, W: int, E: int) -> tuple:
    """(tensors, fields) of shaders/moe.wgsl's pair_bias: bias (E, W) (any format) of each pair's expert, or none
    where bias is None (a zero bound in its place)."""
    if bias is None:
        return [(_zeros(rec.rt), 1), (_zeros(rec.rt), 1)], {}
    return [(bias, E * W), (experts, nk)], {"s5": 1, "s6": E}


def _bias_grad(rec, grad, src, weights, scratch, N, k, E, W, by_token: bool, weighted: bool, accumulate: bool):
    """grad (E, W) f32 (+)= each expert's sum of (w) src rows (by token or by pair) over its sorted rows."""
    _launch(rec, MK.BIAS_BACKWARD, E * W, [(grad, E * W), (src, (N if by_token else N * k) * W), (scratch.perm, N * k),
                                           (weights, N * k), (offsets_view(scratch, N, k, E), E + 1)],
            s0=W, s1=E, s2=k, s3=int(by_token), s4=int(weighted), s6=int(accumulate))


def _gemm(rec, out, x, w, scratch, N, k, E, in_f, cols, layout, by_token, lora=None, hl=None, h=None):
    """One grouped GEMM (tuned/moe_kernels.MoeGemmProblem) over the pairs grouped in scratch."""
    t = dict(out=out, x=x, w=w, offsets=offsets_view(scratch, N, k, E), perm=scratch.perm)
    if lora is not None:
        t.update(hl=hl, lb=lora.b if layout == "nt" else lora.a)
    if h is not None:
        t["h"] = h
    p = MK.MoeGemmProblem(rec.rt, t, N * k, k, E, in_f, cols, layout, by_token, lora.rank if lora else 0,
                          lora.scale if lora and layout == "nt" else 1.0, swiglu=h is not None)
    for dispatch in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*dispatch)


def _outer(rec, out, u, v, weights, scratch, N, k, E, o, q, u_token, v_token, weighted, scale, accumulate,
           split_k=True):
    """out (E, o, q) (+)= scale * each expert's sum of (w) U^T V (tuned/moe_kernels.MoeOuterProblem); split_k:
    the partials in scratch.part may hold it."""
    t = dict(out=out, u=u, v=v, perm=scratch.perm, weights=weights, offsets=offsets_view(scratch, N, k, E))
    p = MK.MoeOuterProblem(rec.rt, t, N * k, k, E, o, q, u_token, v_token, weighted, scale, accumulate)
    if split_k and p.part_size() <= scratch.sizes["part"]:
        t["part"] = scratch.part
    for dispatch in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*dispatch)


def moe_experts_forward(rec, y, gate_up_out, x, weights, experts, gate_up, down, lora_gate_up, lora_down,
                        N: int, k: int, E: int, C: int, I: int, scratch: MoeScratch, accumulate: bool = False,
                        gate_up_bias=None, down_bias=None, activation="silu"):
    """The routed experts' SwiGLU MLPs, each token's k outputs weighted and summed in slot order.

    y (N, C) (+= where accumulate), gate_up_out (N, k, 2I) (every pair's gate then up projections, which
    the backward reads) <- x (N, C), weights (N, k) f32, experts (N, k) i32, gate_up (E, 2I, C), down (E, C, I)
    (any storage format), lora_gate_up / lora_down: MoeLora or None; scratch: MoeScratch for at least N tokens.
    Dispatches: the grouping (3), the gate/up LoRA A rows, the grouped gate/up GEMM with its LoRA B and the swiglu
    (h to scratch.h), the down LoRA A rows, the grouped down GEMM with its LoRA B (to scratch.outp), the combine.
    gpt-oss (shared/moe.py's keywords): gate_up_bias (E, 2I) / down_bias (E, C) (any format) or None, activation a
    ClampedSwiGLU over interleaved gate / up rows; then the gate/up GEMM writes scratch.gu (a staged scratch, float32)
    alone, the activation reads it with the bias (moe_swiglu), gate_up_out is it with the bias (moe_bias: rounded
    once, where 16-bit, as the NumPy engine rounds it), and the combine adds the down bias."""
    nk = N * k
    moe_group(rec, experts, N, k, E, scratch)
    if lora_gate_up is not None:
        r = lora_gate_up.rank
        _lora_rows(rec, scratch.lora_in, x, lora_gate_up.a, E * r * C, experts, nk, C, r, k, True, (r * C, C, 1))
    if activation == "silu" and gate_up_bias is None:
        _gemm(rec, gate_up_out, x, gate_up, scratch, N, k, E, C, I, "nt", True, lora_gate_up, scratch.lora_in,
              h=scratch.h)
    else:
        if "gu" not in scratch.sizes:
            raise ValueError("moe_experts_forward: gpt-oss's experts need a staged MoeScratch (its gu)")
        _gemm(rec, scratch.gu, x, gate_up, scratch, N, k, E, C, 2 * I, "nt", True, lora_gate_up, scratch.lora_in)
        bias, fields = _pair_bias(rec, gate_up_bias, experts, nk, 2 * I, E)
        _launch(rec, MK.SWIGLU, nk * I, [(scratch.h, nk * I), (scratch.gu, nk * 2 * I), *bias], s0=nk, s1=I,
                **_glu(activation), **fields)
        _launch(rec, MK.BIAS, -(-nk * 2 * I // 2), [(gate_up_out, nk * 2 * I), (scratch.gu, nk * 2 * I), *bias],
                s0=nk * 2 * I, s1=2 * I, **fields)
    if lora_down is not None:
        r = lora_down.rank
        _lora_rows(rec, scratch.lora_out, scratch.h, lora_down.a, E * r * I, experts, nk, I, r, k, False,
                   (r * I, I, 1))
    _gemm(rec, scratch.outp, scratch.h, down, scratch, N, k, E, I, C, "nt", False, lora_down, scratch.lora_out)
    bias, fields = _pair_bias(rec, down_bias, experts, nk, C, E)
    _launch(rec, MK.COMBINE, -(-N * C // 2), [(y, N * C), (scratch.outp, nk * C), *bias, (weights, nk)], s0=N, s1=C,
            s2=k, s3=1, s4=int(accumulate), **fields)


def moe_experts_backward(rec, dx, dweights, grads: dict, dy, x, weights, experts, gate_up_out, gate_up, down,
                         lora_gate_up, lora_down, N: int, k: int, E: int, C: int, I: int, scratch: MoeScratch,
                         accumulate: bool = False, gate_up_bias=None, down_bias=None, activation="silu"):
    """Gradients of moe_experts_forward.

    dx (N, C) (+= where accumulate), dweights (N, k) (overwritten; then moe_route_backward), grads: the
    trained tensors' gradient buffers (f32, each its tensor's shape; += where accumulate) by the reference's
    names: "gate_up", "down" (full fine-tuning), "gate_up.lora_A", "gate_up.lora_B", "down.lora_A", "down.lora_B"
    (those of a LoRA pair given), "gate_up_bias" / "down_bias" (full fine-tuning of gpt-oss) <- dy (N, C), x,
    weights, experts, gate_up_out (the forward's), gate_up, down, lora_gate_up, lora_down, the biases and activation,
    as the forward. The grouping and h are recomputed (the forward's scratch need not
    survive); the LoRA gradients are split-K sums over each expert's rows (no float atomics), the base weights'
    one pass per expert."""
    _f32("moe_experts_backward", *grads.values())
    nk = N * k
    moe_group(rec, experts, N, k, E, scratch)
    glu = _glu(activation)
    _launch(rec, MK.SWIGLU, nk * I, [(scratch.h, nk * I), (gate_up_out, nk * 2 * I),
                                     *_pair_bias(rec, None, experts, nk, 2 * I, E)[0]], s0=nk, s1=I, **glu)
    if lora_down is not None:
        r, s2 = lora_down.rank, lora_down.scale
        _lora_rows(rec, scratch.lora_out, scratch.h, lora_down.a, E * r * I, experts, nk, I, r, k, False,
                   (r * I, I, 1))
        _lora_rows(rec, scratch.lora_g, dy, lora_down.b, E * C * r, experts, nk, C, r, k, True, (C * r, 1, r), s2)
    # dh before each pair's weight: dy W2[e] (+ (s dy B2[e]) A2[e]); dweights = dh . h
    _gemm(rec, scratch.dh, dy, down, scratch, N, k, E, C, I, "nn", True, lora_down, scratch.lora_g)
    _launch(rec, MK.DWEIGHTS, -(-nk // 2),
            [(dweights, nk), (scratch.dh, nk * I), (gate_up_out, nk * 2 * I)], s0=nk, s1=I, **glu)
    if down_bias is not None:       # a pair's output holds its bias too
        _launch(rec, MK.BIAS_DWEIGHTS, -(-nk // 2), [(dweights, nk), (dy, N * C), (down_bias, E * C), (experts, nk)],
                s0=nk, s1=C, s2=k, s3=E)
    _launch(rec, MK.SWIGLU_BACKWARD, nk * I, [(scratch.dgu, nk * 2 * I), (scratch.dh, nk * I),
                                              (gate_up_out, nk * 2 * I), (weights, nk)], s0=nk, s1=I, **glu)
    if "down_bias" in grads:
        _bias_grad(rec, grads["down_bias"], dy, weights, scratch, N, k, E, C, True, True, accumulate)
    if "gate_up_bias" in grads:
        _bias_grad(rec, grads["gate_up_bias"], scratch.dgu, weights, scratch, N, k, E, 2 * I, False, False, accumulate)
    if "down" in grads:
        _outer(rec, grads["down"], dy, scratch.h, weights, scratch, N, k, E, C, I, True, False, True, 1.0,
               accumulate, split_k=False)
    if lora_down is not None:
        r, s2 = lora_down.rank, lora_down.scale
        _outer(rec, grads["down.lora_B"], dy, scratch.lora_out, weights, scratch, N, k, E, C, r, True, False, True,
               s2, accumulate)
        _outer(rec, grads["down.lora_A"], scratch.lora_g, scratch.h, weights, scratch, N, k, E, r, I, False, False,
               True, 1.0, accumulate)
    if lora_gate_up is not None:
        r, s1 = lora_gate_up.rank, lora_gate_up.scale
        _lora_rows(rec, scratch.lora_in, x, lora_gate_up.a, E * r * C, experts, nk, C, r, k, True, (r * C, C, 1))
        _lora_rows(rec, scratch.lora_dh, scratch.dgu, lora_gate_up.b, E * 2 * I * r, experts, nk, 2 * I, r, k,
                   False, (2 * I * r, 1, r), s1)
    _gemm(rec, scratch.outp, scratch.dgu, gate_up, scratch, N, k, E, 2 * I, C, "nn", False, lora_gate_up,
          scratch.lora_dh)
    _launch(rec, MK.COMBINE, -(-N * C // 2), [(dx, N * C), (scratch.outp, nk * C),
                                              *_pair_bias(rec, None, experts, nk, C, E)[0], (_zeros(rec.rt), 1)], s0=N,
            s1=C, s2=k, s3=0, s4=int(accumulate))
    if "gate_up" in grads:
        _outer(rec, grads["gate_up"], scratch.dgu, x, weights, scratch, N, k, E, 2 * I, C, False, True, False, 1.0,
               accumulate, split_k=False)
    if lora_gate_up is not None:
        r, s1 = lora_gate_up.rank, lora_gate_up.scale
        _outer(rec, grads["gate_up.lora_B"], scratch.dgu, scratch.lora_in, weights, scratch, N, k, E, 2 * I, r,
               False, False, False, s1, accumulate)
        _outer(rec, grads["gate_up.lora_A"], scratch.lora_dh, x, weights, scratch, N, k, E, r, C, False, True, False,
               1.0, accumulate)


def load_balancing_counts(rec, stats, logits, experts, mask, N: int, E: int, k: int, scratch: MoeScratch,
                          accumulate: bool):
    """stats (2E + 1) f32 (+= where accumulate: a forward's sparse layers after its first) = one layer's share of
    the load-balancing loss: [assignments per expert (E), probability sums per expert (E), real tokens] <- logits
    (N, E) (any format), experts (N, k) i32, mask (N,) i32 (segment ids: 0 for padding). Three dispatches: the
    real tokens' probabilities (scratch.probs), sums per block of tokens, the blocks summed in order."""
    _f32("load_balancing_counts", stats)
    blocks, width = MK.balance_blocks(N), 2 * E + 1
    _launch(rec, MK.BALANCE_PROBS, N, [(scratch.probs, N * E), (logits, N * E), (mask, N)], s0=N, s1=E)
    _launch(rec, MK.BALANCE_PARTIAL, blocks * width, [(scratch.balance_part, blocks * width), (scratch.probs, N * E),
                                                      (experts, N * k), (mask, N)], s0=N, s1=E, s2=k, s3=blocks)
    _launch(rec, MK.BALANCE_REDUCE, width, [(stats, width), (scratch.balance_part, blocks * width)], s0=width,
            s1=blocks, s4=int(accumulate))


def load_balancing_loss(rec, loss, stats, E: int):
    """loss (1,) f32 = transformers' load_balancing_loss_func from stats (2E + 1) (load_balancing_counts summed
    over a forward's sparse layers); 0 before any real token."""
    launch(rec, MK.BALANCE_LOSS, (1,), [(loss, 1), (stats, 2 * E + 1)], s1=E)


def load_balancing_dprobs(rec, dprobs, stats, mask, N: int, E: int, coef: float):
    """dprobs (N, E) f32 = the gradient of coef times the loss on one layer's probabilities (moe_route_backward's
    dprobs) <- stats (2E + 1) of the whole forward, mask (N,) i32 (segment ids: 0 for padding)."""
    _launch(rec, MK.BALANCE_DPROBS, N * E, [(dprobs, N * E), (stats, 2 * E + 1), (mask, N)], s0=N, s1=E, f0=coef)
