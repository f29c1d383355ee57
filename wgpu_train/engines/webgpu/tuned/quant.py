"""Frozen base weights stored as bfloat16, float16 or 4-bit NF4 on the GPU (QuantMatrix), and the GEMMs that read
them and accumulate in f32 (shaders/gemm_quant.wgsl): the forward x @ W.T ("nt") and the backward
dy @ W ("nn"); a frozen weight never needs its own gradient. Also the f16 embedding gather.

Storage (chunk_plan sizes every buffer; memory.py counts bytes with the same function):
- bfloat16 / float16: the values (2 bytes each), row chunks of a multiple of 8 rows that fit one storage
  binding; the shaders read them as u32 words of two and decode them with a shift (bfloat16) or
  unpack2x16float (float16), so no adapter needs shader-f16;
- nf4: engines/shared/quant.py's bitsandbytes layout of the whole flattened weight (64-element blocks, the last
  padded; first element of a pair in the high nibble), viewed as u32 words, plus one f32 absmax per block.
  A chunk starts at a block boundary (its first row times cols is a multiple of 64), so each chunk is a
  contiguous slice of the blocks and the GPU holds exactly the bytes of the reference quantisation;
- nf4-dq: the same codes; the absmax values double-quantised (engines/shared/quant.py's DoubleQuant). Each chunk's
  second buffer holds, as u32 words: the offset (f32), the chunk's first block modulo 256, the word where
  its 8-bit indices start, a spare word, the f32 second-level absmax of every 256-block group the chunk
  touches, then the 8-bit index of each of its blocks, four per word. The 256-value code table is the
  same for every weight: one read-only storage buffer (runtime.shared_storage). Not a uniform buffer:
  each invocation indexes it with its own block's code, which GPUs serve from a constant cache one
  address at a time.
Operands a, c and bias are buffers or (buffer, element_offset) pairs, as in gemm.py. The activations (a and c:
x and y forward, dy and dx backward; the embedding's out) may be stored as bfloat16 or float16 (device/storage.py,
each its own format), the kernels specialised for them at launch; 16-bit outputs are written by pairs, so they need
even element offsets and row pitches. Bias and weights stay as stored.
"""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.shared.quant import (DQ_BLOCK, NF4_BLOCK, StorageDtype, bfloat16_bits, bfloat16_values,
                                            float16_values, nf4_dequantize, nf4_quantize)
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.launch import launch
from wgpu_train.engines.webgpu.device.operands import at, split
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem
from wgpu_train.engines.webgpu.tuned.quant_source import FORMATS, embed_gather_kernel

DQ_HEADER_WORDS = 4                  # offset, first block % 256, index word, spare
NF4_BLOCK_BYTES = NF4_BLOCK // 2
DEFAULT_MAX_BINDING = 128 << 20      # lavapipe's max storage binding (and WebGPU's default limit)
_F32 = 4


def _round16(n: int) -> int:
    return (int(n) + 15) // 16 * 16


