"""The grouped-expert kernel family (engines/webgpu/moe.py, tuned/moe_kernels.py) against the reference op pairs of
engines/shared/moe.py, on every adapter present and every candidate: the router's top-k and its backward, the
counting sort, and the experts' forward and backward (LoRA on both expert parameters, the base weights' gradients),
with sizes that are not multiples of 4, 16 or 64, an expert that receives no pair and one that receives them all;
float32 and 16-bit expert weights, 16-bit outputs in the tuner's check; the router's load-balancing loss; and the
recording neither submits nor reads back."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tolerances import assert_close
from wgpu_train.engines.shared import moe as ref
from wgpu_train.engines.webgpu import moe
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.engines.webgpu.tuned import moe_kernels as MK
from wgpu_train.engines.webgpu.tuned import moe_packed
from wgpu_train.engines.webgpu.tuned.adapter_traits import use_subgroups

N, C, I, E, K, R = 13, 44, 20, 5, 2, 3     # tokens, hidden, expert width, experts, top-k, LoRA rank
GEMMS = ([f"moe_gemm/{cfg.name}" for cfg in MK.GEMM_CONFIGS]
         + [f"moe_gemm/reg_{kind}_m{tm}_wg{wg}" for kind in ("sg", "portable") for tm, wg in
            zip(MK.REGISTER_TMS, MK.REGISTER_WGS)])
OUTERS = [f"moe_outer/split{s}" for s in MK.SPLITS] + ["moe_outer/direct"]


def _routing(kind: str, rng) -> np.ndarray:
    """experts (N, K) i32: "spread" never routes to expert 0; "one" routes every pair of a top-1 to expert 3."""
    if kind == "one":
        return np.full((N, 1), 3, np.int32)
    return np.stack([rng.choice(np.arange(1, E), K, replace=False) for _ in range(N)]).astype(np.int32)


def _lora(rng, out_f, in_f, scale):
    return (rng.standard_normal((E, R, in_f)).astype(np.float32) * 0.3,
            rng.standard_normal((E, out_f, R)).astype(np.float32) * 0.3, scale)


def _upload_lora(rt, lora):
    a, b, scale = lora
    return moe.MoeLora(rt.upload(a), rt.upload(b), scale, R)


def test_route_forward_and_backward(rt):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((N, E)).astype(np.float32)
    logits[2] = logits[2, 0]                           # all equal: the lower index first
    logits[5, 3] = logits[5, 1] = logits[5].max() + 1  # a tie at the top
    dweights = rng.standard_normal((N, K)).astype(np.float32)
    dprobs = rng.standard_normal((N, E)).astype(np.float32)
    for normalize, extra in itertools.product((False, True), (None, dprobs)):
        want_w, want_e = ref.moe_route_forward(logits.astype(np.float64), K, normalize)
        want_d = ref.moe_route_backward(dweights.astype(np.float64), logits.astype(np.float64), want_e, normalize,
                                        extra)
        bufs = [rt.buffer(N * K * 4), rt.buffer(N * K * 4), rt.buffer(N * E * 4), rt.upload(logits),
                rt.upload(dweights)] + ([rt.upload(extra)] if extra is not None else [])
        w, ex, dl, lg, dw = bufs[:5]
        rec = rt.recorder()
        moe.moe_route_forward(rec, w, ex, lg, N, E, K, normalize)
        moe.moe_route_backward(rec, dl, dw, lg, ex, N, E, K, normalize, bufs[5] if extra is not None else None)
        rec.submit()
        assert (rt.read(ex, np.int32, (N, K)) == want_e).all(), f"experts, normalize={normalize}"
        assert_close(rt.read(w, np.float32, (N, K)), want_w, "moe_route", f"weights, normalize={normalize}")
        assert_close(rt.read(dl, np.float32, (N, E)), want_d, "moe_route", f"dlogits, normalize={normalize}, "
                     f"dprobs={extra is not None}")
        rt.release(*bufs)



def test_sigmoid_route_forward_and_backward(rt):
    """LFM2-MoE's router: sigmoid scores, an expert bias that chooses (it flips the top-k here) but does not weigh,
    renormalised over the sum plus 1e-6 or not, times the scale; the backward through the chosen scores alone."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((N, E)).astype(np.float32)
    logits[2] = logits[2, 0]                           # all equal: the lower index first
    bias = (rng.standard_normal(E) * 0.5).astype(np.float32)
    dweights = rng.standard_normal((N, K)).astype(np.float32)
    for normalize, b, scale in ((True, bias, 2.5), (False, bias, 1.0), (True, None, 1.0)):
        want_w, want_e = ref.moe_route_forward(logits.astype(np.float64), K, normalize, "sigmoid",
                                               None if b is None else b.astype(np.float64), scale)
        if b is not None:
            assert (want_e != ref.moe_route_forward(logits, K, normalize, "sigmoid")[1]).any(), "the bias chose"
        want_d = ref.moe_route_backward(dweights.astype(np.float64), logits.astype(np.float64), want_e, normalize,
                                        None, "sigmoid", scale)
        bufs = [rt.buffer(N * K * 4), rt.buffer(N * K * 4), rt.buffer(N * E * 4), rt.upload(logits),
                rt.upload(dweights)] + ([rt.upload(b)] if b is not None else [])
        w, ex, dl, lg, dw = bufs[:5]
        rec = rt.recorder()
        moe.moe_route_forward(rec, w, ex, lg, N, E, K, normalize, "sigmoid", bufs[5] if b is not None else None,
                              scale)
        moe.moe_route_backward(rec, dl, dw, lg, ex, N, E, K, normalize, None, "sigmoid", scale)
        rec.submit()
        what = f"normalize={normalize}, bias={b is not None}, scale={scale}"
        assert (rt.read(ex, np.int32, (N, K)) == want_e).all(), f"experts, {what}"
        assert_close(rt.read(w, np.float32, (N, K)), want_w, "moe_route", f"weights, {what}")
        assert_close(rt.read(dl, np.float32, (N, E)), want_d, "moe_route", f"dlogits, {what}")
        rt.release(*bufs)

