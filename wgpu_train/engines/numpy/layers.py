"""The NumPy engine's walk of one layer over the layer plan (LayerOps, a part of engine.NumpyEngine): each op kind's
forward (`_forward_<kind>`) and backward (`_backward_<kind>`) over engines/numpy/ops.py, the activations and their
gradients rounded where the GPU stores them (precision.Rounding)."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.models.layer_plan import CARRY, INPUT, LayerPlan
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.precision import Rounding
from wgpu_train.engines.numpy.walk import Walk
from wgpu_train.engines.shared.gated_deltanet import CHUNK
from wgpu_train.engines.shared.kv_dtype import KvDtype
from wgpu_train.engines.shared.moe import ClampedSwiGLU
from wgpu_train.engines.shared.quant import round_to


class LayerOps:
    """A layer's forward and backward: cfg, the plans of its layers (by layer), the engine's base weights w (its
    dict, updated in place) in dtype, RoPE's inv_freqs ([long][layer] (R/2,)), the rounding of the run's
    precision; the engine's linear (x, layer, module, activations, residual -> y, with its LoRA), linear_backward
    (dy, layer, module, activations -> the input's gradient in parts), add_grad (name, g: added where that tensor
    trains), trains (name -> whether that base tensor trains) and lora_module (path -> the LoRA pair on that path
    in use now, or None: the experts')."""

    def __init__(self, cfg: ModelConfig, plans: list, w: dict, dtype, inv_freqs: list, rounding: Rounding,
                 linear, linear_backward, add_grad, trains, lora_module):
        self.cfg, self.plans, self.w, self.dtype, self.inv_freqs, self.rounding = cfg, list(plans), w, dtype, \
            inv_freqs, rounding
        self.linear, self.linear_backward, self.add_grad = linear, linear_backward, add_grad
        self.trains, self.lora_module = trains, lora_module

    @property
    def plan(self) -> LayerPlan:
        """The first layer's plan (every layer's in a model without layer kinds); set: every layer walks the
        plan given (a variant a test compares the engines on)."""
        return self.plans[0]

    @plan.setter
    def plan(self, plan: LayerPlan):
        self.plans = [plan] * len(self.plans)

    def forward(self, i: int, x, walk: Walk) -> dict:
        """Layer i's ops in its plan's order from its input x (N, C): every activation by name, (N, width)."""
        a = {INPUT: x}
        for op in self.plans[i].ops:
            getattr(self, "_forward_" + op.kind)(op, i, a, walk)
            self.rounding.op_outputs(op, a, i)
        return a

    def _norm_weight(self, layer, op):
        """The weight an op's param names under layer `layer` (a norm's, a short convolution's)."""
        return f"model.layers.{layer}.{op.param}"

    def _forward_rmsnorm(self, op, i, a, walk):
        x = a[op.inputs[0]]
        w = self.w[self._norm_weight(i, op)]
        y, rstd = ops.rmsnorm_forward(x.reshape(-1, w.shape[0]), w, self.cfg.rms_norm_eps, self.cfg.norm_offset)
        a[op.outputs[0]], a[op.outputs[1]] = y.reshape(x.shape), rstd

    def _forward_linear(self, op, i, a, walk):
        a[op.outputs[0]] = self.linear(a[op.inputs[0]], i, op.param, a, a[op.residual] if op.residual else None)

    def inv_freq(self, i, walk):
        """Layer i's frequencies for this forward (longrope: its short or long set)."""
        return self.inv_freqs[walk.long_rope][i]

    def _forward_rope(self, op, i, a, walk):
        x = a[op.inputs[0]]
        a[op.outputs[0]] = ops.rope_forward(walk.heads(x, self.cfg), walk.rope_positions, self.inv_freq(i, walk),
                                            self.cfg.rope_scale).reshape(x.shape)

    def _sinks(self, i, op):
        """Layer i's attention sinks (Hq,) (gpt-oss), or None."""
        return self.w[f"model.layers.{i}.{op.param}"] if op.param else None

    def _forward_attention(self, op, i, a, walk):
        q, k, v = (walk.heads(a[name], self.cfg) for name in op.inputs)         # (B, T, H, D)
        window, sinks = self.cfg.window(i), self._sinks(i, op)
        if walk.kv is None and sinks is not None and self.rounding.precision.sixteen_bit:
            # as the GPU: its attention kernel stores a 16-bit output, which the sinks then rescale
            att, lse = ops.attention_forward(q, k, v, walk.segments, window, self.cfg.attn_softcap, None, walk.blocks)
            att, lse = ops.attention_sink_forward(self.rounding.activation(att, f"layer {i} attention"), lse, sinks)
        elif walk.kv is None:
            att, lse = ops.attention_forward(q, k, v, walk.segments, window, self.cfg.attn_softcap,
                                             sinks, walk.blocks)                # (B, T, Hq, D), (B, Hq, T)
        else:   # generation: one row of n tokens, each with its own cache row and position
            kv = walk.kv
            k_new, v_new = k[0], v[0]                                           # (n, Hkv, D)
            if kv["dtype"] != KvDtype.FLOAT32:      # rounded as the GPU's cache stores them
                k_new, v_new = (round_to(x, kv["dtype"]).astype(x.dtype) for x in (k_new, v_new))
            ops.kv_cache_write(kv["k"][i], kv["v"][i], k_new, v_new, walk.rows, walk.positions[0])
            att = ops.attention_cached_forward(q[0], kv["k"][i], kv["v"][i], walk.rows, walk.positions[0], window,
                                               self.cfg.attn_softcap, sinks,
                                               None if walk.blocks is None else walk.blocks[0])
            lse = None
        a[op.outputs[0]], a[op.outputs[1]] = att.reshape(a[op.inputs[0]].shape), lse

    def _forward_glu(self, op, i, a, walk):
        """A gated activation, swiglu or geglu (the op's kind names the op pair)."""
        a[op.outputs[0]] = getattr(ops, op.kind + "_forward")(a[op.inputs[0]], a[op.inputs[1]])

    _forward_swiglu = _forward_geglu = _forward_glu

    def _forward_add(self, op, i, a, walk):
        a[op.outputs[0]] = a[op.residual] + a[op.inputs[0]]

    def _forward_scale(self, op, i, a, walk):
        a[op.outputs[0]] = a[op.inputs[0]] * self.dtype.type(op.factor)

    def _forward_split(self, op, i, a, walk):
        parts = ops.split_forward(a[op.inputs[0]], [self.plans[i].widths[y] for y in op.outputs],
                                  self.plans[i].head_count(self.cfg, op))
        a.update(zip(op.outputs, parts))

    def _forward_concat(self, op, i, a, walk):
        a[op.outputs[0]] = ops.split_backward([a[name] for name in op.inputs])

    def _forward_route(self, op, i, a, walk):
        spec = self.cfg.moe
        bias = self.w[f"model.layers.{i}.{op.param}"] if op.param else None    # LFM2-MoE's expert_bias
        a[op.outputs[0]], a[op.outputs[1]] = ops.moe_route_forward(a[op.inputs[0]], spec.top_k, spec.normalize,
                                                                   spec.scoring, bias, spec.scaling)
        if walk.router_loss is not None:
            walk.router_loss.add(a[op.inputs[0]], a[op.outputs[1]], walk.real_tokens)

    def _experts(self, i, op):
        """Layer i's experts: their (gate_up, down) weights and LoRA pairs ((A, B, scale) or None), their paths."""
        paths = [f"model.layers.{i}.{op.param}.{name}" for name in ("gate_up_proj", "down_proj")]
        loras = [self.lora_module(p) for p in paths]
        return [self.w[p] for p in paths], [None if m is None else (m.a, m.b, m.scale) for m in loras], paths

    def _expert_variant(self, paths) -> dict:
        """The experts' biases (gpt-oss: gate_up_bias (E, 2I), down_bias (E, C)) and activation, as keywords of
        the experts' op pair; {} for the plain SwiGLU without biases."""
        spec = self.cfg.moe
        out = {}
        if spec.biases:
            out["gate_up_bias"], out["down_bias"] = (self.w[p + "_bias"] for p in paths)
        if spec.swiglu:
            out["activation"] = ClampedSwiGLU(*spec.swiglu)
        return out

    def _forward_experts(self, op, i, a, walk):
        (gate_up, down), (lora_gu, lora_dn), paths = self._experts(i, op)
        x, weights, experts = (a[name] for name in op.inputs)
        a[op.outputs[0]], gu = ops.moe_experts_forward(x, weights, experts, gate_up, down, lora_gu, lora_dn,
                                                       **self._expert_variant(paths))
        a[op.outputs[1]] = gu.reshape(len(x), -1)

    def _forward_sigmoid_gate(self, op, i, a, walk):
        x, g = a[op.inputs[0]], a[op.inputs[1]]
        a[op.outputs[0]] = ops.sigmoid_gate_forward(x, g)

    def _forward_mul(self, op, i, a, walk):
        a[op.outputs[0]] = ops.mul_forward(a[op.inputs[0]], a[op.inputs[1]])

    def _forward_short_conv(self, op, i, a, walk):
        x, w = a[op.inputs[0]], self.w[self._norm_weight(i, op)]                 # (N, C), (C, 1, K)
        if walk.kv is None:     # a batch of sequences: each segment's window starts from zero
            y = ops.short_conv_forward(x.reshape(walk.b, walk.t, -1), w, walk.segments).reshape(x.shape)
        else:                   # generation: each row's tokens after its recurrent state (its last K-1 inputs)
            state = walk.kv["state"][i][op.param]                               # (rows, K-1, C)
            y = np.empty_like(x)
            for row, idx, start in walk.runs:
                before = state[row] if start else np.zeros_like(state[row])
                y[idx], state[row] = ops.short_conv_cached_forward(x[idx], before, w)
        a[op.outputs[0]] = y

    def _forward_silu(self, op, i, a, walk):
        a[op.outputs[0]] = ops.silu_forward(a[op.inputs[0]])

    def _per_head(self, i, op, x):
        """x (N, H*D) as (N, H, D) over the op's heads."""
        return x.reshape(len(x), self.plans[i].head_count(self.cfg, op), -1)

    def _forward_l2norm(self, op, i, a, walk):
        x = a[op.inputs[0]]
        a[op.outputs[0]] = ops.l2norm_forward(self._per_head(i, op, x))[0].reshape(x.shape)

    def _decay_weights(self, i, op):
        """Layer i's A_log and dt_bias (Hv,), and their names."""
        names = [f"model.layers.{i}.{op.param}.{p}" for p in ("A_log", "dt_bias")]
        return [self.w[n] for n in names], names

    def _forward_decay(self, op, i, a, walk):
        (a_log, dt_bias), _ = self._decay_weights(i, op)
        a[op.outputs[0]], a[op.outputs[1]] = ops.decay_forward(a[op.inputs[0]], a[op.inputs[1]], a_log, dt_bias)

    def _rule_inputs(self, i, op, a, walk):
        """The delta rule's q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g, beta (B, T, Hv) from the activations."""
        spec = self.cfg.linear_attention
        q, k, v, g, beta = (a[name] for name in op.inputs)
        heads = (spec.key_heads, spec.key_heads, spec.value_heads)
        return [x.reshape(walk.b, walk.t, h, -1) for x, h in zip((q, k, v), heads)] + \
            [x.reshape(walk.b, walk.t, -1) for x in (g, beta)]

    def _forward_delta_rule(self, op, i, a, walk):
        spec = self.cfg.linear_attention
        if walk.kv is None:     # a batch of sequences: each segment's state starts from zero
            out = ops.gated_delta_rule_forward(*self._rule_inputs(i, op, a, walk), CHUNK, segments=walk.segments)[0]
        else:                   # generation: each row's tokens after its recurrent state (Hv, Dk, Dv)
            state = walk.kv["state"][i][op.param]                               # (rows, Hv, Dk, Dv)
            q, k, v, g, beta = (a[name] for name in op.inputs)
            out = np.empty((len(v), spec.value_heads, spec.value_dim), dtype=v.dtype)
            for row, idx, start in walk.runs:
                before = state[row] if start else np.zeros_like(state[row])
                args = [x[idx].reshape(len(idx), h, -1) for x, h in
                        zip((q, k, v), (spec.key_heads, spec.key_heads, spec.value_heads))] + [g[idx], beta[idx]]
                if len(idx) == 1:       # one token: the recurrent step
                    y, state[row] = ops.gated_delta_rule_step(*args, before[None])
                    out[idx] = y
                else:                   # a prefill: the chunked form from the row's state
                    y, final, _ = ops.gated_delta_rule_forward(*[x[None] for x in args], CHUNK, before[None])
                    out[idx], state[row] = y[0], final[0]
        a[op.outputs[0]] = out.reshape(len(a[op.inputs[2]]), -1).astype(a[op.inputs[2]].dtype, copy=False)

    def _forward_gated_rmsnorm(self, op, i, a, walk):
        x, z = (self._per_head(i, op, a[name]) for name in op.inputs)
        y = ops.gated_rmsnorm_forward(x, z, self.w[self._norm_weight(i, op)], self.cfg.rms_norm_eps)
        a[op.outputs[0]] = y.reshape(a[op.inputs[0]].shape)


    def backward(self, i: int, a: dict, dx, walk: Walk):
        """The gradient (N, C) of layer i's input from that of its output dx: the plan's ops in reverse, each
        reading its outputs' gradients and writing (or adding into) its inputs'."""
        g = {CARRY: dx}
        for op, accumulate in self.plans[i].backward_steps():
            dys = [g[name] for name in op.grads_out]
            for name in op.grads_out[1:] if op.residual else op.grads_out:
                del g[name]
            dxs = getattr(self, "_backward_" + op.kind)(op, i, a, dys, walk)
            for name, d, add in zip(op.grads_in, dxs, accumulate):
                for j, part in enumerate(d if isinstance(d, tuple) else (d,)):     # a linear's: base, LoRA
                    if part is not None:
                        g[name] = self.rounding.gradient(g[name] + part if add or j else part)
        return g[CARRY]

    def _backward_rmsnorm(self, op, i, a, dys, walk):
        name = self._norm_weight(i, op)
        x, width = a[op.inputs[0]], self.w[name].shape[0]
        dx, dw = ops.rmsnorm_backward(dys[0].reshape(-1, width), x.reshape(-1, width), self.w[name], a[op.outputs[1]],
                                      self.cfg.norm_offset)
        self.add_grad(name, dw)
        return [dx.reshape(x.shape)]

    def _backward_linear(self, op, i, a, dys, walk):
        return [self.linear_backward(dys[0], i, op.param, a)]

    def _backward_rope(self, op, i, a, dys, walk):
        dy = dys[0]
        return [ops.rope_backward(walk.heads(dy, self.cfg), walk.rope_positions, self.inv_freq(i, walk),
                                  self.cfg.rope_scale).reshape(dy.shape)]

    def _backward_attention(self, op, i, a, dys, walk):
        q, k, v = (walk.heads(a[name], self.cfg) for name in op.inputs)
        att, lse = walk.heads(a[op.outputs[0]], self.cfg), a[op.outputs[1]]
        sinks = self._sinks(i, op)
        grads = ops.attention_backward(walk.heads(dys[0], self.cfg), q, k, v, att, lse, walk.segments,
                                       self.cfg.window(i), self.cfg.attn_softcap, sinks, walk.blocks)
        if sinks is not None:
            self.add_grad(f"model.layers.{i}.{op.param}", grads[3])
        return [g.reshape(a[name].shape) for g, name in zip(grads, op.inputs)]

    def _backward_glu(self, op, i, a, dys, walk):
        return list(getattr(ops, op.kind + "_backward")(dys[0], a[op.inputs[0]], a[op.inputs[1]]))

    _backward_swiglu = _backward_geglu = _backward_glu

    def _backward_add(self, op, i, a, dys, walk):
        return [dys[0]]

    def _backward_scale(self, op, i, a, dys, walk):
        return [dys[0] * self.dtype.type(op.factor)]

    def _backward_split(self, op, i, a, dys, walk):
        return [ops.split_backward(dys, self.plans[i].head_count(self.cfg, op))]

    def _backward_concat(self, op, i, a, dys, walk):
        return ops.split_forward(dys[0], [self.plans[i].widths[x] for x in op.inputs])

    def _backward_route(self, op, i, a, dys, walk):
        dprobs = walk.router_loss.dprobs(walk.real_tokens) if walk.router_loss is not None else None
        spec = self.cfg.moe
        return [ops.moe_route_backward(dys[0], a[op.inputs[0]], a[op.outputs[1]], spec.normalize, dprobs,
                                       spec.scoring, spec.scaling)]

    def _backward_experts(self, op, i, a, dys, walk):
        (gate_up, down), (lora_gu, lora_dn), paths = self._experts(i, op)
        x, weights, experts = (a[name] for name in op.inputs)
        trained = [p for p in paths if self.trains(p)]
        dx, dweights, grads = ops.moe_experts_backward(dys[0], x, weights, experts,
                                                       a[op.outputs[1]].reshape(len(x), experts.shape[1], -1),
                                                       gate_up, down, lora_gu, lora_dn, need_weight_grad=bool(trained),
                                                       **self._expert_variant(paths))
        names = {"gate_up": paths[0], "down": paths[1], "gate_up_bias": paths[0] + "_bias",
                 "down_bias": paths[1] + "_bias"}
        for key, grad in grads.items():
            part, _, tensor = key.partition(".")
            self.add_grad(names[part] + ("." + tensor if tensor else ""), grad)
        return [dx, dweights]

    def _backward_sigmoid_gate(self, op, i, a, dys, walk):
        return list(ops.sigmoid_gate_backward(dys[0], a[op.inputs[0]], a[op.inputs[1]]))

    def _backward_mul(self, op, i, a, dys, walk):
        return list(ops.mul_backward(dys[0], a[op.inputs[0]], a[op.inputs[1]]))

    def _backward_short_conv(self, op, i, a, dys, walk):
        name = self._norm_weight(i, op)
        x, dy = a[op.inputs[0]], dys[0]
        dx, dw = ops.short_conv_backward(dy.reshape(walk.b, walk.t, -1), x.reshape(walk.b, walk.t, -1), self.w[name],
                                         walk.segments, need_weight_grad=self.trains(name))
        if dw is not None:
            self.add_grad(name, dw)
        return [dx.reshape(x.shape)]

    def _backward_silu(self, op, i, a, dys, walk):
        return [ops.silu_backward(dys[0], a[op.inputs[0]])]

    def _backward_l2norm(self, op, i, a, dys, walk):
        x = self._per_head(i, op, a[op.inputs[0]])
        y, inv_norm = ops.l2norm_forward(x)
        return [ops.l2norm_backward(self._per_head(i, op, dys[0]), y, inv_norm).reshape(dys[0].shape)]

    def _backward_decay(self, op, i, a, dys, walk):
        (a_log, dt_bias), names = self._decay_weights(i, op)
        trained = any(self.trains(n) for n in names)
        da, db, d_a_log, d_dt_bias = ops.decay_backward(dys[0], dys[1], a[op.inputs[0]], a[op.inputs[1]], a_log,
                                                        dt_bias, need_weight_grad=trained)
        if trained:
            self.add_grad(names[0], d_a_log)
            self.add_grad(names[1], d_dt_bias)
        return [da, db]

    def _backward_delta_rule(self, op, i, a, dys, walk):
        inputs = self._rule_inputs(i, op, a, walk)
        states = ops.gated_delta_rule_forward(*inputs, CHUNK, segments=walk.segments)[2]   # recomputed
        dout = dys[0].reshape(inputs[2].shape)
        grads = ops.gated_delta_rule_backward(dout, *inputs, states, CHUNK, segments=walk.segments)
        return [g.reshape(a[name].shape).astype(a[name].dtype, copy=False) for g, name in zip(grads, op.inputs)]

    def _backward_gated_rmsnorm(self, op, i, a, dys, walk):
        name = self._norm_weight(i, op)
        d = self.w[name].shape[0]
        dy, x, z = (t.reshape(-1, d) for t in (dys[0], a[op.inputs[0]], a[op.inputs[1]]))   # (N Hv, Dv)
        dx, dz, dw = ops.gated_rmsnorm_backward(dy, x, z, self.w[name], self.cfg.rms_norm_eps,
                                                need_weight_grad=self.trains(name))
        if dw is not None:
            self.add_grad(name, dw)
        return [dx.reshape(dys[0].shape), dz.reshape(dys[0].shape)]
