"""A fine-tuning run through pipeline stages: PipelineStages, the placement (training/placement.py) of a trainer
whose model is a PipelineEngine over stages that each hold a contiguous range of layers, as Ray actors or in
this process (local, the tests' oracle); the stages planned from the memory estimate and described in the log and
the summary; finetune_pipeline, which restarts lost stages from the last checkpoint."""
from __future__ import annotations

import dataclasses

from wgpu_train.distributed.pipeline_engine import StageLost
from wgpu_train.distributed.pipeline_model import pipeline_model, stage_devices
from wgpu_train.engines.resources import balanced_stages, format_bytes, stage_memory
from wgpu_train.distributed.stage_budget import check_stages_fit
from wgpu_train.errors import ConfigError
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.training.placement import OneEngine
from wgpu_train.training.trainers import make_trainer


def pipeline_config(config):
    """config as a run through stages takes it: a step's micro-batches --pipeline-micro-batches (else
    --grad-accum)."""
    if not config.pipelined():
        raise ConfigError("a pipeline run needs --pipeline-stages or --stage-layers")
    return dataclasses.replace(config, grad_accum=config.pipeline_micro_batches or config.grad_accum)


class PipelineStages(OneEngine):
    """A trainer's model as a PipelineEngine: `--pipeline-stages S` (or `--stage-layers`) stages, balanced by
    their weights, trainable state and activations (engines/webgpu/stage_memory.py), each loading only its own
    tensors; a step's micro-batches (a data-parallel worker's share of them) go through them in the
    --pipeline-schedule. Checkpoints, the adapter and the summary are one process's: the PipelineEngine gathers
    every stage's tensors and optimizer state through the engine protocol, so a resume may use another S.
    local: the stages in this process (no Ray). The stages take per-token weights or a TokenObjective (GRPO's:
    the last stage computes the weights from its own log-probabilities), not a host function between the head's
    forward and backward (a SequenceObjective): the preference trainer and GSPO score, then train."""

    sequence_objectives = False

    def __init__(self, local: bool = False):
        self.local = local
        self.plan = None
        self.estimates: list = []          # each stage's memory estimate

    @staticmethod
    def micro_batches(trainer) -> int:
        """The micro-batches a step sends through these stages: the step's, or a data-parallel worker's share."""
        return max(1, trainer.micro_per_step // trainer.workers)

    def load(self, trainer, model_cfg):
        cfg = trainer.config
        lora = cfg.lora_config(model_cfg.num_hidden_layers) if cfg.method == "lora" else None
        self.plan = plan = balanced_stages(model_cfg, cfg.pipeline_stages or 0, cfg.stage_layers, cfg.batch_size,
                                           trainer.max_seq_len, lora, cfg.method, trainer.base_dtype,
                                           trainer.embed_dtype, cfg.gradient_checkpointing,
                                           trainer.precision or "fp32", self.micro_batches(trainer),
                                           cfg.pipeline_schedule)
        # the adapter the trainer's choice opens (WGPU_TRAIN_DEVICE's too), else --device as given: checked against
        # the stages whichever engine runs them
        devices = stage_devices(cfg.device if trainer.device is None else trainer.device, len(plan))
        # before any stage loads: each stage's estimate for the run's largest micro-batch against its device's
        check_stages_fit(self._stage_estimates(trainer, model_cfg, lora, *trainer.largest_micro_batch(),
                                               trainer.precision or "fp32"), cfg.device_memory)
        folder = trainer.model_dir.resolve()
        # the engine the trainer chose and said (not auto again in each stage)
        model = pipeline_model(folder, model_cfg, plan, cfg.pipeline_schedule, backend=trainer.backend, devices=devices,
                               base_dtype=trainer.base_dtype, embed_dtype=trainer.embed_dtype,
                               precision=trainer.precision or "auto", address=cfg.ray_address,
                               resources=cfg.stage_resources, local=self.local)
        where = "in this process" if self.local else "as Ray actors"
        trainer.log(f"pipeline: {len(plan)} stages (layers {plan.describe()}), {cfg.pipeline_schedule} over "
                    f"{self.micro_batches(trainer)} micro-batches, {where}")
        return model

    def reference_engine(self, trainer, adapter):
        """The same stages scoring with the adapter in folder `adapter` (--ref-adapter), each holding its layers'
        modules beside the policy's: no process loads a second model. An adapter that changes base weights (a
        PiSSA / OLoRA residual, modules_to_save copies) is refused in one line."""
        prepared = trainer.model.prepare_adapter(adapter)
        if prepared.copies or prepared.residual:
            raise ConfigError(f"the reference adapter {adapter} changes base weights (modules_to_save or an "
                              f"unconverted PiSSA / OLoRA init): pipeline stages score a LoRA adapter's modules alone")
        scales = prepared.config.module_scales(trainer.model.config)
        return trainer.engine.reference({p: (t[0], t[1], scales[p], 0.0, *t[2:])
                                         for p, t in prepared.modules.items()})

    def _stage_estimates(self, trainer, model_cfg, lora, batch: int, length: int, precision) -> list:
        """Each stage's stage_memory for micro-batches of batch x length tokens."""
        cfg = trainer.config
        return stage_memory(model_cfg, self.plan, batch, length, lora, cfg.method, trainer.base_dtype,
                            trainer.embed_dtype, cfg.gradient_checkpointing, None, precision,
                            self.micro_batches(trainer), cfg.pipeline_schedule)

    def estimated(self, trainer, model_cfg, lora, estimate: dict):
        self.estimates = self._stage_estimates(trainer, model_cfg, lora, estimate["batch"], estimate["length"],
                                               trainer.precision)
        for s, e in enumerate(self.estimates):
            trainer.log(f"stage {s} (layers {e['layers']}, {e['in_flight']} micro-batch(es) held): "
                        f"{format_bytes(e['total'])}: weights {format_bytes(e['weights'])}, activations "
                        f"{format_bytes(e['activations'])}")

    def summary(self, trainer) -> dict:
        runner, stages = trainer.engine.runner, range(len(self.plan))
        return {"pipeline": {
            "stages": len(self.plan), "layers": self.plan.describe(), "schedule": trainer.config.pipeline_schedule,
            "micro_batches": self.micro_batches(trainer), "ray": not self.local,
            "weights_bytes_read": [runner.attr(s, "weights_bytes_read") for s in stages],
            "boundary_bytes_sent": [runner.attr(s, "counters")["boundary_bytes_sent"] for s in stages],
            "memory": self.estimates}}

    def close(self, trainer):
        if trainer.engine is not None:
            trainer.engine.close()


def finetune_pipeline(config, local: bool = False, reward_funcs=None, tools=None, environment_factory=None) -> dict:
    """finetune(config, reward_funcs, tools, environment_factory) through config's pipeline stages (Ray actors;
    local: in this process): the trainer of the objective's kind over PipelineStages (GRPO's reward functions and
    tools run in this process; its rollouts' rows are held and extended in the stages' KV caches). A stage
    whose process dies (StageLost) restarts every stage from the run's last checkpoint, up to
    config.max_failures times, as --num-workers' workers do."""
    config = pipeline_config(config)
    failures = 0
    while True:
        trainer = make_trainer(config, reward_funcs=reward_funcs, placement=PipelineStages(local), tools=tools,
                               environment_factory=environment_factory)
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
