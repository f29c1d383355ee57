"""`wgpu-train bench --only precision`: fp32, bf16 and f16 activations side by side in one run: a GEMM, attention,
an elementwise op and a LoRA step of a SmolLM2-135M-shaped model (tokens/s and activation memory), each 16-bit
figure next to fp32's from the same run; each kernel checked against NumPy before it is timed. Where the adapter
has shader-f16, the two GEMMs f16 arithmetic serves (float16 x times a frozen float16 weight; float16 times
float16) in one tile config in float32 and in float16 arithmetic, side by side."""
from __future__ import annotations

import dataclasses

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.bench.checks import Capture, max_rel_err
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import PRECISIONS, OptimizerParams, Precision
from wgpu_train.engines.webgpu.memory import estimate_memory

# SmolLM2-135M's widths and heads, 2 of its 30 layers (a CPU adapter runs a step of those in about a second)
SMOL_SHAPED = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                   max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)
STEP_BATCH = (1, 256)
GEMM = (512, 1536, 576)         # (tokens, out features, in features): the up projection's shape
ATTENTION = (1, 512, 9, 3, 64)  # (B, T, Hq, Hkv, D)
ELEMENTS = 1 << 22


def _tensor(rt, values, fmt):
    from wgpu_train.engines.webgpu.device import storage
    return storage.upload(rt, values, fmt)


def _empty(rt, n, fmt):
    from wgpu_train.engines.webgpu.device import storage
    return storage.set_format(rt.buffer(storage.nbytes(n, fmt)), fmt)


# a checked result's largest error over the reference's largest value: the float32 part (1e-4, as the kernel
# benchmarks), plus one unit in the last place of a 16-bit output (2^-7 of a value at most)
CHECK = {"f32": 1e-4, "bf16": 1e-4 + 2.0 ** -7, "f16": 1e-4 + 2.0 ** -10}


def _checked(rt, dispatches, out, want, fmt: str, what: str):
    """Run the dispatches once and compare out with the float64 reference want; a wrong kernel reports no speed."""
    from wgpu_train.engines.webgpu.device import storage

    rec = rt.recorder()
    for d in dispatches:
        rec.dispatch(*d)
    rec.submit()
    err = max_rel_err(storage.read(rt, out, want.size), want.reshape(-1))
    if not err < CHECK[fmt]:
        raise AssertionError(f"{what} in {fmt} gave a wrong result (max rel err {err:.2e})")


def _kernels(rt, timer, fmt: str) -> dict:
    """Seconds of the GEMM, the attention forward and an add, with activations in format fmt, each checked
    against NumPy first."""
    from wgpu_train.engines.numpy import ops
    from wgpu_train.engines.webgpu import kernels as K
    from wgpu_train.engines.webgpu import attention as A
    from wgpu_train.engines.webgpu.device import storage
    from wgpu_train.engines.webgpu.tensors import linear_forward, store_weight

    def stored(values):      # values as a tensor of format fmt holds them, float64
        return storage.from_words(storage.to_words(values, fmt), values.size, fmt).astype(np.float64)

    rng = np.random.default_rng(0)
    out, bufs = {}, []
    try:
        n, o, i = GEMM
        weight = rng.normal(0, 0.02, (o, i)).astype(np.float32)
        w = store_weight(rt, "model.layers.0.mlp.up_proj.weight", weight, "float32", "float32")
        xs = rng.standard_normal(n * i).astype(np.float32)
        x, y = _tensor(rt, xs, fmt), _empty(rt, n * o, fmt)
        bufs += [x, y] + [b for b, _, _ in w.chunks]
        rec = Capture(rt)
        linear_forward(rec, y, x, w, None, n)
        _checked(rt, rec.dispatches, y, stored(xs).reshape(n, i) @ weight.T.astype(np.float64), fmt, "the GEMM")
        out["gemm"] = timer.time(rec.dispatches, repeats=3, budget_s=2.0)
        b, t, hq, hkv, d = ATTENTION
        qkv = [rng.standard_normal(b * t * h * d).astype(np.float32) for h in (hq, hkv, hkv)]
        q, k, v = (_tensor(rt, values, fmt) for values in qkv)
        att, lse = _empty(rt, b * t * hq * d, fmt), rt.buffer(4 * b * hq * t)
        seg = rt.upload(np.ones(b * t, np.int32))
        bufs += [q, k, v, att, lse, seg]
        rec = Capture(rt)
        A.attention_forward(rec, att, lse, q, k, v, seg, b, t, hq, hkv, d)
        want = ops.attention_forward(*(stored(values).reshape(b, t, -1, d) for values in qkv),
                                     np.ones((b, t), np.int32))[0]
        _checked(rt, rec.dispatches, att, want, fmt, "attention")
        out["attention"] = timer.time(rec.dispatches, repeats=3, budget_s=2.0)
        values = [rng.standard_normal(ELEMENTS).astype(np.float32) for _ in range(2)]
        a, c, s = (_tensor(rt, v, fmt) for v in values + [np.zeros(ELEMENTS, np.float32)])
        bufs += [a, c, s]
        rec = Capture(rt)
        K.add(rec, s, a, c, ELEMENTS)
        _checked(rt, rec.dispatches, s, stored(values[0]) + stored(values[1]), fmt, "add")
        out["add"] = timer.time(rec.dispatches, repeats=3, budget_s=2.0)
    finally:
        rt.release(*bufs)
    return out


