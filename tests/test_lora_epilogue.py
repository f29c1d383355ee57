"""The LoRA term in the base GEMM (gemm_tiled_lora*, Tiled.dispatches_with_lora): C = alpha * op(A) op(B)
(+ bias) (+ C) + alpha2 * H LB^T in one dispatch, against NumPy in float64 on every adapter, and the engine's
training step with the tiled family pinned, where every LoRA module's base GEMM adds its B term itself."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import gemm_source as T
from wgpu_train.engines.webgpu import lora as L
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.gemm import gemm_problem
from wgpu_train.engines.webgpu.tensors import Matrix

from tiny_models import build_model, save_model
from tolerances import assert_close

RTOL, ATOL_PER_SQRT_K = 1e-5, 1e-5     # as tests/test_gemm_tiled.py
CONFIGS = [T.TileConfig(32, 32, 16, 4, 4), T.TileConfig(32, 32, 16, 4, 4, vec4=True),
           T.TileConfig(64, 64, 8, 4, 4, double_buffer=True), T.TileConfig(64, 64, 8, 4, 4, True, True),
           T.TileConfig(32, 32, 16, 4, 4, subgroups=True), T.TileConfig(64, 64, 8, 4, 4, True, True, True)]


def _configs(rt):
    return [c for c in CONFIGS if T.fits(c, rt.limits, rt.features)]


def _run(rt, dispatches):
    rec = rt.recorder()
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()


# (M, N, K, r2, ldh, h column offset, alpha, alpha2, bias, accumulate); 4-aligned ones take the vec4 configs
CASES = [(64, 64, 32, 16, 16, 0, 1.0, 0.5, False, False),
         (37, 45, 29, 5, 5, 0, 1.0, 2.0, True, False),       # odd sizes, r2 not a multiple of BK
         (17, 3, 65, 3, 11, 4, -0.75, 1.5, True, True),      # a group slice: columns 4..6 of an (M, 11) h
         (96, 80, 48, 20, 36, 8, 0.5, 0.25, True, True),     # aligned group slice, alpha != 1
         (33, 64, 16, 0, 4, 0, 2.0, 1.0, False, True),       # r2 = 0: the base GEMM alone
         (8, 128, 128, 40, 40, 0, 0.0, 1.0, True, False)]    # alpha = 0: only the LoRA term


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])))
def test_fused_dispatch_matches_numpy(rt, case):
    M, N, K, r2, ldh, off, alpha, alpha2, with_bias, accumulate = case
    rng = np.random.default_rng(M * 7 + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    h = rng.standard_normal((M, ldh)).astype(np.float32)
    lb = rng.standard_normal((N, max(r2, 1))).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    f = {k: v.astype(np.float64) for k, v in dict(x=x, w=w, bias=bias, h=h, lb=lb, c0=c0).items()}
    want = alpha * f["x"] @ f["w"].T + alpha2 * f["h"][:, off:off + r2] @ f["lb"][:, :r2].T
    want += f["bias"] if with_bias else 0.0
    want += f["c0"] if accumulate else 0.0
    bufs = [rt.upload(v) for v in (x, w, bias, h.ravel(), lb.ravel(), c0)]
    xb, wb, bb, hb, lbb, cb = bufs
    ran = 0
    try:
        for cfg in _configs(rt):
            p = gemm_problem(rt, cb, xb, wb, M, N, K, "nt", alpha=alpha, bias=bb if with_bias else None,
                             accumulate=accumulate)
            cand = GK.Tiled(cfg)
            if not cand.applies(p):
                assert cfg.vec4 and M % 4 + N % 4 + K % 4, f"{cfg.name} should apply to {case}"
                continue
            rt.write(cb, c0)
            ds = cand.dispatches_with_lora(p, (hb, off), ldh, lbb, r2, alpha2, ldlb=max(r2, 1))
            assert len(ds) == 1 and ds[0][0] is rt.compiled(GK.tiled_lora_kernel(cfg)).pipeline
            _run(rt, ds)
            got = rt.read(cb, np.float32, (M, N))
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL_PER_SQRT_K * np.sqrt(K + r2 + 1),
                                       err_msg=f"{cfg.name} on {case}")
            ran += 1
    finally:
        rt.release(*bufs)
    assert ran >= 2 + (M % 4 + N % 4 + K % 4 == 0)


def test_fused_r2_zero_is_bit_identical_to_the_base_gemm(rt):
    """With no second term the LoRA entry point gives gemm_tiled's C exactly (alpha applied to the same sums)."""
    rng = np.random.default_rng(1)
    M, N, K = 45, 36, 70
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K)))
    bias, c0 = rng.standard_normal(N).astype(np.float32), rng.standard_normal((M, N)).astype(np.float32)
    bufs = [rt.upload(v) for v in (x, w, bias, c0)]
    try:
        for cfg in [c for c in _configs(rt) if not c.vec4]:
            p = gemm_problem(rt, bufs[3], bufs[0], bufs[1], M, N, K, "nt", alpha=0.3, bias=bufs[2], accumulate=True)
            outs = []
            for ds in (GK.Tiled(cfg).dispatches(p), GK.Tiled(cfg).dispatches_with_lora(p, bufs[2], 0, bufs[2], 0, 1.0)):
                rt.write(bufs[3], c0)
                _run(rt, ds)
                outs.append(rt.read(bufs[3], np.float32, (M, N)))
            assert np.array_equal(*outs), cfg.name
    finally:
        rt.release(*bufs)


