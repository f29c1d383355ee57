"""Where a trainer's model lives, an object the Trainer owns: OneEngine loads it on one engine in this process; a
run through pipeline stages (distributed/pipeline_trainer.py PipelineStages) over stages that each hold a range
of its layers."""
from __future__ import annotations


class OneEngine:
    """The model on one engine in this process (the engine the run's backend choice names). Each method is what
    pipeline stages do differently."""

    sequence_objectives = True     # whether the engine takes a SequenceObjective (a host function mid-step)

    def load(self, trainer, model_cfg):
        """The run's Model, its base weights loaded."""
        from wgpu_train.engines.loading import load_model

        return load_model(trainer.model_dir.resolve(), backend=trainer.backend, device=trainer.device,
                          base_dtype=trainer.base_dtype, embed_dtype=trainer.embed_dtype,
                          precision=trainer.precision or "auto")

    def reference_engine(self, trainer, adapter):
        """An engine that scores with the PEFT adapter in folder `adapter` on the base model (--ref-adapter): a
        second model loaded here."""
        from wgpu_train.engines.loading import load_model

        ref = load_model(trainer.model_dir.resolve(), backend=trainer.backend, device=trainer.device,
                         base_dtype=trainer.base_dtype, embed_dtype=trainer.embed_dtype, precision=trainer.precision)
        ref.load_adapter(adapter)
        return ref.engine

    def estimated(self, trainer, model_cfg, lora, estimate: dict):
        """Told the run's memory estimate (the whole model's), once the model is loaded."""

    def summary(self, trainer) -> dict:
        """Fields the placement adds to the run's summary."""
        return {}

    def close(self, trainer):
        """The run is over (or failed): release what the placement holds."""
