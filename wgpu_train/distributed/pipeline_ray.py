"""Pipeline stages as Ray actors, one per stage (on its own device where --device lists one per stage): each loads
only its layers' tensors in its own process; a stage's call takes other stages' results as Ray object refs, so
activations and their gradients travel between stages through Ray's object store, packed in the run's precision."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from wgpu_train.distributed.pipeline_engine import StageLost
from wgpu_train.distributed.stage_placement import (parse_resources, release, reserve_stages, seat,
                                                     stage_cpus)
from wgpu_train.errors import ConfigError, WgpuTrainError

try:
    import ray
except ImportError:      # the pipeline extra: refused in one line when a pipeline run starts (RayStages)
    ray = None


EXTRA = "pip install 'wgpu-train[pipeline]'"     # Ray core: the stages need neither Ray Train nor torch
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class StageActor:
    """One stage in its own process: engines.loading.load_stage's engine (on `backend` and `device`), loaded by
    `load` (a task, whose ConfigError reaches the driver as itself, where one raised while the actor is made
    only kills it), then called by method name."""

    def __init__(self):
        self.engine = None
        self.busy = 0.0          # seconds spent in calls (the bubble's complement, bench --only pipeline)

    def load(self, folder: str, plan, stage: int, base_dtype: str, embed_dtype: str, precision: str,
             backend: str = "numpy", device: str | None = None, kv_dtype: str = "float32"):
        from wgpu_train.engines.loading import load_stage

        self.engine = load_stage(folder, plan, stage, backend, base_dtype, embed_dtype, precision, device, kv_dtype)

    def call(self, method: str, *args):
        started = time.perf_counter()
        try:
            return getattr(self.engine, method)(*args)
        finally:
            self.busy += time.perf_counter() - started

    def attr(self, name: str):
        return self.busy if name == "busy" else getattr(self.engine, name)


def start_ray(address: str | None, cpus: int) -> bool:
    """Join Ray at `address` or start a local instance with at least `cpus` CPUs (True), or use the one this
    process already runs."""
    if ray.is_initialized():
        return False
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None    # Ctrl-C is the driver's
    try:
        if address is not None:
            ray.init(address=address, log_to_driver=False)
        else:
            here = str(Path(__file__).resolve().parents[2])    # the actors import this wgpu_train
            path = os.pathsep.join([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
            ray.init(num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"--ray-address {address}: cannot join a Ray cluster ({str(e).splitlines()[0]})") from None
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    return True


class RayStages:
    """The runner of pipeline_engine.PipelineEngine over one Ray actor per stage of `plan`. A call returns object
    refs at once (num_returns of them for a tuple); its arguments may be refs of other stages' results, which Ray
    hands over when they exist, so each actor runs its calls in the order given as soon as their inputs are made.
    Each actor sits on its bundle of a placement group of --stage-resources (stage_placement.py)."""

    def __init__(self, folder, plan, base_dtype: str, embed_dtype: str, precision: str, backend: str = "numpy",
                 devices: list | None = None, address: str | None = None, resources: str | None = None,
                 kv_dtype: str = "float32"):
        if ray is None:
            raise ConfigError("--pipeline-stages runs its stages as Ray actors, and Ray is not installed: "
                              f"{EXTRA}")
        self.started = start_ray(address, stage_cpus(len(plan), resources))
        self.group = None
        try:
            self.group = reserve_stages(ray, len(plan), parse_resources(resources))
        except ConfigError:
            self._stop_ray()
            raise
        # the stages take turns more than they compute at once; their BLAS on one thread, Ray's default for its
        # workers, set here so that the numbers do not depend on how Ray was started
        actor = ray.remote(num_cpus=0, runtime_env={"env_vars": ONE_THREAD})(StageActor)
        devices = devices or [None] * len(plan)
        self.actors = [actor.options(scheduling_strategy=seat(self.group, s)).remote() for s in range(len(plan))]
        try:
            self.get([a.load.remote(str(folder), plan, s, base_dtype, embed_dtype, precision, backend, devices[s],
                                    kv_dtype) for s, a in enumerate(self.actors)])
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, s: int, method: str, *args, returns: int = 1):
        return self.actors[s].call.options(num_returns=returns).remote(method, *args)

    def get(self, refs):
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:      # a user error in a stage (device limits too): its one line
            cause = getattr(e, "cause", None)
            if isinstance(cause, WgpuTrainError):
                raise type(cause)(str(cause)) from None
            if isinstance(cause, ray.exceptions.RayActorError):      # a task fed by a dead stage's results
                raise StageLost(str(cause).splitlines()[0]) from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise StageLost(str(e).splitlines()[0]) from None

    def attr(self, s: int, name: str):
        return self.get(self.actors[s].attr.remote(name))

    def close(self):
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.group is not None:
            release(self.group)
            self.group = None
        self._stop_ray()

    def _stop_ray(self):
        if self.started:
            ray.shutdown()
