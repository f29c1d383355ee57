"""The registry of training objectives: every Objective class by its --objective name, looked up in one place."""
from __future__ import annotations

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives.base import Objective, TrainerKind
from wgpu_train.training.objectives.dpo import DPO
from wgpu_train.training.objectives.grpo import GRPO
from wgpu_train.training.objectives.kto import KTO
from wgpu_train.training.objectives.orpo import ORPO
from wgpu_train.training.objectives.sft import SFT
from wgpu_train.training.objectives.simpo import SimPO

# in the order the command line lists them; sft, the default, first
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (SFT, DPO, SimPO, ORPO, KTO, GRPO)}
# the objectives the PreferenceTrainer runs and `eval --objective` scores
PREFERENCE_OBJECTIVES = tuple(name for name, cls in OBJECTIVES.items() if cls.trainer is TrainerKind.PREFERENCE)
# every option some preference objective reads (PreferenceSettings' fields), in the order of first use
PREFERENCE_OPTIONS = tuple(dict.fromkeys(option for name in PREFERENCE_OBJECTIVES
                                         for option in OBJECTIVES[name].options))


def objective_class(name: str, among: tuple[str, ...] = tuple(OBJECTIVES)) -> type[Objective]:
    """The Objective class registered as `name`, one of `among` (default: every objective); else a ConfigError
    listing the choices."""
    if name not in among:
        raise ConfigError(f"objective must be one of {', '.join(among)}, got {name!r}")
    return OBJECTIVES[name]
