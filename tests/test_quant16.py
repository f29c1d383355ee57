"""16-bit activations through the frozen-weight GEMMs and the quantised embedding (shaders/gemm_quant.wgsl,
gemm_quant_tiled.wgsl): A (x or dy) and C (y or dx) in bfloat16, float16 or float32, in any mix, against float64
NumPy on the same rounded inputs with C rounded once, for each weight format, layout (nt: the forward, nn: the
backward) and kernel; C's neighbours untouched; the linear op pair over row chunks with accumulation; the embedding
gather into 16-bit rows; the tuner's check of a 16-bit product."""
from __future__ import annotations

import numpy as np
import pytest

from wgpu_train.engines.shared import quant as R
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.tuned import quant as Q
from wgpu_train.engines.webgpu.tuned import quant_kernels as QK
from wgpu_train.engines.webgpu.tuned import quant_source as QT
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.gemm_kernels import use_subgroups

from limits import max_binding
from tolerances import assert_close

# (A's format, C's format), taken in turn by the cases: same-format pairs, mixed ones, and float32 on one side
ACTS = [("bf16", "bf16"), ("f16", "f16"), ("bf16", "f16"), ("f16", "bf16"), ("f32", "bf16"), ("f16", "f32")]
TOLERANCE = {"f32": "k_quant_gemm", "bf16": "quant16_bf16", "f16": "quant16_f16"}
# Weights (rows, cols): the fast register kernels need K % 8 == 0 (nt) or N % 8 == 0 (nn), which (30, 40) gives in
# both layouts; (30, 42) runs the other kernels on widths that are not multiples of 4.
FAST_SHAPE, ANY_SHAPE = (30, 40), (30, 42)


def rounded(values, fmt: str) -> np.ndarray:
    """float32 values as a tensor of format fmt holds them (same shape)."""
    v = np.asarray(values, np.float32)
    return storage.from_words(storage.to_words(v, fmt), v.size, fmt).reshape(v.shape)


def kernels(rt) -> list:
    """The kernels to run: the register ones (any shape, fast, and fast with subgroups where the device has them)
    and two tile configs."""
    return ["any", "fast"] + (["sg"] if use_subgroups(rt) else []) + [QT.QTILE_CONFIGS[2], QT.QTILE_CONFIGS[4]]


