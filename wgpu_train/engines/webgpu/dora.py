"""DoRA on the WebGPU engine (a mixin of WgpuEngine, beside LayerRecorder): the per-module norm buffers, the
norm 1 / ||W + s B A|| recomputed from the current A and B before the first forward after any change (for
every base storage: P = A W^T comes from the base linear itself, with A as its input rows), and a DoRA
module's forward and backward (PEFT's formulation, engines/numpy/engine.py's _dora_linear)."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.weights import module_path
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.tuned.gemm import gemm
from wgpu_train.engines.webgpu.lora import lora_a_forward, lora_b_forward, lora_backward, linear_lora_forward
from wgpu_train.engines.webgpu.tensors import Packed, linear_backward, linear_forward


class DoraRecorder:
    """WgpuEngine's DoRA state and recording: `_dora_norms` (per module ||W||^2 and 1 / ||W + s B A||, (out,)
    each, in two packed buffers), a scratch for P^T (r, out) and G = A A^T (r, r), and `_dora_stale` (the norms
    must be recomputed before the next forward: A or B changed)."""

    _dora_buffers: list = []
    _dora_stale = False

    def _dora_modules(self) -> list:
        return [m for m in self.lora.values() if m.m is not None]

    def _setup_dora(self):
        """Allocate the norm buffers of the DoRA modules in self.lora and compute ||W||^2 (once per base)."""
        self.rt.release(*self._dora_buffers)
        self._dora_buffers = []
        mods = self._dora_modules()
        if not mods:
            return
        shapes = {m.path: (m.out_f,) for m in mods}
        wsq, rn = Packed(self.rt, shapes, "dora_weight_sq"), Packed(self.rt, shapes, "dora_rnorm")
        scratch = self.rt.buffer(4 * max(m.r * m.out_f + m.r * m.r for m in mods), "dora_scratch")
        self._dora_buffers = [wsq.buf, rn.buf, scratch]
        for m in mods:
            m.wsq, m.rn = wsq.view(m.path), rn.view(m.path)
        self._dora_scratch = scratch
        self._dora_weight_norms()

    def _dora_weight_norms(self):
        """||W||^2 (out,) of every DoRA module's base weight as stored (dequantised), computed on the host."""
        for m in self._dora_modules():
            w = self.w[m.path + ".weight"].read(self.rt).astype(np.float64)         # (out, in)
            self._write(m.wsq, (w * w).sum(axis=1))
        self._dora_stale = True

    def _record_dora_norms(self, rec):
        """rn = 1 / ||W + s B A|| of every DoRA module from the current A, B (numpy.ops.dora_norm)."""
        rec.section("DoRA weight norms")
        for m in self._dora_modules():
            pt, g = (self._dora_scratch, 0), (self._dora_scratch, m.r * m.out_f)
            linear_forward(rec, pt, m.a, self.w[m.path + ".weight"], None, m.r)     # P^T = A W^T (r, out)
            gemm(rec, g, m.a, m.a, m.r, m.r, m.in_f, "nt")                          # G = A A^T (r, r)
            K.dora_norm(rec, m.rn, m.wsq, pt, g, m.b, m.scale, m.out_f, m.r)
        self._dora_stale = False

    def _dora_linear(self, rec, y, x, layer, module, acts, a, accumulate=False, recompute=False):
        """A DoRA module: z = W x_d + s B (A x_d) saved in dora_z, then y (+)= c z + bias, or with dropout
        y (+)= W x + bias + (c - 1) z + s B h_d. recompute (gradient checkpointing): only x_d, h and z."""
        lora, n = self.lora[module_path(layer, module)], acts.n
        w, bias = self.w[lora.path + ".weight"], self.w.get(lora.path + ".bias")
        xl = self._lora_input(rec, x, lora, module, a, n)
        h, z = a["lora_h." + module], a["dora_z." + module]
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

    def _dora_linear_backward(self, rec, dx, dy, layer, module, acts, a, x, accumulate_dx):
        """dx (+)= the input gradient of _dora_linear; the gradients of A, B and m accumulate."""
        lora, n = self.lora[module_path(layer, module)], acts.n
        w = self.w[lora.path + ".weight"]
        h, z, dz = a["lora_h." + module], a["dora_z." + module], acts.d_dora
        args = (lora.a, lora.b, lora.scale, n, lora.in_f, lora.out_f, lora.r, acts.d_lora_h)
        if lora.dropout > 0:
            xl, dxl = a["lora_x." + module], acts.d_lora_x
            linear_backward(rec, dx, None, None, dy, x, w, n, accumulate_dx)            # dy W
            K.dora_backward(rec, dz, lora.gm, dy, z, lora.m, lora.rn, n, lora.out_f, 1.0)   # (c - 1) dy
            linear_backward(rec, dxl, None, None, dz, xl, w, n)
            K.add_inplace(rec, dz, dy, n * lora.out_f)                                  # c dy
            lora_backward(rec, dxl, lora.ga, lora.gb, dz, xl, h, *args, accumulate_grads=True)
            K.lora_dropout_backward(rec, dx, dxl, self.seeds, self._seed_slot(lora), lora.dropout, n * lora.in_f)
        else:
            K.dora_backward(rec, dz, lora.gm, dy, z, lora.m, lora.rn, n, lora.out_f, 0.0)   # c dy
            linear_backward(rec, dx, None, None, dz, x, w, n, accumulate_dx)
            lora_backward(rec, dx, lora.ga, lora.gb, dz, x, h, *args, accumulate_grads=True)
