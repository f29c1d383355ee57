"""GEMM on the device: one op, C = alpha op(A) op(B) (+ bias) (+ C), float32 arithmetic, served by kernel
families (gemm_kernels.py) of which tune.py picks one per shape (and storage formats) on each adapter.

Operands: every buffer argument is either a wgpu buffer (the operand starts at element 0) or a pair
`(buffer, element_offset)`, the offset counted in elements of the buffer's storage format, so a slice of a
larger buffer (one layer's weights, a chunk of rows of an embedding matrix bigger than a storage binding) can
be an operand without a copy. Buffers bigger than the device's max storage binding (128 MiB on lavapipe) are
bound as an aligned range (min-storage-buffer-offset-alignment) that covers just the operand, and the rest of
the offset travels in the uniform; the operand itself must fit in one binding.

Matrices are row-major. A, B and C are each float32, bfloat16 or float16, as their buffers' storage formats say
(device/storage.py; activations and their gradients may be 16-bit): a 16-bit C is written two elements (a word)
at a time, so it needs rows of even width, an even ldc, stride_c and offset. bias is float32.
Layout letters follow BLAS: layout[0] is op(A), layout[1] is op(B);
"n" means the operand is stored as used, "t" means it is stored transposed:
    nn: A (M, K), B (K, N)     nt: A (M, K), B (N, K) (x @ W.T)     tn: A (K, M), B (K, N) (dy.T @ x)
    tt: A (K, M), B (N, K)
C is (M, N). lda/ldb/ldc are row pitches in elements (default: packed); stride_a/b/c are the element
distances between consecutive matrices of a batch (default: packed), 0 to reuse one matrix for all.
`c` must live in a different buffer from `a`, `b` and `bias`: WebGPU rejects a dispatch that binds one
buffer both writable and read-only, even at disjoint ranges.

Kernel choice (a dictionary lookup per call once a shape is known; pipelines are cached): tune.choose.

All functions only record dispatches into a Recorder (`rt.recorder()`); nothing is submitted here.
"""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.gemm_kernels import Problem, candidates

_F32 = 4


def ones(rt, n: int):
    """A cached read-only-by-convention buffer holding at least n float32 ones (for bias gradients)."""
    size = 1 << max(6, (int(n) - 1).bit_length())
    return rt.memo(("gemm.ones", size), lambda r: r.upload(np.ones(size, np.float32), "gemm.ones"))


def gemm_problem(rt, c, a, b, M, N, K, layout="nn", alpha=1.0, bias=None, accumulate=False, batch=1,
                 lda=None, ldb=None, ldc=None, stride_a=None, stride_b=None, stride_c=None) -> Problem:
    """The GEMM `gemm` records, as the kernel families see it (strides, offsets, extents)."""
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    layout = layout.lower()
    if layout not in ("nn", "nt", "tn", "tt"):
        raise ValueError(f"gemm: layout must be nn, nt, tn or tt, not {layout!r}")
    if K <= 0:
        raise ValueError("gemm: K must be at least 1")
    ta, tb = layout[0] == "t", layout[1] == "t"
    lda = int(lda if lda is not None else (M if ta else K))
    ldb = int(ldb if ldb is not None else (K if tb else N))
    ldc = int(ldc if ldc is not None else N)
    for name, ld, row in (("lda", lda, M if ta else K), ("ldb", ldb, K if tb else N), ("ldc", ldc, N)):
        if ld < row:
            raise ValueError(f"gemm: {name}={ld} is shorter than a row of its matrix ({row} elements)")
    a_sm, a_sk = (1, lda) if ta else (lda, 1)
    b_sk, b_sn = (1, ldb) if tb else (ldb, 1)
    return Problem(rt, M, N, K, batch, float(alpha), bool(accumulate), layout,
                   a, a_sm, a_sk, int(stride_a if stride_a is not None else M * K),
                   b, b_sk, b_sn, int(stride_b if stride_b is not None else K * N),
                   c, ldc, 1, int(stride_c if stride_c is not None else M * N), bias)


def gemm_dispatches(rt, c, a, b, M, N, K, layout="nn", alpha=1.0, bias=None, accumulate=False, batch=1,
                    lda=None, ldb=None, ldc=None, stride_a=None, stride_b=None, stride_c=None, kernel=None) -> list:
    """[(pipeline, resources, groups)] of one GEMM as `gemm` records it (benchmarks and tests time or run
    them directly); kernel: a candidate name to force (gemm_kernels.candidates), else tune.choose's."""
    p = gemm_problem(rt, c, a, b, M, N, K, layout, alpha, bias, accumulate, batch, lda, ldb, ldc,
                     stride_a, stride_b, stride_c)
    if kernel is None:
        return tune.choose(rt, p).dispatches(p)
    for cand in candidates(p):
        if cand.name == kernel:
            return cand.dispatches(p)
    raise ValueError(f"gemm: no candidate {kernel!r} for {p.describe()}")


def gemm(rec, c, a, b, M, N, K, layout="nn", alpha=1.0, bias=None, accumulate=False, batch=1,
         lda=None, ldb=None, ldc=None, stride_a=None, stride_b=None, stride_c=None):
    """Record C[z] = alpha * op(A[z]) @ op(B[z]) (+ bias[None, :]) (+ C[z] if accumulate), z < batch.

    c, a, b, bias: buffers or (buffer, element_offset) pairs; bias has N elements and is shared by
    every row and every batch. See the module docstring for layouts, pitches and batch strides.
    """
    if min(M, N, batch) <= 0:
        return
    for d in gemm_dispatches(rec.rt, c, a, b, M, N, K, layout, alpha, bias, accumulate, batch,
                             lda, ldb, ldc, stride_a, stride_b, stride_c):
        rec.dispatch(*d)