def _f16_arithmetic(rt, timer) -> dict:
    """Seconds of the GEMM's shape with float16 operands (a frozen float16 weight: the forward of a layer under
    --base-dtype float16; a float16 B: e.g. a weight gradient dy^T x) in one tile config in float32 arithmetic
    and its twin in float16 arithmetic, each checked against float64 first (the f16 one within its bound,
    gemm_tolerance.f16_arithmetic_slack), and the f16 time over the f32 one."""
    from wgpu_train.engines.webgpu.device import storage
    from wgpu_train.engines.webgpu.tuned import adapter_traits
    from wgpu_train.engines.webgpu.tuned.gemm_tolerance import f16_arithmetic_slack, gemm_tolerance
    from wgpu_train.engines.webgpu.tuned import gemm as G
    from wgpu_train.engines.webgpu.tuned import gemm_kernels as GK
    from wgpu_train.engines.webgpu.tuned import gemm_source as T
    from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
    from wgpu_train.engines.webgpu.tuned.quant_kernels import QProblem, QTiled

    if not adapter_traits.f16_arithmetic(rt):
        return {"offered": False, "why": "the adapter lacks shader-f16 (or WGPU_TRAIN_F16_ARITHMETIC=0)"}
    rng = np.random.default_rng(0)
    n, o, i = GEMM
    x = storage.rounded(rng.standard_normal(n * i).astype(np.float32), "f16").reshape(n, i)
    w16 = storage.rounded(rng.normal(0, 0.02, o * i).astype(np.float32), "f16").reshape(o, i)
    xb, wt, y = _tensor(rt, x, "f16"), _tensor(rt, w16.T.copy(), "f16"), _empty(rt, n * o, "f32")
    frozen = QuantMatrix(rt, w16, "float16", "bench f16 weight")
    X, W = x.astype(np.float64), w16.astype(np.float64)
    want = X @ W.T
    bound = gemm_tolerance(1.0, i, want) + f16_arithmetic_slack(1.0, i, X, W.T)
    tile = T.TileConfig(64, 64, 16, 8, 4)     # in both families' configs, with a float16-arithmetic twin
    problems = {"qgemm_float16_weight": (QProblem(rt, y, xb, frozen, 0, "nt", n), QTiled),
                "gemm_float16_operands": (G.gemm_problem(rt, y, xb, wt, n, o, i), GK.Tiled)}
    out = {"offered": True, "tile": tile.name}
    try:
        for name, (p, family) in problems.items():
            secs = {}
            for half in (False, True):
                cand = family(dataclasses.replace(tile, half=half))
                if not cand.applies(p):
                    raise AssertionError(f"{cand.name} does not apply to {name}")
                dispatches = cand.dispatches(p)
                rec = rt.recorder()
                for d in dispatches:
                    rec.dispatch(*d)
                rec.submit()
                err = float(np.max(np.abs(storage.read(rt, y, n * o).reshape(n, o) - want)))
                if not err <= (bound if half else gemm_tolerance(1.0, i, want)):
                    raise AssertionError(f"{name} {cand.name} gave a wrong result (max error {err:.3g})")
                secs["f16" if half else "f32"] = timer.time(dispatches, repeats=3, budget_s=2.0)
            out[name] = {"f32_arithmetic_gflops": 2.0 * n * o * i / secs["f32"] / 1e9,
                         "f16_arithmetic_gflops": 2.0 * n * o * i / secs["f16"] / 1e9,
                         "f16_time_vs_f32": secs["f16"] / secs["f32"]}
    finally:
        rt.release(xb, wt, y, *[b for b, _, _ in frozen.chunks])
    return out


