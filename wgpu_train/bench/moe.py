"""`bench --only moe`: the grouped-expert kernels (engines/webgpu/moe.py) against running each expert as its own
dense GEMM with the tuned GEMM kernels, on the same routed tokens, side by side in one run, each path checked
against NumPy before it is timed; and a whole LoRA training step of a Qwen3-MoE-shaped model against a dense
Qwen3 with the same active parameters (its MLP k expert widths wide), as tokens/s and their ratio, measured
alternately in one run; the grouped GEMMs with MXFP4 experts (decoded inside them) against float32 ones."""
from __future__ import annotations

import time

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.bench.checks import Capture, max_rel_err
from wgpu_train.bench.training import random_batch, random_lora, random_weights, timed
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.shared import moe as ref
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu import moe
from wgpu_train.engines.webgpu.tuned import gemm as _gemm
from wgpu_train.engines.webgpu.tuned.moe_packed import mxfp4_upload
from wgpu_train.formats.mxfp4 import Mxfp4

# (tokens, hidden, expert width, experts, top-k): 8 experts of ~64 pairs each, and 32 of ~16
SHAPES = ((256, 256, 128, 8, 2), (256, 256, 128, 32, 2))
RANK = 16
# the step's models: 2 layers of a Qwen3-MoE (8 experts of width 128, top-2) and of a dense Qwen3 whose MLP is
# top-k times an expert's width (the same weights per token but the router's E x C), 4 x 128 tokens
STEP_LAYERS = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=512,
                   tie_word_embeddings=True, rope_theta=10000.0)
STEP_EXPERTS, STEP_TOP_K, STEP_EXPERT_SIZE = 8, 2, 128
STEP_BATCH = (4, 128)


def _run(rt, dispatches):
    rec = rt.recorder()
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()


def _capture(rt, fn) -> list:
    cap = Capture(rt)
    fn(cap)
    return cap.dispatches


def _per_expert(rt, bufs, sorted_x, counts, n_tok, C, I, E):
    """Each expert with pairs as three dense GEMMs (gate, up, down: the tuned gemm family) and the swiglu, on its
    rows gathered into expert order beforehand (a cost this path is spared): out (N k, C) in sorted order."""
    def record(rec):
        row = 0
        for e in range(E):
            n = int(counts[e])
            if n == 0:
                continue
            xs, gate, up, h, out = ((buf, row * w) for buf, w in ((sorted_x, C), (bufs["gate"], I), (bufs["up"], I),
                                                                  (bufs["h"], I), (bufs["out"], C)))
            for dst, first in ((gate, 0), (up, I)):
                for d in _gemm.gemm_dispatches(rt, dst, xs, (bufs["w1"], (e * 2 * I + first) * C), n, I, C, "nt"):
                    rec.dispatch(*d)
            K.swiglu_forward(rec, h, gate, up, n * I)
            for d in _gemm.gemm_dispatches(rt, out, h, (bufs["w2"], e * C * I), n, C, I, "nt"):
                rec.dispatch(*d)
            row += n
    return _capture(rt, record)


