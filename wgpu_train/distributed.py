"""Data-parallel fine-tuning on Ray Train: the driver (Ray started or joined, the workers' log lines and one
progress bar, Ctrl-C, restarts from the last checkpoint, user errors as one line) and the function every
worker runs (data_parallel.DataParallelTrainer over torch.distributed's gloo group). Imported only with
--num-workers: nothing else in wgpu_train imports Ray."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

from . import errors
from .errors import ConfigError, WgpuTrainError

EXTRA = "pip install 'wgpu-train[ray]'"


class RunControl:
    """What the driver and the workers share, kept by one Ray actor that outlives worker restarts: log lines,
    the progress, the stop request, the last checkpoint written, a user error and the summary."""

    def __init__(self):
        self.lines, self.state = [], None
        self.stop, self.checkpoint, self.error, self.result = False, None, None, None

    def log(self, rank: int, line: str):
        self.lines.append((rank, line))

    def progress(self, n: int, total, postfix: dict):
        self.state = (n, total if total is not None else (self.state or (0, None))[1], postfix)

    def drain(self):
        """(log lines since the last drain, the progress)."""
        lines, self.lines = self.lines, []
        return lines, self.state

    def request_stop(self):
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop

    def checkpointed(self, path: str):
        self.checkpoint = path

    def last_checkpoint(self):
        return self.checkpoint

    def fail(self, kind: str, message: str):
        if self.error is None:
            self.error = (kind, message)

    def failure(self):
        return self.error

    def finish(self, summary: dict):
        self.result = summary

    def summary(self):
        return self.result


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
    """A worker's side of the RunControl actor (data_parallel.DataParallelTrainer's sink)."""

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
    from .gpu import runtime

    found = runtime.devices()
    if not found:
        return None, local_workers
    best = runtime.choose_adapter(None)
    same = [a for a in found if (a.adapter_type, a.backend) == (best.adapter_type, best.backend)]
    mine = same[local_rank % len(same)]
    return str(mine.index), len(range(local_rank % len(same), local_workers, len(same)))


def _worker(loop_config: dict):
    """The function each Ray Train worker runs: one DataParallelTrainer; a restarted worker group resumes from
    the last checkpoint rank 0 wrote, and a user error is kept for the driver to print."""
    import ray
    import ray.train

    from .data_parallel import DataParallelTrainer
    from .train_config import TrainConfig

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
        last = ray.get(control.last_checkpoint.remote())
        if last is not None:            # a restart: continue the run from its last checkpoint
            cfg = dataclasses.replace(cfg, resume=last, adapter_path=None)
        trainer = DataParallelTrainer(cfg, TorchCollective(), sink)
        if cfg.backend != "numpy":
            trainer.device, sharing = adapter_for(cfg.device, local_rank, local_workers)
            if sharing > 1:
                sink.log(f"{sharing} workers of this node share adapter {trainer.device} (each its own device)")
        summary = trainer.run()
        if rank == 0:
            ray.get(control.finish.remote(summary))
    except WgpuTrainError as e:
        ray.get(control.fail.remote(type(e).__name__, str(e)))
        raise


# ---- the driver ----------------------------------------------------------------------------------------

def _import_ray():
    import importlib

    try:
        for name in ("ray", "ray.train.torch", "torch.distributed"):   # Ray Train, its TorchTrainer, gloo
            importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(f"--num-workers runs on Ray Train, which is not installed (no module "
                          f"{e.name or e}): {EXTRA}") from None
    return sys.modules["ray"]


def _connect(ray, address: str | None, workers: int) -> bool:
    """Join the cluster at `address`, or start a local instance; True when this call started Ray (a Ray
    already initialised in this process is used as it is)."""
    if address not in (None, "auto"):
        host, _, port = address.split("://")[-1].rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise ConfigError(f"--ray-address {address}: no Ray cluster reachable there "
                              f"({getattr(e, 'strerror', None) or e}); start one with `ray start --head`") from None
    if ray.is_initialized():
        return False
    if address is None:
        here = str(Path(__file__).resolve().parent.parent)    # the workers import this wgpu_train
        path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        # Ray's processes inherit an ignored SIGINT: Ctrl-C in the terminal reaches the whole process group, and
        # only the driver should act on it (it stops the workers after their step)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        return True
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"--ray-address {address}: cannot join a Ray cluster ({str(e).splitlines()[0]})") from None
    return True


def finetune_on_ray(config, log=None) -> dict:
    """finetune(config) on config.num_workers Ray Train workers; rank 0's summary (written to summary.json
    as in one process). Ray is started locally, or joined at config.ray_address."""
    from .train import Trainer

    ray = _import_ray()
    out = Trainer(config).out.resolve()   # the output folder and --resume checks, before Ray starts
    specs = [s for s in (config.device or "").split(",") if s.strip()]
    if config.ray_address is None and config.backend != "numpy" and 1 < len(specs) < config.num_workers:
        adapter_for(config.device, config.num_workers - 1, config.num_workers)    # one line: too few listed
    config = dataclasses.replace(config, out=str(out))
    started = _connect(ray, config.ray_address, config.num_workers)
    try:
        return _run(ray, config, log)
    finally:
        if started:
            ray.shutdown()


def _run(ray, config, log) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    control = ray.remote(num_cpus=0)(RunControl).remote()
    trainer = TorchTrainer(
        _worker, train_loop_config={"config": config.to_dict(), "control": control, "cwd": os.getcwd()},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=False),
        run_config=RunConfig(name=f"wgpu-train-{uuid.uuid4().hex[:8]}",
                             failure_config=FailureConfig(max_failures=config.max_failures)))
    box: dict = {}
    done = threading.Event()    # (not Thread.join: a Ctrl-C inside it can make is_alive() lie before 3.13)

    def fit():
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - raised again on the driver's thread
            box["error"] = e
        finally:
            done.set()

    view = _DriverView(ray, control, log, config.no_progress)
    threading.Thread(target=fit, name="ray-train-fit", daemon=True).start()
    interrupts = 0
    try:
        while not done.is_set():
            try:
                done.wait(0.25)
                view.drain()
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts > 1:
                    raise
                ray.get(control.request_stop.remote())
                view.log("interrupted: the workers finish this step, then save a checkpoint (Ctrl-C again to abort)")
        view.drain()
    finally:
        view.close()
    failure = ray.get(control.failure.remote())
    if failure is not None:
        kind, message = failure
        error = getattr(errors, kind, ConfigError)
        raise (error if isinstance(error, type) and issubclass(error, WgpuTrainError) else ConfigError)(message)
    if "error" in box:
        raise box["error"]
    summary = ray.get(control.summary.remote())
    if summary is None:
        raise RuntimeError("the Ray Train workers ended without rank 0's summary")
    return summary


class _DriverView:
    """The driver's side of the run: the workers' log lines, prefixed with their rank, above one progress bar."""

    def __init__(self, ray, control, log, no_progress: bool):
        from tqdm import tqdm

        self.ray, self.control, self._log = ray, control, log
        self.bar = None if no_progress else tqdm(total=None, unit="step", dynamic_ncols=True, file=sys.stderr,
                                                 desc="finetune")
        self.state = None

    def log(self, line: str):
        if self._log is not None:
            self._log(line)
        else:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)

    def drain(self):
        lines, state = self.ray.get(self.control.drain.remote())
        for rank, line in lines:
            self.log(f"[rank {rank}] {line}")
        if state is not None and state != self.state and self.bar is not None:
            self.state = state
            n, total, postfix = state
            self.bar.total = total
            self.bar.n = n
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()
