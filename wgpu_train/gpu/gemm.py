"""fp32 GEMM on the device (shaders/gemm.wgsl) and the linear and LoRA op pairs built on it.

Operands: every buffer argument is either a wgpu buffer (the operand starts at element 0) or a pair
`(buffer, element_offset)`, the offset counted in fp32 elements, so a slice of a larger buffer (one
layer's weights, a chunk of rows of an embedding matrix bigger than a storage binding) can be an operand
without a copy. Buffers bigger than the device's max storage binding (128 MiB on lavapipe) are bound as
an aligned range (min-storage-buffer-offset-alignment) that covers just the operand, and the rest of the
offset travels in the uniform; the operand itself must fit in one binding.

Matrices are row-major fp32. Layout letters follow BLAS: layout[0] is op(A), layout[1] is op(B);
"n" means the operand is stored as used, "t" means it is stored transposed:
    nn: A (M, K), B (K, N)     nt: A (M, K), B (N, K) (x @ W.T)     tn: A (K, M), B (K, N) (dy.T @ x)
    tt: A (K, M), B (N, K)
C is (M, N). lda/ldb/ldc are row pitches in elements (default: packed); stride_a/b/c are the element
distances between consecutive matrices of a batch (default: packed), 0 to reuse one matrix for all.
`c` must live in a different buffer from `a`, `b` and `bias`: WebGPU rejects a dispatch that binds one
buffer both writable and read-only, even at disjoint ranges.

Kernel choice (a few microseconds per call; pipelines are cached): see shaders/gemm.wgsl. The vec4 kernels need each matrix
contiguous and 4-aligned along one of its dimensions (size, pitch, offset and batch stride multiples of
4); everything else runs the scalar kernels, which take any strides. The *_sg kernels need the
subgroup feature with subgroups of at least 8 lanes (probed once per device).

All functions only record dispatches into a Recorder (`rt.recorder()`); nothing is submitted here.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from ..errors import DeviceError
from .operands import split

SHADER = "gemm"
TM = 32                    # rows of C per workgroup (shaders/gemm.wgsl), TM_CHOICES for skinny products
TM_CHOICES = (8, 32)
TN = 8                     # columns of C per invocation
WG_CHOICES = (8, 16, 32, 64)
_SG_MARKER = "// ---- subgroup kernels"
_PARAMS = struct.Struct("<19If")
_F32 = 4

_device_cache: dict = {}   # id(runtime) -> {"subgroup_size", "subgroups", "min_wg"}
_portable_src: list = []   # gemm.wgsl without its subgroup section (read once)
_ones_cache: dict = {}     # (id(runtime), n) -> buffer of n ones

_PROBE_SRC = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(32)
fn probe(@builtin(subgroup_size) size: u32, @builtin(local_invocation_index) i: u32) {
    if (i == 0u) { out[0] = size; }
}
"""


# ---- kernel choice ----------------------------------------------------------------------------

def _probe_subgroup_size(rt) -> int:
    if "subgroup" not in rt.features:
        return 0
    buf = rt.buffer(4, "gemm.probe")
    rec = rt.recorder()
    rec.dispatch(rt.pipeline("gemm_probe", "probe", source=_PROBE_SRC), [buf], (1,))
    rec.submit()
    size = int(rt.read(buf, np.uint32, (1,))[0])
    rt.release(buf)
    return size


def _device(rt) -> dict:
    """What the kernel choice needs to know about a device, probed once per runtime."""
    info = _device_cache.get(id(rt))
    if info is None:
        size = _probe_subgroup_size(rt)
        use = size >= 8 and os.environ.get("WGPU_TRAIN_GEMM_SUBGROUPS", "1") != "0"
        if use:
            min_wg = max(8, size)
        else:  # a GPU runs whole (>= 32-wide) waves anyway; llvmpipe's SIMD is 8 lanes wide
            min_wg = 8 if rt.info.adapter_type == "CPU" else 32
        info = _device_cache[id(rt)] = {"subgroup_size": size, "subgroups": use, "min_wg": min_wg}
    return info


def subgroup_size(rt) -> int:
    """The device's subgroup size as a compute shader sees it (0 without the subgroup feature)."""
    return _device(rt)["subgroup_size"]


def use_subgroups(rt) -> bool:
    """Whether the *_sg kernels run on this device: they need the subgroup feature and subgroups of at
    least 8 lanes. WGPU_TRAIN_GEMM_SUBGROUPS=0 (read once per device) forces the portable kernels."""
    return _device(rt)["subgroups"]


