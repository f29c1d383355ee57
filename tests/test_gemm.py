"""GEMM (shaders/gemm.wgsl through wgpu_train.engines.webgpu.tuned.gemm) and the linear/LoRA op pairs built on it,
against NumPy in float64, on every adapter present."""
from __future__ import annotations

import os

import numpy as np
import pytest

from wgpu_train.engines.webgpu.tuned import adapter_traits
from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.lora import lora_backward, lora_forward
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward
from wgpu_train.engines.numpy import ops

# fp32 products summed over K: the rounding error of one output grows like eps * sqrt(K) * |a||b| for
# random signs; 1e-5 * sqrt(K) absolute (inputs are O(1)) plus 1e-5 relative leaves a wide margin over
# that while still catching any wrong or missing term (which is O(1)).
RTOL = 1e-5
ATOL_PER_SQRT_K = 1e-5

# every pair of the odd sizes 1, 3, 17, 65, 127 appears as (M, N), (N, K) or (M, K) somewhere below
SHAPES = [(1, 1, 1), (3, 17, 65), (17, 3, 127), (65, 127, 3), (127, 65, 17), (3, 127, 1), (127, 1, 65),
          (1, 65, 127), (65, 17, 17), (1, 17, 3)]
ALIGNED = [(4, 8, 12), (64, 72, 36), (36, 260, 20), (260, 8, 64)]   # multiples of 4: the vec4 kernels


def _close(got, want, k):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL_PER_SQRT_K * np.sqrt(k))


def _op(x, t):
    return x.T if t == "t" else x


def _operands(rng, M, N, K, layout, dtype=np.float32):
    a = rng.standard_normal((K, M) if layout[0] == "t" else (M, K)).astype(dtype)
    b = rng.standard_normal((N, K) if layout[1] == "t" else (K, N)).astype(dtype)
    return a, b


def _variants(rt):
    """(subgroups, vec4) pairs to force: every register kernel this device can run."""
    sg = [False, True] if GK.use_subgroups(rt) else [False]
    return [(s, v) for s in sg for v in (False, True)]


def _register(rt, c, a, b, M, N, K, layout, subgroups=None, vec4=True, **kw):
    """The (pipeline, resources, groups) of the register kernel choose_tiling picks, with subgroups / vec4 forced."""
    p = G.gemm_problem(rt, c, a, b, M, N, K, layout, **kw)
    return GK.register_candidate(p, subgroups, vec4).dispatches(p)[0]


def _run(rt, dispatches):
    rec = rt.recorder()
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_gemm_layouts_odd_sizes(rt, layout):
    """Every layout on sizes that are not multiples of the tile (or of 4), each forced kernel."""
    rng = np.random.default_rng(1)
    cases = []
    for (M, N, K) in SHAPES + ALIGNED:
        a, b = _operands(rng, M, N, K, layout)
        want = _op(a.astype(np.float64), layout[0]) @ _op(b.astype(np.float64), layout[1])
        ab, bb = rt.upload(a), rt.upload(b)
        for sg, v4 in _variants(rt):
            cb = rt.buffer(M * N * 4)
            cases.append((cb, want, K, (M, N, K, sg, v4),
                          _register(rt, cb, ab, bb, M, N, K, layout, subgroups=sg, vec4=v4)))
    _run(rt, [c[-1] for c in cases])
    for cb, want, K, what, _ in cases:
        got = rt.read(cb, np.float32, want.shape)
        try:
            _close(got, want, K)
        except AssertionError as e:
            raise AssertionError(f"{layout} (M, N, K, subgroups, vec4) = {what}: {e}") from None


def test_gemm_default_path_picks_vec4(rt):
    """The default dispatch uses the vec4 kernel on aligned shapes (the fast path is really taken)."""
    buf = rt.buffer(64 * 64 * 4)
    c = rt.buffer(64 * 64 * 4)
    for layout in ("nn", "nt", "tn"):
        pipeline, _, _ = _register(rt, c, buf, buf, 64, 64, 64, layout)
        assert "gemm_v4" in pipeline.label
    pipeline, _, _ = _register(rt, c, buf, buf, 63, 64, 63, "nn")
    assert "gemm_v4" not in pipeline.label


