"""A fine-tuning run through pipeline stages: the Trainer (or PreferenceTrainer) of one process over a PipelineEngine
whose stages (each
holding a contiguous range of layers) run as Ray actors, or in this process (local, the tests' oracle); the
stages planned from the memory estimate and described in the log and the summary."""
from __future__ import annotations

import dataclasses

from wgpu_train.distributed.data_parallel import DataParallelTrainer
from wgpu_train.distributed.pipeline_engine import LocalStages, PipelineEngine, StageLost
from wgpu_train.engines.loading import load_stage
from wgpu_train.engines.model import Model
from wgpu_train.engines.resources import balanced_stages, format_bytes, stage_memory
from wgpu_train.errors import ConfigError
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.training.preference_trainer import PreferenceTrainer
from wgpu_train.training.trainer import Trainer


class PipelineTrainer(Trainer):
    """A Trainer whose engine is a PipelineEngine: `--pipeline-stages S` (or `--stage-layers`) stages, balanced by
    their weights, trainable state and activations (engines/webgpu/stage_memory.py), each loading only its own
    tensors; a step's micro-batches (--pipeline-micro-batches, else --grad-accum) go through them in the
    --pipeline-schedule. Checkpoints, the adapter and the summary are one process's: the PipelineEngine gathers
    every stage's tensors and optimizer state through the engine protocol, so a resume may use another S.
    local: the stages in this process (no Ray)."""

    local_stages = False        # the default of `local`

    def __init__(self, config, log=None, local: bool | None = None):
        if not config.pipelined():
            raise ConfigError("PipelineTrainer needs --pipeline-stages or --stage-layers")
        # the stages run the NumPy engine
        config = dataclasses.replace(config, backend="numpy",
                                     grad_accum=config.pipeline_micro_batches or config.grad_accum)
        super().__init__(config, log)
        self.local = self.local_stages if local is None else local
        self.stage_devices = [s.strip() for s in (config.device or "").split(",") if s.strip()]
        self.device = None           # each stage's own, from stage_devices
        self.plan = None
        self.stage_estimates: list = []

    def stage_micro_batches(self) -> int:
        """The micro-batches a step sends through these stages: the step's, or a data-parallel worker's share."""
        return max(1, self.micro_per_step // self.workers)

    def _load_model(self, model_cfg):
        cfg = self.config
        lora = cfg.lora_config(model_cfg.num_hidden_layers) if cfg.method == "lora" else None
        self.plan = plan = balanced_stages(model_cfg, cfg.pipeline_stages or 0, cfg.stage_layers, cfg.batch_size,
                                           self.max_seq_len, lora, cfg.method, self.base_dtype, self.embed_dtype,
                                           cfg.gradient_checkpointing, self.precision or "fp32",
                                           self.stage_micro_batches(), cfg.pipeline_schedule)
        if len(self.stage_devices) > 1 and len(self.stage_devices) < len(plan):
            raise ConfigError(f"--device lists {len(self.stage_devices)} devices for {len(plan)} pipeline stages: "
                              f"list one per stage")
        folder = self.model_dir.resolve()
        args = (self.base_dtype, self.embed_dtype, self.precision or "auto")
        if self.local:
            runner = LocalStages([load_stage(folder, plan, s, "numpy", *args) for s in range(len(plan))])
        else:
            from wgpu_train.distributed.pipeline_ray import RayStages      # imports Ray

            runner = RayStages(folder, plan, *args, address=cfg.ray_address)
        where = "in this process" if self.local else "as Ray actors"
        self.log(f"pipeline: {len(plan)} stages (layers {plan.describe()}), {cfg.pipeline_schedule} over "
                 f"{self.stage_micro_batches()} micro-batches, {where}")
        return Model(model_cfg, PipelineEngine(runner, plan, cfg.pipeline_schedule), folder)

    def _estimate_memory(self, model_cfg, lora) -> dict:
        est = super()._estimate_memory(model_cfg, lora)
        cfg = self.config
        self.stage_estimates = stage_memory(model_cfg, self.plan, est["batch"], est["length"], lora, cfg.method,
                                            self.base_dtype, self.embed_dtype, cfg.gradient_checkpointing, None,
                                            self.precision, self.stage_micro_batches(), cfg.pipeline_schedule)
        for s, e in enumerate(self.stage_estimates):
            self.log(f"stage {s} (layers {e['layers']}, {e['in_flight']} micro-batch(es) held): "
                     f"{format_bytes(e['total'])}: weights {format_bytes(e['weights'])}, activations "
                     f"{format_bytes(e['activations'])}")
        return est

    def _summary(self, *args) -> dict:
        summary = super()._summary(*args)
        engine = self.engine
        runner = engine.runner
        summary["pipeline"] = {
            "stages": len(self.plan), "layers": self.plan.describe(), "schedule": self.config.pipeline_schedule,
            "micro_batches": self.stage_micro_batches(), "ray": not self.local,
            "weights_bytes_read": [runner.attr(s, "weights_bytes_read") for s in range(len(self.plan))],
            "boundary_bytes_sent": [runner.attr(s, "counters")["boundary_bytes_sent"] for s in range(len(self.plan))],
            "memory": self.stage_estimates}
        return summary

    def run(self) -> dict:
        try:
            return super().run()
        finally:
            if self.engine is not None:
                self.engine.close()


class PipelinePreferenceTrainer(PipelineTrainer, PreferenceTrainer):
    """A preference run through pipeline stages: the reference's log-probabilities come from the same stages with
    the adapter switched off (token_losses' reference), then each step trains the weighted micro-batches."""

    def _one_pass(self) -> bool:
        """Two passes: the stages take per-token weights, not a host function between the head's forward and
        backward (a SequenceObjective), which the last stage would have to call back."""
        return False


class DataParallelPipelineTrainer(DataParallelTrainer, PipelineTrainer):
    """One data-parallel worker (--num-workers) whose model is its own pipeline of stages: a 2-D grid of
    workers x stages. Each worker trains its share of a step through its stages; the gradients of every stage,
    gathered as one flat array, are all-reduced over the workers (DataParallelTrainer's reduce), then every
    stage clips by the global norm and updates alike on every worker."""


def finetune_pipeline(config, local: bool = False) -> dict:
    """finetune(config) through config's pipeline stages (Ray actors; local: in this process): the SFT Trainer's
    loop, or the PreferenceTrainer's for a preference objective. A stage whose process dies (StageLost) restarts
    every stage from the run's last checkpoint, up to config.max_failures times, as --num-workers' workers do."""
    kind = objective_class(config.objective).trainer
    make = PipelinePreferenceTrainer if kind is TrainerKind.PREFERENCE else PipelineTrainer
    failures = 0
    while True:
        trainer = make(config, local=local)
        try:
            return trainer.run()
        except StageLost as e:
            saved = list_checkpoints(trainer.out / "checkpoints")
            if failures == config.max_failures or not saved:
                trainer.log(f"a pipeline stage died; the run's last checkpoint is {saved[-1]} (--resume it to "
                            f"continue)" if saved else "a pipeline stage died before the run's first checkpoint")
                raise
            failures += 1
            trainer.log(f"a pipeline stage died ({e}): restarting the stages from {saved[-1]}")
            config = dataclasses.replace(config, resume=str(saved[-1]), out=str(trainer.out), overwrite=False)
