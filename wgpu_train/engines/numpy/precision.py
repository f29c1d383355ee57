"""Training precision on the NumPy engine: the points where activations, saved tensors and activation gradients are
rounded to bfloat16 / float16, as the GPU stores them, while the arithmetic between them stays float32."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.quant import F16_MAX, bfloat16_bits, bfloat16_values
from wgpu_train.engines.protocol import Precision
from wgpu_train.errors import ConfigError


class Rounding:
    """The rounding points of one precision. fp32 returns every array unchanged (the same object), so an fp32
    engine computes bit for bit as it did before precisions existed.

    Rounded (bf16 / f16): every op output of the layer plan's walk but the statistics (norms' rstd, attention's
    logsumexp), the embedding's output, the loss head's input (the final norm's output), and every gradient
    flowing between ops (the layer plan's gradient buffers, after any accumulation into them, and the loss head's
    dx). Not rounded: the arithmetic inside an op (GEMM accumulation, norm statistics, softmax / logsumexp, the
    logits and the loss), a LoRA module's internals (x A^T, the dropout-masked input, DoRA's z: r-wide or
    module-local; the 16-bit LoRA kernels decide them), the weights as the base dtypes store them, LoRA A / B,
    DoRA magnitudes, trained base copies, their gradients and AdamW's moments (float32 as PEFT keeps them under
    autocast)."""

    def __init__(self, precision: Precision | str, statistics=frozenset()):
        precision = Precision.parse(precision)
        if not precision.resolved:
            raise ValueError("Rounding takes a resolved precision (engines/loading.py resolves auto)")
        self.precision = precision
        self.statistics = frozenset(statistics)     # activations kept in float32 (LayerPlan.statistics)

    def activation(self, x, where: str):
        """x as stored; in f16 a finite value beyond float16's range is refused, naming `where` (a forward whose
        activations overflow float16 cannot be trained in it: bf16 has float32's range)."""
        if not self.precision.sixteen_bit:
            return x
        y = self._round(x)
        if self.precision.loss_scaling:
            overflow = np.isinf(y) & np.isfinite(x)
            if overflow.any():
                largest = float(np.max(np.abs(x[overflow])))
                raise ConfigError(f"activations overflow float16 in {where} (values up to {largest:.6g}, float16 "
                                  f"holds {F16_MAX:g}): train with --precision bf16, which has float32's range")
        return y

    def gradient(self, g):
        """g as stored; in f16 an overflow becomes inf, which the loss scaler's non-finite check catches (the step
        is skipped and the scale halved)."""
        return self._round(g) if self.precision.sixteen_bit else g

    def _round(self, x):
        x = np.asarray(x)
        if self.precision is Precision.BF16:
            return bfloat16_values(bfloat16_bits(x)).reshape(x.shape).astype(x.dtype, copy=False)
        # past float16's range: inf, as torch rounds (WGSL's pack2x16float leaves it unspecified: the f16
        # kernels must encode it themselves)
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(x.dtype)

    def op_outputs(self, op, a: dict, layer: int):
        """Round op's outputs in the activations `a` of decoder layer `layer` (its statistics excepted)."""
        if not self.precision.sixteen_bit:
            return
        for name in op.outputs:
            if name not in self.statistics:
                a[name] = self.activation(a[name], f"layer {layer} ({op.param or op.kind} -> {name})")
