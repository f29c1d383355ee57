"""Kernel benchmarks for `wgpu-train bench`: each figure is reported next to the adapter's own fp32 FMA
peak measured in the same run (and GEMM also next to a naive shared-memory kernel), never alone.
(Over 450 lines on purpose: every kernel family's benchmark is a short registered function sharing this
file's timer, FMA peak, correctness checks and table, which a split would scatter.)

Each kernel family (tuned/catalogue.FAMILIES) names its benchmarks; each is a function registered here under
that name (with @register("name")): `fn(rt, ctx) -> list[dict]`, where each dict has at least "name", "shape"
and "gflops" (or "gbps"); `run_bench` runs them family by family and adds "fraction_of_peak". `ctx` holds the shared Timer ("timer") and "sample_peak", a function to call between
long measurements so that the peak is sampled throughout the run.
"""
from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

from wgpu_train.bench.checks import Capture, check, max_rel_err
from wgpu_train.engines.webgpu.device.timing import Timer, fma_peak
from wgpu_train.engines.webgpu.tuned.catalogue import FAMILIES
from wgpu_train.engines.webgpu.tuned import gemm as _gemm

BENCHES: dict[str, Callable] = {}
# Benchmarks that add a key of their own to the result: name -> fn(rt) -> dict
SECTIONS: dict[str, Callable] = {}


def _training(rt):
    from wgpu_train.bench.training import bench_training
    return bench_training(rt)


SECTIONS["training"] = _training


def _variable_lengths(rt):
    from wgpu_train.bench.training import bench_variable_lengths
    return bench_variable_lengths(rt)


SECTIONS["variable_lengths"] = _variable_lengths


def _base_weights(rt):
    return bench_base_weights(rt)


SECTIONS["base_weights"] = _base_weights


def _mfu(rt):
    from wgpu_train.bench.pretune import training_mfu
    return training_mfu(rt)


SECTIONS["mfu"] = _mfu


def _data_parallel(rt):
    from wgpu_train.bench.data_parallel import bench_data_parallel
    return bench_data_parallel()


SECTIONS["data_parallel"] = _data_parallel


def _engines(rt):
    from wgpu_train.bench.engines import bench_engines
    return bench_engines()


SECTIONS["engines"] = _engines


def _grpo(rt):
    from wgpu_train.bench.grpo import bench_grpo
    return bench_grpo(rt)


SECTIONS["grpo"] = _grpo


def _serve(rt):
    from wgpu_train.bench.serve import bench_serve
    return bench_serve(rt)


SECTIONS["serve"] = _serve


def _precision(rt):
    from wgpu_train.bench.precision import bench_precision
    return bench_precision(rt)


SECTIONS["precision"] = _precision


def _pipeline(rt):
    from wgpu_train.bench.pipeline import bench_pipeline
    return bench_pipeline(None if rt is None else str(rt.info.index))


SECTIONS["pipeline"] = _pipeline


def _vision(rt):
    from wgpu_train.bench.vision import bench_vision
    return bench_vision(rt)


SECTIONS["vision"] = _vision

# Benchmarks on a model folder (the embedded model, or bench --model) that add a key of their own:
# name -> fn(rt, model) -> dict
MODEL_SECTIONS: dict[str, Callable] = {}


def _preference(rt, model):
    from wgpu_train.bench.preference import bench_preference
    return bench_preference(rt, model)


MODEL_SECTIONS["preference"] = _preference


def register(name: str):
    """Decorator: add a bench function under `name`, the name a kernel family lists among its benches (run in the
    families' order; `only` filters by prefix)."""
    def deco(fn):
        BENCHES[name] = fn
        return fn
    return deco


# ---- GEMM --------------------------------------------------------------------------------------

GEMM_SHAPES = [(1024, 1024, 1024), (512, 576, 64), (512, 1536, 576), (512, 576, 1536)]  # (M, N, K)

