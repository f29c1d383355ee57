"""Float16-arithmetic GEMM candidates (gemm_core.wgsl's f16 core; TileConfig.half): they join the tuner only for
float16 operands on adapters with `shader-f16` (lavapipe via Vulkan; the OpenGL adapter lacks it), unless
WGPU_TRAIN_F16_ARITHMETIC=0; each config of both tiled families (float weights, frozen float16 weights) against
float64 within the derived bound (f16_arithmetic_slack), and on CPU adapters bit for bit against a NumPy model of
the arithmetic; the tuner checks and times them; a 16-bit training step through them against the NumPy engine."""
from __future__ import annotations

import numpy as np
import pytest

import wgpu_train as wt
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import gemm as G
from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
from wgpu_train.engines.webgpu.tuned import gemm_source as T
from wgpu_train.engines.webgpu.tuned import gemm_tolerance as GT
from wgpu_train.engines.webgpu.tuned import quant as Q
from wgpu_train.engines.webgpu.tuned import quant_source as QT
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem, QTiled

from tiny_models import build_model, save_model

def needs_f16(rt):
    if "shader-f16" not in rt.features:
        pytest.skip(f"{rt.info.describe()} lacks shader-f16 (test_candidates_only_where_they_apply: none offered)")


def f16_model(A: np.ndarray, B: np.ndarray, fused: bool) -> np.ndarray:
    """op(A) @ op(B) as the f16 core computes it: per 4 steps of k, multiply-adds from zero rounded to f16 (fused:
    one rounding each; else the product, then the sum), each partial added to a float32 accumulator in k order."""
    M, K = A.shape
    acc = np.zeros((M, B.shape[1]), np.float32)
    for k0 in range(0, K, GT.F16_CHUNK):
        part = np.zeros(acc.shape, np.float64)
        for k in range(k0, min(K, k0 + GT.F16_CHUNK)):
            prod = A[:, k, None] * B[None, k, :]
            if not fused:
                prod = prod.astype(np.float16).astype(np.float64)
            part = (prod + part).astype(np.float16).astype(np.float64)
        acc = (acc + part.astype(np.float32)).astype(np.float32)
    return acc


def _upload(rt, rng, n, fmt, bufs):
    v = storage.rounded(rng.standard_normal(n).astype(np.float32), fmt).astype(np.float64)
    bufs.append(storage.upload(rt, v, fmt, "f16 arithmetic test"))
    return v, bufs[-1]


def _run(rt, cand, p, c_buf, n):
    rec = rt.recorder()
    for d in cand.dispatches(p):
        rec.dispatch(*d)
    rec.submit()
    return storage.read(rt, c_buf, n).astype(np.float64)


# ---- which candidates exist where --------------------------------------------------------------------------

def test_half_configs():
    names = [c.name for c in [*T.HALF_CONFIGS, *QT.QTILE_HALF_CONFIGS]]
    assert all(n.endswith("_f16") for n in names) and len(set(T.HALF_CONFIGS)) == len(T.HALF_CONFIGS)
    for cfg in [*T.HALF_CONFIGS, *QT.QTILE_HALF_CONFIGS]:
        assert cfg.half and not cfg.subgroups and cfg.bk % GT.F16_CHUNK == 0
        assert T.kernel_features(cfg) == ("shader-f16",)
        assert T.workgroup_bytes(cfg) == 2 * (cfg.bm + cfg.bn) * cfg.bk * (2 if cfg.double_buffer else 1) <= 16384
        assert T.fits(cfg, {}, ("shader-f16",)) and not T.fits(cfg, {}, ("subgroup",))
    with pytest.raises(ValueError, match="subgroup"):
        T.TileConfig(64, 64, 16, 8, 8, subgroups=True, half=True)
    with pytest.raises(ValueError, match="split-K"):
        GK.Tiled(T.HALF_CONFIGS[0], splits=4)
    assert not any(c.half for c in [*T.TILED_CONFIGS, *QT.QTILE_CONFIGS])


