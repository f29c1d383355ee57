"""The GEMM kernel families through the path the engine runs (gemm.gemm, each family pinned), and the
autotuner: its choice, its per-adapter cache (written, read back, stale, corrupt) and its controls."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from wgpu_train.errors import ConfigError
from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import tune

# (M, N, K, layout): odd and aligned shapes; a long K with a small output, where split-K applies
SHAPES = [(33, 17, 1500, "tn"), (40, 64, 36, "nt"), (64, 96, 200, "nn"), (7, 130, 600, "tt"), (5, 9, 1100, "nt")]


def _operands(rng, M, N, K, layout):
    a = rng.standard_normal((K, M) if layout[0] == "t" else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if layout[1] == "t" else (K, N)).astype(np.float32)
    want = (a.T if layout[0] == "t" else a).astype(np.float64) @ (b.T if layout[1] == "t" else b)
    return a, b, want


@pytest.fixture
def fresh_tuner(rt, tmp_path, monkeypatch):
    """The tuner with an empty cache folder and no in-process choices (restored afterwards)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tune.forget(rt)
    yield tmp_path / "wgpu-train" / "tune"
    tune.forget(rt)


@pytest.mark.parametrize("family", ["register", "tiled", "splitk"])
def test_each_family_through_gemm(rt, family):
    """gemm.gemm with each family pinned equals NumPy, with bias, alpha and accumulation; the pinned family is
    the one that runs wherever it applies (split-K only where the product is skinny)."""
    rng = np.random.default_rng(3)
    runs = []
    rec = rt.recorder()
    with tune.pinned(family):
        for M, N, K, layout in SHAPES:
            a, b, want = _operands(rng, M, N, K, layout)
            bias = rng.standard_normal(N).astype(np.float32)
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            ab, bb, biasb, cb = rt.upload(a), rt.upload(b), rt.upload(bias), rt.upload(c0)
            p = G.gemm_problem(rt, cb, ab, bb, M, N, K, layout)
            chosen = tune.choose(rt, p).family
            names = [c.family for c in GK.candidates(p)]
            assert chosen == family or family not in names
            G.gemm(rec, cb, ab, bb, M, N, K, layout, alpha=0.5, bias=biasb, accumulate=True)
            runs.append((cb, 0.5 * want + bias + c0, K, chosen))
    rec.submit()
    assert any(chosen == family for *_, chosen in runs), f"no test shape ran the {family} family"
    for cb, want, K, chosen in runs:
        got = rt.read(cb, np.float32, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K), err_msg=chosen)


def test_candidates_default_first(rt):
    """On a CPU adapter the untuned choice is the register kernel measured there; on a GPU a tiled one."""
    buf = rt.buffer(256 * 256 * 4)
    p = G.gemm_problem(rt, rt.buffer(256 * 256 * 4), buf, buf, 256, 256, 256, "nt")
    first = GK.candidates(p)[0]
    assert first.family == ("register" if GK.is_cpu(rt) else "tiled")
    assert all(c.applies(p) for c in GK.candidates(p) if c.family != "register")