@pytest.mark.parametrize("n, k", [(13, 2), (300, 3), (7, 1)])
def test_counting_sort_is_stable_and_leaves_no_gap(rt, n, k):
    rng = np.random.default_rng(n)
    experts = np.stack([rng.choice(np.arange(1, E), k, replace=False) for _ in range(n)]).astype(np.int32)
    scratch = moe.MoeScratch(rt, n, k, E, 4, 2)
    ex = rt.upload(experts)
    rec = rt.recorder()
    moe.moe_group(rec, ex, n, k, E, scratch)
    rec.submit()
    off_buf, off = moe.offsets_view(scratch, n, k, E)
    offsets = rt.read(off_buf, np.uint32, (off + E + 1,))[off:]
    perm = rt.read(scratch.perm, np.uint32, (n * k,))
    want_perm = np.argsort(experts.reshape(-1), kind="stable")
    assert (perm == want_perm).all() and offsets[0] == 0 and offsets[1] == 0 and offsets[-1] == n * k
    assert (np.diff(offsets) == np.bincount(experts.reshape(-1), minlength=E)).all()
    scratch.release(rt)
    rt.release(ex)


def _chosen(rt, pin: str, rows: int, k: int, C: int, I: int) -> tuple:
    """The names of the grouped GEMM and outer-product candidates `pin` selects for the forward's gate / up shape
    (a pin no candidate matches would silently test the default)."""
    with tune.pinned(pin):
        gemm = tune.choose(rt, MK.MoeGemmProblem(rt, {}, rows, k, E, C, I, "nt", True, R, 1.0, swiglu=True))
        outer = tune.choose(rt, MK.MoeOuterProblem(rt, {"part": None}, rows, k, E, C, R, True, False, True))
    return gemm.name, outer.name