@pytest.mark.parametrize("M,N,K", [(17, 65, 33), (64, 48, 32), (96, 8, 40), (5, 3, 7)])
@pytest.mark.parametrize("layout", ["nt", "tn"])
def test_gemm_alpha_bias_accumulate(rt, M, N, K, layout):
    """C = alpha * op(A) op(B) + bias + C_old, for every combination of bias and accumulate; (96, 8)
    takes the transposed-C path, (64, 48) and (96, 8) the vec4 epilogue along n and along m."""
    rng = np.random.default_rng(2)
    a, b = _operands(rng, M, N, K, layout)
    bias = rng.standard_normal(N).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    ab, bb, biasb = rt.upload(a), rt.upload(b), rt.upload(bias)
    prod = _op(a.astype(np.float64), layout[0]) @ _op(b.astype(np.float64), layout[1])
    rec = rt.recorder()
    cases = []
    for use_bias in (False, True):
        for acc in (False, True):
            cb = rt.upload(c0)
            G.gemm(rec, cb, ab, bb, M, N, K, layout, alpha=-0.75, bias=biasb if use_bias else None, accumulate=acc)
            want = -0.75 * prod + (bias if use_bias else 0.0) + (c0 if acc else 0.0)
            cases.append((cb, want, (use_bias, acc)))
    rec.submit()
    for cb, want, what in cases:
        got = rt.read(cb, np.float32, (M, N))
        try:
            _close(got, want, K)
        except AssertionError as e:
            raise AssertionError(f"(bias, accumulate) = {what}: {e}") from None


@pytest.mark.parametrize("M,N,K", [(17, 5, 9), (32, 40, 16)])
def test_gemm_batched_strides_and_pitches(rt, M, N, K):
    """Batched GEMM with padded row pitches, non-packed batch strides and a B shared by all (stride 0)."""
    rng = np.random.default_rng(3)
    batch, lda, ldc = 3, K + 4, N + 8
    sa, sc = M * lda + 12, M * ldc + 4
    a_full = rng.standard_normal(batch * sa).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c_full = np.full(batch * sc, 7.0, np.float32)
    ab, bb, cb = rt.upload(a_full), rt.upload(b), rt.upload(c_full)
    rec = rt.recorder()
    G.gemm(rec, cb, ab, bb, M, N, K, "nn", batch=batch, lda=lda, ldc=ldc, stride_a=sa, stride_b=0, stride_c=sc)
    rec.submit()
    got = rt.read(cb, np.float32, (batch * sc,))
    for z in range(batch):
        a = a_full[z * sa: z * sa + M * lda].reshape(M, lda)[:, :K].astype(np.float64)
        c = got[z * sc: z * sc + M * ldc].reshape(M, ldc)
        _close(c[:, :N], a @ b, K)
        assert np.all(c[:, N:] == 7.0), "wrote outside C's columns"
    untouched = np.ones(batch * sc, bool)
    for z in range(batch):
        untouched[z * sc: z * sc + M * ldc] = False
    assert np.all(got[untouched] == 7.0), "wrote between batches"


@pytest.mark.parametrize("offsets", [(3, 5, 7, 1), (8, 4, 12, 4)])   # odd: scalar kernel; aligned: vec4
@pytest.mark.parametrize("layout", ["nt", "tn"])
def test_gemm_element_offsets(rt, offsets, layout):
    """Operands as (buffer, element_offset) slices of larger buffers; nothing outside C is written."""
    a_off, b_off, c_off, bias_off = offsets
    M, N, K = 20, 36, 12
    rng = np.random.default_rng(4)
    a, b = _operands(rng, M, N, K, layout)
    bias = rng.standard_normal(N).astype(np.float32)
    pad = lambda x, off: np.concatenate([rng.standard_normal(off).astype(np.float32), x.ravel(),  # noqa: E731
                                         rng.standard_normal(5).astype(np.float32)])
    ab, bb, biasb = rt.upload(pad(a, a_off)), rt.upload(pad(b, b_off)), rt.upload(pad(bias, bias_off))
    c_init = np.full(c_off + M * N + 9, -3.0, np.float32)
    cb = rt.upload(c_init)
    rec = rt.recorder()
    G.gemm(rec, (cb, c_off), (ab, a_off), (bb, b_off), M, N, K, layout, bias=(biasb, bias_off))
    rec.submit()
    got = rt.read(cb, np.float32, c_init.shape)
    want = _op(a.astype(np.float64), layout[0]) @ _op(b.astype(np.float64), layout[1]) + bias
    _close(got[c_off:c_off + M * N].reshape(M, N), want, K)
    assert np.all(got[:c_off] == -3.0) and np.all(got[c_off + M * N:] == -3.0)


