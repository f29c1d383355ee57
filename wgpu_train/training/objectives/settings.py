"""PreferenceSettings: a preference objective's name and options as one checked value, the form a run records
in its checkpoints and summary, and the objective it makes."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives.base import PreferenceObjective
from wgpu_train.training.objectives.dpo import DPO_LOSSES
from wgpu_train.training.objectives.registry import PREFERENCE_OBJECTIVES, objective_class


@dataclass(frozen=True)
class PreferenceSettings:
    """A preference objective and its parameters, with TRL's names and defaults (DPOConfig, CPOConfig with
    loss_type "simpo" and cpo_alpha 0, ORPOConfig, KTOConfig). Every option's value is checked whichever
    objective reads it; the objective says whether label smoothing applies."""

    objective: str
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        kind = objective_class(self.objective, PREFERENCE_OBJECTIVES)
        if self.dpo_loss not in DPO_LOSSES:
            raise ConfigError(f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}")
        if not self.beta > 0:
            raise ConfigError(f"beta must be positive, got {self.beta}")
        if self.label_smoothing and not kind.smooths_labels(self):
            raise ConfigError("label_smoothing applies to --dpo-loss robust (TRL's robust DPO) and to SimPO only")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError("desirable_weight and undesirable_weight must be positive")

    @property
    def unit(self) -> PreferenceObjective:
        """The objective these settings name, with these settings: its traits and its loss."""
        return objective_class(self.objective)(self)
