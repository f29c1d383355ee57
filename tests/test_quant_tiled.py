"""The workgroup-tiled quantised GEMM (shaders/gemm_quant_tiled.wgsl via wgpu_train.engines.webgpu.tuned.quant_tiled) against
float64 NumPy on the dequantised weight, on every adapter present: every tile config x weight format x
layout on odd and aligned shapes (with bias, accumulate, offsets and pitches), the decode bit for bit
against QuantMatrix.read, and a weight in several row chunks run chunk by chunk as quant.py's linear
op pair does. Cold llvmpipe pays ~0.5 s of JIT per pipeline, so each (format, layout) test submits every
config's cases at once and the shapes stay small."""
from __future__ import annotations

import re

import numpy as np
import pytest

from wgpu_train.engines.webgpu.tuned import quant as Q
from wgpu_train.engines.webgpu.tuned import quant_source as QT
from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem, QTiled
from wgpu_train.engines.webgpu.tuned.gemm_source import TileConfig, core, workgroup_bytes, workgroup_size
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.device.runtime import shader_path, shader_text

from limits import max_binding
from tolerances import assert_close

CONFIGS = QT.QTILE_CONFIGS


def _dispatch(rt, c, a, w, chunk, cfg, layout, M, **kw):
    """(pipeline, resources, groups) of the tiled candidate cfg on one quantised GEMM."""
    p = QProblem(rt, c, a, w, chunk, layout, M, **kw)
    assert QTiled(cfg).applies(p)
    return QTiled(cfg).dispatches(p)[0]
# (M, rows, cols) with W (rows, cols): the first two run on every config (odd: cols % 8 != 0, groups
# straddle words and NF4 blocks cross rows; aligned: cols % 8 == 0, one load per 8 weights, K and N over
# several tiles); one of EXTRA more per config, in turn.
CORE = [(70, 37, 43), (33, 72, 64)]
EXTRA = [(1, 1, 1), (3, 17, 65), (130, 9, 127), (5, 130, 8), (129, 24, 136)]


def _ids(cfg):
    return cfg.name


# ---- the Python side ----------------------------------------------------------------------------

def test_configs_fit_default_limits_and_whole_groups():
    names = [c.name for c in CONFIGS]
    assert len(set(names)) == len(names) >= 4 and any(c.double_buffer for c in CONFIGS)
    for cfg in CONFIGS:
        assert cfg.bk % 8 == 0 and cfg.bn % 8 == 0, cfg.name
        assert workgroup_bytes(cfg) <= 16384 and workgroup_size(cfg) <= 256, cfg.name
        k = QT.qtiled_kernel("nf4", cfg, True)
        assert k.invocations == workgroup_size(cfg) and k.workgroup_bytes == workgroup_bytes(cfg)
        assert QT.qtiled_applies(cfg, "nf4", "nt", 7, 9, 11, 13, 3, {})
    with pytest.raises(ValueError, match="multiples of 8"):
        QT.qtiled_kernel("nf4", TileConfig(64, 64, 4, 4, 4), True)
    with pytest.raises(ValueError, match="formats"):
        QT.qtiled_source("int8", CONFIGS[0], True)


def test_groups_and_applies():
    cfg = TileConfig(128, 64, 16, 8, 8)
    assert QT.qtiled_groups(cfg, 129, 64) == (1, 2, 1)
    assert QT.qtiled_groups(cfg, 1, 65) == (2, 1, 1)
    assert QT.qtiled_applies(cfg, "float16", "nn", 1, 1, 1)
    assert not QT.qtiled_applies(cfg, "float16", "tn", 8, 8, 8)
    assert not QT.qtiled_applies(cfg, "float32", "nt", 8, 8, 8)
    assert not QT.qtiled_applies(cfg, "nf4", "nt", 8, 8, 8, limits={"max-compute-workgroup-storage-size": 12287})
    assert not QT.qtiled_applies(cfg, "nf4", "nt", 8, 8, 8, limits={"max-compute-invocations-per-workgroup": 64})
    assert not QT.qtiled_applies(cfg, "nf4", "nt", 128 * 65536, 8, 8)
    assert QT.qtiled_applies(cfg, "nf4", "nt", 128 * 65535, 8, 8)


