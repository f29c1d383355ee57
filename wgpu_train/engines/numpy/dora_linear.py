"""DoRA modules of the NumPy engine (a mixin of NumpyEngine): PEFT's formulation as the oracle, the norm
||W + s B A|| formed directly (dora.weight_norm) where the GPU engine expands it (webgpu/dora.py)."""
from __future__ import annotations

from wgpu_train.adapters.dora import MAGNITUDE, weight_norm
from wgpu_train.models.weights import module_path
from wgpu_train.engines.numpy import ops


class DoraLinear:
    """NumpyEngine's DoRA linear op pair (it uses the engine's weights, dtype, grads and dropout masks)."""

    def _dora_linear(self, x, layer, module, lora, cache):
        """PEFT's DoRA on a module, x (N, in) -> (N, out): c = m / ||W + s B A|| (detached),
        y = c * (W x + s B A x) + bias, or with dropout's x_d: W x + bias + (c - 1) * W x_d + c * s B A x_d."""
        path = module_path(layer, module)
        w, bias = self.w[path + ".weight"], self.w.get(path + ".bias")
        rn = (1 / weight_norm(w, lora.a, lora.b, lora.scale)).astype(self.dtype)   # (out,)
        xl, mask = self._dropout_input(x, layer, module, lora)
        yl, h = ops.lora_forward(xl, lora.a, lora.b, lora.scale)                  # (N, out), (N, r)
        if mask is None:
            z = ops.linear_forward(x, w) + yl                                     # (N, out)
            y = ops.dora_forward(z, lora.m, rn, bias)
        else:
            z = ops.linear_forward(xl, w) + yl
            y = ops.linear_forward(x, w, bias) + ops.dora_forward(z, lora.m, rn, None, 1.0) + yl
        cache[module] = (x, xl, h, mask, z, rn)
        return y

    def _dora_linear_backward(self, dy, layer, module, lora, cache):
        path = module_path(layer, module)
        x, xl, h, mask, z, rn = cache[module]
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
        self.grads[path + ".lora_A"] += da
        self.grads[path + ".lora_B"] += db
        self.grads[f"{path}.{MAGNITUDE}"] += dm
        return dx
