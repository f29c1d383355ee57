"""ResumePoint, a part the Trainer owns when it resumes (--resume): the checkpoint the run continues from and
its state, refused as the trainer is constructed unless it fits the run's settings, then restored into the
model once it is loaded."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from wgpu_train.errors import ConfigError
from wgpu_train.training import checkpoint
from wgpu_train.training.config import TrainConfig
from wgpu_train.engines.shared.quant import check_dtypes


class ResumePoint:
    """The checkpoint folder that config.resume names (`folder`) and its state (checkpoint.state_dict's, as
    Trainer.state_dict wrote it)."""

    def __init__(self, config: TrainConfig, out: Path, base_dtype, embed_dtype, precision):
        """Find and check the checkpoint; base_dtype, embed_dtype, precision: the run's (None where auto: then
        the checkpoint's, see `dtypes`). ConfigError (one line) for a checkpoint outside a run's checkpoints/
        folder without --out, or one trained with another method, LoRA setting, storage dtype or precision."""
        self.folder = checkpoint.find_checkpoint(config.resume)
        if config.out is None and (out / checkpoint.STATE_FILE).is_file():
            raise ConfigError(f"resume: {out} is a checkpoint outside a run's checkpoints/ folder; pass --out "
                              f"DIR to say where the run continues")
        self.state = state = checkpoint.read_state(self.folder)
        if base_dtype is None and state.get("base_dtype"):      # auto: the run continues as it trained
            base_dtype, embed_dtype = check_dtypes(state["base_dtype"], config.embed_dtype)
        if precision is None and state.get("precision"):
            precision = state["precision"]
        self.dtypes = (base_dtype, embed_dtype, precision)      # the run's, auto resolved as the checkpoint's
        # lora_layers "N" needs the model's layer count: its LoRA setting is checked by restore() in setup
        lora = config.lora_config() if config.method == "lora" and not config.lora_layers_last() else None
        checkpoint.check_state(self.folder, state, config.method, lora, base_dtype, embed_dtype, precision)

    def check_objective(self, settings):
        """ConfigError (one line) when the checkpoint trained other objective settings (a dataclass such as
        PreferenceSettings or GRPOSettings, as the state records it under "objective")."""
        saved = self.state.get("objective")
        now = dataclasses.asdict(settings)
        if saved is not None and saved != now:
            changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v)
            raise ConfigError(f"resume: the run trained another objective setting ({changed}); leave those options "
                              f"out to continue it as it trained")

    def restore(self, model, config: TrainConfig):
        """Put the checkpoint's tensors, moments and dropout counter into the model's engine."""
        checkpoint.restore(self.folder, model, self.state, config.lora_config() if config.method == "lora" else None)

    def best(self, step: int, method: str):
        """(best step, its trainable tensors) of early stopping, read from that step's checkpoint (the one
        resumed when `step` is it); None when the state names no best step or its checkpoint is gone."""
        best = self.state.get("history", {}).get("best_step")
        if best is None:
            return None
        found = self.folder if best == step else self.folder.parent / checkpoint.checkpoint_name(best)
        if not (found / checkpoint.STATE_FILE).is_file():
            return None
        from wgpu_train.training.tower_lora import checkpoint_kept

        return best, {**checkpoint.read_trainable(found, method), **checkpoint_kept(checkpoint.read_arrays(found))}