def _experts_case(rt, routing: str, fmt: str, pin: str):
    """Forward and backward of the experts on one routing, expert-weight format and pinned candidates, against the
    reference in float64 on the same (rounded) weights."""
    rng = np.random.default_rng(7)
    experts = _routing(routing, rng)
    k = experts.shape[1]
    x = rng.standard_normal((N, C)).astype(np.float32)
    weights = rng.uniform(0.2, 1.0, (N, k)).astype(np.float32)
    gate_up = storage.rounded(rng.standard_normal((E, 2 * I, C)) / 6, fmt).reshape(E, 2 * I, C)
    down = storage.rounded(rng.standard_normal((E, C, I)) / 4, fmt).reshape(E, C, I)
    lgu, ldn = _lora(rng, 2 * I, C, 1.5), _lora(rng, C, I, 0.75)
    dy = rng.standard_normal((N, C)).astype(np.float32)
    f64 = (lambda t: tuple(np.asarray(v, np.float64) if isinstance(v, np.ndarray) else v for v in t))
    want_y, want_gu = ref.moe_experts_forward(x.astype(np.float64), weights.astype(np.float64), experts,
                                              gate_up.astype(np.float64), down.astype(np.float64), f64(lgu), f64(ldn))
    want_dx, want_dw, want_g = ref.moe_experts_backward(dy.astype(np.float64), x.astype(np.float64),
                                                        weights.astype(np.float64), experts, want_gu,
                                                        gate_up.astype(np.float64), down.astype(np.float64),
                                                        f64(lgu), f64(ldn), need_weight_grad=True)
    scratch = moe.MoeScratch(rt, N, k, E, C, I, R)
    ins = [rt.upload(x), rt.upload(weights), rt.upload(experts), storage.upload(rt, gate_up, fmt),
           storage.upload(rt, down, fmt), rt.upload(dy)]
    xb, wb, eb, gub, dnb, dyb = ins
    outs = {"y": rt.buffer(N * C * 4), "gu": rt.buffer(N * k * 2 * I * 4), "dx": rt.buffer(N * C * 4),
            "dw": rt.buffer(N * k * 4)}
    grads = {name: rt.upload(np.full(g.shape, np.nan, np.float32)) for name, g in want_g.items()}
    gl, dl = _upload_lora(rt, lgu), _upload_lora(rt, ldn)
    if "/reg_sg" in pin and not use_subgroups(rt):
        pytest.skip(f"{rt.info.name} does not run the subgroup kernels (no subgroups of 8 lanes or more)")
    chosen = _chosen(rt, pin, N * k, k, C, I)
    assert all(name.startswith(p) for name, p in zip(chosen, pin.split(","))), (pin, chosen)
    before = dict(rt.counters)     # after the subgroup probe, which submits once per device
    with tune.pinned(pin):
        rec = rt.recorder()
        moe.moe_experts_forward(rec, outs["y"], outs["gu"], xb, wb, eb, gub, dnb, gl, dl, N, k, E, C, I, scratch)
        moe.moe_experts_backward(rec, outs["dx"], outs["dw"], grads, dyb, xb, wb, eb, outs["gu"], gub, dnb, gl, dl,
                                 N, k, E, C, I, scratch)
    assert rt.counters["submits"] == before["submits"] and rt.counters["readbacks"] == before["readbacks"]
    rec.submit()
    what = f"{routing} {fmt} {pin}"
    assert_close(rt.read(outs["y"], np.float32, (N, C)), want_y, "moe_experts", f"y, {what}")
    assert_close(rt.read(outs["gu"], np.float32, (N, k, 2 * I)), want_gu, "moe_experts", f"gate_up_out, {what}")
    assert_close(rt.read(outs["dx"], np.float32, (N, C)), want_dx, "moe_experts", f"dx, {what}")
    assert_close(rt.read(outs["dw"], np.float32, (N, k)), want_dw, "moe_experts", f"dweights, {what}")
    for name, g in want_g.items():
        assert_close(rt.read(grads[name], np.float32, g.shape), g, "moe_experts", f"{name}, {what}")
    scratch.release(rt)
    rt.release(*ins, *outs.values(), *grads.values(), gl.a, gl.b, dl.a, dl.b)


@pytest.mark.parametrize("gemm, outer", list(zip(GEMMS, itertools.cycle(OUTERS))))
def test_experts_every_candidate(rt, gemm, outer):
    _experts_case(rt, "spread", "f32", f"{gemm},{outer}")


@pytest.mark.parametrize("gemm, outer", list(zip(["moe_gemm/r4x4", "moe_gemm/reg_portable_m32",
                                                   "moe_gemm/reg_sg_m16"], OUTERS)))
def test_experts_one_expert_takes_every_pair(rt, gemm, outer):
    _experts_case(rt, "one", "f32", f"{gemm},{outer}")


@pytest.mark.parametrize("fmt, gemm", [("bf16", "moe_gemm/r8x2"), ("f16", "moe_gemm/r8x2"),
                                       ("bf16", "moe_gemm/reg_portable_m16"), ("f16", "moe_gemm/reg_sg_m8")])
