"""The layer recorder's methods for LFM2's op kinds (mul, short_conv), forward and backward, which the layer plan's
walk finds by name (LayerRecorder takes them as a mixin); generation runs the short convolution's recurrent step
over each row's window state (recurrent_state.py)."""
from __future__ import annotations

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu import short_conv as SC


class ConvLayerOps:
    """mul and short_conv for LayerRecorder (its plans, w, grads and _where)."""

    def _forward_mul(self, rec, op, i, acts, buf, kv):
        rec.section(self._where + " conv")
        K.mul_forward(rec, buf[op.outputs[0]], buf[op.inputs[0]], buf[op.inputs[1]],
                      acts.n * self.plans[i].widths[op.inputs[0]])

    def _backward_mul(self, rec, op, i, acts, a, dys, dxs, accumulate):
        assert not any(accumulate), "mul's backward writes its gradients"
        rec.section(self._where + " conv")
        K.mul_backward(rec, *dxs, dys[0], *(a[x] for x in op.inputs), acts.n * self.plans[i].widths[op.inputs[0]])

    def _forward_short_conv(self, rec, op, i, acts, buf, kv):
        """Over each sequence of the batch; in generation (kv) the step over each row's run of tokens, its window
        state read and replaced (recurrent_state.begin wrote the call's runs table)."""
        rec.section(self._where + " conv")
        c, weight = self.plans[i].widths[op.inputs[0]], self.w[f"model.layers.{i}.{op.param}"]
        y, x = buf[op.outputs[0]], buf[op.inputs[0]]
        if kv is None:
            SC.short_conv_forward(rec, y, x, weight, acts.segments, acts.b, acts.t, c, op.size)
        else:
            SC.short_conv_step(rec, y, kv["state"][i][op.param], x, weight, kv["runs_table"], len(kv["runs"]),
                               acts.n, c, op.size)

    def _backward_short_conv(self, rec, op, i, acts, a, dys, dxs, accumulate):
        """dx written; the weight's gradient added to its own where the weight trains (full fine-tuning)."""
        assert not accumulate[0], "short_conv's backward writes its input's gradient"
        rec.section(self._where + " conv")
        c, name = self.plans[i].widths[op.inputs[0]], f"model.layers.{i}.{op.param}"
        dw, scratch = self.grads.get(name), None
        if dw is not None:     # the weight gradient's partial sums: one buffer per size, kept for the next steps
            size = SC.scratch_size(acts.b, acts.t, c, op.size)
            scratch = rec.rt.memo(("short_conv.scratch", size), lambda rt: rt.buffer(4 * size, "short_conv_scratch"))
        SC.short_conv_backward(rec, dxs[0], dw, dys[0], a[op.inputs[0]], self.w[name], acts.segments, acts.b, acts.t,
                               c, op.size, scratch, accumulate_dw=True)
