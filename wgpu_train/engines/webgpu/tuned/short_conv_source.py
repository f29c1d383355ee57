"""The short convolution's source builder (shaders/short_conv.wgsl): the kernel size K, positions per invocation
TILE and invocations per workgroup WG, each a constant of one builder (the activation is a launch parameter)."""
from __future__ import annotations

import functools

from wgpu_train.engines.webgpu.device.shaders import shader_text


@functools.lru_cache(maxsize=None)
def source(k: int, tile: int, wg: int) -> str:
    """shaders/short_conv.wgsl for kernel size k, `tile` positions per forward / dx invocation and `wg`
    invocations per workgroup (a Kernel's source: launch expands its tensor markers for the storage formats)."""
    consts = dict(K=k, TILE=tile, WG=wg)
    return "".join(f"const {name}: u32 = {v}u;\n" for name, v in consts.items()) + shader_text("short_conv")
