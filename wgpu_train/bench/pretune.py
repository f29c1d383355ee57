"""Pre-tuning and model-FLOPs utilisation of a model's LoRA training step: one step of the model's shapes,
built from its config.json with random weights, runs every GEMM and attention pass it needs through the
tuner (`wgpu-train tune`), and a timed step gives the step's model FLOPs per second next to the adapter's FMA peak (`bench`)."""
from __future__ import annotations

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.bench.training import random_batch, random_lora, random_weights, timed

# a SmolLM2-135M-shaped configuration (hidden 576, 30 layers, 9 / 3 heads, vocabulary 49,152)
SMOL135 = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
               max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0)


# a Qwen2.5-0.5B-shaped one (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864, vocabulary 151,936)
QWEN05 = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
              num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0, attention_bias=True)


def step_gemms(cfg: ModelConfig, tokens: int, r: int, max_binding: int) -> list[tuple]:
    """(what, M, N, K, layout) of the distinct GEMMs of a LoRA step (all linear layers, rank r) at `tokens`
    tokens: each projection forward and its input gradient, the LoRA A / B products and gradients, the head
    (one float32 row chunk of it, as the engine splits a head bigger than a storage binding)."""
    from wgpu_train.engines.webgpu.tuned.quant import chunk_plan

    c, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_size
    v = chunk_plan(cfg.vocab_size, c, "float32", max_binding)[0][1]
    return [("q/o forward", tokens, c, c, "nt"), ("k/v forward", tokens, kv, c, "nt"),
            ("gate/up forward", tokens, f, c, "nt"), ("down forward", tokens, c, f, "nt"),
            ("gate/up dx", tokens, c, f, "nn"), ("down dx", tokens, f, c, "nn"),
            ("LoRA A forward (q/k/v)", tokens, r * 3, c, "nt"), ("LoRA B forward", tokens, c, r, "nt"),
            ("LoRA dA", 3 * r, c, tokens, "tn"), ("LoRA dB", c, r, tokens, "tn"),
            ("head forward", tokens, v, c, "nt"), ("head dx", tokens, c, v, "nn")]


def random_engine(rt, cfg: ModelConfig, lora: LoraConfig, seed: int = 0, precision: str = "fp32"):
    """A WgpuEngine of cfg's shapes with random float32 weights and a random LoRA on lora's targets, its
    activations in `precision`."""
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    rng = np.random.default_rng(seed)
    engine = WgpuEngine(cfg, random_weights(cfg, rng), rt, precision=precision)
    engine.set_lora(random_lora(cfg, lora, rng, b_std=0.01))
    return engine


