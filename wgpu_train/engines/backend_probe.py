"""backend auto's timed probe where the only WebGPU adapters are CPUs: a LoRA step of the model's shape on the
NumPy engine and, unless that step is too short for the adapter's kernel compilation to pay off, on the adapter,
timed side by side once and cached with the adapter's tuned kernels (a change to the kernels' sources re-measures
it)."""
from __future__ import annotations

import hashlib
import time

import numpy as np

from wgpu_train.engines.numpy.engine import NumpyEngine
from wgpu_train.engines.protocol import OptimizerParams, Precision
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.engines.webgpu.engine import WgpuEngine
from wgpu_train.engines.webgpu.memory import weight_shapes
from wgpu_train.engines.webgpu.tuned import tune
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.weights import module_path

PROBE_BATCH = (4, 64)       # rows x tokens of the probe's step where the caller names none (generation, eval)
PROBE_RANK = 8              # its LoRA rank, on every linear module
PROBE_STEPS = 2                                  # timed steps per engine, after one that warms it up
# A NumPy step shorter than this is not worth the adapter's first run: compiling its kernels takes seconds (the
# embedded default's whole run measured 16.5 s on the NumPy engine and 31-34 s with a probe that compiled them,
# on a fresh cache), while its step took 65 ms there; a SmolLM2-135M-shaped step takes seconds.
MIN_PROBED_STEP_S = 0.5


def probe_key(cfg: ModelConfig, base_dtype: str, embed_dtype: str, precision: Precision, batch: tuple) -> str:
    """The tune-cache key of a probe: what its speed depends on (the shapes, storage, precision and batch)."""
    shapes = sorted((k, tuple(v)) for k, v in weight_shapes(cfg).items())
    digest = hashlib.sha256(repr((shapes, cfg.architecture, cfg.num_key_value_heads)).encode()).hexdigest()[:12]
    return f"engines {cfg.architecture} {cfg.hidden_size}x{cfg.num_hidden_layers} v{cfg.vocab_size} #{digest} " \
           f"{base_dtype}/{embed_dtype} {precision} {batch[0]}x{batch[1]}"


def _probe_lora(cfg: ModelConfig, rng) -> dict:
    """set_lora's modules: rank PROBE_RANK on every linear module, A small and B zero (PEFT's start)."""
    mods = {}
    for i in range(cfg.num_hidden_layers):
        for m in cfg.layer_modules(i):
            out_f, in_f = cfg.linear_shape(m)
            mods[module_path(i, m)] = (rng.uniform(-0.1, 0.1, (PROBE_RANK, in_f)).astype(np.float32),
                                       np.zeros((out_f, PROBE_RANK), np.float32), 2.0, 0.0)
    return mods


def _tokens_per_s(engine, cfg: ModelConfig, batch: tuple, enough_below: float = 0.0) -> float:
    """Tokens/s of the fastest of PROBE_STEPS LoRA steps after a warm-up step; the warm-up's own when it took
    less than `enough_below` seconds (already short enough to decide)."""
    rng = np.random.default_rng(0)
    engine.set_lora(_probe_lora(cfg, rng))
    rows, seq = batch
    ids = rng.integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)                        # (B, T)
    pos = np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape).copy()
    micro = [(ids, shift_labels(ids.astype(np.int64)), np.ones_like(ids), pos)]
    hp = OptimizerParams(lr=1e-4, max_grad_norm=1.0)
    walls = []
    for step in range(PROBE_STEPS + 1):
        t0 = time.perf_counter()
        engine.train_step(micro, hp, step + 1)
        walls.append(time.perf_counter() - t0)
        if step == 0 and walls[0] < enough_below:
            return rows * seq / walls[0]
    return rows * seq / min(walls[1:])


def measure_engines(cfg: ModelConfig, rt, base_dtype: str, embed_dtype: str, precision: Precision,
                    batch: tuple) -> dict:
    """{"numpy": tokens/s, "wgpu": tokens/s} of a LoRA step of cfg's shape (random weights) over a random batch
    of rows x tokens on each engine, one engine at a time (so the two copies of the weights are never held
    together); only "numpy" when its step takes less than MIN_PROBED_STEP_S (the adapter is not timed)."""
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.02, shape)).astype(np.float32)
               for name, shape in weight_shapes(cfg).items()}
    speeds = {"numpy": _tokens_per_s(NumpyEngine(cfg, weights, base_dtype=base_dtype, embed_dtype=embed_dtype,
                                                 precision=precision), cfg, batch, MIN_PROBED_STEP_S / 4)}
    if batch[0] * batch[1] / speeds["numpy"] >= MIN_PROBED_STEP_S:
        speeds["wgpu"] = _tokens_per_s(WgpuEngine(cfg, weights, rt, base_dtype, embed_dtype, precision=precision),
                                       cfg, batch)
    return speeds


def probed_speeds(cfg: ModelConfig, rt, base_dtype: str, embed_dtype: str, precision: Precision,
                  batch: tuple | None = None) -> tuple[dict, bool]:
    """(the speeds of measure_engines, whether they came from the adapter's tune cache): measured once per
    model shape, storage, precision and batch (rows, tokens; default PROBE_BATCH, within the model's positions)
    on this adapter, then read from the cache."""
    rows, seq = batch or PROBE_BATCH
    batch = (max(1, int(rows)), max(2, min(int(seq), cfg.max_position_embeddings)))
    cache = tune.cache(rt)
    key = probe_key(cfg, base_dtype, embed_dtype, precision, batch)
    entry = cache.entries.get(key)
    if entry and "numpy" in entry.get("tokens_per_s", {}):
        return entry["tokens_per_s"], True
    speeds = measure_engines(cfg, rt, base_dtype, embed_dtype, precision, batch)
    cache.put(key, {"choice": max(speeds, key=speeds.get), "tokens_per_s": speeds})
    return speeds, False
