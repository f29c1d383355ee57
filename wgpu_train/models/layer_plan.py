"""The decoder layer as data: its ops in order, the activations each reads and writes, the gradient buffers
its backward reads and writes. Both engines walk it (forward in order, backward in reverse) and memory.py
sizes the buffers from it, so a layer variant is a change here and, for a new kind of op, one function per
engine."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from wgpu_train.models import lfm2
from wgpu_train.models.config import ModelConfig

INPUT = "x_in"       # the layer's input activation (the residual stream)
OUTPUT = "x_out"     # its output: the next layer's INPUT, or the final norm's input after the last layer
CARRY = "d_res"      # the gradient buffer of the residual stream: the layer's OUTPUT's, then its INPUT's


@dataclass(frozen=True)
class Op:
    """One op of a decoder layer.

    kind: one of KINDS; inputs / outputs: activation names (OUTPUT for the layer's output); grads_out: the
    gradient buffers of the outputs its backward reads, one per differentiable output; grads_in: those of
    the inputs it writes, one per input. param: the module of a linear op ("q_proj"), the weight of an
    rmsnorm under the layer ("input_layernorm.weight"). residual: an activation a linear op's output adds
    (y = residual + x W^T); the residual's gradient is the output's, so grads_out[0] carries on past it.
    heads: "q" or "kv" where the op works per head (rope, a per-head rmsnorm): Hq or Hkv heads of head_dim; "lk" or
    "lv" the linear attention's key or value heads (LayerPlan.head_count); a split op with heads splits each head's
    columns (Qwen3.5's q_proj: each head's query then its gate). factor: a scale op's constant. size: a short_conv
    op's kernel (its per-row state in generation: the last size - 1 inputs); a delta_rule op's key head dim Dk.

    The kinds: rmsnorm (y, rstd of x), linear (base + LoRA), rope (in place), attention (out, lse of q, k,
    v), swiglu / geglu (m of gate, up), add (y = residual + x), scale (y = factor x), split (x's columns
    into the outputs, side by side in their order: a fused projection's parts); a mixture of experts' route
    (the top-k weights and expert indices of the router's logits), experts (the routed experts' MLPs of x,
    weighted by the route; param: the experts' path under the layer, their gate / up projections kept for the
    backward) and sigmoid_gate (y = sigmoid(g) x, Qwen2-MoE's shared expert behind its gate); LFM2's mul (y = a b,
    elementwise) and short_conv (a causal depthwise convolution over each sequence, param: its weight (C, 1, size)
    under the layer; a recurrent op: generation keeps its window per row, RECURRENT); Qwen3.5's Gated DeltaNet:
    silu (y = x sigmoid(x)), concat (split's inverse), l2norm (each head's vector over its norm), decay (g and
    beta of the projections a and b, param: the path of A_log and dt_bias), delta_rule (the gated delta rule of q,
    k, v, g, beta over each sequence, engines/shared/delta_rule.py; recurrent: generation keeps its (Hv, Dk, Dv)
    state per row; param: the state's key) and gated_rmsnorm (each value head's rmsnorm times silu of z, its weight
    (Dv,) without an offset). An attention op's
    param, where it has one, is its sinks (gpt-oss: a learned logit per head in the softmax's denominator). An input or
    output without a gradient (the expert indices) comes after those with one: grads_in / grads_out name one
    buffer per differentiable input / output, in order."""

    kind: str
    inputs: tuple
    outputs: tuple
    grads_out: tuple
    grads_in: tuple
    param: str = ""
    residual: str = ""
    heads: str = ""
    factor: float = 1.0
    size: int = 0


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

    @property
    def saved(self) -> set:
        """The activations some op's backward reads: a layer keeps these for its backward; the others
        (memory.activation_plan) share one buffer across layers."""
        return {INPUT} | {x for op in self.ops for x in _BACKWARD_READS[op.kind](op)}

    @property
    def statistics(self) -> set:
        """The activations that are statistics (a norm's rstd, attention's logsumexp): float32 in every
        precision, where 16-bit training stores the others in bfloat16 / float16."""
        return {op.outputs[1] for op in self.ops if op.kind in ("rmsnorm", "attention")} | \
            {x for op in self.ops if op.kind == "route" for x in op.outputs}

    @classmethod
    def build(cls, ops, widths: dict, grad_widths: dict) -> "LayerPlan":
        """A plan from its ops in forward order, with the backward's write-or-add decisions derived."""
        ops = tuple(ops)
        unknown = [x for op in ops for x in op.inputs + op.outputs if x != OUTPUT and x not in widths]
        unknown += [g for op in ops for g in op.grads_in + op.grads_out if g not in grad_widths]
        if unknown or any(op.kind not in KINDS for op in ops):
            raise ValueError(f"layer plan: unknown op kinds or buffers {sorted(set(unknown))}")
        _check_buffers(ops)
        return cls(ops, dict(widths), dict(grad_widths), _accumulate_flags(ops))

    @property
    def states(self) -> dict:
        """The per-row recurrent state of each recurrent op (RECURRENT) in generation, by its param: the shape of one
        row's (a short convolution's: its last size - 1 inputs, (size - 1, C)). Empty for a layer without one."""
        return {op.param: RECURRENT[op.kind](op, self.widths) for op in self.ops if op.kind in RECURRENT}

    def backward_steps(self):
        """(op, accumulate flags) in backward order."""
        return list(zip(reversed(self.ops), reversed(self.accumulate)))

    def head_count(self, cfg: ModelConfig, op: Op) -> int:
        """Heads of a per-head op (Hq or Hkv); 1 for an op over whole token rows."""
        if op.heads in ("lk", "lv"):
            spec = cfg.linear_attention
            return spec.key_heads if op.heads == "lk" else spec.value_heads
        return {"q": cfg.num_attention_heads, "kv": cfg.num_key_value_heads, "": 1}[op.heads]


_BACKWARD_READS = {          # the op kinds, and the activations each one's backward reads
    "rmsnorm": lambda op: (op.inputs[0], op.outputs[1]),
    "linear": lambda op: op.inputs,
    "rope": lambda op: (),
    "attention": lambda op: op.inputs + op.outputs,
    "swiglu": lambda op: op.inputs,
    "geglu": lambda op: op.inputs,
    "add": lambda op: (),
    "scale": lambda op: (),
    "split": lambda op: (),
    "route": lambda op: op.inputs + op.outputs[1:],
    "experts": lambda op: op.inputs + op.outputs[1:],
    "sigmoid_gate": lambda op: op.inputs,
    "mul": lambda op: op.inputs,
    "short_conv": lambda op: op.inputs,
    "silu": lambda op: op.inputs,
    "concat": lambda op: (),
    "l2norm": lambda op: op.inputs,
    "decay": lambda op: op.inputs,
    "delta_rule": lambda op: op.inputs,
    "gated_rmsnorm": lambda op: op.inputs,
}
KINDS = tuple(_BACKWARD_READS)
# the recurrent kinds, and one row's state of an op of that kind in generation (in place of a KV cache)
RECURRENT = {"short_conv": lambda op, widths: (op.size - 1, widths[op.inputs[0]]),
             "delta_rule": lambda op, widths: (widths[op.inputs[3]], op.size,
                                               widths[op.inputs[2]] // widths[op.inputs[3]])}   # (Hv, Dk, Dv)


def _check_buffers(ops: tuple):
    """Refuse plans the engines' buffer sharing cannot run: only the last op writes OUTPUT, and it neither
    reads INPUT (forward-only buckets hold every layer's input and output in one buffer) nor needs its own
    outputs in its backward (gradient checkpointing does not recompute it); an op writing in place does not
    overwrite what an earlier op's backward reads."""
    last = ops[-1]
    if any(OUTPUT in op.outputs for op in ops[:-1]) or OUTPUT not in last.outputs:
        raise ValueError("layer plan: the last op, and only it, writes the layer's output")
    if INPUT in last.inputs or last.residual == INPUT:
        raise ValueError("layer plan: the op that writes the layer's output may not read its input")
    if set(_BACKWARD_READS[last.kind](last)) & set(last.outputs):
        raise ValueError(f"layer plan: the last op ({last.kind}) may not need its own outputs in its backward")
    for i, op in enumerate(ops):
        for x in set(op.inputs) & set(op.outputs):
            if any(x in _BACKWARD_READS[o.kind](o) for o in ops[:i + 1]):
                raise ValueError(f"layer plan: {op.kind} overwrites {x}, which its own or an earlier op's backward "
                                 f"reads")


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


_PLAN_FIELDS = ("hidden_size", "q_size", "kv_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "qk_norm", "qk_norm_per_head", "query_scale", "hidden_act", "sandwich_norms", "fused_projections",
                "attention_sinks", "family", "attn_output_gate", "head_gate")
# a layer's norms and modules as the family names them: Llama's, Gemma's (post1 / post2: the sandwich norms on the
# token mixer's and the MLP's outputs), LFM2's (its MLP's gate / up / down are w1 / w3 / w2), LFM3's
_LLAMA = dict(norm1="input_layernorm.weight", norm2="post_attention_layernorm.weight", q_norm="self_attn.q_norm.weight",
              k_norm="self_attn.k_norm.weight", o="o_proj", gate="gate_proj", up="up_proj", down="down_proj")
_LFM2 = dict(norm1="operator_norm.weight", norm2="ffn_norm.weight", q_norm="self_attn.q_layernorm.weight",
             k_norm="self_attn.k_layernorm.weight", o="out_proj", gate="feed_forward.w1", up="feed_forward.w3",
             down="feed_forward.w2")
_NAMES = {"llama": _LLAMA, "lfm2": _LFM2,
          "gemma": dict(_LLAMA, norm2="pre_feedforward_layernorm.weight", post1="post_attention_layernorm.weight",
                        post2="post_feedforward_layernorm.weight"),
          "lfm3": dict(_LFM2, q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight", o="o_proj",
                       post1="post_operator_norm.weight", post2="post_ffn_norm.weight")}


def _names(cfg) -> dict:
    if cfg.family in lfm2.FAMILIES:
        return _NAMES["lfm2"]
    return _NAMES["lfm3" if cfg.family == "lfm3" else "gemma" if cfg.family.startswith("gemma") else "llama"]


def _merged(part: tuple, normed: tuple) -> tuple:
    """A branch (ops, widths, gradient widths) with its last op replaced by _post_norm's."""
    return normed[0], {**part[1], **normed[1]}, {**part[2], **normed[2]}


def _post_norm(weight: str, ops: list, c: int, residual: str, out: str) -> tuple[list, dict, dict]:
    """A sandwich norm (Gemma, LFM3) on a branch whose last op writes `out` (added to `residual`): that op writes
    the branch's output "o" instead, normed by `weight`, then added to `residual` as `out`."""
    last, name = ops[-1], "o" if out == "x_mid" else "mlp"
    ops = ops[:-1] + [Op(last.kind, last.inputs, (name,), ("d_pre",), last.grads_in, param=last.param),
                      _rmsnorm(weight, name, name + "_n", "rstd_" + name, "d_post", "d_pre"),
                      Op("add", (name + "_n",), (out,), (CARRY,), ("d_post",), residual=residual)]
    return ops, {name: c, name + "_n": c, "rstd_" + name: 1}, {"d_pre": c, "d_post": c}


def _short_conv(c: int, kernel: int) -> tuple[list, dict, dict]:
    """LFM2's double-gated short convolution from the normed input h1 to the residual stream x_mid: in_proj to B, C
    and x side by side, B x, the causal depthwise convolution over each sequence, C times it, out_proj."""
    ops = [_linear("conv.in_proj", "h1", "bcx", "d_bcx", "d_h"),
           Op("split", ("bcx",), ("conv_b", "conv_c", "conv_x"), ("d_b", "d_c", "d_x"), ("d_bcx",)),
           Op("mul", ("conv_b", "conv_x"), ("bx",), ("d_bx",), ("d_b", "d_x")),
           Op("short_conv", ("bx",), ("conv_y",), ("d_y",), ("d_bx",), param="conv.conv.weight", size=kernel),
           Op("mul", ("conv_c", "conv_y"), ("cy",), ("d_cy",), ("d_c", "d_y")),
           _linear("conv.out_proj", "cy", "x_mid", CARRY, "d_cy", residual=INPUT)]
    widths = {"bcx": 3 * c, "conv_b": c, "conv_c": c, "conv_x": c, "bx": c, "conv_y": c, "cy": c}
    grad_widths = {"d_bcx": 3 * c, "d_b": c, "d_c": c, "d_x": c, "d_bx": c, "d_y": c, "d_cy": c}
    return ops, widths, grad_widths


def _gated_delta_net(spec) -> tuple[list, dict, dict]:
    """Qwen3.5's Gated DeltaNet from the normed input h1 to the residual stream x_mid: the in-projections (Qwen3.5's
    four; Qwen3-Next's two, their rows interleaved per key head: split per key head, then q, k, v side by side),
    the causal depthwise conv1d over q, k, v with SiLU, q and k l2-normalised, the decay g and beta of a and b, the
    gated delta rule, each value head's RMSNorm gated by silu(z), out_proj."""
    kd, vd, hv, conv = spec.keys, spec.values, spec.value_heads, spec.conv_width
    if spec.fused:
        ops = [_linear("linear_attn.in_proj_qkvz", "h1", "qkvz", "d_qkvz", "d_h"),
               Op("split", ("qkvz",), ("qkv_q", "qkv_k", "qkv_v", "z"), ("d_qkv_q", "d_qkv_k", "d_qkv_v", "d_z"),
                  ("d_qkvz",), heads="lk"),
               Op("concat", ("qkv_q", "qkv_k", "qkv_v"), ("qkv",), ("d_qkv",), ("d_qkv_q", "d_qkv_k", "d_qkv_v")),
               _linear("linear_attn.in_proj_ba", "h1", "ba", "d_ba", "d_h"),
               Op("split", ("ba",), ("lin_b", "lin_a"), ("d_lin_b", "d_lin_a"), ("d_ba",), heads="lk")]
        widths = {"qkvz": conv + vd, "qkv_q": kd, "qkv_k": kd, "qkv_v": vd, "ba": 2 * hv}
        grad_widths = {"d_qkvz": conv + vd, "d_qkv_q": kd, "d_qkv_k": kd, "d_qkv_v": vd, "d_ba": 2 * hv}
    else:
        ops = [_linear("linear_attn.in_proj_qkv", "h1", "qkv", "d_qkv", "d_h"),
               _linear("linear_attn.in_proj_z", "h1", "z", "d_z", "d_h"),
               _linear("linear_attn.in_proj_b", "h1", "lin_b", "d_lin_b", "d_h"),
               _linear("linear_attn.in_proj_a", "h1", "lin_a", "d_lin_a", "d_h")]
        widths, grad_widths = {}, {}
    ops += [Op("short_conv", ("qkv",), ("qkv_conv",), ("d_qkv_conv",), ("d_qkv",), param="linear_attn.conv1d.weight",
               size=spec.conv_kernel),
            Op("silu", ("qkv_conv",), ("qkv_act",), ("d_qkv_act",), ("d_qkv_conv",)),
            Op("split", ("qkv_act",), ("lin_q", "lin_k", "lin_v"), ("d_lin_q", "d_lin_k", "d_lin_v"), ("d_qkv_act",)),
            Op("l2norm", ("lin_q",), ("lin_qn",), ("d_lin_qn",), ("d_lin_q",), heads="lk"),
            Op("l2norm", ("lin_k",), ("lin_kn",), ("d_lin_kn",), ("d_lin_k",), heads="lk"),
            Op("decay", ("lin_a", "lin_b"), ("lin_g", "lin_beta"), ("d_lin_g", "d_lin_beta"), ("d_lin_a", "d_lin_b"),
               param="linear_attn"),
            Op("delta_rule", ("lin_qn", "lin_kn", "lin_v", "lin_g", "lin_beta"), ("core",), ("d_core",),
               ("d_lin_qn", "d_lin_kn", "d_lin_v", "d_lin_g", "d_lin_beta"), param="linear_attn.state",
               size=spec.key_dim),
            Op("gated_rmsnorm", ("core", "z"), ("core_n",), ("d_core_n",), ("d_core", "d_z"),
               param="linear_attn.norm.weight", heads="lv"),
            _linear("linear_attn.out_proj", "core_n", "x_mid", CARRY, "d_core_n", residual=INPUT)]
    widths.update(qkv=conv, z=vd, lin_b=hv, lin_a=hv, qkv_conv=conv, qkv_act=conv, lin_q=kd, lin_k=kd, lin_v=vd,
                  lin_qn=kd, lin_kn=kd, lin_g=hv, lin_beta=hv, core=vd, core_n=vd)
    grad_widths.update(d_qkv=conv, d_z=vd, d_lin_b=hv, d_lin_a=hv, d_qkv_conv=conv, d_qkv_act=conv, d_lin_q=kd,
                       d_lin_k=kd, d_lin_v=vd, d_lin_qn=kd, d_lin_kn=kd, d_lin_g=hv, d_lin_beta=hv, d_core=vd,
                       d_core_n=vd)
    return ops, widths, grad_widths


def _experts_mlp(moe, c: int) -> tuple[list, dict, dict]:
    """The ops after the MLP's norm (h2) of a mixture-of-experts layer, and their activations' and gradients'
    widths: the router (a linear module), the route, the routed experts, Qwen2-MoE's gated shared expert, each
    branch added to the residual stream."""
    e, k, f, s = moe.num_experts, moe.top_k, moe.expert_size, moe.shared_expert_size
    # the logits' activation is named apart from the router's module (the NumPy engine keeps a linear's input
    # under its module's name): "router" after Mixtral's and Qwen's mlp.gate, "router_logits" after gpt-oss's
    # mlp.router
    logits = "router_logits" if moe.router == "router" else "router"
    ops = [_linear(moe.router, "h2", logits, "d_router", "d_h"),
           Op("route", (logits,), ("route_w", "route_e"), ("d_route_w",), ("d_router",),
              param=f"{moe.block}.expert_bias" if moe.expert_bias else ""),
           Op("experts", ("h2", "route_w", "route_e"), ("moe", "moe_gu"), ("d_moe",), ("d_h", "d_route_w"),
              param=f"{moe.block}.experts")]
    widths = {logits: e, "route_w": k, "route_e": k, "moe": c, "moe_gu": k * 2 * f}
    grad_widths = {"d_router": e, "d_route_w": k, "d_moe": c}
    if not s:
        return ops + [Op("add", ("moe",), (OUTPUT,), (CARRY,), ("d_moe",), residual="x_mid")], widths, grad_widths
    ops += [Op("add", ("moe",), ("x_moe",), (CARRY,), ("d_moe",), residual="x_mid"),
            _linear("shared_expert.gate_proj", "h2", "s_gate", "d_s_gate", "d_h"),
            _linear("shared_expert.up_proj", "h2", "s_up", "d_s_up", "d_h"),
            Op("swiglu", ("s_gate", "s_up"), ("s_m",), ("d_s_m",), ("d_s_gate", "d_s_up")),
            _linear("shared_expert.down_proj", "s_m", "shared", "d_shared", "d_s_m"),
            _linear("shared_expert_gate", "h2", "s_g", "d_s_g", "d_h"),
            Op("sigmoid_gate", ("shared", "s_g"), ("shared_g",), ("d_moe",), ("d_shared", "d_s_g")),
            Op("add", ("shared_g",), (OUTPUT,), (CARRY,), ("d_moe",), residual="x_moe")]
    widths.update(x_moe=c, s_gate=s, s_up=s, s_m=s, shared=c, s_g=1, shared_g=c)
    grad_widths.update(d_s_gate=s, d_s_up=s, d_s_m=s, d_shared=c, d_s_g=1)
    return ops, widths, grad_widths


def _attention(cfg, names: dict, rope: bool) -> tuple[list, dict, dict]:
    """Self-attention from the normed input h1 up to its output att (the heads side by side): the q / k / v
    projections (Phi-3's fused one, split; Qwen3.5's q_proj with each head's output gate beside its query),
    q / k norms, RoPE (not on SmolLM3's NoPE layers), a query scale, attention (with gpt-oss's sinks)."""
    q, kv, hq, hkv = cfg.q_size, cfg.kv_size, cfg.num_attention_heads, cfg.num_key_value_heads
    q_proj, k_proj = ("q_pre", "k_pre") if cfg.qk_norm else ("q", "k")
    dq_proj, dk_proj = ("dq2", "dk2") if cfg.qk_norm else ("dq", "dk")
    widths = {"q": q, "k": kv, "v": kv, "att": q, "lse": hq}
    grad_widths = {"d_att": q, "dq": q, "dk": kv, "dv": kv}
    if cfg.fused_projections:    # Phi-3: one GEMM, its output split into q, k, v
        ops = [_linear("qkv_proj", "h1", "qkv", "d_qkv", "d_h"),
               Op("split", ("qkv",), (q_proj, k_proj, "v"), (dq_proj, dk_proj, "dv"), ("d_qkv",))]
        widths["qkv"], grad_widths["d_qkv"] = q + 2 * kv, q + 2 * kv
    elif cfg.attn_output_gate:   # Qwen3.5: q_proj writes each head's query, then its output gate
        ops = [_linear("q_proj", "h1", "q_gate", "d_q_gate", "d_h"),
               Op("split", ("q_gate",), (q_proj, "att_gate"), (dq_proj, "d_att_gate"), ("d_q_gate",), heads="q"),
               _linear("k_proj", "h1", k_proj, dk_proj, "d_h"),
               _linear("v_proj", "h1", "v", "dv", "d_h")]
    else:
        ops = [_linear("q_proj", "h1", q_proj, dq_proj, "d_h"),
               _linear("k_proj", "h1", k_proj, dk_proj, "d_h"),
               _linear("v_proj", "h1", "v", "dv", "d_h")]
    if cfg.qk_norm:      # over each head, or over the whole projection (OLMoE)
        ops += [_rmsnorm(names["q_norm"], "q_pre", "q", "rstd_q", "dq", "dq2",
                         heads="q" if cfg.qk_norm_per_head else ""),
                _rmsnorm(names["k_norm"], "k_pre", "k", "rstd_k", "dk", "dk2",
                         heads="kv" if cfg.qk_norm_per_head else "")]
        widths.update(q_pre=q, k_pre=kv, rstd_q=hq if cfg.qk_norm_per_head else 1,
                      rstd_k=hkv if cfg.qk_norm_per_head else 1)
        grad_widths.update(dq2=q, dk2=kv)
    if rope:        # SmolLM3's NoPE layers leave q and k unrotated
        ops += [Op("rope", ("q",), ("q",), ("dq",), ("dq",), heads="q"),
                Op("rope", ("k",), ("k",), ("dk",), ("dk",), heads="kv")]
    if cfg.query_scale != 1.0:
        ops.append(Op("scale", ("q",), ("q",), ("dq",), ("dq",), factor=cfg.query_scale))
    ops.append(Op("attention", ("q", "k", "v"), ("att", "lse"), ("d_att",), ("dq", "dk", "dv"),
                  param="self_attn.sinks" if cfg.attention_sinks else ""))
    return ops, widths, grad_widths


def _attention_mixer(cfg, names: dict, rope: bool) -> tuple[list, dict, dict]:
    """Self-attention from h1 to the residual stream x_mid: _attention, Qwen3.5's output gate, o_proj added to
    the layer's input."""
    ops, widths, grad_widths = _attention(cfg, names, rope)
    out, d_out = "att", "d_att"
    q = cfg.q_size
    if cfg.attn_output_gate:
        ops.append(Op("sigmoid_gate", ("att", "att_gate"), ("att_g",), ("d_att_g",), ("d_att", "d_att_gate")))
        widths.update(q_gate=2 * q, att_gate=q, att_g=q)
        grad_widths.update(d_q_gate=2 * q, d_att_gate=q, d_att_g=q)
        out, d_out = "att_g", "d_att_g"
    elif cfg.head_gate:      # LFM3: g_proj's one gate per head
        h = cfg.num_attention_heads
        ops += [_linear("g_proj", "h1", "head_g", "d_head_g", "d_h"),
                Op("sigmoid_gate", ("att", "head_g"), ("att_g",), ("d_att_g",), ("d_att", "d_head_g"))]
        widths.update(head_g=h, att_g=q)
        grad_widths.update(d_head_g=h, d_att_g=q)
        out, d_out = "att_g", "d_att_g"
    return ops + [_linear(names["o"], out, "x_mid", CARRY, d_out, residual=INPUT)], widths, grad_widths


def _dense_mlp(cfg, names: dict, h: str, out: str, d_out: str, residual: str) -> tuple[list, dict, dict]:
    """The gated MLP from its normed input h to `out` (added to `residual`, if any): gate and up (Phi-3's fused
    gate_up, split), SwiGLU or Gemma's GeGLU, down."""
    f = cfg.intermediate_size
    if cfg.fused_projections:
        ops = [_linear("gate_up_proj", h, "gate_up", "d_gate_up", "d_h"),
               Op("split", ("gate_up",), ("gate", "up"), ("d_gate", "d_up"), ("d_gate_up",))]
    else:
        ops = [_linear(names["gate"], h, "gate", "d_gate", "d_h"), _linear(names["up"], h, "up", "d_up", "d_h")]
    ops += [Op("geglu" if cfg.hidden_act == "gelu_tanh" else "swiglu", ("gate", "up"), ("m",), ("d_m",),
               ("d_gate", "d_up")),
            _linear(names["down"], "m", out, d_out, "d_m", residual=residual)]
    widths, grad_widths = {"gate": f, "up": f, "m": f}, {"d_gate": f, "d_up": f, "d_m": f}
    if cfg.fused_projections:
        widths["gate_up"], grad_widths["d_gate_up"] = 2 * f, 2 * f
    return ops, widths, grad_widths


@lru_cache(maxsize=None)
def _plan(fields: tuple, moe=None, rope: bool = True, conv: int = 0, linear=None) -> LayerPlan:
    """A layer from its input norm, its token mixer (attention; LFM2's short convolution; Qwen3.5's Gated
    DeltaNet) to x_mid, the MLP's norm, then its channel mixer (the dense MLP, or a mixture of experts) to the
    layer's output; Gemma's and LFM3's sandwich norms on each branch's output (_post_norm)."""
    cfg = SimpleNamespace(**dict(zip(_PLAN_FIELDS, fields)))
    names = _names(cfg)
    c = cfg.hidden_size
    ops = [_rmsnorm(names["norm1"], INPUT, "h1", "rstd1", "d_h", CARRY)]
    widths = {INPUT: c, "h1": c, "rstd1": 1, "x_mid": c, "h2": c, "rstd2": 1}
    grad_widths = {CARRY: c, "d_h": c}
    mixer = _short_conv(c, conv) if conv else _gated_delta_net(linear) if linear else \
        _attention_mixer(cfg, names, rope)
    norm2 = ([_rmsnorm(names["norm2"], "x_mid", "h2", "rstd2", "d_h", CARRY)], {}, {})
    mlp = _experts_mlp(moe, c) if moe is not None else _dense_mlp(cfg, names, "h2", OUTPUT, CARRY, "x_mid")
    if cfg.sandwich_norms:     # each branch's output normed before its residual add
        mixer, mlp = [_merged(part, _post_norm(names[post], part[0], c, res, out))
                      for part, post, res, out in ((mixer, "post1", INPUT, "x_mid"), (mlp, "post2", "x_mid", OUTPUT))]
    parts = [mixer, norm2, mlp]
    for part_ops, part_widths, part_grads in parts:
        ops += part_ops
        widths.update(part_widths)
        grad_widths.update(part_grads)
    return LayerPlan.build(ops, widths, grad_widths)


def layer_plan(cfg: ModelConfig, layer: int = 0) -> LayerPlan:
    """Decoder layer `layer` of a Llama-family model: pre-norm attention with RoPE and grouped-query heads, then
    a pre-norm gated MLP, each added to the residual stream. Variants: Qwen3's and Gemma 3's per-head q / k
    norms (OLMoE's over the whole projection); Gemma's query scale, GeGLU and norms on each branch's output
    (sandwich norms); Phi-3's fused q / k / v and gate / up projections, each split after its GEMM; a mixture
    of experts' router, routed experts and shared expert in place of the MLP on its sparse layers; gpt-oss's
    attention sinks; LFM2's names (operator_norm, ffn_norm, q / k_layernorm, out_proj, feed_forward.w1 / w3 / w2) and
    its double-gated short convolution in place of attention on its conv layers; Qwen3.5's and Qwen3-Next's Gated
    DeltaNet on their linear-attention layers, and the sigmoid output gate of their full-attention layers."""
    return _plan(tuple(getattr(cfg, name) for name in _PLAN_FIELDS), cfg.moe if cfg.is_sparse(layer) else None,
                 cfg.uses_rope(layer), cfg.conv_kernel if cfg.is_conv(layer) else 0,
                 cfg.linear_attention if cfg.is_linear(layer) else None)


def layer_plans(cfg: ModelConfig) -> list:
    """Every decoder layer's plan, by layer (one object for layers of the same kind)."""
    return [layer_plan(cfg, i) for i in range(cfg.num_hidden_layers)]