def test_candidates_only_where_they_apply(rt, monkeypatch):
    """Float16 A and B on an adapter with shader-f16: the f16 candidates join, after every float32 one (the untuned
    default stays float32 arithmetic), and the tuner's key says so; any other mix of formats, the OpenGL adapter,
    or WGPU_TRAIN_F16_ARITHMETIC=0: none. The same for the frozen-weight GEMM with a float16 weight and A."""
    rng, bufs = np.random.default_rng(0), []
    M, N, K = 8, 16, 12
    ops = {fmt: (_upload(rt, rng, M * K, fmt, bufs)[1], _upload(rt, rng, K * N, fmt, bufs)[1])
           for fmt in ("f16", "bf16")}
    c = storage.upload(rt, np.zeros(M * N, np.float32), "f16")
    w16 = Q.QuantMatrix(rt, rng.standard_normal((N, K)).astype(np.float32), "float16", "w")
    wbf = Q.QuantMatrix(rt, rng.standard_normal((N, K)).astype(np.float32), "bfloat16", "w")

    def halves():
        out = {}
        for a_fmt, b_fmt in (("f16", "f16"), ("f16", "bf16"), ("bf16", "f16")):
            p = G.gemm_problem(rt, c, ops[a_fmt][0], ops[b_fmt][1], M, N, K)
            cands = p.candidates()
            out[a_fmt, b_fmt] = [x.name for x in cands if getattr(x, "half", False)]
            assert p.key().endswith(" f16a") == bool(out[a_fmt, b_fmt])    # the tuner's choice depends on them
            if out[a_fmt, b_fmt]:
                assert not getattr(cands[0], "half", False)
                first = [i for i, x in enumerate(cands) if x.family == "tiled-f16"][0]
                assert all(x.family != "tiled" for x in cands[first:])
        for w in (w16, wbf):
            for a_fmt in ("f16", "bf16"):
                q = QProblem(rt, c, ops[a_fmt][0], w, 0, "nt", M)
                cands = q.candidates()
                out[w.dtype, a_fmt] = [x.name for x in cands if getattr(x, "half", False)]
                assert q.key().endswith(" f16a") == bool(out[w.dtype, a_fmt])
                assert not getattr(cands[0], "half", False)
        return out

    try:
        found = halves()
        if "shader-f16" in rt.features:
            assert sorted(found.pop(("f16", "f16"))) == sorted(f"tiled/{cfg.name}" for cfg in T.HALF_CONFIGS)
            assert sorted(found.pop(("float16", "f16"))) == sorted(f"qtiled/{c.name}" for c in QT.QTILE_HALF_CONFIGS)
        assert not any(found.values()), found
        monkeypatch.setenv("WGPU_TRAIN_F16_ARITHMETIC", "0")
        assert not any(halves().values())
    finally:
        rt.release(c, *bufs, *[b for w in (w16, wbf) for b, _, _ in w.chunks])


# ---- the kernels against float64 and against a model of their arithmetic --------------------------------------

@pytest.mark.parametrize("cfg", T.HALF_CONFIGS, ids=lambda c: c.name)
def test_float_gemm_in_f16_arithmetic(rt, cfg):
    """Layouts nn / nt / tn with ragged tiles (aligned to 4 for vec4), alpha, bias and accumulation, C in float32
    and float16: within gemm_tolerance + f16_arithmetic_slack of float64, and, on a CPU adapter, equal to the
    NumPy model of the f16 core (lavapipe: unfused, bit for bit) before alpha, bias and C's rounding."""
    needs_f16(rt)
    rng, bufs = np.random.default_rng(1), []
    M, N, K = (cfg.bm + 4, cfg.bn + 12, 3 * cfg.bk + 4) if cfg.vec4 else (cfg.bm + 3, cfg.bn + 6, 3 * cfg.bk + 5)
    try:
        cases = (("nn", "f32", 1.0, False, False), ("nt", "f16", 1.0, False, False), ("tn", "f32", -2.0, True, True),
                 ("nt", "f16", 0.5, True, True))
        for layout, c_fmt, alpha, bias, accumulate in cases:
            a, ab = _upload(rt, rng, M * K, "f16", bufs)
            b, bb = _upload(rt, rng, K * N, "f16", bufs)
            c0, cb = _upload(rt, rng, M * N, c_fmt, bufs)
            bias_v = rng.standard_normal(N).astype(np.float32)
            bias_b = rt.upload(bias_v, "bias") if bias else None
            bufs += [bias_b] if bias else []
            A = a.reshape(K, M).T if layout[0] == "t" else a.reshape(M, K)
            B = b.reshape(N, K).T if layout[1] == "t" else b.reshape(K, N)
            p = G.gemm_problem(rt, cb, ab, bb, M, N, K, layout, alpha, bias_b, accumulate)
            cand = GK.Tiled(cfg)
            assert cand.applies(p), (cfg.name, layout)
            got = _run(rt, cand, p, cb, M * N).reshape(M, N)
            extra = (bias_v.astype(np.float64) if bias else 0.0) + (c0.reshape(M, N) if accumulate else 0.0)
            want = alpha * (A @ B) + extra
            tol = GT.gemm_tolerance(alpha, K, want, c_fmt) + GT.f16_arithmetic_slack(alpha, K, A, B)
            err = np.abs(got - want).max()
            assert err <= tol, (cfg.name, layout, err, tol)
            if GK.is_cpu(rt) and not (bias or accumulate) and alpha == 1.0:   # the model; C rounded once
                models = [storage.rounded(f16_model(A, B, fused), c_fmt).reshape(M, N) for fused in (False, True)]
                assert any(np.array_equal(got, m) for m in models), (
                    f"{cfg.name} {layout}: matches neither the unfused nor the fused model of f16 arithmetic (max "
                    f"differences {[float(np.abs(got - m).max()) for m in models]})")
    finally:
        rt.release(*bufs)