def test_experts_with_sixteen_bit_weights(rt, fmt, gemm):
    _experts_case(rt, "spread", fmt, f"{gemm},moe_outer/split64")


def test_accumulate_adds_to_the_outputs(rt):
    """accumulate=True adds y, dx and the gradients to what their buffers hold (micro-batches)."""
    rng = np.random.default_rng(3)
    experts = _routing("spread", rng)
    x, dy = (rng.standard_normal((N, C)).astype(np.float32) for _ in range(2))
    weights = rng.uniform(0.2, 1.0, (N, K)).astype(np.float32)
    gate_up = rng.standard_normal((E, 2 * I, C)).astype(np.float32) / 6
    down = rng.standard_normal((E, C, I)).astype(np.float32) / 4
    lgu = _lora(rng, 2 * I, C, 2.0)
    want_y, want_gu = ref.moe_experts_forward(x, weights, experts, gate_up, down, lgu, None)
    want_dx, _, want_g = ref.moe_experts_backward(dy, x, weights, experts, want_gu, gate_up, down, lgu, None)
    y0, dx0 = (rng.standard_normal((N, C)).astype(np.float32) for _ in range(2))
    g0 = {name: rng.standard_normal(g.shape).astype(np.float32) for name, g in want_g.items()}
    scratch = moe.MoeScratch(rt, N, K, E, C, I, R)
    bufs = [rt.upload(v) for v in (x, weights, experts, gate_up, down, dy, y0, dx0)]
    xb, wb, eb, gub, dnb, dyb, yb, dxb = bufs
    gu, dw = rt.buffer(N * K * 2 * I * 4), rt.buffer(N * K * 4)
    grads = {name: rt.upload(v) for name, v in g0.items()}
    gl = _upload_lora(rt, lgu)
    rec = rt.recorder()
    moe.moe_experts_forward(rec, yb, gu, xb, wb, eb, gub, dnb, gl, None, N, K, E, C, I, scratch, accumulate=True)
    moe.moe_experts_backward(rec, dxb, dw, grads, dyb, xb, wb, eb, gu, gub, dnb, gl, None, N, K, E, C, I, scratch,
                             accumulate=True)
    rec.submit()
    assert_close(rt.read(yb, np.float32, (N, C)), y0 + want_y, "moe_experts", "y")
    assert_close(rt.read(dxb, np.float32, (N, C)), dx0 + want_dx, "moe_experts", "dx")
    for name, g in want_g.items():
        assert_close(rt.read(grads[name], np.float32, g.shape), g0[name] + g, "moe_experts", name)
    scratch.release(rt)
    rt.release(*bufs, gu, dw, *grads.values(), gl.a, gl.b)


@pytest.mark.parametrize("problem", ["gemm", "gemm nn", "outer", "gemm bf16", "gemm nn f16", "gemm nf4",
                                     "gemm nn nf4", "gemm mxfp4", "gemm nn mxfp4"])
