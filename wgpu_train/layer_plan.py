"""The decoder layer as data: its ops in order, the activations each reads and writes, the gradient buffers
its backward reads and writes. Both engines walk it (forward in order, backward in reverse) and memory.py
sizes the buffers from it, so a layer variant is a change here and, for a new kind of op, one function per
engine."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .config import ModelConfig

INPUT = "x_in"       # the layer's input activation (the residual stream)
OUTPUT = "x_out"     # its output: the next layer's INPUT, or the final norm's input after the last layer
CARRY = "d_res"      # the gradient buffer of the residual stream: the layer's OUTPUT's, then its INPUT's
KINDS = ("rmsnorm", "linear", "rope", "attention", "swiglu")


@dataclass(frozen=True)
class Op:
    """One op of a decoder layer.

    kind: one of KINDS; inputs / outputs: activation names (OUTPUT for the layer's output); grads_out: the
    gradient buffers of the outputs its backward reads, one per differentiable output; grads_in: those of
    the inputs it writes, one per input. param: the module of a linear op ("q_proj"), the weight of an
    rmsnorm under the layer ("input_layernorm.weight"). residual: an activation a linear op's output adds
    (y = residual + x W^T); the residual's gradient is the output's, so grads_out[0] carries on past it.
    heads: "q" or "kv" where the op works per head (rope, a per-head rmsnorm): Hq or Hkv heads of head_dim."""

    kind: str
    inputs: tuple
    outputs: tuple
    grads_out: tuple
    grads_in: tuple
    param: str = ""
    residual: str = ""
    heads: str = ""


@dataclass(frozen=True)
class LayerPlan:
    """A decoder layer: ops in forward order; widths: activation -> float32 elements per token (INPUT
    included, OUTPUT not: it is the next layer's); grad_widths: gradient buffer -> elements per token;
    accumulate: per op, per grads_in entry, whether its backward adds into a gradient already holding the
    contributions of the ops after it (True) or writes it (False). An input read by several ops (h1 by
    q/k/v) names one gradient buffer in each: the last op's backward writes it, the others add to it."""

    ops: tuple
    widths: dict
    grad_widths: dict
    accumulate: tuple

    @classmethod
    def build(cls, ops, widths: dict, grad_widths: dict) -> "LayerPlan":
        """A plan from its ops in forward order, with the backward's write-or-add decisions derived."""
        ops = tuple(ops)
        unknown = [x for op in ops for x in op.inputs + op.outputs if x != OUTPUT and x not in widths]
        unknown += [g for op in ops for g in op.grads_in + op.grads_out if g not in grad_widths]
        if unknown or any(op.kind not in KINDS for op in ops):
            raise ValueError(f"layer plan: unknown op kinds or buffers {sorted(set(unknown))}")
        return cls(ops, dict(widths), dict(grad_widths), _accumulate_flags(ops))

    def backward_steps(self):
        """(op, accumulate flags) in backward order."""
        return list(zip(reversed(self.ops), reversed(self.accumulate)))

    def head_count(self, cfg: ModelConfig, op: Op) -> int:
        """Heads of a per-head op (Hq or Hkv); 1 for an op over whole token rows."""
        return {"q": cfg.num_attention_heads, "kv": cfg.num_key_value_heads, "": 1}[op.heads]


def _accumulate_flags(ops: tuple) -> tuple:
    """The write-or-add decision of every backward write, from the buffers live at that point of the
    backward walk; checks that every gradient an op reads has been written and that only CARRY is live at
    the layer's start and end."""
    live = {CARRY}
    flags = []
    for op in reversed(ops):
        missing = set(op.grads_out) - live
        if missing:
            raise ValueError(f"layer plan: {op.kind} {op.param} reads gradient {sorted(missing)} before it is written")
        live -= set(op.grads_out[1:] if op.residual else op.grads_out)
        flags.append(tuple(g in live for g in op.grads_in))
        live |= set(op.grads_in)
    if live != {CARRY}:
        raise ValueError(f"layer plan: gradients {sorted(live - {CARRY})} are written but never read")
    return tuple(reversed(flags))


def _linear(module, x, y, dy, dx, residual=""):
    return Op("linear", (x,), (y,), (dy,), (dx,), param=module, residual=residual)


def _rmsnorm(weight, x, y, rstd, dy, dx, heads=""):
    return Op("rmsnorm", (x,), (y, rstd), (dy,), (dx,), param=weight, heads=heads)


@lru_cache(maxsize=None)
def _plan(qk_norm: bool, c: int, q: int, kv: int, f: int, hq: int, hkv: int) -> LayerPlan:
    q_proj, k_proj = ("q_pre", "k_pre") if qk_norm else ("q", "k")
    dq_proj, dk_proj = ("dq2", "dk2") if qk_norm else ("dq", "dk")
    ops = [_rmsnorm("input_layernorm.weight", INPUT, "h1", "rstd1", "d_h", CARRY),
           _linear("q_proj", "h1", q_proj, dq_proj, "d_h"),
           _linear("k_proj", "h1", k_proj, dk_proj, "d_h"),
           _linear("v_proj", "h1", "v", "dv", "d_h")]
    if qk_norm:
        ops += [_rmsnorm("self_attn.q_norm.weight", "q_pre", "q", "rstd_q", "dq", "dq2", heads="q"),
                _rmsnorm("self_attn.k_norm.weight", "k_pre", "k", "rstd_k", "dk", "dk2", heads="kv")]
    ops += [Op("rope", ("q",), ("q",), ("dq",), ("dq",), heads="q"),
            Op("rope", ("k",), ("k",), ("dk",), ("dk",), heads="kv"),
            Op("attention", ("q", "k", "v"), ("att", "lse"), ("d_att",), ("dq", "dk", "dv")),
            _linear("o_proj", "att", "x_mid", CARRY, "d_att", residual=INPUT),
            _rmsnorm("post_attention_layernorm.weight", "x_mid", "h2", "rstd2", "d_h", CARRY),
            _linear("gate_proj", "h2", "gate", "d_gate", "d_h"),
            _linear("up_proj", "h2", "up", "d_up", "d_h"),
            Op("swiglu", ("gate", "up"), ("m",), ("d_m",), ("d_gate", "d_up")),
            _linear("down_proj", "m", OUTPUT, CARRY, "d_m", residual="x_mid")]
    widths = {INPUT: c, "h1": c, "rstd1": 1, "q": q, "k": kv, "v": kv, "att": q, "lse": hq, "x_mid": c, "h2": c,
              "rstd2": 1, "gate": f, "up": f, "m": f}
    grad_widths = {CARRY: c, "d_h": c, "d_att": q, "dq": q, "dk": kv, "dv": kv, "d_gate": f, "d_up": f, "d_m": f}
    if qk_norm:
        widths.update(q_pre=q, k_pre=kv, rstd_q=hq, rstd_k=hkv)
        grad_widths.update(dq2=q, dk2=kv)
    return LayerPlan.build(ops, widths, grad_widths)


def layer_plan(cfg: ModelConfig) -> LayerPlan:
    """The decoder layer of a Llama-family model (Llama, Mistral, Qwen2; Qwen3's per-head q/k norms):
    pre-norm attention with RoPE and grouped-query heads, then a pre-norm SwiGLU MLP, each added to the
    residual stream."""
    return _plan(cfg.qk_norm, cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size,
                 cfg.num_attention_heads, cfg.num_key_value_heads)