def _step(rt, precision: Precision, steps: int) -> dict:
    """Median seconds of a LoRA step (r=8, all linear layers) and the bytes of its activation bucket."""
    from wgpu_train.bench.training import random_batch, random_lora, random_weights, timed
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    rng = np.random.default_rng(0)
    cfg = ModelConfig.from_dict(dict(SMOL_SHAPED), "bench model")
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    engine = WgpuEngine(cfg, random_weights(cfg, rng), rt, precision=precision)
    engine.set_lora(random_lora(cfg, lora, rng))
    micro = random_batch(cfg, *STEP_BATCH, rng)
    hp = OptimizerParams(lr=1e-4)
    walls = timed(lambda i: engine.train_step(micro, hp, i + 1), steps)
    acts = engine._activations(*STEP_BATCH, train=True)
    allocated = sum({id(b): b.size for layer in acts.layers.values() for b in layer.values()}.values())
    est = estimate_memory(cfg, *STEP_BATCH, lora=lora, max_binding=rt.max_binding, precision=precision)
    engine._release_acts()
    return {"step_s": float(np.median(walls)), "layer_activation_bytes": allocated,
            "estimated_activation_bytes": est["activations"]}


def bench_precision(rt, steps: int = 3) -> dict:
    """Each precision's kernel times and LoRA step, and each 16-bit figure over fp32's."""
    from wgpu_train.engines.webgpu.device.timing import Timer

    timer = Timer(rt)
    b, t, hq, hkv, d = ATTENTION
    n, o, i = GEMM
    work = {"gemm": (2.0 * n * o * i, "gflops"), "attention": (4.0 * b * t * t * d * hq / 2, "gflops")}
    rows = {}
    for precision in PRECISIONS:
        fmt = precision.storage
        secs = _kernels(rt, timer, fmt)
        step = _step(rt, precision, steps)
        size = {"f32": 4, "bf16": 2, "f16": 2}[fmt]
        rows[precision] = {
            "gemm_gflops": work["gemm"][0] / secs["gemm"] / 1e9,
            "attention_causal_gflops": work["attention"][0] / secs["attention"] / 1e9,
            "add_gbps": 3 * ELEMENTS * size / secs["add"] / 1e9,
            "step_tokens_per_s": STEP_BATCH[0] * STEP_BATCH[1] / step["step_s"],
            "layer_activation_bytes": step["layer_activation_bytes"],
            "estimated_activation_bytes": step["estimated_activation_bytes"],
            "_s": {**secs, "step": step["step_s"]},
        }
    base = rows[Precision.FP32]
    for precision in (Precision.BF16, Precision.F16):
        r = rows[precision]
        r["vs_fp32"] = {"gemm_time": r["_s"]["gemm"] / base["_s"]["gemm"],
                        "attention_time": r["_s"]["attention"] / base["_s"]["attention"],
                        "add_time": r["_s"]["add"] / base["_s"]["add"],
                        "step_time": r["_s"]["step"] / base["_s"]["step"],
                        "activation_bytes": r["estimated_activation_bytes"] / base["estimated_activation_bytes"]}
    for r in rows.values():
        del r["_s"]
    return {"model": "SmolLM2-135M-shaped Llama (2 of 30 layers), LoRA r=8 all-linear",
            "step_batch": f"{STEP_BATCH[0]}x{STEP_BATCH[1]}", "gemm": "x (512, 576) W^T (576, 1536)",
            "attention": "causal forward, T 512, 9 / 3 heads, D 64", "add": f"{ELEMENTS} elements", **rows,
            "f16_arithmetic": _f16_arithmetic(rt, timer)}