# The yardstick for GEMM: the textbook 16 x 16 tile kernel with both operand tiles in workgroup memory
# and one output per invocation (C = A @ B, row-major, any size).
NAIVE16_SRC = """
struct Params { M: u32, N: u32, K: u32, pad: u32 };
@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;
var<workgroup> As: array<f32, 256>;
var<workgroup> Bs: array<f32, 256>;

@compute @workgroup_size(16, 16)
fn gemm_naive16(@builtin(local_invocation_id) l: vec3<u32>, @builtin(workgroup_id) w: vec3<u32>) {
    let row = w.y * 16u + l.y;
    let col = w.x * 16u + l.x;
    var acc = 0.0;
    for (var k0 = 0u; k0 < P.K; k0 += 16u) {
        let ka = k0 + l.x;
        let kb = k0 + l.y;
        As[l.y * 16u + l.x] = select(0.0, A[min(row, P.M - 1u) * P.K + min(ka, P.K - 1u)], row < P.M && ka < P.K);
        Bs[l.y * 16u + l.x] = select(0.0, B[min(kb, P.K - 1u) * P.N + min(col, P.N - 1u)], kb < P.K && col < P.N);
        workgroupBarrier();
        for (var kk = 0u; kk < 16u; kk++) {
            acc = fma(As[l.y * 16u + kk], Bs[kk * 16u + l.x], acc);
        }
        workgroupBarrier();
    }
    if (row < P.M && col < P.N) {
        C[row * P.N + col] = acc;
    }
}
"""