def test_f16_arithmetic_is_what_runs(rt):
    """(1 + 2^-10)^2 = 1 + 2^-9 + 2^-20: float32 arithmetic keeps the 2^-20, float16's product rounds it away. So a
    float16-arithmetic candidate gives 1 + 2^-9 exactly into a float32 C, and the float32 candidate does not."""
    needs_f16(rt)
    x = np.full(4, 1 + 2.0 ** -10, np.float32)
    a, b = storage.upload(rt, x, "f16"), storage.upload(rt, x, "f16")
    c = storage.upload(rt, np.zeros(4, np.float32), "f32")
    try:
        p = G.gemm_problem(rt, c, a, b, 2, 2, 1, "nn")
        by_half = {getattr(x, "half", False): x for x in p.candidates() if x.family.startswith("tiled")}
        assert _run(rt, by_half[True], p, c, 4).tolist() == [1 + 2.0 ** -9] * 4
        assert _run(rt, by_half[False], p, c, 4).tolist() == [(1 + 2.0 ** -10) ** 2] * 4
    finally:
        rt.release(a, b, c)


@pytest.mark.parametrize("layout", ["nt", "nn"])
def test_frozen_float16_weight_in_f16_arithmetic(rt, layout):
    """The frozen-weight tiled GEMM with a float16 weight and A, every f16 config, C float32 and float16 with bias
    and accumulation: within the bound of float64 on the weight as stored."""
    needs_f16(rt)
    rng, bufs = np.random.default_rng(2), []
    rows, cols, M = 70, 38, 33          # even (a float16 C), not a multiple of 8 (groups straddle words)
    w = Q.QuantMatrix(rt, rng.standard_normal((rows, cols)).astype(np.float32), "float16", "w")
    W = w.read(rt).astype(np.float64)
    op_w = W.T if layout == "nt" else W
    K, N = op_w.shape
    try:
        for cfg, c_fmt in zip(QT.QTILE_HALF_CONFIGS, ("f32", "f16")):
            a, ab = _upload(rt, rng, M * K, "f16", bufs)
            c0, cb = _upload(rt, rng, M * N, c_fmt, bufs)
            bias_v = rng.standard_normal(N).astype(np.float32)
            bufs.append(rt.upload(bias_v, "bias"))
            p = QProblem(rt, cb, ab, w, 0, layout, M, bufs[-1], True)
            cand = QTiled(cfg)
            assert cand.applies(p)
            got = _run(rt, cand, p, cb, M * N).reshape(M, N)
            A = a.reshape(M, K)
            want = A @ op_w + bias_v + c0.reshape(M, N)
            tol = GT.gemm_tolerance(1.0, K, want, c_fmt) + GT.f16_arithmetic_slack(1.0, K, A, op_w)
            err = np.abs(got - want).max()
            assert err <= tol, (cfg.name, c_fmt, err, tol)
    finally:
        rt.release(*bufs, *[b for b, _, _ in w.chunks])


