"""What runs inside each Ray Train worker of a --num-workers run (ray_driver.py starts them): the adapter a
worker takes, its side of the driver's RunControl actor, torch.distributed's gloo group as the collective, and
the function that runs one data-parallel trainer (data_parallel.data_parallel_trainer)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.errors import ConfigError, WgpuTrainError
from wgpu_train.adapters.layout import lora_options
from wgpu_train.engines.backend_choice import choose_backend


class TorchCollective:
    """The workers' torch.distributed process group (gloo on CPU tensors), which Ray Train's TorchTrainer
    sets up: data_parallel's all_reduce (a sum) and broadcast (rank 0's object)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()

    def all_reduce(self, array: np.ndarray) -> np.ndarray:
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(array))
        self.dist.all_reduce(tensor)
        return tensor.numpy()

    def broadcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


class _Sink:
    """A worker's side of the RunControl actor (data_parallel.DataParallelWorker's sink)."""

    def __init__(self, ray, control, rank: int):
        self.ray, self.control, self.rank = ray, control, rank

    def log(self, line: str):
        self.control.log.remote(self.rank, line)

    def progress(self, n: int, total, postfix: dict):
        self.control.progress.remote(n, total, {k: str(v) for k, v in postfix.items()})

    def stop_requested(self) -> bool:
        return self.ray.get(self.control.stop_requested.remote())

    def checkpointed(self, path: str):
        self.ray.get(self.control.checkpointed.remote(path))


def adapter_for(device: str | None, local_rank: int, local_workers: int) -> tuple[str | None, int]:
    """(the --device spec of worker `local_rank` of a node, how many of the node's workers use that adapter).
    A list (0,1,...) gives worker i the i-th; one spec is shared by every worker; without one, worker i takes
    the i-th adapter of the kind and backend the default choice has, shared round-robin when there are fewer."""
    specs = [s.strip() for s in device.split(",") if s.strip()] if device else []
    if len(specs) > 1:
        if local_rank >= len(specs):
            raise ConfigError(f"--device lists {len(specs)} adapters for {local_workers} workers on a node: list "
                              f"one per worker, or give one adapter for the workers to share")
        return specs[local_rank], 1
    if specs:
        return specs[0], local_workers
    from wgpu_train.engines import resources

    found = resources.devices()
    if not found:
        return None, local_workers
    best = resources.choose_adapter(None)
    same = [a for a in found if (a.adapter_type, a.backend) == (best.adapter_type, best.backend)]
    mine = same[local_rank % len(same)]
    return str(mine.index), len(range(local_rank % len(same), local_workers, len(same)))


# what a run resolves from --adapter-path as it starts, and records in train_config.json: the model and every
# LoRA option (layout.lora_options), so a restart rebuilds the adapter as the run trained it
RECORDED = ("model",) + tuple(lora_options(LoraConfig()))


def worker(loop_config: dict):
    """The function each Ray Train worker runs: one data-parallel trainer; a restarted worker group resumes from
    the last checkpoint rank 0 wrote, and a user error is kept for the driver to print."""
    import ray
    import ray.train

    from wgpu_train.distributed.data_parallel import data_parallel_trainer
    from wgpu_train.training.config import TrainConfig, resumed_settings

    control = loop_config["control"]
    if ray.get(control.failure.remote()) is not None:
        return                          # an earlier attempt met a user error: the driver reports it
    ctx = ray.train.get_context()
    rank, local_rank, local_workers = ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_local_world_size()
    if os.path.isdir(loop_config["cwd"]):
        os.chdir(loop_config["cwd"])    # relative paths mean what they meant on the driver
    sink = _Sink(ray, control, rank)
    try:
        cfg = TrainConfig(**loop_config["config"])
        restarted = ray.get(control.start.remote(rank)) > 1
        last = ray.get(control.last_checkpoint.remote())
        if last is not None:            # a restart: continue the run from its last checkpoint, with the model
            # and LoRA settings it recorded (those of an --adapter-path it continues)
            recorded = resumed_settings(last)
            cfg = dataclasses.replace(cfg, resume=last, adapter_path=None,
                                      **{k: recorded[k] for k in RECORDED if k in recorded})
        elif restarted:                 # a restart before any checkpoint: what is in --out is this run's
            cfg = dataclasses.replace(cfg, overwrite=True)
        placement = None
        if cfg.pipelined():         # a 2-D grid: this worker's own pipeline of stages
            from wgpu_train.distributed.pipeline_trainer import PipelineStages, pipeline_config

            cfg, placement = pipeline_config(cfg), PipelineStages()
        trainer = data_parallel_trainer(cfg, TorchCollective(), sink, loop_config.get("reward_funcs"), placement,
                                        loop_config.get("tools"), loop_config.get("environment_factory"))
        if choose_backend(cfg.backend, cfg.device).engine == "wgpu":
            trainer.device, sharing = adapter_for(cfg.device, local_rank, local_workers)
            if trainer.device is not None and sharing > 1:
                sink.log(f"{sharing} workers of this node share adapter {trainer.device} (each its own device)")
        summary = trainer.run()
        if rank == 0:
            ray.get(control.finish.remote(summary))
    except WgpuTrainError as e:
        ray.get(control.fail.remote(type(e).__name__, str(e)))
        raise
