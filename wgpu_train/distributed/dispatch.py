"""finetune(): the one entry point of a fine-tuning run, which trains in this process (the trainer of the
objective's kind, training/trainers.py) or, with num_workers, data-parallel on Ray Train workers (ray_driver.py),
or with pipeline_stages through stages on Ray actors (pipeline_trainer.py), or with both, each worker through its
own stages."""
from __future__ import annotations

import dataclasses

from wgpu_train.errors import ConfigError
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.trainers import check_objective_inputs, make_trainer


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
    check_objective_inputs(config, reward_funcs, tools, environment_factory)     # before Ray starts anything
    python_tools = {"tools": tools, "environment_factory": environment_factory}
    if config.pipelined() and not config.num_workers:
        from wgpu_train.distributed.pipeline_trainer import finetune_pipeline    # its stages on Ray

        return finetune_pipeline(config, reward_funcs=reward_funcs, **python_tools)
    if config.num_workers:
        from wgpu_train.distributed.ray_driver import finetune_on_ray     # imports Ray

        return finetune_on_ray(config, reward_funcs=reward_funcs, **python_tools)
    return make_trainer(config, reward_funcs=reward_funcs, tools=tools, environment_factory=environment_factory).run()