def lora_step_flops(cfg: ModelConfig, lora: LoraConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one LoRA training step: every base linear layer and the head forward and backward to
    their input (4 per weight per token), the LoRA pairs forward and backward with their weight gradients
    (6 per weight per token), and causal attention (scores and values, half of T^2, three times for the
    forward and the backward)."""
    n = batch * seq
    base = sum(int(np.prod(cfg.linear_shape(m))) for m in cfg.linear_modules) * cfg.num_hidden_layers
    head = cfg.vocab_size * cfg.hidden_size
    adapters = sum(lora.r * sum(cfg.linear_shape(m)) for m in lora.targets_in(cfg)) * cfg.num_hidden_layers
    attention = 2 * 2 * batch * seq * seq / 2 * cfg.q_size * cfg.num_hidden_layers
    return 4.0 * n * (base + head) + 6.0 * n * adapters + 3 * attention


def pretune(rt, cfg: ModelConfig, lora: LoraConfig, batch: int, seq: int, mode: str = "full") -> list[dict]:
    """Tune every GEMM and attention pass of one LoRA training step of cfg at batch x seq tokens on rt; one row
    per shape:
    {"shape", "choice", "gflops": {candidate: GFLOP/s or None (wrong)}, "fraction_of_peak", "tuned"}."""
    engine = random_engine(rt, cfg, lora)
    hp = OptimizerParams(lr=1e-4)
    with tune.forced_mode(mode):
        engine.train_step(random_batch(cfg, batch, seq, np.random.default_rng(0)), hp, 1)
    cache = tune.cache(rt)
    tuned = {key for key, _, _ in tune.tuned_log(rt)}
    peak = cache.peak_gflops or None
    rows = []
    for key, name in sorted(rt.memo("tune.choices", lambda r: {}).items()):
        entry = cache.entries.get(key, {})
        gflops = entry.get("gflops", {})
        best = gflops.get(name)
        rows.append({"shape": key, "choice": name, "gflops": gflops,
                     "fraction_of_peak": best / peak if best and peak else None, "tuned": key in tuned})
    return rows


def tune_cache(rt) -> tune.TuneCache:
    """The adapter's tune cache that pretune fills: its file and the FMA peak measured with it."""
    return tune.cache(rt)


def format_rows(rows: list[dict], peak: float | None) -> str:
    """The tune table: each shape, its candidates' GFLOP/s and share of the peak, the chosen one marked *."""
    lines = [f"fp32 FMA peak: {peak:.1f} GFLOP/s" if peak else "fp32 FMA peak: not measured (nothing tuned)"]
    for r in rows:
        lines.append(f"{r['shape']}: {r['choice']}" + ("" if r["tuned"] else " (from the cache)"))
        for name, g in sorted(r["gflops"].items(), key=lambda kv: -(kv[1] or 0)):
            mark = "*" if name == r["choice"] else " "
            rate = "wrong result" if g is None else f"{g:9.2f} GFLOP/s" + (f" {100 * g / peak:5.1f}%" if peak else "")
            lines.append(f"  {mark} {name:<36} {rate}")
    return "\n".join(lines)


def training_mfu(rt, cfg: ModelConfig | None = None, batch: int = 1, seq: int = 128, steps: int = 2,
                 precision: str = "fp32") -> dict:
    """Model-FLOPs utilisation of LoRA (r=16, all linear layers) steps of cfg (default: the SmolLM2-135M shape)
    with random weights and activations in `precision`: model FLOPs per second over the adapter's FMA peak,
    measured in the same run."""
    from wgpu_train.engines.webgpu.device.timing import Timer, fma_peak

    cfg = cfg or ModelConfig.from_dict(dict(SMOL135), "135M-shaped configuration")
    lora = LoraConfig(r=16, alpha=32, target_modules="all-linear")
    engine = random_engine(rt, cfg, lora, precision=precision)
    micro = random_batch(cfg, batch, seq, np.random.default_rng(0))
    hp = OptimizerParams(lr=1e-4)
    timer = Timer(rt)
    peaks = [fma_peak(rt, timer)]
    records = []

    def step(i):                                    # step 0 warms up: pipelines, buffers, tuning
        engine.train_step(micro, hp, i + 1)
        records.append(engine.last_timing["record_s"])

    walls = timed(step, steps)
    records = records[1:]
    peaks.append(fma_peak(rt, timer))
    wall, peak = min(walls), max(peaks)
    flops = lora_step_flops(cfg, lora, batch, seq)
    return {"model": "SmolLM2-135M-shaped (hidden 576, 30 layers, vocab 49152), LoRA r=16 all-linear, random weights",
            "batch": f"{batch}x{seq}", "step_s": wall, "tokens_per_s": batch * seq / wall,
            "model_gflops_per_step": flops / 1e9, "model_gflops_per_s": flops / wall / 1e9,
            "precision": precision, "fma_peak_gflops": peak, "mfu": flops / wall / 1e9 / peak,
            "peak_is_cpu_adapters": rt.info.adapter_type == "CPU",   # then not the CPU's own peak (bench's note)
            "python_record_s": min(records),
            "submits_per_step": engine.last_step["submits"]}