def test_gemm_operand_past_max_binding(default_rt):
    """An operand near the end of a buffer larger than one storage binding is bound as an aligned
    range, at an unaligned offset (scalar kernel) and an aligned one (vec4 kernel)."""
    rt = default_rt
    n_elems = rt.max_binding // 4 + 1000
    if n_elems * 4 > rt.max_buffer:
        pytest.skip("device cannot allocate a buffer larger than its max storage binding")
    M, N, K = 9, 12, 16
    rng = np.random.default_rng(5)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    big = rt.buffer(n_elems * 4, "test.big")
    bb = rt.upload(b)
    try:
        for off, kernel in ((n_elems - M * K - 3, "gemm_sg" if GK.use_subgroups(rt) else "gemm"),
                            (n_elems - M * K - 64, "gemm_v4")):
            rt.write(big, a, offset=off * 4)
            cb = rt.buffer(M * N * 4)
            pipeline, resources, groups = _register(rt, cb, (big, off), bb, M, N, K, "nt")
            assert pipeline.label.split(".")[1].startswith(kernel)
            assert any(isinstance(r, tuple) and r[0] is big for r in resources), "expected a range binding"
            _run(rt, [(pipeline, resources, groups)])
            _close(rt.read(cb, np.float32, (M, N)), a.astype(np.float64) @ b.T, K)
    finally:
        rt.release(big)


def test_gemm_rejects_operand_outside_buffer(default_rt):
    rt = default_rt
    small = rt.buffer(10 * 4)
    rec = rt.recorder()
    with pytest.raises(ValueError, match="gemm A: needs elements"):
        G.gemm(rec, small, small, small, 4, 4, 4)


def test_choose_tiling():
    """Skinny products are computed transposed so the small side is not padded to a wide tile; the
    operand each invocation streams is kept contiguous along k, or its panel small enough for L2."""
    assert GK.choose_tiling(512, 8, 576) == (True, 8, 8)       # x @ lora_a.T: N = r, computed as (r, N)
    assert GK.choose_tiling(8, 512, 576)[::2] == (False, 8)    # dlora_a: M = r, an 8-row tile
    assert GK.choose_tiling(1024, 1024, 1024, b_along_k=(True, True)) == (False, 64, 32)    # nt
    assert GK.choose_tiling(1024, 1024, 1024, b_along_k=(False, True))[0] is True           # nn: swap
    swap, wg, tm = GK.choose_tiling(1024, 1024, 1024, b_along_k=(False, False))            # tn
    assert 1024 * GK.TN * wg * 4 <= GK.L2_PANEL_BYTES and tm == 32


# ---- linear and LoRA vs wgpu_train.engines.numpy.ops ----------------------------------------------

LINEAR_SHAPES = [(13, 17, 9), (32, 64, 48), (5, 1, 3)]    # (N, in, out)


