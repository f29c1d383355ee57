"""The trainer that runs each kind of objective (Objective.trainer): the Trainer, the PreferenceTrainer or the
GRPOTrainer; one process's run, a pipeline run's and a data-parallel worker's build theirs from here, so the
objective's input checks (check_objective_inputs) hold on every path."""
from __future__ import annotations

from wgpu_train.errors import ConfigError
from wgpu_train.training.grpo_trainer import GRPOTrainer
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.training.preference_trainer import PreferenceTrainer
from wgpu_train.training.trainer import Trainer

TRAINERS = {TrainerKind.SUPERVISED: Trainer, TrainerKind.PREFERENCE: PreferenceTrainer,
            TrainerKind.ONLINE: GRPOTrainer}


def check_objective_inputs(config, reward_funcs=None, tools=None, environment_factory=None):
    """Refuse in one line what config.objective's trainer does not take: the embedded image demo but for sft,
    GRPO's Python rewards, tools or environment for another objective. make_trainer checks every trainer it
    builds (one process, pipeline stages local or on Ray, data-parallel workers); finetune checks before Ray
    starts workers."""
    kind = objective_class(config.objective).trainer
    if config.images_demo and kind is not TrainerKind.SUPERVISED:
        raise ConfigError(f"--images-demo trains sft only: give --objective {config.objective} records with "
                          f"images as --data")
    if reward_funcs and kind is not TrainerKind.ONLINE:
        raise ConfigError(f"reward_funcs are GRPO's rewards: --objective {config.objective} takes none")
    if (tools or environment_factory) and kind is not TrainerKind.ONLINE:
        raise ConfigError(f"tools are GRPO's: --objective {config.objective} takes none")


def make_trainer(config, log=None, process=None, reward_funcs=None, placement=None, tools=None,
                 environment_factory=None):
    """The trainer of config.objective's kind, with its parts (process, placement: the Trainer's); reward_funcs,
    tools and environment_factory (GRPO's Python objects) go to GRPO's alone."""
    check_objective_inputs(config, reward_funcs, tools, environment_factory)
    kind = objective_class(config.objective).trainer
    extra = {"reward_funcs": reward_funcs, "tools": tools, "environment_factory": environment_factory} \
        if kind is TrainerKind.ONLINE else {}
    return TRAINERS[kind](config, log=log, process=process, placement=placement, **extra)