def test_the_tuners_replica_checks_every_candidate(rt, problem):
    """The tuner's own check of each candidate on a replica (what it runs before timing one on a new adapter): odd
    sizes (the portable kernels alone), and sizes a multiple of 4 (the register-blocked ones too, 70 rows: blocks
    of 32, 16 and 8 left partial); a 16-bit out (16-bit activations: the portable kernels storing pairs of
    columns, the register-blocked ones vec4s) at even sizes; NF4 and MXFP4 experts (decoded inside every candidate;
    MXFP4's blocks of 32 along the stored tensor's last axis: in_f in "nt", the columns in "nn")."""
    fmt = problem.split()[-1] if problem.endswith("16") else "f32"
    out = {"out": storage.set_format(rt.buffer(16), fmt)} if fmt != "f32" else {}
    if problem.endswith(moe_packed.FORMATS):   # a stand-in for the format alone: the replica packs its own experts
        out = {"w": rt.buffer(16)}
        setattr(out["w"], moe_packed.PACKED_ATTRIBUTE, (problem.split()[-1], 0))
    if problem == "gemm":
        p = MK.MoeGemmProblem(rt, {}, 2 * 19, 2, E, 23, 9, "nt", True, rank=R, scale=0.5, swiglu=True)
    elif problem == "gemm nf4":
        p = MK.MoeGemmProblem(rt, out, 2 * 19, 2, E, 23, 9, "nt", True, rank=R, scale=0.5, swiglu=True)
    elif problem == "gemm mxfp4":
        p = MK.MoeGemmProblem(rt, out, 2 * 19, 2, E, 64, 9, "nt", True, rank=R, scale=0.5, swiglu=True)
    elif problem == "gemm nn mxfp4":
        p = MK.MoeGemmProblem(rt, out, 2 * 35, 2, E, 36, 32, "nn", False, rank=R, scale=0.5)
        assert any(c.family == "register" for c in p.candidates())
    elif problem == "gemm bf16":
        p = MK.MoeGemmProblem(rt, out, 2 * 19, 2, E, 22, 10, "nt", True, rank=R, scale=0.5, swiglu=True)
        assert all(c.family == "grouped" for c in p.candidates())
    elif problem.startswith("gemm nn"):
        p = MK.MoeGemmProblem(rt, out, 2 * 35, 2, E, 36, 12, "nn", False, rank=R, scale=0.5)
        assert any(c.family == "register" for c in p.candidates())
    else:
        # expert 1 gets a pair of each of 150 tokens: several tiles of every split, summed by the reduction
        p = MK.MoeOuterProblem(rt, {"part": None}, 2 * 150, 2, E, 7, 5, True, False, True, 0.5, accumulate=True)
    rep, parts, c0, want, bufs = p.replica(np.random.default_rng(1))
    parts = parts if isinstance(parts, list) else [(parts, c0.size)]
    try:
        for cand in rep.candidates():
            for (buf, n), at in zip(parts, np.cumsum([0] + [n for _, n in parts])):
                rt.write(buf, storage.to_words(c0[at:at + n], storage.format_of(buf)))
            rec = rt.recorder()
            for d in cand.dispatches(rep):
                rec.dispatch(*d)
            rec.submit()
            got = np.concatenate([storage.read(rt, buf, n) for buf, n in parts])
            assert np.max(np.abs(got - want)) <= rep.tolerance(want, cand), cand.name
    finally:
        rt.release(*bufs, *out.values())


@pytest.mark.parametrize("tokens", [600, 7])
def test_load_balancing_loss_and_its_gradient(rt, tokens):
    """The router's load-balancing loss on the device (moe.load_balancing_counts over two layers, _loss, _dprobs)
    against the reference RouterLoss: 600 tokens span three blocks of the partial sums, padding (segment 0) left
    out; 7 tokens all padding give a loss of 0 and no gradient."""
    rng = np.random.default_rng(4)
    seg = (rng.random(tokens) < 0.8).astype(np.int32) * (1 + np.arange(tokens, dtype=np.int32) // 50)
    if tokens == 7:
        seg[:] = 0
    mask = (seg != 0).astype(float)
    want = ref.RouterLoss(E, 0.3)
    scratch = moe.MoeScratch(rt, tokens, K, E, C, I)
    stats, loss, dprobs = rt.buffer(4 * (2 * E + 1)), rt.buffer(16), rt.buffer(4 * tokens * E)
    segb = rt.upload(seg)
    bufs = []
    rec = rt.recorder()
    for layer in range(2):
        logits = rng.standard_normal((tokens, E)).astype(np.float32)
        _, experts = ref.moe_route_forward(logits, K, True)
        want.add(logits.astype(np.float64), experts, mask)
        bufs += [rt.upload(logits), rt.upload(experts)]
        moe.load_balancing_counts(rec, stats, bufs[-2], bufs[-1], segb, tokens, E, K, scratch, accumulate=layer > 0)
    moe.load_balancing_loss(rec, loss, stats, E)
    moe.load_balancing_dprobs(rec, dprobs, stats, segb, tokens, E, 0.3)
    rec.submit()
    got = rt.read(stats, np.float32, (2 * E + 1,))
    assert_close(got, np.concatenate([want.counts, want.prob_sums, [want.rows]]), "moe_experts", "stats")
    assert_close(rt.read(loss, np.float32, (1,)), np.array([want.value]), "moe_experts", "loss")
    assert_close(rt.read(dprobs, np.float32, (tokens, E)), want.dprobs(mask), "moe_experts", "dprobs")
    assert (want.value > 0) == (tokens == 600)
    scratch.release(rt)
    rt.release(stats, loss, dprobs, segb, *bufs)