class Case:
    """C (+)= A @ op(W) (+ bias) with A and C in their formats, as views (offset, pitch) into bigger buffers:
    A's padding is NaN (a read outside A would show in C), C's padding random and checked unchanged."""

    def __init__(self, rt, rng, qm, wq, kernel, layout, M, a_fmt, c_fmt, bias, accumulate, offsets):
        nt = layout == "nt"
        K, N = (qm.cols, qm.rows) if nt else (qm.rows, qm.cols)
        a_off, c_off, ldc = (4, 2, N + 2) if offsets else (0, 0, N)
        lda = (K + 3) // 4 * 4 + a_off            # the fast kernels read A by 4-aligned quads
        a = np.full(a_off + M * lda + 6, np.nan, np.float32)
        a_idx = a_off + np.arange(M)[:, None] * lda + np.arange(K)[None, :]
        a[a_idx] = rounded(rng.standard_normal((M, K)), a_fmt)
        self.c = rounded(rng.standard_normal(c_off + M * ldc + 4), c_fmt)
        self.c_idx = c_off + np.arange(M)[:, None] * ldc + np.arange(N)[None, :]
        bias_v = rng.standard_normal(N).astype(np.float32)
        want = a[a_idx].astype(np.float64) @ (wq.T if nt else wq)
        if bias:
            want += bias_v
        if accumulate:
            want += self.c[self.c_idx]
        self.want, self.c_fmt = want, c_fmt
        self.cb = storage.upload(rt, self.c, c_fmt, "c")
        p = QK.QProblem(rt, at(self.cb, c_off), at(storage.upload(rt, a, a_fmt, "a"), a_off), qm, 0, layout, M,
                        bias=rt.upload(bias_v) if bias else None, accumulate=accumulate, lda=lda, ldc=ldc)
        if isinstance(kernel, str):
            cand = QK.register_candidate(p, fast=kernel != "any", subgroups=kernel == "sg")
        else:
            cand = QK.QTiled(kernel)
        self.dispatches = cand.dispatches(p)
        self.what = (f"{cand.name} {qm.dtype} {layout} A {a_fmt} C {c_fmt} M={M} N={N} K={K} bias={bias} "
                     f"acc={accumulate} offsets={offsets}")

    def check(self, rt):
        got = storage.read(rt, self.cb, self.c.size)
        want = self.want if self.c_fmt == "f32" else rounded(self.want, self.c_fmt)
        assert_close(got[self.c_idx], want, TOLERANCE[self.c_fmt], self.what)
        outside = np.ones(got.shape, bool)
        outside[self.c_idx] = False
        assert np.array_equal(got[outside], self.c[outside]), f"{self.what}: wrote outside C"


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_qgemm_with_16_bit_activations(rt, fmt):
    """Two kernels per layout, taken in turn so that over the weight formats each kernel runs both layouts, with the
    activation formats in turn (bias, accumulate and offsets varied), all in one submit."""
    rng = np.random.default_rng(16)
    weights = {}
    for shape in (FAST_SHAPE, ANY_SHAPE):
        qm = Q.QuantMatrix(rt, rng.standard_normal(shape).astype(np.float32), fmt, "w")
        weights[shape] = (qm, qm.read(rt).astype(np.float64))
    ks = kernels(rt)
    cases, i = [], 3 * Q.FORMATS.index(fmt)
    for layout in ("nt", "nn"):
        for _ in range(2):
            kernel = ks[i % len(ks)]
            qm, wq = weights[ANY_SHAPE if kernel == "any" else FAST_SHAPE]
            a_fmt, c_fmt = ACTS[i % len(ACTS)]
            cases.append(Case(rt, rng, qm, wq, kernel, layout, 5 + i % 4, a_fmt, c_fmt, bias=i % 2 == 0,
                              accumulate=i % 3 != 1, offsets=i % 4 >= 2))
            i += 1
    rec = rt.recorder()
    for case in cases:
        for d in case.dispatches:
            rec.dispatch(*d)
    rec.submit()
    for case in cases:
        case.check(rt)


@pytest.mark.parametrize("fmt,x_fmt,g_fmt", [("nf4", "bf16", "f16"), ("float16", "f16", "bf16")])
def test_linear_pair_over_chunks_in_16_bits(rt, fmt, x_fmt, g_fmt):
    """quant.linear_forward / linear_backward as the engine calls them, on a weight in row chunks: y (x's format)
    written column range by column range, dx (the gradient's format) accumulated over the chunks onto its old
    values, each chunk's sum rounded as it is stored."""
    rng = np.random.default_rng(17)
    rows, cols, n = 72, 42, 3
    with max_binding(rt, 1024):
        qm = Q.QuantMatrix(rt, rng.standard_normal((rows, cols)).astype(np.float32), fmt, "w")
    assert len(qm.chunks) >= 2
    wq = qm.read(rt).astype(np.float64)
    x, dx0 = rounded(rng.standard_normal((n, cols)), x_fmt), rounded(rng.standard_normal((n, cols)), g_fmt)
    dy = rounded(rng.standard_normal((n, rows)), g_fmt)
    bias = rng.standard_normal(rows).astype(np.float32)
    y = storage.upload(rt, np.zeros(n * rows, np.float32), x_fmt, "y")
    dx = storage.upload(rt, dx0, g_fmt, "dx")
    rec = rt.recorder()
    Q.linear_forward(rec, y, storage.upload(rt, x, x_fmt, "x"), qm, rt.upload(bias), n)
    Q.linear_backward(rec, dx, storage.upload(rt, dy, g_fmt, "dy"), qm, n, accumulate_dx=True)
    rec.submit()
    assert_close(storage.read(rt, y, n * rows).reshape(n, rows), rounded(x @ wq.T + bias, x_fmt), TOLERANCE[x_fmt], "y")
    want = dx0.astype(np.float64)
    for _, r0, k in qm.chunks:            # dx is stored, so rounded, after each chunk's product
        want = rounded(want + dy[:, r0:r0 + k] @ wq[r0:r0 + k], g_fmt).astype(np.float64)
    assert_close(storage.read(rt, dx, n * cols).reshape(n, cols), want, TOLERANCE[g_fmt], "dx")