@pytest.mark.parametrize("fmt", QT.FORMATS)
def test_source_specialises_the_block_and_appends_the_format(fmt):
    """The template's lines (gemm_core.wgsl appended, its float16 core blanked) keep their numbers (only the const
    block changes); the appended text is gemm_quant.wgsl's sections for fmt, byte for byte (the same decoders),
    and nothing needs shader-f16."""
    template = core(shader_text(QT.SHADER), half=False)
    assert template.startswith(shader_path(QT.SHADER).read_text()) and "fn multiply(" in template
    cfg = TileConfig(128, 64, 16, 8, 8, double_buffer=True)
    src = QT.qtiled_source(fmt, cfg, False)
    lines, tlines = src.split("\n"), template.split("\n")
    changed = [i for i, (x, y) in enumerate(zip(tlines, lines)) if x != y]
    assert len(changed) == 4           # BM, TN, NBUF and NT differ from the file's defaults
    consts = dict(re.findall(r"const (BM|BN|BK|TM|TN|NBUF): u32 = (\d+)u;", src))
    assert consts == {"BM": "128", "BN": "64", "BK": "16", "TM": "8", "TN": "8", "NBUF": "2"}
    assert "const NT: bool = false;" in src and "const NT: bool = true;" in QT.qtiled_source(fmt, cfg, True)
    tail = "\n".join(lines[len(tlines):])
    quant = shader_path(QT.REGISTER_SHADER).read_text()
    assert tail.strip("\n") == QT.format_sections(fmt).strip("\n")
    mark = "// ---- format: "
    parts = tail.split(mark)[1:]
    assert len(parts) == 2            # the format's decoders, and the section it shares with its sibling
    assert all(mark + p.strip("\n") in quant for p in parts)
    assert "fn raw8(" in tail and "fn dec4(" in tail and "enable f16" not in src
    for other in QT.FORMATS:
        assert (QT.format_sections(other) in src) == (other == fmt), other
    half = TileConfig(128, 64, 16, 8, 8, half=True)
    if fmt != "float16":
        with pytest.raises(ValueError, match="float16 arithmetic takes a float16 weight"):
            QT.qtiled_source(fmt, half, True)
        return
    src16 = QT.qtiled_source(fmt, half, True)
    assert "alias Elem = f16;" in src16 and "alias Sum = array<vec4<f16>" in src16 and "var part: Sum;" in src16
    assert src16.count("fn multiply(") == 1 and "alias Sum = Acc;" not in src16
    assert QT.qtiled_kernel(fmt, half, True).features == ("shader-f16",)


# ---- the kernel ----------------------------------------------------------------------------------

class Case:
    """One product C (+)= A @ op(W) (+ bias) on the device, with its float64 expectation. A and C are
    views (element offset, pitch) into bigger buffers: A's padding is NaN (a read outside A shows up in
    C), C's is random and must come back unchanged."""

    def __init__(self, rt, rng, qm, wq, cfg, layout, M, bias=False, accumulate=False, offsets=False, identity=False):
        nt = layout == "nt"
        K, N = (qm.cols, qm.rows) if nt else (qm.rows, qm.cols)
        a_off, lda, c_off, ldc, b_off = (3, K + 5, 2, N + 3, 1) if offsets else (0, K, 0, N, 0)
        a = np.full(a_off + M * lda + 7, np.nan, np.float32)
        av = np.eye(M, K, dtype=np.float32) if identity else rng.standard_normal((M, K)).astype(np.float32)
        self.a_idx = a_off + np.arange(M)[:, None] * lda + np.arange(K)[None, :]
        a[self.a_idx] = av
        self.c = rng.standard_normal(c_off + M * ldc + 5).astype(np.float32)
        self.c_idx = c_off + np.arange(M)[:, None] * ldc + np.arange(N)[None, :]
        bias_v = rng.standard_normal(b_off + N).astype(np.float32)
        want = av.astype(np.float64) @ (wq.T if nt else wq)
        if bias:
            want += bias_v[b_off:]
        if accumulate:
            want += self.c[self.c_idx]
        self.want, self.exact = want, identity
        self.cb = rt.upload(self.c)
        bias_t = at(rt.upload(bias_v), b_off) if bias else None
        self.dispatch = _dispatch(rt, at(self.cb, c_off), at(rt.upload(a), a_off), qm, 0, cfg, layout, M,
                                  bias=bias_t, accumulate=accumulate, lda=lda, ldc=ldc)
        self.what = f"{cfg.name} {qm.dtype} {layout} M={M} N={N} K={K} bias={bias} acc={accumulate} offsets={offsets}"

    def check(self, rt):
        got = rt.read(self.cb, np.float32, self.c.shape)
        if self.exact:     # one-hot rows of A: C holds the decoded weights themselves
            np.testing.assert_array_equal(got[self.c_idx], self.want, err_msg=self.what)
        else:
            assert_close(got[self.c_idx], self.want, "k_quant_gemm", self.what)
        outside = np.ones(got.shape, bool)
        outside[self.c_idx] = False
        assert np.array_equal(got[outside], self.c[outside]), f"{self.what}: wrote outside C"


