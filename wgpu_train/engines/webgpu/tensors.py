"""GPU tensors of the engine: row-chunked weight matrices, packed tensor sets, and the linear op pair
over chunked (or float16 / NF4) weights, its activations in any storage format (device/storage.py); packed experts
(NF4, a checkpoint's MXFP4) for the grouped-expert GEMMs."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import quant
from wgpu_train.engines.webgpu.tuned.gemm import gemm, ones
from wgpu_train.engines.shared.quant import StorageDtype, storage_dtype
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
from wgpu_train.engines.webgpu.tuned.moe_packed import mxfp4_bytes, mxfp4_upload, nf4_bytes, nf4_upload
from wgpu_train.formats.mxfp4 import Mxfp4
from wgpu_train.engines.webgpu.device.runtime import Runtime

F32 = 4


class Matrix:
    """A (rows, cols) fp32 weight on the GPU, split by rows into buffers that each fit one binding, as
    quant.chunk_plan plans them (chunks of a multiple of 8 rows, which memory.base_weight_bytes counts)."""

    def __init__(self, rt: Runtime, rows: int, cols: int, label: str, data: np.ndarray | None = None):
        self.rows, self.cols = rows, cols
        self.chunks = []                                   # (buffer, first_row, n_rows)
        for r0, n, nbytes, _ in quant.chunk_plan(rows, cols, "float32", rt.max_binding):
            buf = rt.buffer(nbytes, f"{label}[{r0}:]")
            if data is not None:
                rt.write(buf, np.ascontiguousarray(data[r0:r0 + n], dtype=np.float32))
            self.chunks.append((buf, r0, n))

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def read(self, rt) -> np.ndarray:
        return np.concatenate([rt.read(b, np.float32, (n, self.cols)) for b, _, n in self.chunks])

    def write(self, rt, data):
        for b, r0, n in self.chunks:
            rt.write(b, np.ascontiguousarray(data[r0:r0 + n], dtype=np.float32))


def store_weight(rt: Runtime, name: str, arr: np.ndarray | Mxfp4, base_dtype: StorageDtype | str,
                 embed_dtype: StorageDtype | str):
    """A base tensor on the GPU as the engine holds it (shared/quant.storage_dtype decides): a QuantMatrix
    (16-bit / NF4 storage), a Matrix (2-D float32), a buffer (1-D), or an MoE layer's experts (3-D: store_experts;
    arr an Mxfp4: a checkpoint's packed experts kept so, shared/quant.kept_packed)."""
    packed = "mxfp4" if isinstance(arr, Mxfp4) else ""
    stored = StorageDtype(storage_dtype(name, arr.ndim, base_dtype, embed_dtype, packed))
    if arr.ndim == 3:
        return store_experts(rt, name, arr, stored)
    if stored.rounds:
        return QuantMatrix(rt, arr, stored, name)
    if arr.ndim == 2:
        return Matrix(rt, arr.shape[0], arr.shape[1], name, arr)
    return rt.upload(arr.astype(np.float32), name)


EXPERT_FORMATS = {StorageDtype.FLOAT32: "f32", StorageDtype.BFLOAT16: "bf16", StorageDtype.FLOAT16: "f16"}


def expert_bytes(elements: int, stored: StorageDtype) -> int:
    """Bytes of an MoE layer's expert tensor of that many weights as store_experts holds it."""
    stored = StorageDtype(stored)
    if stored.mxfp4:
        return mxfp4_bytes(elements)
    return nf4_bytes(elements) if stored.nf4 else storage.nbytes(elements, EXPERT_FORMATS[stored])


def store_experts(rt: Runtime, name: str, arr: np.ndarray | Mxfp4, stored: StorageDtype):
    """An MoE layer's expert tensor (E, out, in) as one buffer in its storage format (device/storage.py), or packed
    as NF4 / nf4-dq or MXFP4 (arr an Mxfp4; tuned/moe_packed.py: decoded inside the grouped GEMMs), which the
    grouped-expert kernels bind whole; DeviceError (one line) when it exceeds one storage binding."""
    size = expert_bytes(int(np.prod(arr.shape)), stored)
    if size > rt.max_binding:
        raise DeviceError(f"{name} {tuple(arr.shape)} needs {size / 2**20:.0f} MiB as "
                          f"{stored}, over the device's max storage binding of {rt.max_binding / 2**20:.0f} MiB "
                          f"(the grouped-expert kernels bind each layer's experts whole)")
    if stored.mxfp4:
        return mxfp4_upload(rt, arr, name)
    if stored.nf4:
        return nf4_upload(rt, np.ascontiguousarray(arr, np.float32), stored.double_quant, name)
    return storage.upload(rt, np.ascontiguousarray(arr, np.float32), EXPERT_FORMATS[stored], name)