def naive16_dispatch(rt, c, a, b, M, N, K):
    """(pipeline, resources, groups) of the naive kernel on whole buffers: C (M, N) = A (M, K) @ B (K, N)."""
    p = rt.pipeline("bench_gemm_naive16", "gemm_naive16", source=NAIVE16_SRC)
    return p, [rt.uniform("<4I", M, N, K, 0), a, b, c], (-(-N // 16), -(-M // 16), 1)


GEMM_ROUNDS = 3   # interleaved rounds per shape: each kernel keeps its best, like the peak does


@register("gemm")
def bench_gemm(rt, ctx) -> list[dict]:
    """gemm_nn/nt/tn (tuned/gemm.py's default kernel choice) and gemm_naive16 on each of GEMM_SHAPES."""
    timer = ctx["timer"]
    rng = np.random.default_rng(0)
    out = []
    for (m, n, k) in GEMM_SHAPES:
        flops = 2.0 * m * n * k
        shape = f"{m}x{n}x{k}"
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        want = a @ b
        at, bt = np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
        bufs = [rt.upload(a), rt.upload(b), rt.upload(at), rt.upload(bt), rt.buffer(m * n * 4)]
        ab, bb, atb, btb, cb = bufs
        try:
            # the naive kernel is slow on CPU adapters (seconds at 1024^3): checked (and compiled) on
            # the whole problem, then timed once
            nd = naive16_dispatch(rt, cb, ab, bb, m, n, k)
            naive_err = check(rt, [nd], cb, want)
            naive = flops / timer.time([nd], repeats=1, warmup=[]) / 1e9
            out.append({"name": "gemm_naive16", "shape": shape, "gflops": naive, "max_rel_err": naive_err})
            cases = []
            for layout, a_op, b_op in (("nn", ab, bb), ("nt", ab, btb), ("tn", atb, bb)):
                d = _gemm.gemm_dispatches(rt, cb, a_op, b_op, m, n, k, layout)
                cases.append((layout, d, check(rt, d, cb, want)))
            best = {layout: float("inf") for layout, _, _ in cases}
            for _ in range(GEMM_ROUNDS):
                for layout, d, _ in cases:
                    best[layout] = min(best[layout], timer.time(d, repeats=2, budget_s=1.0, warmup=[]))
            for layout, d, err in cases:
                g = flops / best[layout] / 1e9
                out.append({"name": f"gemm_{layout}", "shape": shape, "gflops": g, "ms": best[layout] * 1e3,
                            "vs_naive": g / naive, "kernel": d[0][0].label.split(".")[-1], "max_rel_err": err})
        finally:
            rt.release(*bufs)
        ctx["sample_peak"]()
    return out


CPU_CANDIDATES = 3   # candidates per shape the candidates bench times on CPU adapters


@register("gemm_candidates")
def bench_gemm_candidates(rt, ctx) -> list[dict]:
    """Every GEMM candidate (gemm_kernels.candidates) on the distinct GEMMs of a LoRA step (r=16) of the
    SmolLM2-135M and Qwen2.5-0.5B shapes, each checked against NumPy, the fastest marked "chosen" (what the
    tuner would keep). 512 tokens on GPUs; on CPU adapters 128 tokens and the 8 likeliest candidates (the
    tiled kernels are an order of magnitude slower there, see benchmarks/README.md)."""
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.tuned.adapter_traits import is_cpu
    from wgpu_train.engines.webgpu.tuned.gemm_kernels import candidates
    from wgpu_train.bench.pretune import QWEN05, SMOL135, step_gemms
    from wgpu_train.engines.webgpu.tuned.tune import measure

    cpu = is_cpu(rt)
    tokens = 128 if cpu else 512
    out = []
    for label, raw in (("135M", SMOL135), ("0.5B", QWEN05)):
        cfg = ModelConfig.from_dict(dict(raw), label)
        for what, m, n, k, layout in step_gemms(cfg, tokens, 16, rt.max_binding):
            a_shape, b_shape = ((k, m) if layout[0] == "t" else (m, k)), ((n, k) if layout[1] == "t" else (k, n))
            bufs = [rt.buffer(int(np.prod(a_shape)) * 4), rt.buffer(int(np.prod(b_shape)) * 4), rt.buffer(m * n * 4)]
            try:
                p = _gemm.gemm_problem(rt, bufs[2], bufs[0], bufs[1], m, n, k, layout)
                cands = candidates(p)
                results = measure(rt, p, cands[:CPU_CANDIDATES] if cpu else cands, timer=ctx["timer"])
            finally:
                rt.release(*bufs)
            timed = {name: g for name, g in results.items() if g is not None}
            best = max(timed, key=timed.get) if timed else None
            for name, g in results.items():
                out.append({"name": "gemm_candidate", "shape": f"{label} {what} {layout} {m}x{n}x{k}",
                            "kernel": name, "gflops": g if g is not None else float("nan"),
                            "correct": g is not None, "chosen": name == best})
            ctx["sample_peak"]()
    return out


# ---- attention (tuned/attention_kernels.py) --------------------------------------------------------------

ATT_SHAPE = dict(B=1, Hq=9, Hkv=3, D=64)       # SmolLM2-135M's heads


@register("attention")
def bench_attention(rt, ctx) -> list[dict]:
    """Causal attention forward + backward at T = 512 and 2048 for B = 1, 9 / 3 heads, D = 64: one row, and the
    same row packed with 8 equal segments; the kernel the tuner picks on this adapter ("default") next to
    the per-row kernels it replaced ("rows/vec4", where they run), each checked against the NumPy reference
    at T = 512 first. GFLOP/s count the causal (unpacked) work 6 T^2 D Hq for both rows, so the packed row's
    figure shows how much masked work it skips; "vs_rows" is the default's speed over rows/vec4's, and
    "packed_vs_causal" the causal row's time over the packed one's, both from this run."""
    from wgpu_train.engines.webgpu.tuned import attention_kernels as AK
    from wgpu_train.engines.webgpu import attention as A
    from wgpu_train.engines.webgpu.tuned import tune

    B, Hq, Hkv, D = ATT_SHAPE["B"], ATT_SHAPE["Hq"], ATT_SHAPE["Hkv"], ATT_SHAPE["D"]
    rng = np.random.default_rng(3)
    out = []
    for T in (512, 2048):
        q, dout = (rng.standard_normal((B, T, Hq, D), dtype=np.float32) for _ in range(2))
        k, v = (rng.standard_normal((B, T, Hkv, D), dtype=np.float32) for _ in range(2))
        bufs = [rt.upload(x) for x in (q, k, v, dout)] + [rt.buffer(q.nbytes) for _ in range(2)]
        bufs += [rt.buffer(k.nbytes) for _ in range(2)] + [rt.buffer(4 * B * Hq * T),
                                                            rt.buffer(4 * A.attention_scratch_size(B, T, Hq))]
        tq, tk, tv, tdo, o, dq, dk, dv, lse, scratch = bufs
        flops = 6.0 * T * T * D * Hq
        ms: dict = {}
        rows: dict = {}
        try:
            for kind in ("causal", "packed8"):
                seg = np.ones((B, T), np.int32) if kind == "causal" else (np.arange(T) // (T // 8) + 1)[None]
                seg_buf = rt.upload(seg.astype(np.int32))
                bufs.append(seg_buf)
                probe = AK.AttentionProblem(rt, "forward", dict(out=o, lse=lse, q=tq, k=tk, v=tv, segment_ids=seg_buf),
                                            B, T, Hq, Hkv, D)
                names = [c.name for c in probe.candidates()]
                for label, name in (("default", tune.choose(rt, probe).name), ("rows", "rows/vec4")):
                    if name not in names:
                        continue
                    rec = Capture(rt)
                    with tune.pinned(name):
                        A.attention_forward(rec, o, lse, tq, tk, tv, seg_buf, B, T, Hq, Hkv, D)
                        A.attention_backward(rec, dq, dk, dv, tdo, tq, tk, tv, o, lse, seg_buf, B, T, Hq, Hkv, D,
                                             scratch)
                    if T == 512:
                        _check_attention(rt, rec.dispatches, (q, k, v, dout), seg, (o, dq), f"{name} {kind} T={T}")
                    t = ms[(label, kind)] = ctx["timer"].time(rec.dispatches, repeats=2, budget_s=2.0)
                    rows[(label, kind)] = {"name": f"attention_{kind}", "shape": f"T{T}x{Hq}/{Hkv}xD{D}",
                                           "kernel": name, "gflops": flops / t / 1e9, "ms": t * 1e3}
            for kind in ("causal", "packed8"):
                if ("rows", kind) in ms:
                    rows[("default", kind)]["vs_rows"] = ms[("rows", kind)] / ms[("default", kind)]
            rows[("default", "packed8")]["packed_vs_causal"] = ms[("default", "causal")] / ms[("default", "packed8")]
            out += list(rows.values())
        finally:
            rt.release(*bufs)
        ctx["sample_peak"]()
    return out


@register("decode")
def bench_decode(rt, ctx) -> list[dict]:
    """Cached attention of a decoding step (decode_kernels): 1 and 8 rows of Llama-3-8B's heads (32 / 8, D 128)
    over 4096 cached positions, and 1 row of SmolLM2-135M's (9 / 3, D 64) over 480 (where the single pass fits
    llvmpipe's loop budget); every pass that runs here (the single one, the split ones by chunk) checked
    against NumPy, then timed; "vs_single" is the single pass's time over each one's, from this run, where the
    single pass runs, and "default" marks the tuner's choice on this adapter."""
    from wgpu_train.engines.webgpu.tuned import decode_kernels as AD
    from wgpu_train.engines.webgpu.tuned import tune

    out = []
    for n, length, hq, hkv, d in ((1, 4096, 32, 8, 128), (8, 4096, 32, 8, 128), (1, 480, 9, 3, 64)):
        shape = AD.DecodeProblem(rt, {}, n, n, length, hq, hkv, d, scratch_elems=AD.scratch_elements(n, hq, d))
        rep, res, c0, want, bufs = shape.replica(np.random.default_rng(4))
        try:
            chosen, times, rows = tune.choose(rt, rep).name, {}, []
            for cand in rep.candidates():
                dispatches = cand.dispatches(rep)
                check(rt, dispatches, res, want)
                t = times[cand.name] = ctx["timer"].time(dispatches, repeats=2, budget_s=2.0)
                rows.append({"name": "attention_decode", "shape": f"n{n} len{length} {hq}/{hkv}xD{d}", "kernel": cand.name,
                             "gflops": rep.flops / t / 1e9, "ms": t * 1e3,
                             **({"default": True} if cand.name == chosen else {})})
            for row in rows if "decode/single" in times else ():
                row["vs_single"] = times["decode/single"] / times[row["kernel"]]
            out += rows
        finally:
            rt.release(*bufs)
        ctx["sample_peak"]()
    return out


@register("mixed_lora")
def bench_mixed_lora(rt, ctx) -> list[dict]:
    """The mixed-adapter LoRA product of serving (mixed_lora_kernels): 16 rows over 3 adapters and none, in a
    Qwen2.5-0.5B module (896 -> 896 and 896 -> 4864), the bank padded to rank 16 and to 64 (one adapter of rank
    64 among rank-16 ones: every row then pays for 64, the cost of padding); every candidate checked against
    NumPy, then timed; "default" marks the tuner's choice on this adapter."""
    from wgpu_train.engines.webgpu.tuned import mixed_lora_kernels as ML
    from wgpu_train.engines.webgpu.tuned import tune

    out = []
    for in_f, out_f, rank in ((896, 896, 16), (896, 896, 64), (896, 4864, 16)):
        rep, res, y0, want, bufs = ML.MixedLoraProblem(rt, {}, 16, in_f, out_f, rank, 3).replica(
            np.random.default_rng(5))
        try:
            chosen = tune.choose(rt, rep).name
            for cand in rep.candidates():
                dispatches = cand.dispatches(rep)
                check(rt, dispatches, res, want - y0)           # check clears y first
                t = ctx["timer"].time(dispatches, repeats=2, budget_s=1.0)
                out.append({"name": "mixed_lora", "shape": f"n16 {in_f}->{out_f} r{rank} k3", "kernel": cand.name,
                            "gflops": rep.flops / t / 1e9, "ms": t * 1e3,
                            **({"default": True} if cand.name == chosen else {})})
        finally:
            rt.release(*bufs)
        ctx["sample_peak"]()
    return out


@register("moe")
def bench_moe(rt, ctx) -> list[dict]:
    """The grouped-expert kernels against one dense GEMM per expert, and an MoE training step against a dense one
    with the same active parameters (bench/moe.py)."""
    from wgpu_train.bench.moe import bench_moe as run, bench_moe_step
    return run(rt, ctx) + bench_moe_step(rt)


@register("linear_attention")
def bench_linear_attention(rt, ctx) -> list[dict]:
    """The chunked gated delta rule against full attention on the same heads (bench/linear_attention.py)."""
    from wgpu_train.bench.linear_attention import bench_linear_attention as run
    return run(rt, ctx)


def _check_attention(rt, dispatches, inputs, seg, outputs, what):
    """Run the dispatches once and compare out and dq with the float64 reference."""
    from wgpu_train.engines.numpy import ops

    real = rt.recorder()
    for d in dispatches:
        real.dispatch(*d)
    real.submit()
    q, k, v, dout = (x.astype(np.float64) for x in inputs)
    want, want_lse = ops.attention_forward(q, k, v, seg)
    want_dq = ops.attention_backward(dout, q, k, v, want, want_lse, seg)[0]
    o, dq = outputs
    err = max(max_rel_err(rt.read(o, np.float32, q.shape), want), max_rel_err(rt.read(dq, np.float32, q.shape), want_dq))
    if not err < 1e-4:
        raise AssertionError(f"attention {what} gave a wrong result (max rel err {err:.2e})")


# ---- GEMM with float16 / NF4 weights (tuned/quant.py) -----------------------------------------------

@register("gemm_quant")
def bench_gemm_quant(rt, ctx) -> list[dict]:
    """gemm_{f16,nf4,nf4-dq}_{nt,nn} (the frozen-weight GEMMs: x @ W.T and dy @ W) on GEMM_SHAPES, each checked
    against the dequantised weight, timed in interleaved rounds with gemm_nt / gemm_nn (fp32) on the same
    shape; "vs_float32" is the ratio of their speeds in this run."""
    from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
    from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem
    from wgpu_train.engines.webgpu.tuned.tune import choose
    from wgpu_train.engines.shared.quant import round_to

    timer = ctx["timer"]
    rng = np.random.default_rng(1)
    formats = ["bfloat16", "float16", "nf4", "nf4-dq"]
    out = []
    for (m, n, k) in GEMM_SHAPES:
        flops = 2.0 * m * n * k
        a = rng.standard_normal((m, k), dtype=np.float32)
        w_nt = rng.standard_normal((n, k), dtype=np.float32)     # nt: the (out, in) weight of x @ W.T
        w_nn = rng.standard_normal((k, n), dtype=np.float32)     # nn: dy @ W, W (out, in) = (k, n)
        bufs = [rt.upload(a), rt.upload(w_nt), rt.upload(w_nn), rt.buffer(m * n * 4)]
        ab, wntb, wnnb, cb = bufs
        mats = []
        try:
            cases = [("gemm_nt", "float32", _gemm.gemm_dispatches(rt, cb, ab, wntb, m, n, k, "nt"), a @ w_nt.T),
                     ("gemm_nn", "float32", _gemm.gemm_dispatches(rt, cb, ab, wnnb, m, n, k, "nn"), a @ w_nn)]
            for fmt in formats:
                for layout, w in (("nt", w_nt), ("nn", w_nn)):
                    q = QuantMatrix(rt, w, fmt, f"bench.{fmt}")
                    mats.append(q)
                    wq = round_to(w, fmt).astype(np.float64)
                    want = a @ (wq.T if layout == "nt" else wq)
                    name = f"gemm_{'f16' if fmt == 'float16' else fmt}_{layout}"
                    p = QProblem(rt, cb, ab, q, 0, layout, m)
                    cases.append((name, fmt, choose(rt, p).dispatches(p), want))
            errs = {name: check(rt, d, cb, want.astype(np.float32)) for name, _, d, want in cases}
            best = {name: float("inf") for name, *_ in cases}
            for _ in range(GEMM_ROUNDS):
                for name, _, d, _ in cases:
                    best[name] = min(best[name], timer.time(d, repeats=2, budget_s=1.0, warmup=[]))
            for name, fmt, d, _ in cases[2:]:
                ref = "gemm_" + name[-2:]
                out.append({"name": name, "shape": f"{m}x{n}x{k}", "gflops": flops / best[name] / 1e9,
                            "ms": best[name] * 1e3, "vs_float32": best[ref] / best[name],
                            "float32_gflops": flops / best[ref] / 1e9, "kernel": d[0][0].label.split(".")[-1],
                            "max_rel_err": errs[name]})
        finally:
            rt.release(*bufs)
            for q in mats:
                q.release(rt)
        ctx["sample_peak"]()
    return out


# The base-weight memory of a 0.5B-parameter model (Qwen2.5-0.5B's dimensions), built with random weights
# and allocated tensor by tensor per storage dtype.
QWEN05 = dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864,
              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
              tie_word_embeddings=True, attention_bias=True)
BASE_WEIGHT_CASES = (("float32", "float32"), ("bfloat16", "float32"), ("float16", "float16"), ("nf4", "float32"),
                     ("nf4", "float16"), ("nf4-dq", "float16"))


def bench_base_weights(rt) -> list[dict]:
    """[{base_dtype, embed_dtype, bytes, bytes_vs_float32, ...}] for the QWEN05 configuration (tied
    embedding): every base tensor built with random values and stored on this device as the engine stores
    it, one at a time (each released before the next, so the device never holds the whole model); "bytes"
    is what was allocated, and must equal memory.base_weight_bytes, the plan the engine allocates by."""
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.memory import base_weight_bytes, weight_shapes
    from wgpu_train.engines.webgpu.tensors import store_weight, weight_buffers

    cfg = ModelConfig(**QWEN05)
    shapes = weight_shapes(cfg)
    params = sum(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(0)
    values = {s: 0.02 * rng.standard_normal(s, dtype=np.float32) for s in set(shapes.values())}  # one per shape
    out = []
    for base, emb in BASE_WEIGHT_CASES:
        started = time.perf_counter()
        allocated = 0
        for name, shape in shapes.items():
            bufs = weight_buffers(store_weight(rt, name, values[shape], base, emb))
            allocated += sum(b.size for b in bufs)
            rt.release(*bufs)
        plan = base_weight_bytes(cfg, base, emb, rt.max_binding)
        if allocated != plan["total"]:
            raise AssertionError(f"{base} / {emb}: allocated {allocated} bytes, the plan says {plan['total']}")
        out.append({"base_dtype": base, "embed_dtype": emb, "bytes": allocated, "linear_bytes": plan["linear"],
                    "embedding_bytes": plan["embedding"], "other_bytes": plan["other"], "parameters": params,
                    "build_s": round(time.perf_counter() - started, 2)})
    for entry in out:
        entry["bytes_vs_float32"] = entry["bytes"] / out[0]["bytes"]
    return out


# ---- driver ------------------------------------------------------------------------------------

def kernel_benches() -> list[tuple[str, Callable]]:
    """(name, fn) of the kernel families' benchmarks, family by family in FAMILIES' order. A family naming a
    benchmark no function is registered for is a bug: KeyError naming both."""
    out = []
    for family in FAMILIES:
        for name in family.benches:
            if name not in BENCHES:
                raise KeyError(f"kernel family {family.name} names a benchmark {name!r} that bench/suite.py lacks")
            out.append((name, BENCHES[name]))
    return out


def cpu_peak_note(rt) -> str | None:
    """What the FMA peak of a CPU adapter is not: the CPU's own peak (lavapipe's JIT vectors are at most 256
    bits wide, so a CPU with AVX-512 does more), so fractions of it and MFU overstate the CPU's use."""
    if rt.info.adapter_type != "CPU":
        return None
    return ("a CPU adapter's peak, as its JIT compiles the kernels (256-bit vectors at most), not the CPU's own: "
            "fractions of it and MFU overstate the CPU's use")


def bench_names() -> list[str]:
    """The names --only selects among: kernel families' benchmarks and sections, in the order they run."""
    return [*(name for name, _ in kernel_benches()), *SECTIONS, *MODEL_SECTIONS]


def check_only(only: str | None):
    """Refuse an `only` that selects no bench (a ConfigError listing the names), before anything runs."""
    from wgpu_train.errors import ConfigError

    if only is not None and not any(name.startswith(only) or only.startswith(name) for name in bench_names()):
        raise ConfigError(f"--only {only!r} selects no benchmark; the names are {', '.join(bench_names())} "
                          f"(a prefix of one, or a kernel such as gemm_nt)")


def _selected(name: str, only: str | None) -> bool:
    return not only or name.startswith(only) or only.startswith(name)


def check_model(only: str | None, model: str | None):
    """Refuse a --model that no selected benchmark reads (a ConfigError naming those that do)."""
    from wgpu_train.errors import ConfigError

    if model is not None and not any(_selected(name, only) for name in MODEL_SECTIONS):
        raise ConfigError(f"--model is the model of the {', '.join(MODEL_SECTIONS)} benchmark, which --only "
                          f"{only!r} leaves out")


def run_bench(rt, only: str | None = None, model: str | None = None) -> dict:
    """Measure the FMA peak, then every registered bench whose name starts with `only` (or that `only`
    starts with; all if None), then the peak again. `model` (a folder or hub id) is the model of the
    MODEL_SECTIONS benchmarks (default: the embedded model).

    Returns {"adapter": {"name", "backend"}, "fma_peak_gflops", "timing", "kernels": [...]} plus one key
    per selected SECTIONS entry (e.g. "training": tokens/s side by side), each kernel
    entry with "fraction_of_peak" (gflops / peak) where it reports gflops. The peak is the best of
    the measurements taken between the benches (each bench may take more through ctx["sample_peak"]()),
    so that a busy moment on a shared machine cannot make a kernel look closer to the peak than it is.
    """
    check_only(only)
    timer = Timer(rt)
    peaks = [fma_peak(rt, timer)]
    ctx = {"timer": timer, "sample_peak": lambda: peaks.append(fma_peak(rt, timer))}
    kernels = []
    for name, fn in kernel_benches():
        if only and not (name.startswith(only) or only.startswith(name)):
            continue
        for entry in fn(rt, ctx):
            if only and not (entry["name"].startswith(only) or name.startswith(only)):
                continue
            kernels.append(entry)
        peaks.append(fma_peak(rt, timer))
    peak = max(peaks)
    for entry in kernels:
        if "gflops" in entry:
            entry["fraction_of_peak"] = entry["gflops"] / peak
    result = {"adapter": {"name": rt.info.name, "backend": rt.info.backend},
              "fma_peak_gflops": peak, "peak_note": cpu_peak_note(rt),
              "timing": "timestamp-query" if timer.use_ts else "wall-clock",
              "kernels": kernels}
    for key, fn in SECTIONS.items():
        if _selected(key, only):
            result[key] = fn(rt)
    for key, fn in MODEL_SECTIONS.items():
        if _selected(key, only):
            result[key] = fn(rt, model)
    return result


def format_table(result: dict) -> str:
    """A plain-text table of a run_bench result (for the CLI without --json)."""
    adapter = result["adapter"]
    lines = [f"adapter: {adapter['name']} ({adapter['backend']}), timing: {result.get('timing', '?')}",
             f"fp32 FMA peak: {result['fma_peak_gflops']:.1f} GFLOP/s"
             + (f" ({result['peak_note']})" if result.get("peak_note") else "")]
    if result["kernels"]:
        lines.append(f"{'kernel':<16} {'shape':<16} {'GFLOP/s':>9} {'of peak':>8} {'vs naive':>9}")
    for e in result["kernels"]:
        rate = e.get("gflops", e.get("gbps", float("nan")))
        frac = e.get("fraction_of_peak")
        vs = e.get("vs_naive")
        line = (f"{e['name']:<16} {e['shape']:<16} {rate:>9.2f} "
                f"{'' if frac is None else f'{100 * frac:.0f}%':>8} {'' if vs is None else f'{vs:.1f}x':>9}")
        if e["name"] == "gemm_candidate":
            line += f"  {'*' if e['chosen'] else ' '} {e['kernel']}"
        elif e["name"] == "linear_attention":
            line += f"  {e['kernel']}  {e['ms']:.0f} ms  {e['us_per_token']:.0f} us/token  growth {e['growth']:.2f}" + (
                f"  vs_attention {e['vs_attention']:.2f}x" if "vs_attention" in e else "")
        elif e["name"] == "moe":
            line += f"  {e['kernel']}  {e['ms']:.1f} ms" + "".join(
                f"  {k} {e[k]:.2f}x" for k in ("vs_per_expert", "vs_f32", "moe_vs_dense") if k in e) + (
                f"  {e['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in e else "")
        elif e["name"].startswith("attention_"):
            line += f"  {e['kernel']}" + "".join(f"  {k} {e[k]:.2f}x" for k in ("vs_rows", "packed_vs_causal")
                                                  if k in e)
        lines.append(line)
    for key, value in result.items():
        if key not in ("adapter", "fma_peak_gflops", "peak_note", "timing", "kernels"):
            lines.append(f"{key}: {json.dumps(value, indent=2)}")
    return "\n".join(lines)