def test_tuner_chooses_caches_and_reuses(rt, fresh_tuner, monkeypatch):
    """WGPU_TRAIN_TUNE=full times the candidates of a new shape, keeps the fastest that is correct, writes the
    cache file, and a new process (a forgotten runtime state) reads the choice back without timing again."""
    monkeypatch.setenv("WGPU_TRAIN_TUNE", "full")
    monkeypatch.setattr(tune, "FAST_CANDIDATES", 3)
    rng = np.random.default_rng(5)
    a, b, want = _operands(rng, 24, 20, 40, "nt")
    ab, bb, cb = rt.upload(a), rt.upload(b), rt.buffer(24 * 20 * 4)
    p = G.gemm_problem(rt, cb, ab, bb, 24, 20, 40, "nt")
    chosen = tune.choose(rt, p)
    (key, name, gflops), = tune.tuned_log(rt)
    assert name == chosen.name and key == p.key()
    timed = {k: v for k, v in gflops.items() if v is not None}
    assert timed and max(timed, key=timed.get) == name
    files = list(fresh_tuner.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["entries"][key]["choice"] == name and data["checksum"] == tune.sources_checksum()
    assert data["adapter"]["name"] == rt.info.name

    tune.forget(rt)
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **k: pytest.fail("re-timed a cached shape"))
    assert tune.choose(rt, p).name == name
    rec = rt.recorder()
    G.gemm(rec, cb, ab, bb, 24, 20, 40, "nt")
    rec.submit()
    np.testing.assert_allclose(rt.read(cb, np.float32, (24, 20)), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("damage", ["corrupt", "stale"])
def test_tuner_cache_corrupt_or_stale_is_retuned(rt, fresh_tuner, monkeypatch, caplog, damage):
    """An unreadable cache file, or one made by other kernel sources, gives one warning and is re-tuned and
    replaced (atomically) by a valid file."""
    monkeypatch.setenv("WGPU_TRAIN_TUNE", "full")
    monkeypatch.setattr(tune, "FAST_CANDIDATES", 2)
    buf = rt.buffer(16 * 16 * 4)
    p = G.gemm_problem(rt, rt.buffer(16 * 16 * 4), buf, buf, 16, 16, 16, "nn")
    path = tune.TuneCache(rt).path
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "corrupt":
        path.write_text('{"entries": {"gemm nn m16')
    else:
        path.write_text(json.dumps({"version": tune.CACHE_VERSION, "checksum": "0" * 16, "peak_gflops": 1.0,
                                    "entries": {p.key(): {"choice": "register/x"}}}))
    with caplog.at_level(logging.WARNING, logger="wgpu_train"):
        name = tune.choose(rt, p).name
    warnings = [r.getMessage() for r in caplog.records if "tune cache" in r.getMessage()]
    assert warnings and "re-tuning" in warnings[0]
    data = json.loads(path.read_text())
    assert data["checksum"] == tune.sources_checksum() and data["entries"][p.key()]["choice"] == name
    assert not list(path.parent.glob("*.tmp")), "a temporary file was left behind"


def test_tuner_modes(rt, fresh_tuner, monkeypatch):
    """off never tunes; an unknown mode is one clear error; fast keeps CPU adapters on the measured default."""
    buf = rt.buffer(16 * 16 * 4)
    p = G.gemm_problem(rt, rt.buffer(16 * 16 * 4), buf, buf, 16, 16, 16, "nt")
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **k: pytest.fail("tuned"))
    monkeypatch.setenv("WGPU_TRAIN_TUNE", "off")
    assert tune.choose(rt, p).name == GK.candidates(p)[0].name
    if GK.is_cpu(rt):
        monkeypatch.setenv("WGPU_TRAIN_TUNE", "fast")
        assert tune.choose(rt, p).name == GK.candidates(p)[0].name
    monkeypatch.setenv("WGPU_TRAIN_TUNE", "sometimes")
    with pytest.raises(ConfigError, match="WGPU_TRAIN_TUNE='sometimes' is not one of off, fast, full"):
        tune.choose(rt, p)


def test_grad_norm_uses_many_workgroups(rt):
    """The gradient norm's partial sums use one workgroup per 4096 elements (up to 1024) and agree with NumPy,
    including a tensor given as an offset view and a second tensor accumulated into the same slots."""
    from wgpu_train.engines.webgpu import kernels as K

    rng = np.random.default_rng(9)
    g = rng.standard_normal(50_001).astype(np.float32)
    h = rng.standard_normal(3_000).astype(np.float32)
    slots = K.grad_norm_slots(g.size)
    assert slots == 13 and K.grad_norm_slots(10**9) == K.NORM_MAX_WORKGROUPS
    gb = rt.upload(np.concatenate([np.zeros(7, np.float32), g]))
    part, result = rt.buffer((slots + 1) * 4), rt.buffer(16)
    rec = rt.recorder()
    K.grad_norm_partial(rec, part, 1, (gb, 7), g.size)
    K.grad_norm_partial(rec, part, 1, rt.upload(h), h.size, accumulate=True)
    K.grad_norm_finalize(rec, result, part, slots + 1, 0.0)
    rec.submit()
    norm = rt.read(result, np.float32, (3,))[0]
    want = np.sqrt(np.sum(g.astype(np.float64) ** 2) + np.sum(h.astype(np.float64) ** 2))
    np.testing.assert_allclose(norm, want, rtol=1e-5)


@pytest.mark.parametrize("family", ["tiled", "splitk"])
def test_family_operand_past_max_binding(default_rt, family):
    """An operand near the end of a buffer larger than one storage binding (bound as an aligned range, the
    rest of its offset in the uniform), for the tiled and split-K kernels; aligned and unaligned offsets."""
    rt = default_rt
    n_elems = rt.max_binding // 4 + 4000
    if n_elems * 4 > rt.max_buffer:
        pytest.skip("device cannot allocate a buffer larger than its max storage binding")
    M, N, K = 12, 20, 600
    rng = np.random.default_rng(7)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    big, bb = rt.buffer(n_elems * 4, "test.big"), rt.upload(b)
    try:
        for off in (n_elems - M * K - 3, n_elems - M * K - 64):
            rt.write(big, a, offset=off * 4)
            cb = rt.buffer(M * N * 4)
            with tune.pinned(family):
                dispatches = G.gemm_dispatches(rt, cb, (big, off), bb, M, N, K, "nt")
            assert dispatches[0][0].label.split(".")[1].startswith("gemm_tiled")
            assert any(isinstance(r, tuple) and r[0] is big for r in dispatches[0][1]), "expected a range binding"
            rec = rt.recorder()
            for d in dispatches:
                rec.dispatch(*d)
            rec.submit()
            np.testing.assert_allclose(rt.read(cb, np.float32, (M, N)), a.astype(np.float64) @ b.T,
                                       rtol=1e-5, atol=1e-5 * np.sqrt(K))
    finally:
        rt.release(big)