def _mxfp4_grouped(rt, timer, bufs, x, weights, experts, sizes, scratch, t_f32) -> dict:
    """The grouped GEMMs with MXFP4 experts (random codes, scales near 2^-4; decoded inside the products), checked
    against NumPy on their decoded values, then timed: "vs_f32" is their time over float32 experts' (t_f32)."""
    n_tok, C, I, E, k = sizes
    rng = np.random.default_rng(E + 1)
    packed = [Mxfp4(rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8),
                    rng.integers(121, 125, (E, rows, cols // 32), dtype=np.uint8), "w", "bench")
              for rows, cols in ((2 * I, C), (C, I))]
    w1, w2 = (mxfp4_upload(rt, p, "bench operand") for p in packed)
    try:
        dispatches = _capture(rt, lambda rec: moe.moe_experts_forward(
            rec, bufs["y"], bufs["gu"], bufs["x"], bufs["weights"], bufs["experts"], w1, w2, None, None, n_tok, k, E,
            C, I, scratch))
        _run(rt, dispatches)
        want, _ = ref.moe_experts_forward(x.astype(np.float64), weights, experts,
                                          *(p.values().astype(np.float64) for p in packed))
        err = max_rel_err(rt.read(bufs["y"], np.float32, (n_tok, C)), want)
        if not err < 1e-4:
            raise AssertionError(f"moe bench MXFP4 N{n_tok} E{E}: a wrong result (max rel err {err:.2e})")
        t = timer.time(dispatches[3:5], repeats=3, budget_s=1.0)
    finally:
        rt.release(w1, w2)
    return {"name": "moe", "shape": f"N{n_tok} C{C} I{I} E{E} k{k}", "kernel": "grouped GEMMs, MXFP4 experts",
            "ms": t * 1e3, "gflops": 2.0 * n_tok * k * 3 * I * C / t / 1e9, "vs_f32": t / t_f32}


def bench_moe(rt, ctx) -> list[dict]:
    """Per shape: the experts' GEMMs grouped (two dispatches: gate/up with the swiglu, then down) against one dense
    GEMM per expert (three per expert, plus its swiglu), and the whole forward and backward of moe_experts (the
    grouping, LoRA of rank 16 on both expert parameters, the combine; the backward with the LoRA gradients).
    "vs_per_expert" is the per-expert path's time over the grouped one's, measured in the same run. GFLOP/s count
    the base GEMMs' 6 N k I C FLOPs alone (the backward's dh and dx products are as many; LoRA not counted)."""
    timer = ctx["timer"]
    out = []
    for n_tok, C, I, E, k in SHAPES:
        rng = np.random.default_rng(E)
        nk = n_tok * k
        logits = rng.standard_normal((n_tok, E)).astype(np.float32)
        weights, experts = ref.moe_route_forward(logits, k, True)
        x = rng.standard_normal((n_tok, C)).astype(np.float32)
        w1 = (rng.standard_normal((E, 2 * I, C)) / np.sqrt(C)).astype(np.float32)
        w2 = (rng.standard_normal((E, C, I)) / np.sqrt(I)).astype(np.float32)
        lgu = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in ((E, RANK, C), (E, 2 * I, RANK))]
        ldn = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in ((E, RANK, I), (E, C, RANK))]
        order = np.argsort(experts.reshape(-1), kind="stable")
        counts = np.bincount(experts.reshape(-1), minlength=E)
        bufs = {"x": rt.upload(x), "w1": rt.upload(w1), "w2": rt.upload(w2), "weights": rt.upload(weights),
                "experts": rt.upload(experts), "sorted_x": rt.upload(x[order // k]), "dy": rt.upload(x[::-1].copy()),
                **{name: rt.buffer(4 * n) for name, n in (("gate", nk * I), ("up", nk * I), ("h", nk * I),
                                                          ("out", nk * C), ("y", n_tok * C), ("gu", nk * 2 * I),
                                                          ("dx", n_tok * C), ("dw", nk))}}
        grads = {f"{p}.lora_{m}": rt.buffer(4 * a.size) for p, pair in (("gate_up", lgu), ("down", ldn))
                 for m, a in zip("AB", pair)}
        loras = [moe.MoeLora(rt.upload(a), rt.upload(b), 2.0, RANK) for a, b in (lgu, ldn)]
        scratch = moe.MoeScratch(rt, n_tok, k, E, C, I, RANK)
        try:
            shape = f"N{n_tok} C{C} I{I} E{E} k{k}"
            # the grouped path, its GEMMs alone: the grouping left in scratch by a forward without LoRA
            plain = _capture(rt, lambda rec: moe.moe_experts_forward(
                rec, bufs["y"], bufs["gu"], bufs["x"], bufs["weights"], bufs["experts"], bufs["w1"], bufs["w2"],
                None, None, n_tok, k, E, C, I, scratch))
            _run(rt, plain)
            want_y, _ = ref.moe_experts_forward(x.astype(np.float64), weights, experts, w1.astype(np.float64),
                                                w2.astype(np.float64))
            err = max_rel_err(rt.read(bufs["y"], np.float32, (n_tok, C)), want_y)
            per_expert = _per_expert(rt, bufs, bufs["sorted_x"], counts, n_tok, C, I, E)
            _run(rt, per_expert)
            xs = x[order // k].astype(np.float64)
            gu = np.einsum("qc,qoc->qo", xs, w1[experts.reshape(-1)[order]].astype(np.float64))
            hh = gu[:, :I] / (1 + np.exp(-gu[:, :I])) * gu[:, I:]
            want_out = np.einsum("qi,qci->qc", hh, w2[experts.reshape(-1)[order]].astype(np.float64))
            err = max(err, max_rel_err(rt.read(bufs["out"], np.float32, (nk, C)), want_out))
            if not err < 1e-4:
                raise AssertionError(f"moe bench {shape}: a wrong result (max rel err {err:.2e})")
            grouped = plain[3:5]          # after the grouping's three dispatches: gate/up, down (then the combine)
            flops = 2.0 * nk * 3 * I * C
            t_grouped = timer.time(grouped, repeats=3, budget_s=1.0)
            t_dense = timer.time(per_expert, repeats=3, budget_s=1.0)
            out.append({"name": "moe", "shape": shape, "kernel": "grouped GEMMs", "ms": t_grouped * 1e3,
                        "gflops": flops / t_grouped / 1e9, "vs_per_expert": t_dense / t_grouped})
            out.append({"name": "moe", "shape": shape, "kernel": "per-expert GEMMs", "ms": t_dense * 1e3,
                        "gflops": flops / t_dense / 1e9})
            out.append(_mxfp4_grouped(rt, timer, bufs, x, weights, experts, (n_tok, C, I, E, k), scratch, t_grouped))
            fwd = _capture(rt, lambda rec: moe.moe_experts_forward(
                rec, bufs["y"], bufs["gu"], bufs["x"], bufs["weights"], bufs["experts"], bufs["w1"], bufs["w2"],
                loras[0], loras[1], n_tok, k, E, C, I, scratch))
            bwd = _capture(rt, lambda rec: moe.moe_experts_backward(
                rec, bufs["dx"], bufs["dw"], grads, bufs["dy"], bufs["x"], bufs["weights"], bufs["experts"],
                bufs["gu"], bufs["w1"], bufs["w2"], loras[0], loras[1], n_tok, k, E, C, I, scratch))
            for what, dispatches in (("forward, LoRA r16", fwd), ("backward, LoRA r16", bwd)):
                t = timer.time(dispatches, repeats=2, budget_s=1.0)
                out.append({"name": "moe", "shape": shape, "kernel": f"moe_experts {what}", "ms": t * 1e3,
                            "gflops": flops / t / 1e9, "dispatches": len(dispatches)})
        finally:
            scratch.release(rt)
            rt.release(*bufs.values(), *grads.values(), *(b for lo in loras for b in (lo.a, lo.b)))
        ctx["sample_peak"]()
    return out


def step_models() -> tuple:
    """(the MoE config, the dense config with the same active parameters) of the step comparison."""
    moe = ModelConfig.from_dict(dict(STEP_LAYERS, architectures=["Qwen3MoeForCausalLM"], num_experts=STEP_EXPERTS,
                                     num_experts_per_tok=STEP_TOP_K, moe_intermediate_size=STEP_EXPERT_SIZE,
                                     intermediate_size=STEP_TOP_K * STEP_EXPERT_SIZE, norm_topk_prob=True),
                                "bench moe model")
    dense = ModelConfig.from_dict(dict(STEP_LAYERS, architectures=["Qwen3ForCausalLM"],
                                       intermediate_size=STEP_TOP_K * STEP_EXPERT_SIZE), "bench dense model")
    return moe, dense


def bench_moe_step(rt, steps: int = 4) -> list[dict]:
    """Tokens/s of a LoRA step (r 16 on q, k, v, o: the same trainable modules in both) of the MoE model and of
    the dense one with the same active parameters (step_models), their steps alternated so that both see the
    same machine; "moe_vs_dense" is the MoE's tokens/s over the dense one's (the issue aims at 1 / 1.5 or more).
    GFLOP/s count 4 N P: the forward and the input gradients of the P weights a token uses (no weight
    gradients: they are frozen), the same P for both."""
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    rng = np.random.default_rng(0)
    lora = LoraConfig(r=RANK, alpha=2 * RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    hp = OptimizerParams(lr=1e-4, max_grad_norm=1.0)
    engines, micro = {}, None
    for name, cfg in zip(("moe", "dense"), step_models()):
        engine = WgpuEngine(cfg, random_weights(cfg, rng), rt)
        engine.set_lora(random_lora(cfg, lora, rng))
        engines[name] = engine
        micro = micro or random_batch(cfg, *STEP_BATCH, rng)
    walls = {name: [] for name in engines}

    def step(i):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            engine.train_step(micro, hp, i + 1)
            walls[name].append(time.perf_counter() - t0)
    timed(step, steps)
    tokens = int(np.prod(STEP_BATCH))
    _, dense = step_models()
    c, d = dense.hidden_size, dense.intermediate_size
    active = dense.num_hidden_layers * (sum(int(np.prod(dense.linear_shape(m))) for m in
                                            ("q_proj", "k_proj", "v_proj", "o_proj")) + 3 * c * d)
    wall = {name: float(np.median(w[1:])) for name, w in walls.items()}
    shape = f"{STEP_BATCH[0]}x{STEP_BATCH[1]} C{c} E{STEP_EXPERTS} k{STEP_TOP_K} I{STEP_EXPERT_SIZE}"
    out = []
    for name, kernel in (("moe", "train step, MoE"), ("dense", f"train step, dense (MLP {d})")):
        out.append({"name": "moe", "shape": shape, "kernel": kernel, "ms": wall[name] * 1e3,
                    "tokens_per_s": tokens / wall[name], "gflops": 4.0 * tokens * active / wall[name] / 1e9,
                    "submits_per_step": engines[name].last_step["submits"]})
    out[0]["moe_vs_dense"] = wall["dense"] / wall["moe"]
    return out
