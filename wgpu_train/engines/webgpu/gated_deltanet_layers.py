"""Recording Qwen3.5's and Qwen3-Next's Gated DeltaNet ops of the layer plan (models/layer_plan._gated_delta_net) on
the WebGPU engine: a part of LayerRecorder (webgpu/layers.py), one short method per op kind and direction, the
same ones the NumPy engine's walk finds (engines/numpy/layers.py). The conv1d is the short_conv op's
(webgpu/short_conv.py); the other ops run the gated_deltanet and delta_rule families (gated_deltanet.py,
delta_rule.py).

What the layer plan does not hold lives here, sized per batch and grown on demand: the delta rule's states (B, Hv, N,
Dk, Dv) per layer in a training bucket without gradient checkpointing (the backward reads them), else one set that
the checkpointed backward's recompute refills, held by the bucket (a pipeline stage's micro-batch in flight keeps its
own); its scratch, final state, and the l2norm's inverse norms, which the backward recomputes from the saved input
rather than storing. With 16-bit activations the ops that write float32 only (the l2norm, the rule) write into
float32 buffers here, then rounded into the plan's (_float32, _settle)."""
from __future__ import annotations

from wgpu_train.errors import ConfigError
from wgpu_train.engines.webgpu import delta_rule as DR
from wgpu_train.engines.webgpu import gated_deltanet as GD
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import at, split