class _FakeAdapter:
    """Just what TuneCache reads of a runtime (no device needed)."""

    def __init__(self):
        from types import SimpleNamespace
        self.info = SimpleNamespace(name="fake", vendor="none", backend="Vulkan", adapter_type="CPU")
        self.adapter = SimpleNamespace(info={"description": "test driver"})


def _put_many(prefix, n):
    store = tune.TuneCache(_FakeAdapter())
    for i in range(n):
        store.put(f"{prefix} {i}", {"choice": f"register/{prefix}{i}", "gflops": {}})


def test_tune_cache_two_writers(tmp_path, monkeypatch):
    """Two processes writing the same adapter's cache at once: every choice of both survives, and the file
    is whole JSON (merged under a lock, replaced atomically)."""
    import multiprocessing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_put_many, args=(p, 25)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = tune.TuneCache(_FakeAdapter())
    assert len(store.entries) == 50
    assert store.get("a 24") == "register/a24" and store.get("b 0") == "register/b0"


@pytest.mark.parametrize("family", ["qregister", "qtiled"])
@pytest.mark.parametrize("fmt", ["float16", "nf4-dq"])
def test_quant_families_through_linear(rt, family, fmt):
    """quant.linear_forward / linear_backward (the engine's path for a frozen weight) with each quantised GEMM
    family pinned, against the dequantised weight; the tuner's key names the weight format."""
    from wgpu_train.engines.webgpu.tuned import quant as Q
    from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem

    rng = np.random.default_rng(11)
    n, fin, fout = 37, 72, 56
    qm = Q.QuantMatrix(rt, rng.standard_normal((fout, fin)).astype(np.float32), fmt, "test.w")
    w = qm.read(rt).astype(np.float64)
    x, dy = rng.standard_normal((n, fin)).astype(np.float32), rng.standard_normal((n, fout)).astype(np.float32)
    y, dx = rt.buffer(n * fout * 4), rt.buffer(n * fin * 4)
    p = QProblem(rt, y, rt.upload(x), qm, 0, "nt", n)
    assert p.key().startswith(f"qgemm {fmt} nt m64 n{fout} k{fin}")
    with tune.pinned(family):
        assert tune.choose(rt, p).family == family
        rec = rt.recorder()
        Q.linear_forward(rec, y, rt.upload(x), qm, None, n)
        Q.linear_backward(rec, dx, rt.upload(dy), qm, n)
        rec.submit()
    np.testing.assert_allclose(rt.read(y, np.float32, (n, fout)), x @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(rt.read(dx, np.float32, (n, fin)), dy @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["tiled", "splitk,tiled"])
def test_tiled_linear_over_weight_chunks(rt, family):
    """tensors.linear_forward / linear_backward over a float32 weight split into row chunks by a shrunk max
    storage binding (each chunk's columns of y and dy at an offset, with the whole row pitch), the tiled
    family pinned; split-K takes the weight gradient (K = 600 tokens)."""
    from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward

    rng = np.random.default_rng(12)
    n, fin, fout = 600, 20, 52
    x = rng.standard_normal((n, fin)).astype(np.float32)
    w = rng.standard_normal((fout, fin)).astype(np.float32)
    dy = rng.standard_normal((n, fout)).astype(np.float32)
    saved = rt.max_binding
    rt.max_binding = 16 * fin * 4 + 256            # chunks of 16 rows
    try:
        wm, dwm = Matrix(rt, fout, fin, "test.w", w), Matrix(rt, fout, fin, "test.dw", np.zeros_like(w))
        assert len(wm.chunks) == 4
        rt.max_binding = saved                       # activations of full size; the weight stays chunked
        y, dx = rt.buffer(n * fout * 4), rt.buffer(n * fin * 4)
        with tune.pinned(family):
            rec = rt.recorder()
            linear_forward(rec, y, rt.upload(x), wm, None, n)
            linear_backward(rec, dx, dwm, None, rt.upload(dy), rt.upload(x), wm, n)
            rec.submit()
    finally:
        rt.max_binding = saved
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    np.testing.assert_allclose(rt.read(y, np.float32, (n, fout)), x64 @ w64.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(rt.read(dx, np.float32, (n, fin)), dy64 @ w64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dwm.read(rt), dy64.T @ x64, rtol=1e-5, atol=1e-5 * np.sqrt(n) * 4)


def test_fast_mode_times_every_family(rt):
    """fast mode's candidates hold each family's likeliest one, whatever the ranking puts last."""
    buf = rt.buffer(4 * 64 * 1024)
    p = G.gemm_problem(rt, rt.buffer(4 * 32 * 64), buf, buf, 32, 64, 1024, "tn")
    cands = GK.candidates(p)
    fast = tune.fast_set(cands)
    assert len(fast) == min(tune.FAST_CANDIDATES, len(cands))
    assert {c.family for c in fast} == {c.family for c in cands} == {"register", "tiled", "splitk"}
    assert fast == sorted(fast, key=cands.index)
