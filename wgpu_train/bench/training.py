"""Training-throughput benchmark: tokens/s of LoRA steps on the wgpu engine (also with gradient
checkpointing), the NumPy engine and PyTorch CPU + PEFT (when installed) on the same small model and batch,
measured side by side."""
from __future__ import annotations

import time

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import OptimizerParams
from wgpu_train.engines.webgpu.memory import weight_shapes
from wgpu_train.engines.shared.labels import shift_labels

BENCH_MODEL = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=128, intermediate_size=344,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                   max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0)
BATCH, SEQ = 8, 64


def random_weights(cfg: ModelConfig, rng) -> dict:
    """Every base tensor of cfg: norms (1-D) ones, the rest N(0, 0.02), float32."""
    return {name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.02, shape)).astype(np.float32)
            for name, shape in weight_shapes(cfg).items()}


def random_lora(cfg: ModelConfig, lora: LoraConfig, rng, b_std: float = 0.0) -> dict:
    """WgpuEngine.set_lora's modules for every layer and target: A uniform in +-0.1, B N(0, b_std) (0: zeros)."""
    from wgpu_train.models.weights import module_path

    mods = {}
    for i in range(cfg.num_hidden_layers):
        for m in lora.targets_in(cfg):
            out_f, in_f = cfg.linear_shape(m)
            b = rng.normal(0, b_std, (out_f, lora.r)) if b_std else np.zeros((out_f, lora.r))
            mods[module_path(i, m)] = (rng.uniform(-0.1, 0.1, (lora.r, in_f)).astype(np.float32),
                                       b.astype(np.float32), lora.scale, 0.0)
    return mods


def random_batch(cfg: ModelConfig, batch: int, seq: int, rng) -> list:
    """One micro-batch of random tokens, every token trained."""
    ids = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()
    return [(ids, shift_labels(ids.astype(np.int64)), np.ones_like(ids), pos)]


def timed(step, steps: int) -> list:
    """Seconds of step(1) .. step(steps), after step(0) as a warm-up (pipelines, buffers, JIT)."""
    step(0)
    walls = []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        step(i)
        walls.append(time.perf_counter() - t0)
    return walls


def _time_engine(engine, micro, hp, steps):
    """(median step seconds, median Python recording seconds) of engine.train_step on micro."""
    records = []

    def step(i):
        engine.train_step(micro, hp, i + 1)
        records.append(getattr(engine, "last_timing", {}).get("record_s", 0.0))

    walls = timed(step, steps)
    return float(np.median(walls)), float(np.median(records[1:]))


def _torch_tokens_per_s(cfg_raw, cfg, weights, lora, micro, steps):
    try:
        import torch
        import transformers
        import peft
    except ImportError:
        return None
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg_raw.items() if k != "architectures"})
    model = transformers.LlamaForCausalLM(hf_cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                       target_modules=list(lora.targets_in(cfg)), lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.from_numpy(micro[0][0].astype(np.int64))

    def step(_):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()

    return BATCH * SEQ / float(np.median(timed(step, steps)))


def bench_training(rt, steps: int = 5) -> dict:
    """LoRA (all linear layers, r=8) training steps of a 4-layer, 128-wide Llama on a batch of 8 x 64 tokens."""
    from wgpu_train.engines.numpy.engine import NumpyEngine
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    rng = np.random.default_rng(0)
    cfg = ModelConfig.from_dict(dict(BENCH_MODEL), "bench model")
    weights = random_weights(cfg, rng)
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    modules = random_lora(cfg, lora, rng)
    micro = random_batch(cfg, BATCH, SEQ, rng)
    hp = OptimizerParams(lr=1e-3, max_grad_norm=1.0)
    tokens = BATCH * SEQ

    gpu = WgpuEngine(cfg, weights, rt)
    gpu.set_lora(modules)
    wall, record = _time_engine(gpu, micro, hp, steps)
    per_step = dict(gpu.last_step)
    # the GPU's busy time comes from a step timed with timestamp queries (which slow it a little), so its
    # share is taken of that same step's wall time
    gpu.train_step(micro, hp, steps + 2, profile="total")
    busy = sum(gpu.last_profile.values()) if rt.has_timestamps else None
    profiled_wall = gpu.last_timing["wall_s"]
    gpu.set_gradient_checkpointing(True)
    ckpt_wall, _ = _time_engine(gpu, micro, hp, steps)

    cpu = NumpyEngine(cfg, weights)
    cpu.set_lora(modules)
    cpu_wall, _ = _time_engine(cpu, micro, hp, max(2, steps // 2))
    torch_tps = _torch_tokens_per_s(BENCH_MODEL, cfg, weights, lora, micro, max(2, steps // 2))

    out = {
        "model": "Llama 4 layers, hidden 128, vocab 512, LoRA r=8 all-linear",
        "batch": f"{BATCH}x{SEQ}",
        "tokens_per_s": {"wgpu": tokens / wall, "wgpu_gradient_checkpointing": tokens / ckpt_wall,
                         "numpy": tokens / cpu_wall, "torch_cpu_peft": torch_tps},
        "gradient_checkpointing_step_time_ratio": ckpt_wall / wall,
        "wgpu_vs_numpy": cpu_wall / wall,
        "wgpu_vs_torch_cpu_peft": (tokens / wall) / torch_tps if torch_tps else None,
        "step_wall_ms": wall * 1e3,
        "python_record_ms": record * 1e3,
        "python_record_fraction": record / wall,
        "gpu_busy_ms": busy * 1e3 if busy is not None else None,
        "gpu_busy_fraction": busy / profiled_wall if busy is not None else None,
        "submits_per_step": per_step["submits"],
        "readbacks_per_step": per_step["readbacks"],
    }
    return out


def bench_variable_lengths(rt, samples: int = 50, fixed: int = 128) -> dict:
    """Evaluation (the engine's loss) of `samples` rows of distinct lengths (16..256 tokens) next to the same
    number of tokens in rows of one length, on the bench model, each on a fresh engine: wall time of a first
    pass (buckets, pipelines and uniforms made as they are needed) and of a second, the ratio of the second
    passes, and the activation buckets and GPU buffers each pass created (Runtime.buffer's count)."""
    from wgpu_train.engines.webgpu.engine import WgpuEngine

    rng = np.random.default_rng(1)
    cfg = ModelConfig.from_dict(dict(BENCH_MODEL), "bench model")
    weights = random_weights(cfg, rng)
    lengths = [int(t) for t in rng.permutation(np.arange(16, 257))[:samples]]
    rows = {"variable": lengths, "fixed": [fixed] * max(1, round(sum(lengths) / fixed))}
    out = {"model": "Llama 4 layers, hidden 128, vocab 512", "tokens": {k: sum(v) for k, v in rows.items()}}
    for name, ts in rows.items():
        engine = WgpuEngine(cfg, weights, rt)
        batches = []
        for t in ts:
            ids = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
            pos = np.arange(t, dtype=np.int32)[None]
            batches.append((ids, shift_labels(ids.astype(np.int64)), np.ones_like(ids), pos))
        for run in ("first", "second"):
            before, t0 = dict(rt.counters), time.perf_counter()
            for b in batches:
                engine.loss(*b)
            out[f"{name}_{run}_s"] = time.perf_counter() - t0
            out[f"{name}_{run}_buffers_created"] = rt.counters["buffers_created"] - before["buffers_created"]
        out[f"{name}_buckets_allocated"] = engine.counters["buckets_allocated"]
        engine._release_acts()
    out["variable_vs_fixed_time"] = out["variable_second_s"] / out["fixed_second_s"]
    return out
