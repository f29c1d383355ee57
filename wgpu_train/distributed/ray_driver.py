"""Data-parallel fine-tuning on Ray Train, the driver: Ray started or joined, the RunControl actor it shares with
the workers (ray_worker.py), their log lines and one progress bar, Ctrl-C, restarts from the last checkpoint,
user errors as one line. Imported only with --num-workers: nothing else in wgpu_train imports Ray."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import sys
import threading
import uuid
from pathlib import Path

from wgpu_train import errors
from wgpu_train.errors import ConfigError, WgpuTrainError

EXTRA = "pip install 'wgpu-train[ray]'"


class RunControl:
    """What the driver and the workers share, kept by one Ray actor that outlives worker restarts: log lines,
    the progress, the stop request, the last checkpoint written, a user error and the summary."""

    def __init__(self):
        self.lines, self.state, self.starts = [], None, {}
        self.stop, self.checkpoint, self.error, self.result = False, None, None, None

    def start(self, rank: int) -> int:
        """How many times the worker of `rank` has started, this time included."""
        self.starts[rank] = self.starts.get(rank, 0) + 1
        return self.starts[rank]

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


def _connect(ray, address: str | None, cpus: int) -> bool:
    """Join the cluster at `address`, or start a local instance of at least `cpus` CPUs; True when this call
    started Ray (a Ray already initialised in this process is used as it is)."""
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
        here = str(Path(__file__).resolve().parents[2])    # the workers import this wgpu_train
        path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        # Ray's processes inherit an ignored SIGINT: Ctrl-C in the terminal reaches the whole process group, and
        # only the driver should act on it (it stops the workers after their step)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            ray.init(num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
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


def finetune_on_ray(config, log=None, reward_funcs=None, tools=None, environment_factory=None) -> dict:
    """finetune(config) on config.num_workers Ray Train workers; rank 0's summary (written to summary.json
    as in one process). Ray is started locally, or joined at config.ray_address. reward_funcs, tools and
    environment_factory (GRPO's Python objects) travel to the workers by Ray's pickling; GRPO's tools (specs
    too) are checked here first, so a bad one is one line before Ray starts."""
    from wgpu_train.distributed.ray_worker import adapter_for
    from wgpu_train.training.tools import run_toolbox
    from wgpu_train.training.trainer import Trainer

    run_toolbox(config, tools, environment_factory)
    ray = _import_ray()
    out = Trainer(config).out.resolve()   # the output folder and --resume checks, before Ray starts
    specs = [s for s in (config.device or "").split(",") if s.strip()]
    if config.ray_address is None and config.backend != "numpy" and 1 < len(specs) < config.num_workers:
        adapter_for(config.device, config.num_workers - 1, config.num_workers)    # one line: too few listed
    config = dataclasses.replace(config, out=str(out))
    existed = out.exists()
    # Ray Train's own run folder (it checks that every worker sees it): inside --out, which a cluster shares
    storage = out / ".ray_train"
    started = _connect(ray, config.ray_address, _cpus(config))
    try:
        return _run(ray, config, log, storage, {"reward_funcs": reward_funcs, "tools": tools,
                                                "environment_factory": environment_factory})
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()            # a run that wrote nothing leaves no folder, as in one process


def _cpus(config) -> int:
    """The CPUs a run's workers reserve: one each, and on a 2-D grid its pipeline stages' bundles too."""
    from wgpu_train.distributed.stage_placement import stage_cpus

    stages = (config.pipeline_stages or len(config.stage_layers.split(","))) if config.pipelined() else 0
    return config.num_workers * (1 + stage_cpus(stages, config.stage_resources))


def _run(ray, config, log, storage: Path, python_objects: dict) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from wgpu_train.distributed.ray_worker import worker

    control = ray.remote(num_cpus=0)(RunControl).remote()
    trainer = TorchTrainer(
        worker, train_loop_config={"config": config.to_dict(), "control": control, "cwd": os.getcwd(),
                                   **python_objects},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=False),
        run_config=RunConfig(name=f"wgpu-train-{uuid.uuid4().hex[:8]}", storage_path=str(storage),
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
        last = ray.get(control.last_checkpoint.remote())
        if last is not None:
            view.log(f"the workers failed; the run's last checkpoint is {last} (--resume it to continue)")
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
