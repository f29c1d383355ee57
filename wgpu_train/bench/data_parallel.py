"""`wgpu-train bench --only data_parallel`: the embedded default run's LoRA step on 1 and on 2 Ray Train workers
(the same batch per worker), side by side in one run: step times, the all-reduce's share, scaling efficiency."""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from wgpu_train.errors import ConfigError


def _side(summary: dict) -> dict:
    dp = summary["data_parallel"]
    tokens_per_step = summary["tokens"] / max(summary["steps"], 1)
    return {"workers": dp["workers"], "step_s": dp["step_s_median"], "allreduce_s": dp["allreduce_s_median"],
            "wait_s": dp["wait_s_median"], "allreduce_share": dp["allreduce_share"],
            "tokens_per_step": round(tokens_per_step, 1),
            "tokens_per_s": round(tokens_per_step / max(dp["step_s_median"], 1e-12), 1)}


def bench_data_parallel(steps: int = 10, batch_size: int = 8) -> dict:
    """Each side trains `steps` steps of batch_size rows per worker (medians past the first step) on the
    adapters the workers choose by default (ray_worker.adapter_for); {"skipped": why} without Ray Train."""
    from wgpu_train.distributed import ray_driver as distributed
    from wgpu_train.engines.webgpu.device import runtime
    from wgpu_train.distributed.ray_worker import adapter_for
    from wgpu_train.training.config import default_run_config

    try:
        ray = distributed._import_ray()
    except ConfigError as e:
        return {"skipped": str(e)}
    base = default_run_config(backend="wgpu", max_steps=steps, batch_size=batch_size,
                              grad_accum=1, eval_every=0, valid_split=0.0, eval_generate=False, save_every=0,
                              no_progress=True, overwrite=True, log_every=steps)
    started = distributed._connect(ray, None, 2)
    sides = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for workers in (1, 2):
                cfg = dataclasses.replace(base, num_workers=workers, out=str(Path(tmp) / f"w{workers}"))
                sides.append(_side(distributed.finetune_on_ray(cfg, log=lambda line: None)))
    finally:
        if started:
            ray.shutdown()
    one, two = sides
    spec, sharing = adapter_for(None, 0, 2)     # what the workers took (as ray_worker.worker chooses)
    adapter = next(a for a in runtime.devices() if str(a.index) == spec)
    if sharing < 2:
        note = "one adapter per worker"
    elif adapter.adapter_type == "CPU":
        note = (f"both workers share one software adapter, which computes on the same {os.cpu_count()} CPU cores: "
                f"the efficiency is bounded by the cores, not by the all-reduce")
    else:
        note = "both workers share one GPU: the efficiency is bounded by that GPU"
    from wgpu_train.models.config import ModelConfig
    from wgpu_train.engines.webgpu.memory import count_trainable
    from wgpu_train.training.config import default_model_dir

    grads = 4 * count_trainable(ModelConfig.from_folder(default_model_dir()), base.lora_config())
    return {"adapter": adapter.describe(), "workers_per_adapter": sharing, "steps": steps, "gradient_bytes": grads,
            "batch_per_worker": batch_size, "one_worker": one, "two_workers": two,
            "allreduce_share": two["allreduce_share"],
            "scaling_efficiency": round(two["tokens_per_s"] / max(2 * one["tokens_per_s"], 1e-12), 3),
            "note": note}
