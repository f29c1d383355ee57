"""finetune(): the one entry point of a fine-tuning run, which trains in this process (the trainer of the
objective's kind, training/trainers.py) or, with num_workers, data-parallel on Ray Train workers (ray_driver.py),
or with pipeline_stages through stages on Ray actors (pipeline_trainer.py), or with both, each worker through its
own stages."""
from __future__ import annotations

import dataclasses

from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.objectives import TrainerKind, objective_class
from wgpu_train.training.trainers import make_trainer
from wgpu_train.data.vision_records import is_vision_data


def finetune(config: TrainConfig | None = None, reward_funcs=None, tools=None, environment_factory=None,
             **overrides) -> dict:
    """Fine-tune as `config` says (fields may also be given or overridden as keywords); returns the summary
    that is also written to summary.json in the output folder. reward_funcs: --objective grpo's reward functions
    as Python callables (TRL's signature), after config.reward's; tools and environment_factory: GRPO's tools as
    Python functions and TRL's environment class, after config.tool's and config.environment's (they travel to
    Ray workers by Ray's pickling, as reward_funcs do)."""
    config = config or TrainConfig()
    if overrides:
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field {unknown[0]!r}")
        config = dataclasses.replace(config, **overrides)
    kind = objective_class(config.objective).trainer
    if config.images_demo or is_vision_data(config.data):     # records with images
        if kind is not TrainerKind.SUPERVISED and config.images_demo:
            raise ConfigError(f"--images-demo trains sft only: give --objective {config.objective} records with "
                              f"images as --data")
        if kind is not TrainerKind.SUPERVISED and config.pipelined() and config.backend != "numpy":
            raise ConfigError(f"--objective {config.objective} with images through pipeline stages runs on NumPy "
                              f"stages only for now (--backend numpy)")
    if reward_funcs and kind is not TrainerKind.ONLINE:
        raise ConfigError(f"reward_funcs are GRPO's rewards: --objective {config.objective} takes none")
    if (tools or environment_factory) and kind is not TrainerKind.ONLINE:
        raise ConfigError(f"tools are GRPO's: --objective {config.objective} takes none")
    python_tools = {"tools": tools, "environment_factory": environment_factory}
    if config.pipelined() and not config.num_workers:
        from wgpu_train.distributed.pipeline_trainer import finetune_pipeline    # its stages on Ray

        return finetune_pipeline(config, reward_funcs=reward_funcs, **python_tools)
    if config.num_workers:
        from wgpu_train.distributed.ray_driver import finetune_on_ray     # imports Ray

        return finetune_on_ray(config, reward_funcs=reward_funcs, **python_tools)
    return make_trainer(config, reward_funcs=reward_funcs, tools=tools, environment_factory=environment_factory).run()
