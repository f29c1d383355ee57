"""`wgpu-train bench --only pipeline`: the embedded default model's LoRA step through S = 1, 2 and 3 pipeline stages
as Ray actors, on the NumPy engine and on the bench's WebGPU adapter, on the same global batch, side by side in
one run: time per step, the bubble (the share of the stages' time they wait), and the bytes passed between
stages per step."""
from __future__ import annotations

import os
import time

import numpy as np

from wgpu_train.errors import ConfigError


def _step_batches(micro: int, rows: int, length: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(micro):
        ids = rng.integers(0, vocab, (rows, length)).astype(np.int32)
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape).copy()
        out.append((ids, np.roll(ids, -1, axis=1).astype(np.int64), np.ones_like(ids), pos))
    return out


def _side(folder, stages: int, micro: int, rows: int, length: int, steps: int, schedule: str,
          device: str | None) -> dict:
    """One side: S stages on the NumPy engine (device None) or each on the WebGPU adapter `device`."""
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.distributed.pipeline_engine import PipelineEngine
    from wgpu_train.distributed.pipeline_ray import RayStages
    from wgpu_train.engines.model import Model
    from wgpu_train.engines.protocol import OptimizerParams
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.models.stage_plan import plan_stages

    cfg = ModelConfig.from_folder(folder)
    plan = plan_stages(cfg.num_hidden_layers, stages, tied=cfg.tie_word_embeddings)
    backend = "numpy" if device is None else "wgpu"
    runner = RayStages(folder, plan, "float32", "auto", "fp32", backend=backend, devices=[device] * stages)
    try:
        engine = PipelineEngine(runner, plan, schedule)
        Model(cfg, engine, folder).add_lora(LoraConfig(r=8, target_modules=("q_proj", "v_proj")), seed=0)
        hp = OptimizerParams(lr=1e-3)
        times, busy, sent = [], [], []
        for step in range(1, steps + 2):        # the first step warms up: not counted
            batches = _step_batches(micro, rows, length, cfg.vocab_size, step)
            before = [runner.attr(s, "busy") for s in range(stages)]
            bytes_before = engine.counters["boundary_bytes_sent"]
            t0 = time.perf_counter()
            engine.train_step(batches, hp, step)
            times.append(time.perf_counter() - t0)
            busy.append(sum(runner.attr(s, "busy") - b for s, b in enumerate(before)))
            sent.append(engine.counters["boundary_bytes_sent"] - bytes_before)
        step_s = float(np.median(times[1:]))
        idle = 1.0 - float(np.median([b / (stages * t) for b, t in zip(busy[1:], times[1:])]))
        return {"engine": backend, "stages": stages, "layers": plan.describe(), "step_s": round(step_s, 4),
                "tokens_per_s": round(micro * rows * length / step_s, 1), "bubble_measured": round(idle, 3),
                "bubble_gpipe_theory": round((stages - 1) / (micro + stages - 1), 3),
                "boundary_bytes_per_step": int(np.median(sent[1:]))}
    finally:
        runner.close()


def bench_pipeline(device: str | None = None, steps: int = 4, micro: int = 4, rows: int = 4, length: int = 64,
                   schedule: str = "1f1b") -> dict:
    """S = 1, 2, 3 stages (Ray actors) over the embedded default model on the NumPy engine, and with a WebGPU
    adapter `device` on it too (every stage on that adapter), `steps` steps (medians, past a first one) of
    `micro` micro-batches of rows x length tokens; each side's step time against 1 stage of its engine;
    {"skipped": why} without Ray."""
    from wgpu_train.distributed import pipeline_ray
    from wgpu_train.training.config import default_model_dir

    if pipeline_ray.ray is None:
        return {"skipped": f"Ray is not installed: {pipeline_ray.EXTRA}"}
    folder = default_model_dir()
    started = pipeline_ray.start_ray(None, 3)       # one Ray instance for the three sides
    try:
        devices = [None] + ([device] if device is not None else [])          # the NumPy engine, the adapter
        sides = [_side(folder, s, micro, rows, length, steps, schedule, on) for on in devices for s in (1, 2, 3)]
    except ConfigError as e:
        return {"skipped": str(e)}
    finally:
        if started:
            pipeline_ray.ray.shutdown()
    for side in sides:
        one = next(x["step_s"] for x in sides if x["engine"] == side["engine"] and x["stages"] == 1)
        side["step_time_vs_1_stage"] = round(side["step_s"] / one, 3)
    return {"schedule": schedule, "micro_batches": micro, "rows": rows, "length": length, "sides": sides,
            "note": (f"{os.cpu_count()} CPU cores; the stages share them (and one adapter, on the WebGPU side), "
                     f"so more stages cannot run faster here; the bubble and the step time show Ray's per-call "
                     f"latency on a model this small, not what separate devices would gain. The bytes per step "
                     f"are exact.")}
