"""DoRA on the WebGPU engine: the per-module norm buffers (DoraNorms, a part that WgpuEngine owns), the norm
1 / ||W + s B A|| recomputed from the current A and B before the first forward after any change (for every
base storage: P = A W^T comes from the base linear itself, with A as its input rows), and a DoRA module's
forward and backward (PEFT's formulation, engines/numpy/dora_linear.py's)."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.tuned.gemm import gemm
from wgpu_train.engines.webgpu.lora import lora_a_forward, lora_b_forward, lora_backward, linear_lora_forward
from wgpu_train.engines.webgpu.buffers import GpuLora
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import Packed, linear_backward, linear_forward, write_tensor


class DoraNorms:
    """DoRA's norm buffers, a part that WgpuEngine owns: per DoRA module ||W||^2 and 1 / ||W + s B A|| ((out,)
    each, in two packed buffers, views set on its GpuLora as wsq and rn), a scratch for P^T (r, out) and
    G = A A^T (r, r), and `stale` (the norms must be recomputed before the next forward: A or B changed). It
    reads the engine's base weights `w` (name -> Matrix or QuantMatrix), a dict the engine keeps."""

    def __init__(self, rt: Runtime, w: dict):
        self.rt, self.w = rt, w
        self.buffers: list = []
        self.modules: list = []       # the GpuLora modules with a magnitude
        self.scratch = None
        self.stale = False

    def setup(self, lora: dict):
        """Allocate the norm buffers of the DoRA modules among lora (path -> GpuLora) and compute ||W||^2 (once
        per base)."""
        self.rt.release(*self.buffers)
        self.buffers = []
        self.modules = [m for m in lora.values() if m.m is not None]
        if not self.modules:
            return
        shapes = {m.path: (m.out_f,) for m in self.modules}
        wsq, rn = Packed(self.rt, shapes, "dora_weight_sq"), Packed(self.rt, shapes, "dora_rnorm")
        self.scratch = self.rt.buffer(4 * max(m.r * m.out_f + m.r * m.r for m in self.modules), "dora_scratch")
        self.buffers = [wsq.buf, rn.buf, self.scratch]
        for m in self.modules:
            m.wsq, m.rn = wsq.view(m.path), rn.view(m.path)
        self.weight_norms()

    def weight_norms(self):
        """||W||^2 (out,) of every DoRA module's base weight as stored (dequantised), computed on the host."""
        for m in self.modules:
            w = self.w[m.path + ".weight"].read(self.rt).astype(np.float64)         # (out, in)
            write_tensor(self.rt, m.wsq, (w * w).sum(axis=1))
        self.stale = True

    def record_norms(self, rec):
        """rn = 1 / ||W + s B A|| of every DoRA module from the current A, B (numpy.ops.dora_norm)."""
        rec.section("DoRA weight norms")
        for m in self.modules:
            pt, g = (self.scratch, 0), (self.scratch, m.r * m.out_f)
            linear_forward(rec, pt, m.a, self.w[m.path + ".weight"], None, m.r)     # P^T = A W^T (r, out)
            gemm(rec, g, m.a, m.a, m.r, m.r, m.in_f, "nt")                          # G = A A^T (r, r)
            K.dora_norm(rec, m.rn, m.wsq, pt, g, m.b, m.scale, m.out_f, m.r)
        self.stale = False


def dora_linear_forward(rec, y, h, z, x, xl, lora: GpuLora, w, bias, n: int, accumulate=False, recompute=False):
    """A DoRA module: h = x_d A^T and z = W x_d + s B h saved (x_d = xl, the LoRA input: x, or x with its
    dropout mask), then y (+)= c z + bias, or with dropout y (+)= W x + bias + (c - 1) z + s B h.
    recompute (gradient checkpointing): only h and z."""
    lora_a_forward(rec, h, xl, lora.a, n, lora.in_f, lora.r)
    linear_lora_forward(rec, z, xl, w, None, n, h, lora.r, lora.b, lora.scale, lora.r)
    if recompute:
        return
    if xl is x:
        K.dora_forward(rec, y, z, lora.m, lora.rn, bias, n, lora.out_f, 0.0, accumulate)
    else:
        linear_forward(rec, y, x, w, bias, n, accumulate)
        K.dora_forward(rec, y, z, lora.m, lora.rn, None, n, lora.out_f, 1.0, accumulate=True)
        lora_b_forward(rec, y, h, lora.b, lora.scale, n, lora.out_f, lora.r)


def dora_linear_backward(rec, dx, dy, h, z, x, xl, lora: GpuLora, w, n: int, dz, d_lora_h, d_lora_x, seeds,
                         seed_slot: int, accumulate_dx: bool):
    """dx (+)= the input gradient of dora_linear_forward; the gradients of A, B and m accumulate. dz, d_lora_h
    and d_lora_x are the bucket's scratch; seeds and seed_slot the dropout mask's (with dropout)."""
    args = (lora.a, lora.b, lora.scale, n, lora.in_f, lora.out_f, lora.r, d_lora_h)
    if lora.dropout > 0:
        linear_backward(rec, dx, None, None, dy, x, w, n, accumulate_dx)            # dy W
        K.dora_backward(rec, dz, lora.gm, dy, z, lora.m, lora.rn, n, lora.out_f, 1.0)   # (c - 1) dy
        linear_backward(rec, d_lora_x, None, None, dz, xl, w, n)
        K.add_inplace(rec, dz, dy, n * lora.out_f)                                  # c dy
        lora_backward(rec, d_lora_x, lora.ga, lora.gb, dz, xl, h, *args, accumulate_grads=True)
        K.lora_dropout_backward(rec, dx, d_lora_x, seeds, seed_slot, lora.dropout, n * lora.in_f)
    else:
        K.dora_backward(rec, dz, lora.gm, dy, z, lora.m, lora.rn, n, lora.out_f, 0.0)   # c dy
        linear_backward(rec, dx, None, None, dz, x, w, n, accumulate_dx)
        lora_backward(rec, dx, lora.ga, lora.gb, dz, x, h, *args, accumulate_grads=True)