def weight_buffers(t) -> list:
    """Every GPU buffer of a tensor store_weight made (their sizes are its bytes)."""
    if isinstance(t, QuantMatrix):
        return [b for b, _, _ in t.chunks] + t.absmax
    if isinstance(t, Matrix):
        return [b for b, _, _ in t.chunks]
    return [t]


def linear_forward(rec, y, x, w: Matrix, bias, N, accumulate=False):
    """y (N, out) (+)= x (N, in) @ w.T (+ bias), one GEMM per row chunk of w (columns of y). x and y may be
    16-bit (y rounded once, after the sum; a chunk's columns start at an even offset: chunks are multiples of
    8 rows)."""
    if isinstance(w, QuantMatrix):
        return quant.linear_forward(rec, y, x, w, bias, N, accumulate)
    for buf, r0, n in w.chunks:
        b = (bias, r0) if bias is not None else None
        gemm(rec, at(y, r0), x, buf, N, n, w.cols, "nt", bias=b, accumulate=accumulate, ldc=w.rows)


def linear_backward(rec, dx, dweight, dbias, dy, x, w: Matrix, N, accumulate_dx=False):
    """dx (N, in) (+)= dy @ w; dweight (+)= dy.T @ x and dbias (+)= sum(dy) when given (always accumulated).
    dy, x and dx may be 16-bit, dweight and dbias are float32. A 16-bit dx is rounded once per row chunk of w
    (each chunk's GEMM adds its part of the sum over out into dx): once for a weight of one chunk."""
    if isinstance(w, QuantMatrix):   # a frozen float16 / NF4 weight: only dx
        if dweight is not None or dbias is not None:
            raise ValueError(f"a {w.dtype} base weight is frozen: it has no weight or bias gradient")
        if dx is not None:
            quant.linear_backward(rec, dx, dy, w, N, accumulate_dx)
        return
    for i, (buf, r0, n) in enumerate(w.chunks):
        if dx is not None:
            gemm(rec, dx, at(dy, r0), buf, N, w.cols, n, "nn", lda=w.rows, accumulate=accumulate_dx or i > 0)
        if dweight is not None:
            gemm(rec, dweight.chunks[i][0], at(dy, r0), x, n, w.cols, N, "tn", lda=w.rows, accumulate=True)
    if dbias is not None:
        gemm(rec, dbias, ones(rec.rt, N), dy, 1, w.rows, N, "nn", accumulate=True)


class Packed:
    """Named fp32 tensors stored back to back in one buffer, so that one dispatch can update them all.
    `view(name)` is the (buffer, element offset) operand the kernels take."""

    def __init__(self, rt: Runtime, shapes: dict, label: str):
        self.shapes, self.offsets, n = dict(shapes), {}, 0
        for name, shape in shapes.items():
            self.offsets[name] = n
            n += int(np.prod(shape))
        self.n = n
        self.buf = rt.buffer(max(1, n) * F32, label)

    def view(self, name):
        return (self.buf, self.offsets[name])


def read_tensor(rt: Runtime, t, shape) -> np.ndarray:
    """A tensor (Matrix, buffer, or (buffer, element offset) view) back as an array of `shape`."""
    if isinstance(t, Matrix):
        return t.read(rt)
    if isinstance(t, tuple):
        return rt.read(t[0], np.float32, shape, offset=t[1] * F32)
    return rt.read(t, np.float32, shape)


def write_tensor(rt: Runtime, t, arr):
    """Write arr into a tensor (Matrix, buffer, or (buffer, element offset) view) as float32."""
    if isinstance(t, Matrix):
        t.write(rt, arr)
    elif isinstance(t, tuple):
        rt.write(t[0], np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), t[1] * F32)
    else:
        rt.write(t, np.ascontiguousarray(arr, dtype=np.float32))