@pytest.mark.parametrize("fmt,out_fmt", [("bfloat16", "bf16"), ("float16", "f16"), ("float16", "bf16"),
                                         ("bfloat16", "f16")])
def test_embedding_gather_into_16_bit_rows(rt, fmt, out_fmt):
    """The gather of a vocabulary in chunks into a 16-bit out at an even offset: rows equal the weight's values
    rounded once to out's format (exact for the same format), out's neighbours untouched."""
    rng = np.random.default_rng(18)
    vocab, c = 40, 6
    with max_binding(rt, 256):
        qm = Q.QuantMatrix(rt, rng.standard_normal((vocab, c)).astype(np.float32), fmt, "emb")
    assert len(qm.chunks) == 3
    ids = np.array([0, 39, 17, 16, 15, 3, 39], np.int32)
    pad = rounded(rng.standard_normal(ids.size * c + 6), out_fmt)
    out = storage.upload(rt, pad, out_fmt, "out")
    rec = rt.recorder()
    Q.embedding_forward(rec, at(out, 2), rt.upload(ids), qm, ids.size)
    rec.submit()
    got = storage.read(rt, out, pad.size)
    assert_close(got[2:2 + ids.size * c].reshape(ids.size, c), rounded(R.round_to(qm.read(rt), fmt)[ids], out_fmt),
                 "exact")
    assert got[:2].tolist() == pad[:2].tolist() and got[2 + ids.size * c:].tolist() == pad[2 + ids.size * c:].tolist()
    with pytest.raises(ValueError, match="even"):
        Q.embedding_forward(rt.recorder(), at(out, 1), rt.upload(ids), qm, ids.size)


def test_embedding_gather_with_odd_rows_in_float32(rt):
    """A float32 out keeps taking odd widths: a pair of elements straddling two tokens' rows is stored one by one,
    and a token of another chunk leaves its row untouched (one chunk gathered here)."""
    rng = np.random.default_rng(19)
    vocab, c = 16, 5
    qm = Q.QuantMatrix(rt, rng.standard_normal((vocab, c)).astype(np.float32), "bfloat16", "emb")
    ids = np.array([3, 20, 15, 0, 7], np.int32)              # 20: outside this chunk
    pad = rng.standard_normal(ids.size * c + 1).astype(np.float32)
    out = rt.upload(pad)
    rec = rt.recorder()
    Q.embedding_forward(rec, at(out, 1), rt.upload(ids), qm, ids.size)
    rec.submit()
    got = rt.read(out, np.float32, pad.shape)
    want = pad.copy()
    rows = want[1:].reshape(ids.size, c)
    inside = ids < vocab
    rows[inside] = qm.read(rt)[ids[inside]]
    np.testing.assert_array_equal(got, want)


def test_tuner_checks_a_16_bit_product(default_rt):
    """The tuner's replica and check in the problem's formats: each candidate passes on a bf16 -> f16 product (the
    replica's C written and read back in f16), and the formats are in the cache key. One adapter: the kernels'
    formats are the other tests' subject."""
    rt = default_rt
    rng = np.random.default_rng(20)
    qm = Q.QuantMatrix(rt, rng.standard_normal(FAST_SHAPE).astype(np.float32), "nf4", "w")
    a = storage.upload(rt, np.zeros(6 * 40, np.float32), "bf16", "a")
    c = storage.upload(rt, np.zeros(6 * 30, np.float32), "f16", "c")
    p = QK.QProblem(rt, c, a, qm, 0, "nt", 6, accumulate=True)
    assert p.key().endswith(" a:bf16 c:f16") and p.signature()[-2:] == ("bf16", "f16")
    cands = [QK.register_candidate(p), QK.QTiled(QT.QTILE_CONFIGS[2])]
    results = tune.measure(rt, p, cands)
    assert set(results) == {cand.name for cand in cands} and all(g is not None for g in results.values()), results
    with pytest.raises(ValueError, match="even"):
        QK.QProblem(rt, at(c, 1), a, qm, 0, "nt", 5)
