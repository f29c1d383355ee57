"""What the tuned kernel families ask of an adapter: its subgroup size as a shader sees it (probed once per
device by a one-workgroup kernel, which the gemm family lists among its kernels), whether the subgroup register
GEMMs run, the narrowest workgroup worth using, whether it is a CPU, and whether float16 arithmetic may run."""
from __future__ import annotations

import os

import numpy as np

from wgpu_train.engines.webgpu.device.launch import Kernel, prepare

_PROBE_SRC = """
struct Params { lane: u32 };
@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(32)
fn probe(@builtin(subgroup_size) size: u32, @builtin(local_invocation_index) i: u32) {
    if (i == P.lane) { out[0] = size; }
}
"""


def _probe_source() -> str:
    return _PROBE_SRC


SUBGROUP_PROBE = Kernel("gemm_probe", "probe", "out!", source=(_probe_source,), invocations=32, features=("subgroup",))


def _probe(rt) -> dict:
    size = 0
    if "subgroup" in rt.features:
        buf = rt.buffer(4, "gemm.probe")
        rec = rt.recorder()
        rec.dispatch(*prepare(rt, SUBGROUP_PROBE, [(buf, 1)]), (1,))
        rec.submit()
        size = int(rt.read(buf, np.uint32, (1,))[0])
        rt.release(buf)
    use = size >= 8 and os.environ.get("WGPU_TRAIN_GEMM_SUBGROUPS", "1") != "0"
    if use:
        min_wg = max(8, size)
    else:  # a GPU runs whole (>= 32-wide) waves anyway; llvmpipe's SIMD is 8 lanes wide
        min_wg = 8 if rt.info.adapter_type == "CPU" else 32
    return {"subgroup_size": size, "subgroups": use, "min_wg": min_wg}


def _device(rt) -> dict:
    return rt.memo("gemm.device", _probe)


def subgroup_size(rt) -> int:
    """The device's subgroup size as a compute shader sees it (0 without the subgroup feature)."""
    return _device(rt)["subgroup_size"]


def use_subgroups(rt) -> bool:
    """Whether the *_sg register kernels run on this device: they need the subgroup feature and subgroups
    of at least 8 lanes. WGPU_TRAIN_GEMM_SUBGROUPS=0 (read once per device) forces the portable kernels."""
    return _device(rt)["subgroups"]


def min_workgroup(rt) -> int:
    """The narrowest workgroup worth using: one full subgroup (8 lanes on llvmpipe); without subgroups,
    8 on CPU adapters and 32 elsewhere."""
    return _device(rt)["min_wg"]


def is_cpu(rt) -> bool:
    return rt.info.adapter_type == "CPU"


def f16_arithmetic(rt) -> bool:
    """Whether float16-arithmetic candidates may run on this device: it has `shader-f16` and
    WGPU_TRAIN_F16_ARITHMETIC is not 0."""
    return "shader-f16" in rt.features and os.environ.get("WGPU_TRAIN_F16_ARITHMETIC", "1").strip() != "0"


def f16_operands(rt, *formats) -> bool:
    """Whether a GEMM whose operands are stored in `formats` gets float16-arithmetic candidates: all float16, on
    a device that may run them (f16_arithmetic)."""
    return all(f == "f16" for f in formats) and f16_arithmetic(rt)
