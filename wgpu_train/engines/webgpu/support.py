"""What the WebGPU engine cannot run yet, as one line: WgpuEngine refuses such a model and backend auto takes the
NumPy engine for it, so the two never disagree."""
from __future__ import annotations

from wgpu_train.engines.webgpu.layers import LayerRecorder
from wgpu_train.engines.webgpu.tuned import attention_kernels
from wgpu_train.engines.webgpu.tuned import short_conv_kernels
from wgpu_train.models.config import ModelConfig


def unsupported_reason(cfg: ModelConfig) -> str | None:
    """Why the WebGPU engine cannot run `cfg` ("the WebGPU engine does not ..."), or None where it can."""
    if LayerRecorder.unrecorded_kinds(cfg):
        return f"the WebGPU engine does not run {cfg.recurrent_kind} layers yet"
    if not attention_kernels.supported_head_dim(cfg.head_dim):
        return (f"the WebGPU attention kernels do not take config.json's field 'head_dim' ({cfg.head_dim}): up to "
                f"{attention_kernels.MAX_HEAD_DIM}, a multiple of 4 above {attention_kernels.ROWS_DMAX}")
    kernels = {"conv_L_cache": cfg.conv_kernel if cfg.conv_layers and any(cfg.conv_layers) else 0,
               "linear_conv_kernel_dim": cfg.linear_attention.conv_kernel if cfg.linear_attention else 0}
    for field, size in kernels.items():
        if size > short_conv_kernels.MAX_K:
            return (f"the WebGPU short-convolution kernels do not take config.json's field '{field}' ({size}): up "
                    f"to {short_conv_kernels.MAX_K}")
    return None
