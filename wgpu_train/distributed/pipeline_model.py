"""A Model through pipeline stages, one loader for both of its users: a fine-tuning run's placement
(pipeline_trainer.PipelineStages) and the commands that generate, evaluate, chat and serve (cli/adapter_settings.py).
Each stage, a Ray actor (or in this process: local), reads only its own tensors; a PipelineEngine drives them as one
Engine under the Model. For inference the stages are balanced by the memory estimate of generation, where the
weights dominate (inference_plan)."""
from __future__ import annotations

from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine
from wgpu_train.engines.loading import load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.resources import balanced_stages
from wgpu_train.engines.shared.quant import check_dtypes
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.stage_plan import StagePlan, per_stage


def stage_devices(device: str | None, stages: int) -> list:
    """Each stage's --device: one per stage where --device lists several, else the one given (or None) for all."""
    devices = [s.strip() for s in (device or "").split(",") if s.strip()]
    return per_stage(devices or [None], stages, "--device", "devices")


def inference_plan(config: ModelConfig, stages: int | None, stage_layers: str | None, base_dtype: str = "auto",
                   embed_dtype: str = "auto") -> StagePlan:
    """The stages that generate and evaluate: `stage_layers` as given, else `stages` stages balanced by the memory
    estimate of one row of one token (balanced_stages with batch 1): the weights each stage holds in its storage
    dtypes, the embedding on the first and the head on the last. ConfigError (one line) for a bad split."""
    base, embed = check_dtypes(base_dtype, embed_dtype, config.checkpoint_dtype)
    return balanced_stages(config, stages or 0, stage_layers, 1, 1, None, "lora", base, embed)


def stage_runner(folder, plan: StagePlan, backend: str = "numpy", devices: list | None = None,
                 base_dtype: str = "auto", embed_dtype: str = "auto", precision: str = "auto",
                 kv_dtype: str = "float32", address: str | None = None, resources: str | None = None,
                 local: bool = False):
    """The stages of `plan` loaded from `folder`, each on `backend` and its device: Ray actors
    (pipeline_ray.RayStages: a local Ray started, or the cluster at `address` joined; each actor on its bundle of
    `resources`, --stage-resources), or in this process (local, LocalStages)."""
    devices = devices or [None] * len(plan)
    if local:
        return LocalStages([load_stage(folder, plan, s, backend, base_dtype, embed_dtype, precision, devices[s],
                                       kv_dtype) for s in range(len(plan))])
    from wgpu_train.distributed.pipeline_ray import RayStages      # imports Ray

    return RayStages(folder, plan, base_dtype, embed_dtype, precision, backend=backend, devices=devices,
                     address=address, resources=resources, kv_dtype=kv_dtype)


def pipeline_model(folder, config: ModelConfig, plan: StagePlan, schedule: str = "1f1b", **runner_options) -> Model:
    """A Model of `config` whose engine is a PipelineEngine over the stages of `plan` (stage_runner's, with
    runner_options); its engine's close() ends the stages (and a Ray this process started)."""
    runner = stage_runner(folder, plan, **runner_options)
    try:
        return Model(config, PipelineEngine(runner, plan, schedule), folder)
    except BaseException:
        runner.close()
        raise
