"""SFT, supervised fine-tuning: the engine's token cross-entropy on the completions, run by the Trainer."""
from __future__ import annotations

from wgpu_train.training.objectives.base import DataKind, Objective, TrainerKind


class SFT(Objective):
    """Supervised fine-tuning (TRL's SFTTrainer): no reference and no preference options; its loss is the
    engines' own."""

    name = "sft"
    data = DataKind.SFT
    trainer = TrainerKind.SUPERVISED
    adds_router_aux_loss = True