class GatedDeltaNetOps:
    """LayerRecorder's methods for the op kinds silu, concat, l2norm, decay, delta_rule and gated_rmsnorm."""

    def _dn_buffer(self, rt, name: str, elements: int, owner=None):
        """A float32 buffer of at least `elements` for `name`, grown (a new one) when a bigger batch needs more; held
        by the recorder, or by `owner` (a bucket: what a micro-batch keeps until its backward, when a pipeline stage
        holds several in flight). A replaced buffer is kept, since a recording not yet submitted may still bind it."""
        holder = (owner if owner is not None else self).__dict__
        store = holder.setdefault("_dn_buffers", {})
        buf = store.get(name)
        if buf is None or buf.size < 4 * elements:
            if buf is not None:
                holder.setdefault("_dn_retired", []).append(buf)
            buf = store[name] = rt.buffer(4 * max(1, elements), "gated_deltanet." + name)
        return buf

    def _float32(self, rec, key: str, t, n: int):
        """t itself where it is a float32 tensor, else a float32 buffer (key) of n elements for an op that writes
        float32 only, which _settle then rounds into t (16-bit activations: the NumPy engine's rounding point)."""
        return t if storage.format_of(split(t)[0]) == "f32" else self._dn_buffer(rec.rt, key, n)

    @staticmethod
    def _settle(rec, t, written, n: int):
        if written is not t:
            K.copy(rec, t, written, n)

    def _dn_sizes(self):
        spec = self.cfg.linear_attention
        return spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim

    def _forward_silu(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " linear attention")
        GD.silu_forward(rec, buf[op.outputs[0]], buf[op.inputs[0]], acts.n * self.plans[i].widths[op.inputs[0]])

    def _backward_silu(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not accumulate[0], "silu's backward writes its gradient"
        rec.section(self._where + " linear attention")
        GD.silu_backward(rec, dxs[0], dys[0], a[op.inputs[0]], acts.n * self.plans[i].widths[op.inputs[0]])

    def _forward_concat(self, rec, op, i, acts, buf, kv):
        """split's inverse: its backward's kernel."""
        rec.section(self._where + " split")
        K.split_backward(rec, buf[op.outputs[0]], [buf[x] for x in op.inputs], acts.n,
                         [self.plans[i].widths[x] for x in op.inputs])

    def _backward_concat(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "concat's backward writes its gradients"
        rec.section(self._where + " split")
        K.split_forward(rec, dxs, dys[0], acts.n, [self.plans[i].widths[x] for x in op.inputs])

    def _l2norm_rows(self, op, i, acts) -> tuple:
        heads = self.plans[i].head_count(self.cfg, op)
        return acts.n * heads, self.plans[i].widths[op.inputs[0]] // heads

    def _forward_l2norm(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " linear attention")
        rows, d = self._l2norm_rows(op, i, acts)
        y = self._float32(rec, "l2norm_out", buf[op.outputs[0]], rows * d)
        DR.l2norm_forward(rec, y, self._dn_buffer(rec.rt, "inv_norm", rows), buf[op.inputs[0]], rows, d)
        self._settle(rec, buf[op.outputs[0]], y, rows * d)

    def _backward_l2norm(self, rec, op, i, acts, a, dys, dxs, accumulate):
        """The normalised vectors and their inverse norms recomputed from the saved input, then the gradient."""
        assert not accumulate[0], "l2norm's backward writes its gradient"
        rec.section(self._where + " linear attention")
        rows, d = self._l2norm_rows(op, i, acts)
        y, inv = self._dn_buffer(rec.rt, "l2norm_y", rows * d), self._dn_buffer(rec.rt, "inv_norm", rows)
        DR.l2norm_forward(rec, y, inv, a[op.inputs[0]], rows, d)
        dx = self._float32(rec, "l2norm_dx", dxs[0], rows * d)
        DR.l2norm_backward(rec, dx, dys[0], y, inv, rows, d)
        self._settle(rec, dxs[0], dx, rows * d)

    def _decay_weights(self, i: int, op) -> list:
        return [f"model.layers.{i}.{op.param}.{p}" for p in ("A_log", "dt_bias")]

    def _forward_decay(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " linear attention")
        a_log, dt_bias = (self.w[n] for n in self._decay_weights(i, op))
        GD.decay_forward(rec, buf[op.outputs[0]], buf[op.outputs[1]], buf[op.inputs[0]], buf[op.inputs[1]], a_log,
                         dt_bias, acts.n, self.plans[i].widths[op.inputs[0]])

    def _backward_decay(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "decay's backward writes its gradients"
        rec.section(self._where + " linear attention")
        names = self._decay_weights(i, op)
        grads = [self.grads.get(n) for n in names]
        if (grads[0] is None) != (grads[1] is None):
            raise ConfigError(f"layer {i}: A_log and dt_bias train together on the WebGPU engine")
        GD.decay_backward(rec, *dxs, *grads, *dys, *(a[x] for x in op.inputs), *(self.w[n] for n in names), acts.n,
                          self.plans[i].widths[op.inputs[0]])

    def _rule(self, rec, acts, i: int) -> tuple:
        """(chunk, states, scratch, final_state) of layer i's delta rule on this batch."""
        hk, hv, dk, dv = self._dn_sizes()
        b, t = acts.b, acts.t
        chunk = DR.delta_rule_chunk(rec.rt, b, t, hk, hv, dk, dv, backward=acts.train)
        own = acts.train and not acts.checkpoint
        states = self._dn_buffer(rec.rt, f"states.{i}" if own else "states", DR.states_size(b, t, hv, dk, dv, chunk),
                                 owner=acts)
        passes = [False, True] if acts.train else [False]     # the forward's and the backward's scratch, by pass
        sizes = []
        for back in passes:
            rows, heads = DR.pass_shape(rec.rt, b, t, hk, hv, dk, dv, chunk, back)
            sizes.append(DR.scratch_size(rows, t, heads, dk, dv, chunk, back))
        scratch = self._dn_buffer(rec.rt, "scratch", max(sizes))
        return chunk, states, scratch, self._dn_buffer(rec.rt, "final_state", b * hv * dk * dv)

    def _forward_delta_rule(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " linear attention")
        if kv is not None:
            self._delta_rule_rows(rec, op, i, buf, kv, acts.n)
            return
        hk, hv, dk, dv = self._dn_sizes()
        chunk, states, scratch, final = self._rule(rec, acts, i)
        out = self._float32(rec, "rule_out", buf[op.outputs[0]], acts.n * hv * dv)
        DR.gated_delta_rule_forward(rec, out, final, states, *(buf[x] for x in op.inputs), chunk, acts.b, acts.t, hk,
                                    hv, dk, dv, scratch, segments=acts.segments)
        self._settle(rec, buf[op.outputs[0]], out, acts.n * hv * dv)

    def _delta_rule_rows(self, rec, op, i, buf, kv, tokens: int):
        """Generation: each row's run of tokens in the call (kv["runs"], recurrent_state.begin) from the row's state
        (kv["state"], zeroed for a row that starts), which it replaces: one token by the recurrent step in place,
        a prefill by the chunked forward from it, its final state copied back."""
        hk, hv, dk, dv = self._dn_sizes()
        state, one = kv["state"][i][op.param], hv * dk * dv
        out, (q, k, v, g, beta) = self._float32(rec, "rule_out", buf[op.outputs[0]], tokens * hv * dv), \
            (buf[x] for x in op.inputs)
        for row, first, n in _row_blocks(kv["runs"]):
            views = (at(out, first * hv * dv), at(q, first * hk * dk), at(k, first * hk * dk), at(v, first * hv * dv),
                     at(g, first * hv), at(beta, first * hv))
            slot = at(state, row * one)
            if n < 0:           # -n rows of one token each, their slots and tokens both consecutive
                DR.gated_delta_rule_step(rec, views[0], slot, *views[1:], -n, hk, hv, dk, dv)
                continue
            chunk = DR.delta_rule_chunk(rec.rt, 1, n, hk, hv, dk, dv)
            final = self._dn_buffer(rec.rt, "final_state", one)
            states = self._dn_buffer(rec.rt, "prefill_states", DR.states_size(1, n, hv, dk, dv, chunk))
            _, heads = DR.pass_shape(rec.rt, 1, n, hk, hv, dk, dv, chunk, False)
            scratch = self._dn_buffer(rec.rt, "prefill_scratch", DR.scratch_size(1, n, heads, dk, dv, chunk, False))
            DR.gated_delta_rule_forward(rec, views[0], final, states, *views[1:], chunk, 1, n, hk, hv, dk, dv, scratch,
                                        initial_state=slot)
            K.copy(rec, slot, final, one)
        self._settle(rec, buf[op.outputs[0]], out, tokens * hv * dv)

    def _backward_delta_rule(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "the delta rule's backward writes its gradients"
        rec.section(self._where + " linear attention")
        hk, hv, dk, dv = self._dn_sizes()
        chunk, states, scratch, _ = self._rule(rec, acts, i)
        sizes = [acts.n * self.plans[i].widths[x] for x in op.inputs]
        grads = [self._float32(rec, f"rule_grad{j}", d, e) for j, (d, e) in enumerate(zip(dxs, sizes))]
        DR.gated_delta_rule_backward(rec, *grads, None, dys[0], *(a[x] for x in op.inputs), states, chunk, acts.b,
                                     acts.t, hk, hv, dk, dv, scratch, segments=acts.segments)
        for d, written, e in zip(dxs, grads, sizes):
            self._settle(rec, d, written, e)

    def _forward_gated_rmsnorm(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " norm")
        _, hv, _, dv = self._dn_sizes()
        GD.gated_rmsnorm_forward(rec, buf[op.outputs[0]], *(buf[x] for x in op.inputs),
                                 self.w[f"model.layers.{i}.{op.param}"], acts.n * hv, dv, self.cfg.rms_norm_eps)

    def _backward_gated_rmsnorm(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "the gated RMSNorm's backward writes its gradients"
        rec.section(self._where + " norm")
        _, hv, _, dv = self._dn_sizes()
        name = f"model.layers.{i}.{op.param}"
        GD.gated_rmsnorm_backward(rec, *dxs, self.grads.get(name), dys[0], *(a[x] for x in op.inputs), self.w[name],
                                  acts.n * hv, dv, self.cfg.rms_norm_eps)


def _row_blocks(runs) -> list:
    """Generation's row runs as (first slot, first token, n) blocks: a prefill (n > 1 tokens of one row), or -n rows
    of one token each whose slots and tokens follow each other (one step dispatch for a whole decoding batch)."""
    out = []
    for row, idx, _ in runs:
        first, n = int(idx[0]), len(idx)
        if int(idx[-1]) - first + 1 != n:
            raise ValueError(f"forward_rows: row {row}'s tokens must be consecutive in the call on the WebGPU engine's "
                             f"linear-attention layers")
        if n == 1 and out and out[-1][2] < 0 and (row, first) == (out[-1][0] - out[-1][2], out[-1][1] - out[-1][2]):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] - 1)
        else:
            out.append((row, first, -1 if n == 1 else n))
    return out