@pytest.mark.parametrize("layout", QT.LAYOUTS)
@pytest.mark.parametrize("fmt", QT.FORMATS)
def test_qtiled_matches_numpy(rt, fmt, layout):
    """Every config on the core shapes and one extra, options varied across cases, all in one submit; and
    with A = I the weights decoded bit for bit as QuantMatrix.read (the reference's dequantisation)."""
    rng = np.random.default_rng(11)
    weights = {}
    for shape in CORE + EXTRA:
        rows, cols = shape[1:]
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        qm = Q.QuantMatrix(rt, w, fmt, "w")
        weights[shape] = (qm, qm.read(rt).astype(np.float64))
    cases, i = [], 0
    for j, cfg in enumerate(CONFIGS):
        for shape in CORE + [EXTRA[j % len(EXTRA)]]:
            qm, wq = weights[shape]
            cases.append(Case(rt, rng, qm, wq, cfg, layout, shape[0], bias=i % 2 == 0, accumulate=i % 3 != 1,
                              offsets=i % 4 >= 2))
            i += 1
        qm, wq = weights[CORE[0]]
        cases.append(Case(rt, rng, qm, wq, cfg, layout, qm.cols if layout == "nt" else qm.rows, identity=True,
                          offsets=j % 2 == 1))
    rec = rt.recorder()
    for case in cases:
        rec.dispatch(*case.dispatch)
    rec.submit()
    for case in cases:
        case.check(rt)


@pytest.mark.parametrize("fmt", QT.FORMATS)
def test_qtiled_over_several_chunks(rt, fmt):
    """A weight in row chunks (a small max storage binding), run chunk by chunk as quant.linear_forward /
    linear_backward do: y's columns r0.. (ldc = rows, bias at r0), dx summed over chunks from dy's
    columns r0.. (lda = rows)."""
    rng = np.random.default_rng(12)
    cfg = CONFIGS[QT.FORMATS.index(fmt) % len(CONFIGS)]
    rows, cols, n = 300, 72, 37
    with max_binding(rt, 4096):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        qm = Q.QuantMatrix(rt, w, fmt, "w")
    assert len(qm.chunks) >= 3
    wq = qm.read(rt).astype(np.float64)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    dy = rng.standard_normal((n, rows)).astype(np.float32)
    dx0 = rng.standard_normal((n, cols)).astype(np.float32)
    y, dx = rt.buffer(n * rows * 4), rt.upload(dx0)
    xb, bb, dyb = rt.upload(x), rt.upload(bias), rt.upload(dy)
    rec = rt.recorder()
    for i, (_, r0, _) in enumerate(qm.chunks):
        rec.dispatch(*_dispatch(rt, at(y, r0), xb, qm, i, cfg, "nt", n, bias=at(bb, r0), ldc=rows))
        rec.dispatch(*_dispatch(rt, dx, at(dyb, r0), qm, i, cfg, "nn", n, lda=rows, accumulate=True))
    rec.submit()
    assert_close(rt.read(y, np.float32, (n, rows)), x @ wq.T + bias, "k_quant_gemm", f"{cfg.name} y")
    assert_close(rt.read(dx, np.float32, (n, cols)), dy @ wq + dx0, "k_quant_gemm", f"{cfg.name} dx")