@pytest.mark.parametrize("n,fin,fout", LINEAR_SHAPES)
def test_linear_forward_backward(rt, n, fin, fout):
    """tensors.linear_forward / linear_backward (the engine's path) over a float32 Matrix."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, fin)).astype(np.float32)
    w = rng.standard_normal((fout, fin)).astype(np.float32)
    bias = rng.standard_normal(fout).astype(np.float32)
    dy = rng.standard_normal((n, fout)).astype(np.float32)
    dx0 = rng.standard_normal((n, fin)).astype(np.float32)
    xb, biasb, dyb = rt.upload(x), rt.upload(bias), rt.upload(dy)
    wm, dwm = Matrix(rt, fout, fin, "test.w", w), Matrix(rt, fout, fin, "test.dw", np.zeros_like(w))
    yb, dxb, dbb = rt.buffer(n * fout * 4), rt.buffer(n * fin * 4), rt.buffer(fout * 4)
    dxacc = rt.upload(dx0)
    rec = rt.recorder()
    linear_forward(rec, yb, xb, wm, biasb, n)
    linear_backward(rec, dxb, dwm, dbb, dyb, xb, wm, n)
    linear_backward(rec, dxacc, None, None, dyb, xb, wm, n, accumulate_dx=True)
    rec.submit()
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    _close(rt.read(yb, np.float32, (n, fout)), ops.linear_forward(x64, w64, bias.astype(np.float64)), fin)
    dx, dw, db = ops.linear_backward(dy64, x64, w64)
    _close(rt.read(dxb, np.float32, (n, fin)), dx, fout)
    _close(dwm.read(rt), dw, n)
    _close(rt.read(dbb, np.float32, (fout,)), db, n)
    _close(rt.read(dxacc, np.float32, (n, fin)), dx0 + dx, fout)


@pytest.mark.parametrize("n,fin,fout,r", [(13, 17, 9, 3), (64, 48, 40, 8), (7, 33, 65, 1)])
def test_lora_forward_backward(rt, n, fin, fout, r):
    rng = np.random.default_rng(7)
    scale = 2.0 / max(r, 1)
    x = rng.standard_normal((n, fin)).astype(np.float32)
    la = rng.standard_normal((r, fin)).astype(np.float32)
    lb = rng.standard_normal((fout, r)).astype(np.float32)
    y0 = rng.standard_normal((n, fout)).astype(np.float32)      # the base layer's output
    dy = rng.standard_normal((n, fout)).astype(np.float32)
    dx0 = rng.standard_normal((n, fin)).astype(np.float32)      # the base layer's dx
    g0a = rng.standard_normal((r, fin)).astype(np.float32)      # gradients from an earlier micro-batch
    g0b = rng.standard_normal((fout, r)).astype(np.float32)
    xb, lab, lbb, dyb = rt.upload(x), rt.upload(la), rt.upload(lb), rt.upload(dy)
    yb, hb, dxb = rt.upload(y0), rt.buffer(n * r * 4), rt.upload(dx0)
    dab, dbb, dhb = rt.buffer(r * fin * 4), rt.buffer(fout * r * 4), rt.buffer(n * r * 4)
    dab2, dbb2 = rt.upload(g0a), rt.upload(g0b)
    rec = rt.recorder()
    lora_forward(rec, yb, hb, xb, lab, lbb, scale, n, fin, fout, r)
    lora_backward(rec, dxb, dab, dbb, dyb, xb, hb, lab, lbb, scale, n, fin, fout, r, dhb)
    lora_backward(rec, None, dab2, dbb2, dyb, xb, hb, lab, lbb, scale, n, fin, fout, r, dhb, accumulate_grads=True)
    rec.submit()
    x64, la64, lb64, dy64 = (v.astype(np.float64) for v in (x, la, lb, dy))
    y, h = ops.lora_forward(x64, la64, lb64, scale)
    dx, da, db = ops.lora_backward(dy64, x64, h, la64, lb64, scale)
    _close(rt.read(hb, np.float32, (n, r)), h, fin)
    _close(rt.read(yb, np.float32, (n, fout)), y0 + y, fin)
    _close(rt.read(dxb, np.float32, (n, fin)), dx0 + dx, max(n, fout))
    _close(rt.read(dab, np.float32, (r, fin)), da, n * fout)
    _close(rt.read(dbb, np.float32, (fout, r)), db, n)
    _close(rt.read(dab2, np.float32, (r, fin)), g0a + da, n * fout)
    _close(rt.read(dbb2, np.float32, (fout, r)), g0b + db, n)


def test_subgroup_probe(rt):
    """The subgroup kernels are used exactly when the device has subgroups of at least 8 lanes."""
    size = adapter_traits.subgroup_size(rt)
    assert size == 0 or size & (size - 1) == 0
    if os.environ.get("WGPU_TRAIN_GEMM_SUBGROUPS", "1") != "0":
        assert GK.use_subgroups(rt) == (size >= 8)


@pytest.mark.parametrize("wg", [16, 32, 64])
def test_gemm_workgroup_sizes(rt, wg, monkeypatch):
    """Each workgroup width the tiling may choose (the other tests mostly get 8), on ragged edges."""
    monkeypatch.setattr(GK, "WG_CHOICES", (wg,))
    rng = np.random.default_rng(8)
    cases = []
    for (M, N, K, layout) in [(40, 8 * wg + 12, 20, "nn"), (33, 8 * wg + 5, 9, "tn")]:
        a, b = _operands(rng, M, N, K, layout)
        want = _op(a.astype(np.float64), layout[0]) @ _op(b.astype(np.float64), layout[1])
        cb = rt.buffer(M * N * 4)
        d = _register(rt, cb, rt.upload(a), rt.upload(b), M, N, K, layout)
        assert d[2][0] == 2, "the test shape should span two workgroups of columns"
        cases.append((cb, want, K, d))
    _run(rt, [c[-1] for c in cases])
    for cb, want, K, _ in cases:
        _close(rt.read(cb, np.float32, want.shape), want, K)
