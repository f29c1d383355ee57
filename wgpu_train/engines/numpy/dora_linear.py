"""DoRA modules of the NumPy engine (DoraLinear, a part of NumpyEngine): PEFT's formulation as the oracle, the norm
||W + s B A|| formed directly (dora.weight_norm) where the GPU engine expands it (webgpu/dora.py)."""
from __future__ import annotations

from wgpu_train.adapters.dora import weight_norm
from wgpu_train.engines.numpy import ops


class DoraLinear:
    """A DoRA module's linear op pair over the engine's base weights w (its dict, name -> array, which the engine
    updates in place) in dtype; the engine draws the dropout masks and adds the gradients."""

    def __init__(self, w: dict, dtype):
        self.w, self.dtype = w, dtype

    def forward(self, x, path: str, lora, xl, mask) -> tuple:
        """PEFT's DoRA on a module, x (N, in) -> (N, out): c = m / ||W + s B A|| (detached),
        y = c * (W x + s B A x) + bias, or with dropout's x_d = xl (mask not None):
        W x + bias + (c - 1) * W x_d + c * s B A x_d. (y, what the backward needs)."""
        w, bias = self.w[path + ".weight"], self.w.get(path + ".bias")
        rn = (1 / weight_norm(w, lora.a, lora.b, lora.scale)).astype(self.dtype)   # (out,)
        yl, h = ops.lora_forward(xl, lora.a, lora.b, lora.scale)                  # (N, out), (N, r)
        if mask is None:
            z = ops.linear_forward(x, w) + yl                                     # (N, out)
            y = ops.dora_forward(z, lora.m, rn, bias)
        else:
            z = ops.linear_forward(xl, w) + yl
            y = ops.linear_forward(x, w, bias) + ops.dora_forward(z, lora.m, rn, None, 1.0) + yl
        return y, (x, xl, h, mask, z, rn)

    def backward(self, dy, path: str, lora, saved) -> tuple:
        """From the output's dy (N, out) and forward's saved tensors: (dx (N, in), dA, dB, dm)."""
        x, xl, h, mask, z, rn = saved
        w = self.w[path + ".weight"]
        if mask is None:
            dz, dm = ops.dora_backward(dy, z, lora.m, rn)
            dx = ops.linear_backward(dz, x, w, need_weight_grad=False)[0]
            dxl, da, db = ops.lora_backward(dz, x, h, lora.a, lora.b, lora.scale)
            dx = dx + dxl
        else:
            dx = ops.linear_backward(dy, x, w, need_weight_grad=False)[0]
            dz, dm = ops.dora_backward(dy, z, lora.m, rn, 1.0)                   # (c - 1) dy
            dxd = ops.linear_backward(dz, xl, w, need_weight_grad=False)[0]
            dxl, da, db = ops.lora_backward(dz + dy, xl, h, lora.a, lora.b, lora.scale)
            dx = dx + (dxd + dxl) * mask
        return dx, da, db, dm
