"""The trainer that runs each kind of objective (Objective.trainer): the Trainer, the PreferenceTrainer or the
GRPOTrainer; one process's run and a data-parallel worker's build theirs from here."""
from __future__ import annotations

from wgpu_train.training.grpo_trainer import GRPOTrainer
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.training.preference_trainer import PreferenceTrainer
from wgpu_train.training.trainer import Trainer

TRAINERS = {TrainerKind.SUPERVISED: Trainer, TrainerKind.PREFERENCE: PreferenceTrainer,
            TrainerKind.ONLINE: GRPOTrainer}


def make_trainer(config, log=None, process=None, reward_funcs=None, placement=None, tools=None,
                 environment_factory=None):
    """The trainer of config.objective's kind, with its parts (process, placement: the Trainer's); reward_funcs,
    tools and environment_factory (GRPO's Python objects) go to GRPO's alone."""
    kind = objective_class(config.objective).trainer
    extra = {"reward_funcs": reward_funcs, "tools": tools, "environment_factory": environment_factory} \
        if kind is TrainerKind.ONLINE else {}
    return TRAINERS[kind](config, log=log, process=process, placement=placement, **extra)