def _nf4_blocks(elements: int) -> int:
    return -(-int(elements) // NF4_BLOCK)


def _dq_groups(b0: int, blocks: int) -> int:
    """How many 256-block groups of second-level absmax values blocks b0 .. b0 + blocks - 1 touch."""
    return (b0 + blocks - 1) // DQ_BLOCK - b0 // DQ_BLOCK + 1


def _dq_stats(dq, b0: int, b1: int) -> np.ndarray:
    """The stats words (uint32) of the chunk holding blocks b0 .. b1 - 1 of a DoubleQuant (layout above)."""
    g0, g1 = b0 // DQ_BLOCK, (b1 - 1) // DQ_BLOCK + 1
    index_word = DQ_HEADER_WORDS + g1 - g0
    head = np.zeros(DQ_HEADER_WORDS, np.uint32)
    head[0] = np.float32(dq.offset).view(np.uint32)
    head[1], head[2] = b0 % DQ_BLOCK, index_word
    q = np.zeros(-(-(b1 - b0) // 4) * 4, np.uint8)
    q[:b1 - b0] = dq.q[b0:b1]
    return np.concatenate([head, dq.absmax2[g0:g1].view(np.uint32), q.view(np.uint32)])


def _dq_absmax(words: np.ndarray, code: np.ndarray, blocks: int) -> np.ndarray:
    """The float32 absmax values of a chunk's `blocks` blocks from its stats words and the code table, as
    the shader and engines/shared/quant.py's dequantize_absmax rebuild them."""
    offset = words[0:1].view(np.float32)[0]
    phase, index_word = int(words[1]), int(words[2])
    absmax2 = words[DQ_HEADER_WORDS:index_word].view(np.float32)
    q = words[index_word:].view(np.uint8)[:blocks]
    scale = code[q] * absmax2[(phase + np.arange(blocks)) // DQ_BLOCK]
    return (scale.astype(np.float32) + offset).astype(np.float32)


def chunk_plan(rows: int, cols: int, dtype: StorageDtype | str, max_binding: int = DEFAULT_MAX_BINDING) -> list:
    """(first_row, n_rows, weight_bytes, absmax_bytes) of each buffer pair a (rows, cols) weight stored as
    `dtype` occupies on the GPU (float32: tensors.Matrix's chunks; the others: QuantMatrix's). Chunks start
    on a multiple of 8 rows, so that the GEMMs' column offsets into y and dy keep the vec4 paths; NF4 ones
    also on a block boundary."""
    dtype = StorageDtype(dtype)
    if dtype is StorageDtype.FLOAT32:
        unit, fit = 8, max_binding // (cols * _F32)
    elif dtype.sixteen_bit:
        unit, fit = 8, max_binding // (cols * 2)
    elif dtype.nf4:
        unit = math.lcm(8, NF4_BLOCK // math.gcd(cols, NF4_BLOCK))
        fit = (max_binding // NF4_BLOCK_BYTES) * NF4_BLOCK // cols
    else:
        raise ValueError(f"unknown weight dtype {dtype!r}")
    per = rows if rows <= fit else fit // unit * unit
    if per < 1:
        raise DeviceError(f"a {dtype} weight with rows of {cols} elements cannot be split into chunks that fit "
                          f"the device's max storage binding of {max_binding} bytes")
    out = []
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        if dtype is StorageDtype.FLOAT32:
            out.append((r0, n, n * cols * _F32, 0))
            continue
        if dtype.sixteen_bit:
            out.append((r0, n, _round16(n * cols * 2), 0))
            continue
        blocks = _nf4_blocks(n * cols)
        if not dtype.double_quant:
            stats = blocks * _F32
        else:
            b0 = r0 * cols // NF4_BLOCK
            stats = (DQ_HEADER_WORDS + _dq_groups(b0, blocks)) * _F32 + blocks
        out.append((r0, n, _round16(blocks * NF4_BLOCK_BYTES), _round16(stats)))
    return out


def stored_bytes(rows: int, cols: int, dtype: StorageDtype | str, max_binding: int = DEFAULT_MAX_BINDING) -> int:
    """GPU bytes of a (rows, cols) weight stored as dtype."""
    return sum(w + s for _, _, w, s in chunk_plan(rows, cols, dtype, max_binding))


class QuantMatrix:
    """A frozen (rows, cols) weight stored as bfloat16, float16 or NF4 on the GPU, in row chunks that each fit one
    storage binding. Attributes as tensors.Matrix: rows, cols, chunks [(buffer, first_row, n_rows)], size,
    read(rt); plus dtype, absmax (NF4: one f32 absmax buffer per chunk) and nbytes (all its buffers)."""

    def __init__(self, rt, data: np.ndarray, dtype: StorageDtype | str, label: str = ""):
        dtype = StorageDtype(dtype)
        if not (dtype.sixteen_bit or dtype.nf4):
            raise ValueError(f"QuantMatrix dtype must be one of {FORMATS}, got {dtype!r}")
        data = np.asarray(data, dtype=np.float32)
        self.rows, self.cols = data.shape
        self.dtype = dtype
        self.chunks: list = []     # (buffer, first_row, n_rows)
        self.absmax: list = []     # nf4: f32 absmax of the chunk's blocks; nf4-dq: the chunk's stats words
        self.code = self.code_buffer = None    # nf4-dq: the 8-bit code table (256,) and its shared buffer
        self.nbytes = 0
        if dtype.nf4:
            packed, absmax = nf4_quantize(data, double_quant=dtype.double_quant)
        if dtype.double_quant:
            self.code = absmax.code
            self.code_buffer = rt.shared_storage(self.code)
        for r0, n, wbytes, sbytes in chunk_plan(self.rows, self.cols, dtype, rt.max_binding):
            buf = rt.buffer(wbytes, f"{label}[{r0}:] {dtype}")
            if dtype is StorageDtype.FLOAT16:
                rt.write(buf, float16_values(data[r0:r0 + n], label or "a weight").reshape(-1))
            elif dtype is StorageDtype.BFLOAT16:
                rt.write(buf, bfloat16_bits(data[r0:r0 + n]).reshape(-1))
            else:
                b0, b1 = r0 * self.cols // NF4_BLOCK, _nf4_blocks((r0 + n) * self.cols)
                rt.write(buf, packed[b0 * NF4_BLOCK_BYTES:b1 * NF4_BLOCK_BYTES])
                sbuf = rt.buffer(sbytes, f"{label}[{r0}:] absmax")
                rt.write(sbuf, _dq_stats(absmax, b0, b1) if dtype.double_quant else absmax[b0:b1])
                self.absmax.append(sbuf)
            self.chunks.append((buf, r0, n))
            self.nbytes += wbytes + sbytes

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def read(self, rt) -> np.ndarray:
        """The dequantised float32 weight (rows, cols), from the bytes on the device."""
        if self.dtype is StorageDtype.FLOAT16:
            parts = [rt.read(b, np.float16, (n, self.cols)) for b, _, n in self.chunks]
            return np.concatenate(parts).astype(np.float32)
        if self.dtype is StorageDtype.BFLOAT16:
            return bfloat16_values(np.concatenate([rt.read(b, np.uint16, (n, self.cols)) for b, _, n in self.chunks]))
        packed, absmax = [], []
        for (b, r0, n), s in zip(self.chunks, self.absmax):
            blocks = _nf4_blocks((r0 + n) * self.cols) - r0 * self.cols // NF4_BLOCK
            packed.append(rt.read(b, np.uint8, (blocks * NF4_BLOCK_BYTES,)))
            if not self.dtype.double_quant:
                absmax.append(rt.read(s, np.float32, (blocks,)))
            else:
                absmax.append(_dq_absmax(rt.read(s, np.uint32), self.code, blocks))
        return nf4_dequantize(np.concatenate(packed), np.concatenate(absmax), (self.rows, self.cols))

    def release(self, rt):
        rt.release(*[b for b, _, _ in self.chunks], *self.absmax)


# ---- the GEMM with a frozen weight ----------------------------------------------------------------

def qgemm(rec, c, a, w: QuantMatrix, chunk: int, layout: str, M: int, bias=None, accumulate=False, lda=None,
          ldc=None):
    """Record C (M, N) (+)= A (M, K) @ op(W chunk) (+ bias (N,)) with the kernel tune.choose picks: layout "nt"
    (op = transpose: K = w.cols, N = the chunk's rows) or "nn" (K = the chunk's rows, N = w.cols)."""
    if M <= 0:
        return
    p = QProblem(rec.rt, c, a, w, chunk, layout, M, bias, accumulate, lda, ldc)
    for d in tune.choose(rec.rt, p).dispatches(p):
        rec.dispatch(*d)


# ---- the linear op pair with a frozen quantised weight ---------------------------------------------

def linear_forward(rec, y, x, w: QuantMatrix, bias, N, accumulate=False):
    """y (N, out) (+)= x (N, in) @ w.T (+ bias), one GEMM per row chunk of w (columns of y)."""
    for i, (_, r0, _) in enumerate(w.chunks):
        qgemm(rec, at(y, r0), x, w, i, "nt", N, bias=at(bias, r0) if bias is not None else None,
              accumulate=accumulate, ldc=w.rows)


def linear_backward(rec, dx, dy, w: QuantMatrix, N, accumulate_dx=False):
    """dx (N, in) (+)= dy (N, out) @ w: the input gradient only (the weight is frozen)."""
    for i, (_, r0, _) in enumerate(w.chunks):
        qgemm(rec, dx, at(dy, r0), w, i, "nn", N, lda=w.rows, accumulate=accumulate_dx or i > 0)


def embedding_forward(rec, out, ids, w: QuantMatrix, n: int):
    """out (n, cols) = w[ids] for a 16-bit embedding, one dispatch per vocabulary chunk; out in any storage format
    (16-bit: an even offset and cols)."""
    if not w.dtype.sixteen_bit:
        raise ValueError(f"embeddings are stored as float32, bfloat16 or float16, not {w.dtype}")
    buf, off = split(out)
    if storage.format_of(buf) != "f32" and (off % 2 or w.cols % 2):
        raise ValueError(f"a {storage.format_of(buf)} embedding output is stored by pairs: its offset {off} and "
                         f"width {w.cols} must be even")
    groups = -(-(n * w.cols) // 128)           # an invocation per pair of out's elements
    gx = min(groups, 65535)
    for buf, r0, rows in w.chunks:
        launch(rec, embed_gather_kernel(w.dtype), (gx, -(-groups // gx), 1), [(ids, n), (buf, buf.size // _F32), (out, n * w.cols)],
               M=n, cols=w.cols, row0=r0, rows=rows)