def min_workgroup(rt) -> int:
    """The narrowest workgroup worth using: one full subgroup (8 lanes on llvmpipe); without subgroups,
    8 on CPU adapters and 32 elsewhere."""
    return _device(rt)["min_wg"]


def _pipeline(rt, wg: int, tm: int, subgroups: bool, vec=None):
    """The pipeline for one kernel: `vec` None for the scalar kernel, else (a_kvec, b_nvec, c_nvec)."""
    entry = ("gemm_v4" if vec else "gemm") + ("_sg" if subgroups else "")
    constants = {"WG": wg, "TM": tm}
    if vec:
        constants.update(A_KVEC=bool(vec[0]), B_NVEC=bool(vec[1]), C_NVEC=bool(vec[2]))
    if subgroups:
        return rt.pipeline(SHADER, entry, constants)
    if not _portable_src:
        from .runtime import shader_path
        text = shader_path(SHADER).read_text()
        _portable_src.append(text[:text.index(_SG_MARKER)])
    return rt.pipeline(SHADER, entry, constants, source=_portable_src[0])


def vec4_modes(M, N, K, batch, a_off, a_sm, a_sk, a_sz, b_off, b_sk, b_sn, b_sz, c_off, c_sm, c_sn, c_sz):
    """(a_kvec, b_nvec, c_nvec) when all three matrices can be accessed as aligned vec4s (op(A) along
    k or m, op(B) along n or k, C along n or m), else None (the scalar kernel)."""
    def ok(vec_len, pitch, off, sz):
        return vec_len % 4 == 0 and pitch % 4 == 0 and off % 4 == 0 and (batch == 1 or sz % 4 == 0)

    def mode(s_first, len_first, s_second, len_second, off, sz):
        """True: vec4s along the first axis (stride 1 there); False: along the second; None: neither."""
        if s_first == 1 and ok(len_first, s_second, off, sz):
            return True
        if s_second == 1 and ok(len_second, s_first, off, sz):
            return False
        return None

    modes = (mode(a_sk, K, a_sm, M, a_off, a_sz), mode(b_sn, N, b_sk, K, b_off, b_sz),
             mode(c_sn, N, c_sm, M, c_off, c_sz))
    return None if None in modes else modes


L2_PANEL_BYTES = 256 * 1024   # the slice of B one workgroup streams should stay in a core's L2 (llvmpipe)