def test_the_tuner_checks_them_with_their_own_bound(rt, monkeypatch):
    """Float16 arithmetic needs its own bound: on a product with heavy cancellation (signs alternating along k,
    |products| ~ 1e4) an f16 candidate errs by far more than the float32 bound (gemm_tolerance) and stays within
    it plus f16_arithmetic_slack, where the float32 candidate of the same tile is exact. tune.measure checks each
    candidate with its own: the f16 ones pass and are timed; with their slack taken away they fail, and the
    float32 ones, checked without it, still pass."""
    needs_f16(rt)
    rng, bufs = np.random.default_rng(4), []
    M, N, K = 8, 8, 256
    sign = np.where(np.arange(K) % 2 == 0, 1.0, -1.0)
    a = storage.rounded((sign * (100 + rng.random((M, K)))).astype(np.float32), "f16").astype(np.float64)
    b = storage.rounded((100 + rng.random((K, N))).astype(np.float32), "f16").astype(np.float64)
    bufs += [storage.upload(rt, a, "f16"), storage.upload(rt, b, "f16"), storage.upload(rt, np.zeros(M * N), "f32")]
    try:
        p = G.gemm_problem(rt, bufs[2], bufs[0], bufs[1], M, N, K)
        want, A, B = a.reshape(M, K) @ b.reshape(K, N), a.reshape(M, K), b.reshape(K, N)
        by_half = {x.half: x for x in p.candidates() if x.name.startswith("tiled/t64x64x16_8x4")}
        f32_bound = GT.gemm_tolerance(1.0, K, want)
        err = {half: np.abs(_run(rt, c, p, bufs[2], M * N).reshape(M, N) - want).max() for half, c in by_half.items()}
        assert err[False] <= f32_bound < 10 * f32_bound < err[True] <= f32_bound + GT.f16_arithmetic_slack(1.0, K, A, B)

        a2, b2 = _upload(rt, rng, 64 * 32, "f16", bufs)[1], _upload(rt, rng, 32 * 64, "f16", bufs)[1]
        c = storage.upload(rt, np.zeros(64 * 64, np.float32), "f16")
        bufs.append(c)
        q = G.gemm_problem(rt, c, a2, b2, 64, 64, 32)     # measure() runs its candidates on a random replica
        cands = [x for x in q.candidates() if x.name.startswith("tiled/t64x64x16_8x4")]
        assert sorted(x.half for x in cands) == [False, False, True, True]
        results = tune.measure(rt, q, cands)
        assert all(g and g > 0 for g in results.values()), results
        monkeypatch.setattr(GT, "f16_arithmetic_slack", lambda *args: -np.inf)
        results = tune.measure(rt, q, cands)
        assert {x.name for x in cands if results[x.name] is None} == {x.name for x in cands if x.half}, results
    finally:
        rt.release(*bufs)


# ---- a training step through them ---------------------------------------------------------------------------

def test_lora_step_through_f16_arithmetic_matches_numpy(tmp_path, rt, monkeypatch):
    """f16 precision with float16 frozen weights, every frozen-weight GEMM pinned to an f16-arithmetic candidate:
    logits, loss and LoRA gradients against the NumPy engine (float32 arithmetic, the same rounding points) within
    f16_arith_* (test_precision_gpu's f16 differences plus what f16 arithmetic adds, measured here)."""
    needs_f16(rt)
    from test_precision_gpu import _batch, _check, _pair

    save_model(build_model("llama", seed=2, intermediate_size=42), tmp_path)
    lora = wt.LoraConfig(target_modules=["q_proj", "v_proj", "down_proj"], r=3, alpha=6)
    ref, gpu = _pair(tmp_path, rt, "f16", lora, base_dtype="float16")
    chosen, choose = [], tune.choose
    monkeypatch.setattr(tune, "choose", lambda *args: chosen.append(c := choose(*args)) or c)
    with tune.pinned(f"qtiled/{QT.QTILE_HALF_CONFIGS[0].name}"):
        _check(ref, gpu, *_batch(), "f16_arith")
    assert {c.name for c in chosen if c.family == "qtiled-f16"}, "no f16-arithmetic kernel ran"


def test_the_precision_bench_times_both_arithmetics(rt, monkeypatch):
    """`wgpu-train bench --only precision`'s f16-arithmetic rows (a small shape here): both GEMMs, each checked,
    timed in both arithmetics where the adapter has shader-f16; said not offered elsewhere."""
    from wgpu_train.bench import precision
    from wgpu_train.engines.webgpu.device.timing import Timer

    monkeypatch.setattr(precision, "GEMM", (24, 40, 32))
    out = precision._f16_arithmetic(rt, Timer(rt))
    assert out["offered"] == ("shader-f16" in rt.features), out
    for name in ("qgemm_float16_weight", "gemm_float16_operands") if out["offered"] else ():
        row = out[name]
        assert row["f16_arithmetic_gflops"] > 0 and row["f32_arithmetic_gflops"] > 0
        assert row["f16_time_vs_f32"] == pytest.approx(row["f32_arithmetic_gflops"] / row["f16_arithmetic_gflops"])
