"""The LoRA op pairs on the device, y += scale * (x A^T) B^T, for one module and for a group of modules that
share their input (q/k/v, gate/up): the group's A matrices lie back to back, so one GEMM computes every
module's h and, in the backward, one GEMM each gives every dA and the input gradient. linear_lora_forward
runs a module's base linear and its B term as one dispatch where the tiled GEMM serves the base.

Storage formats (device/storage.py): x, y, dy and dx may be bfloat16 / float16 (activations and their
gradients); h, dh, the A and B matrices and their gradients are float32. A 16-bit output is rounded once after
each GEMM's sum (with what it accumulates onto): y once by the fused dispatch, after the base and again after the
B term on the two-step path; dx once by lora_backward, after its term is added to what dx holds."""
from __future__ import annotations

from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.gemm import gemm, gemm_problem
from wgpu_train.engines.webgpu.tuned.gemm_kernels import Tiled
from wgpu_train.engines.webgpu.device.operands import at, split
from wgpu_train.engines.webgpu.device.storage import format_of
from wgpu_train.engines.webgpu.tensors import Matrix, linear_forward


def lora_a_forward(rec, h, x, lora_a, N, in_features, r, ldh=None):
    """h (N, r) = x (N, in) @ lora_a (r, in).T: the half of lora_forward whose result the backward needs
    (gradient checkpointing recomputes only this where the module's output is not needed again).
    ldh: h's row pitch (default r)."""
    gemm(rec, h, x, lora_a, N, r, in_features, "nt", ldc=ldh)


def lora_b_forward(rec, y, h, lora_b, scale, N, out_features, r, ldh=None):
    """y (N, out) += scale * h (N, r; row pitch ldh, default r) @ lora_b (out, r).T."""
    gemm(rec, y, h, lora_b, N, out_features, r, "nt", alpha=scale, accumulate=True, lda=ldh)


def linear_lora_forward(rec, y, x, w, bias, N, h, ldh, lora_b, scale, r, accumulate=False):
    """y (N, out) (+)= x (N, in) @ w.T (+ bias) + scale * h (N, r; row pitch ldh) @ lora_b (out, r).T: a
    module's base linear and LoRA B term, h already computed (lora_a_forward). One dispatch
    (Tiled.dispatches_with_lora) when w is a float32 Matrix of one chunk whose GEMM tune.choose gives to a
    one-pass tiled candidate and y is float32; otherwise linear_forward then lora_b_forward, as two steps (a
    16-bit y always: its base output is stored, rounded, before the LoRA term is added, the rounding points of
    engines/numpy). Its gradients are
    those of the two steps: linear_backward and lora_backward (lora_group_backward for a group)."""
    if isinstance(w, Matrix) and len(w.chunks) == 1 and N > 0 and format_of(split(y)[0]) == "f32":
        p = gemm_problem(rec.rt, y, x, w.chunks[0][0], N, w.rows, w.cols, "nt", bias=bias, accumulate=accumulate)
        cand = tune.choose(rec.rt, p)
        if isinstance(cand, Tiled) and cand.lora_applies(p):
            for d in cand.dispatches_with_lora(p, h, ldh, lora_b, r, scale):
                rec.dispatch(*d)
            return
    linear_forward(rec, y, x, w, bias, N, accumulate)
    lora_b_forward(rec, y, h, lora_b, scale, N, w.rows, r, ldh=ldh)


def lora_forward(rec, y, h, x, lora_a, lora_b, scale, N, in_features, out_features, r):
    """h (N, r) = x (N, in) @ lora_a (r, in).T, saved for the backward; then
    y (N, out) += scale * h @ lora_b (out, r).T, on top of the base layer's output already in y.
    Modules that share x (a group) run lora_a_forward once over their A matrices back to back, then
    lora_b_forward each on its columns of h."""
    lora_a_forward(rec, h, x, lora_a, N, in_features, r)
    lora_b_forward(rec, y, h, lora_b, scale, N, out_features, r)


def lora_backward(rec, dx, dlora_a, dlora_b, dy, x, h, lora_a, lora_b, scale, N, in_features, out_features, r,
                  dh, accumulate_grads=False):
    """Gradients of lora_forward from dy (N, out), with dh (N, r) a scratch buffer:
    dlora_b (out, r) = scale * dy.T @ h;  dh = scale * dy @ lora_b;  dlora_a (r, in) = dh.T @ x;
    dx (N, in) += dh @ lora_a (always added: the base layer's dx is already there).
    With accumulate_grads the two weight gradients are added to what they hold (gradient accumulation).
    dx may be None when the input needs no gradient."""
    lora_group_backward(rec, dx, dlora_a, [dlora_b], [dy], x, h, lora_a, [lora_b], [scale], N, in_features,
                        [out_features], [r], dh, accumulate_grads)


def lora_group_backward(rec, dx, dlora_a, dlora_bs, dys, x, h, lora_a, lora_bs, scales, N, in_features, outs,
                        ranks, dh, accumulate_grads=False):
    """Gradients of a group's LoRA forward (lora_forward's docstring) from each module's dy_i (N, outs[i]): with
    h (N, sum(ranks)) the group's saved h and dh (N, sum(ranks)) a scratch,
    dlora_b_i = scales[i] * dy_i.T @ h_i and dh_i = scales[i] * dy_i @ lora_b_i per module, then
    dlora_a (sum(ranks), in) = dh.T @ x and dx (N, in) += dh @ lora_a in one GEMM each (dlora_a: the
    gradients of the A matrices, back to back like lora_a)."""
    total = sum(ranks)
    off = 0
    for db, dy, b, s, out_f, r in zip(dlora_bs, dys, lora_bs, scales, outs, ranks):
        gemm(rec, db, dy, at(h, off), out_f, r, N, "tn", alpha=s, accumulate=accumulate_grads, ldb=total)
        gemm(rec, at(dh, off), dy, b, N, r, out_f, "nn", alpha=s, ldc=total)
        off += r
    gemm(rec, dlora_a, dh, x, total, in_features, N, "tn", accumulate=accumulate_grads)
    if dx is not None:
        gemm(rec, dx, dh, lora_a, N, in_features, total, "nn", accumulate=True)
