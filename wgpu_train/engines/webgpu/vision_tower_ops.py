"""The op wrappers only the SigLIP vision tower needs on the WebGPU engine (kernels.py's conventions: the Recorder
first, then outputs, inputs, sizes; names of engines/numpy/vision_tower.py's ops): LayerNorm's forward with its
bias and its backward's dx (shaders/rmsnorm.wgsl, the norm family), gelu_tanh (or the exact erf GELU, Qwen's mergers)
alone and its backward (shaders/swiglu.wgsl, the MLP activations)."""
from __future__ import annotations

from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import Kernel, flat_grid, launch
from wgpu_train.engines.webgpu.device.operands import split
from wgpu_train.engines.webgpu.kernels import RMS_WG, WG, rms_row_max_c

LAYERNORM_ROW = Kernel("rmsnorm", "layernorm_forward_row", "y! x weight bias")
LAYERNORM_WG = Kernel("rmsnorm", "layernorm_forward", "y! x weight bias")
LAYERNORM_BACKWARD_ROW = Kernel("rmsnorm", "layernorm_backward_row", "dx! dy x weight")
GELU = Kernel("swiglu", "gelu_forward", "h! gate")
GELU_BACKWARD = Kernel("swiglu", "gelu_backward", "dx! dy x")


def _float32(what, **tensors):
    """Refuse (ValueError) a 16-bit tensor where the norm's entry points read float32 arrays."""
    bad = [name for name, t in tensors.items() if storage.format_of(split(t)[0]) != "f32"]
    if bad:
        raise ValueError(f"{what}: {', '.join(bad)} must be float32 tensors")


def layernorm_forward(rec, y, x, weight, bias, N, C, eps):
    """y (N, C) = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) over each row; every tensor
    float32 (the frozen tower keeps no statistics). One invocation per row up to rmsnorm's row threshold, else a
    workgroup per row."""
    _float32("layernorm_forward", y=y, x=x)
    if N <= 0:
        return
    tensors = [(y, N * C), (x, N * C), (weight, C), (bias, C)]
    if C <= rms_row_max_c(rec.rt):
        launch(rec, LAYERNORM_ROW, flat_grid(-(-N // RMS_WG)), tensors, s0=N, s1=C, f0=eps)
    else:
        launch(rec, LAYERNORM_WG, flat_grid(N), tensors, s0=N, s1=C, f0=eps)


def layernorm_backward(rec, dx, dy, x, weight, N, C, eps, accumulate=False):
    """dx (N, C) (+= where accumulate) of layernorm_forward from dy, its weight and bias frozen; the rows' mean
    and rstd recomputed from x. Every tensor float32; one invocation per row."""
    _float32("layernorm_backward", dx=dx, dy=dy, x=x)
    if N > 0:
        launch(rec, LAYERNORM_BACKWARD_ROW, flat_grid(-(-N // RMS_WG)), [(dx, N * C), (dy, N * C), (x, N * C),
                                                                       (weight, C)],
               s0=N, s1=C, s2=int(accumulate), f0=eps)


def gelu_forward(rec, y, x, n, erf=False):
    """y = gelu_tanh(x) over n elements (transformers' gelu_pytorch_tanh), or with erf the exact GELU x Phi(x)
    (erf by Abramowitz & Stegun 7.1.26), any storage format each; not in place."""
    if n > 0:
        launch(rec, GELU, flat_grid(-(-n // (2 * WG))), [(y, n), (x, n)], s0=n, s1=int(erf))


def gelu_backward(rec, dx, dy, x, n, erf=False):
    """dx = dy * gelu'(x) over n elements (gelu_forward's, erf likewise), any storage format each; not in place."""
    if n > 0:
        launch(rec, GELU_BACKWARD, flat_grid(-(-n // (2 * WG))), [(dx, n), (dy, n), (x, n)], s0=n, s1=int(erf))