def test_fused_dispatch_refuses_split_k(rt):
    buf = rt.upload(np.zeros(8 * 1024, np.float32))
    try:
        p = gemm_problem(rt, buf, buf, buf, 8, 8, 1024, "nt")
        with pytest.raises(ValueError, match="splits == 1"):
            GK.Tiled(T.TileConfig(32, 32, 16, 4, 4), 4).dispatches_with_lora(p, buf, 4, buf, 4, 1.0)
    finally:
        rt.release(buf)


def test_linear_lora_forward_falls_back_and_fuses(rt, monkeypatch):
    """The op gives the same y (up to rounding) whichever way it runs: the register family (two steps) and
    the tiled family (one dispatch)."""
    rng = np.random.default_rng(4)
    n, fin, fout, r, total, off = 24, 20, 28, 4, 12, 8
    x = rng.standard_normal((n, fin)).astype(np.float32)
    w = rng.standard_normal((fout, fin)).astype(np.float32)
    bias = rng.standard_normal(fout).astype(np.float32)
    h = rng.standard_normal((n, total)).astype(np.float32)
    lb = rng.standard_normal((fout, r)).astype(np.float32)
    y0 = rng.standard_normal((n, fout)).astype(np.float32)
    want = y0 + x.astype(np.float64) @ w.T + bias + 0.5 * h[:, off:off + r].astype(np.float64) @ lb.T
    W = Matrix(rt, fout, fin, "test.w", w)
    bufs = [rt.upload(v) for v in (x, bias, h, lb, y0)]
    xb, bb, hb, lbb, yb = bufs
    try:
        ran = []
        real = GK.Tiled.dispatches_with_lora
        monkeypatch.setattr(GK.Tiled, "dispatches_with_lora", lambda *a, **k: ran.append(1) or real(*a, **k))
        for family, fused in (("register", False), ("tiled", True)):
            ran.clear()
            rt.write(yb, y0)
            with tune.pinned(family):
                rec = rt.recorder()
                L.linear_lora_forward(rec, yb, xb, W, bb, n, (hb, off), total, lbb, 0.5, r, accumulate=True)
                rec.submit()
            assert bool(ran) == fused, family
            np.testing.assert_allclose(rt.read(yb, np.float32, (n, fout)), want, rtol=1e-5, atol=1e-4)
    finally:
        rt.release(*bufs, *[b for b, _, _ in W.chunks])


# ---- the engine ----------------------------------------------------------------------------------

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-d16-lora-epilogue")
    save_model(build_model("llama", seed=3, **SIZES), path)
    return path


def test_engine_fuses_lora_b_into_the_base_gemm(folder, rt, monkeypatch):
    """A LoRA (all linear layers) step with the tiled family pinned: every module's base GEMM runs the fused
    entry point, loss and gradients equal the NumPy engine's, and gradient checkpointing (which recomputes
    the layers' fused GEMMs but down_proj's) gives them bit for bit."""
    pytest.importorskip("torch")
    lora = wt.LoraConfig(r=4, alpha=8, target_modules="all-linear")
    ids = np.random.default_rng(0).integers(0, 96, (2, 64))
    mask = np.ones_like(ids)
    labels = ids.copy()
    labels[:, :3] = -100
    ref = wt.load_model(folder, backend="numpy")
    ref.add_lora(lora, seed=5)
    rng = np.random.default_rng(2)
    modules = {p: (a, rng.normal(0, 0.1, b.shape).astype(np.float32)) for p, (a, b) in ref.engine.lora_tensors().items()}
    ref._set_lora(lora, modules, seed=5)
    tensors = ref.engine.lora_tensors()
    loss_ref, grads_ref = ref.loss_and_grads(ids, labels, mask)

    labels_run = []
    real = GK.Tiled.dispatches_with_lora

    def recorded(*a, **k):
        ds = real(*a, **k)
        labels_run.extend(pipeline.label for pipeline, _, _ in ds)
        return ds

    monkeypatch.setattr(GK.Tiled, "dispatches_with_lora", recorded)
    results = []
    for checkpoint in (False, True):
        gpu = wt.load_model(folder, backend="wgpu", device=str(rt.info.index))
        gpu._set_lora(lora, tensors, seed=5)
        gpu.set_gradient_checkpointing(checkpoint)
        labels_run.clear()
        with tune.pinned("tiled"):
            results.append(gpu.loss_and_grads(ids, labels, mask))
        layers = gpu.engine.cfg.num_hidden_layers
        assert len(labels_run) >= 7 * layers, labels_run          # each module's base GEMM, once at least
        assert all("gemm_tiled_lora" in name for name in labels_run), sorted(set(labels_run))
        assert any("_v4" in name for name in labels_run), sorted(set(labels_run))
    (loss_gpu, grads_gpu), (loss_ckpt, grads_ckpt) = results
    assert_close(np.float64(loss_gpu), np.float64(loss_ref), "gpu_loss")
    for k in grads_ref:
        assert_close(grads_gpu[k], grads_ref[k], "gpu_grads", k)
    assert loss_ckpt == loss_gpu and grads_ckpt.keys() == grads_gpu.keys()
    for k in grads_gpu:
        np.testing.assert_array_equal(grads_ckpt[k], grads_gpu[k], err_msg=k)