def choose_tiling(M: int, N: int, K: int = 1, batch: int = 1, min_wg: int = 8, b_along_k=(False, False)):
    """(swap, wg, tm): whether to compute C^T = op(B)^T op(A)^T instead, the workgroup size (8 * wg
    columns) and the rows per workgroup (32, or 8 for products with a side of at most 8, e.g. a rank).

    Workgroups are numbered row tile first, so consecutive workgroups (run at the same time on the
    cores of a CPU adapter) stream the same K x 8*wg panel of B, each invocation its own columns.
    b_along_k[swap] says whether that operand (op(B), or op(A)^T when swapped) is contiguous along k:
    such streams are sequential; the other order reads 4 rows a step, which costs little while the
    panel stays in L2 and halves the speed once it does not.

    Cost: the padded work (so a skinny product is not padded to a wide tile of columns), a row of an
    8-row tile counting sqrt(4) = 2 (it shares each load of B over fewer FMAs), times 1.2 for a B not
    along k, 2 if its panel is also over L2_PANEL_BYTES. Ties go to more workgroups, up to 16 (to feed
    every core), then no swap (C rows stay contiguous), then the widest workgroup (fewer, larger tasks)."""
    best = None
    for swap in (False, True):
        m, n = (N, M) if swap else (M, N)
        for tm in TM_CHOICES:
            for wg in WG_CHOICES:
                if wg < min_wg and wg != WG_CHOICES[-1]:
                    continue
                tiles_m, tiles_n = -(-m // tm), -(-n // (TN * wg))
                cost = tiles_m * tm * tiles_n * TN * wg * (TM // tm) ** 0.5
                if not b_along_k[swap]:
                    cost *= 1.2 if K * TN * wg * 4 <= L2_PANEL_BYTES else 2.0
                key = (cost, -min(tiles_m * tiles_n * batch, 16), swap, -tm, -wg)
                if best is None or key < best[0]:
                    best = (key, swap, wg, tm)
    return best[1:]


# ---- operands ---------------------------------------------------------------------------------

def _bind(rt, operand, extent: int, what: str):
    """(binding resource, element offset inside it) for an operand whose elements lie in
    [offset, offset + extent) of its buffer."""
    buf, off = split(operand)
    end = (off + extent) * _F32
    if off < 0 or end > buf.size:
        raise ValueError(f"gemm: {what} needs elements [{off}, {off + extent}) "
                         f"but its buffer holds {buf.size // _F32}")
    if buf.size <= rt.max_binding:
        return buf, off
    align = int(rt.adapter.limits.get("min-storage-buffer-offset-alignment", 256))
    start = (off * _F32) // align * align
    size = (end - start + 3) // 4 * 4
    if size > rt.max_binding:
        raise DeviceError(f"gemm: {what} spans {size} bytes, over this device's max storage binding "
                          f"of {rt.max_binding}")
    return (buf, start, size), off - start // _F32


def _extent(batch, stride, rows, row_pitch, cols, col_pitch):
    """Number of elements from the first to the last one touched, inclusive."""
    return (batch - 1) * stride + (rows - 1) * row_pitch + (cols - 1) * col_pitch + 1


def ones(rt, n: int):
    """A cached read-only-by-convention buffer holding at least n fp32 ones (for bias gradients)."""
    size = 1 << max(6, (int(n) - 1).bit_length())
    key = (id(rt), size)
    if key not in _ones_cache:
        _ones_cache[key] = rt.upload(np.ones(size, np.float32), "gemm.ones")
    return _ones_cache[key]


# ---- GEMM -------------------------------------------------------------------------------------

def gemm_dispatch(rt, c, a, b, M, N, K, layout="nn", alpha=1.0, bias=None, accumulate=False, batch=1,
                  lda=None, ldb=None, ldc=None, stride_a=None, stride_b=None, stride_c=None,
                  subgroups=None, vec4=True):
    """(pipeline, resources, groups) for one GEMM, as `gemm` records it (benchmarks time it directly).
    subgroups (None: the device's choice) and vec4=False force a kernel, for tests and benchmarks."""
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    layout = layout.lower()
    if layout not in ("nn", "nt", "tn", "tt"):
        raise ValueError(f"gemm: layout must be nn, nt, tn or tt, not {layout!r}")
    ta, tb = layout[0] == "t", layout[1] == "t"
    lda = int(lda if lda is not None else (M if ta else K))
    ldb = int(ldb if ldb is not None else (K if tb else N))
    ldc = int(ldc if ldc is not None else N)
    stride_a = int(stride_a if stride_a is not None else M * K)
    stride_b = int(stride_b if stride_b is not None else K * N)
    stride_c = int(stride_c if stride_c is not None else M * N)
    for name, ld, row in (("lda", lda, M if ta else K), ("ldb", ldb, K if tb else N), ("ldc", ldc, N)):
        if ld < row:
            raise ValueError(f"gemm: {name}={ld} is shorter than a row of its matrix ({row} elements)")
    # element strides of op(A) as (m, k), op(B) as (k, n), C as (m, n)
    a_sm, a_sk = (1, lda) if ta else (lda, 1)
    b_sk, b_sn = (1, ldb) if tb else (ldb, 1)
    c_sm, c_sn = ldc, 1
    bias_sm, bias_sn = 0, 1

    a_res, a_off = _bind(rt, a, _extent(batch, stride_a, M, a_sm, K, a_sk), "A")
    b_res, b_off = _bind(rt, b, _extent(batch, stride_b, K, b_sk, N, b_sn), "B")
    c_res, c_off = _bind(rt, c, _extent(batch, stride_c, M, c_sm, N, c_sn), "C")
    if bias is not None:
        bias_res, bias_off = _bind(rt, bias, N, "bias")
    else:
        bias_res, bias_off = a_res, 0

    swap, wg, tm = choose_tiling(M, N, K, batch, min_workgroup(rt), (b_sk == 1, a_sk == 1))
    if swap:  # C^T (N, M) = op(B)^T (N, K) @ op(A)^T (K, M)
        M, N = N, M
        a_res, b_res = b_res, a_res
        a_off, b_off = b_off, a_off
        stride_a, stride_b = stride_b, stride_a
        a_sm, a_sk, b_sk, b_sn = b_sn, b_sk, a_sk, a_sm
        c_sm, c_sn = c_sn, c_sm
        bias_sm, bias_sn = bias_sn, bias_sm

    flags = (1 if accumulate else 0) | (2 if bias is not None else 0)
    params = rt.uniform(_PARAMS.format, M, N, K, flags,
                        a_off, a_sm, a_sk, stride_a, b_off, b_sk, b_sn, stride_b,
                        c_off, c_sm, c_sn, stride_c, bias_off, bias_sm, bias_sn, float(alpha))
    sg = use_subgroups(rt) if subgroups is None else subgroups
    vec = (vec4_modes(M, N, K, batch, a_off, a_sm, a_sk, stride_a, b_off, b_sk, b_sn, stride_b,
                      c_off, c_sm, c_sn, stride_c) if vec4 else None)
    pipeline = _pipeline(rt, wg, tm, sg, vec)
    groups = (-(-M // tm), -(-N // (TN * wg)), batch)
    return pipeline, [params, a_res, b_res, bias_res, c_res], groups


def gemm(rec, c, a, b, M, N, K, layout="nn", alpha=1.0, bias=None, accumulate=False, batch=1,
         lda=None, ldb=None, ldc=None, stride_a=None, stride_b=None, stride_c=None):
    """Record C[z] = alpha * op(A[z]) @ op(B[z]) (+ bias[None, :]) (+ C[z] if accumulate), z < batch.

    c, a, b, bias: buffers or (buffer, element_offset) pairs; bias has N elements and is shared by
    every row and every batch. See the module docstring for layouts, pitches and batch strides.
    """
    if min(M, N, batch) <= 0:
        return
    if K <= 0:
        raise ValueError("gemm: K must be at least 1")
    pipeline, resources, groups = gemm_dispatch(rec.rt, c, a, b, M, N, K, layout, alpha, bias, accumulate, batch,
                                                lda, ldb, ldc, stride_a, stride_b, stride_c)
    rec.dispatch(pipeline, resources, groups)


# ---- linear (x @ W.T + b) ---------------------------------------------------------------------

def linear_forward(rec, y, x, weight, bias, N, in_features, out_features):
    """y (N, out) = x (N, in) @ weight (out, in).T (+ bias (out,)); bias may be None."""
    gemm(rec, y, x, weight, N, out_features, in_features, "nt", bias=bias)


def linear_backward(rec, dx, dweight, dbias, dy, x, weight, N, in_features, out_features,
                    accumulate_dx=False, accumulate_grads=False):
    """Gradients of linear_forward from dy (N, out):
    dx (N, in) = dy @ weight (added to dx when accumulate_dx, so LoRA and base contributions sum);
    dweight (out, in) = dy.T @ x and dbias (out,) = dy summed over rows, each skipped when None
    (added to what they hold when accumulate_grads). dx may be None too (e.g. for the first layer)."""
    if dx is not None:
        gemm(rec, dx, dy, weight, N, in_features, out_features, "nn", accumulate=accumulate_dx)
    if dweight is not None:
        gemm(rec, dweight, dy, x, out_features, in_features, N, "tn", accumulate=accumulate_grads)
    if dbias is not None:  # (1, N) ones @ dy (N, out)
        gemm(rec, dbias, ones(rec.rt, N), dy, 1, out_features, N, "nn", accumulate=accumulate_grads)


# ---- LoRA: y += scale * (x A^T) B^T -----------------------------------------------------------

def lora_a_forward(rec, h, x, lora_a, N, in_features, r):
    """h (N, r) = x (N, in) @ lora_a (r, in).T: the half of lora_forward whose result the backward needs
    (gradient checkpointing recomputes only this where the module's output is not needed again)."""
    gemm(rec, h, x, lora_a, N, r, in_features, "nt")


def lora_forward(rec, y, h, x, lora_a, lora_b, scale, N, in_features, out_features, r):
    """h (N, r) = x (N, in) @ lora_a (r, in).T, saved for the backward; then
    y (N, out) += scale * h @ lora_b (out, r).T, on top of the base layer's output already in y."""
    lora_a_forward(rec, h, x, lora_a, N, in_features, r)
    gemm(rec, y, h, lora_b, N, out_features, r, "nt", alpha=scale, accumulate=True)


def lora_backward(rec, dx, dlora_a, dlora_b, dy, x, h, lora_a, lora_b, scale, N, in_features, out_features, r,
                  dh, accumulate_grads=False):
    """Gradients of lora_forward from dy (N, out), with dh (N, r) a scratch buffer:
    dlora_b (out, r) = scale * dy.T @ h;  dh = scale * dy @ lora_b;  dlora_a (r, in) = dh.T @ x;
    dx (N, in) += dh @ lora_a (always added: the base layer's dx is already there).
    With accumulate_grads the two weight gradients are added to what they hold (gradient accumulation).
    dx may be None when the input needs no gradient."""
    gemm(rec, dlora_b, dy, h, out_features, r, N, "tn", alpha=scale, accumulate=accumulate_grads)
    gemm(rec, dh, dy, lora_b, N, r, out_features, "nn", alpha=scale)
    gemm(rec, dlora_a, dh, x, r, in_features, N, "tn", accumulate=accumulate_grads)
    if dx is not None:
        gemm(rec, dx, dh, lora_a, N, in_features, r, "nn", accumulate=True)
