"""Training objectives as units: one class per objective (sft.py, dpo.py, simpo.py, orpo.py, kto.py, grpo.py)
carrying its traits (base.py: the data it reads, its trainer, its reference, its options) and its loss with
derivatives and TRL's metrics (the preference objectives' of sequence log-probabilities; GRPO's of per-token
log-probabilities, with its advantages in grpo_advantages.py); one registry (registry.py) that everything else reads
instead of comparing names; PreferenceSettings (settings.py), a preference objective's options, and GRPOSettings
(grpo.py), GRPO's."""
from __future__ import annotations

from wgpu_train.training.objectives.base import (DataKind, Objective, ObjectiveResult, PairObjective,
                                                 PreferenceObjective, TrainerKind)
from wgpu_train.training.objectives.dpo import DPO_LOSSES
from wgpu_train.training.objectives.grpo import GRPO, GRPO_LOSSES, GRPOResult, GRPOSettings
from wgpu_train.training.objectives.registry import (OBJECTIVES, PREFERENCE_OBJECTIVES, PREFERENCE_OPTIONS,
                                                     objective_class)
from wgpu_train.training.objectives.settings import PreferenceSettings


def pair_objective(settings: PreferenceSettings, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen=None,
                   ref_rejected=None, nll=None) -> ObjectiveResult:
    """A paired objective's step as a function of its settings: PairObjective.loss of `settings`' objective."""
    return settings.unit.loss(chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen, ref_rejected, nll)


def kto_objective(settings: PreferenceSettings, logps, ref_logps, desirable, kl_logps,
                  ref_kl_logps) -> ObjectiveResult:
    """KTO's step as a function of its settings: KTO.loss."""
    return settings.unit.loss(logps, ref_logps, desirable, kl_logps, ref_kl_logps)


__all__ = ["DPO_LOSSES", "GRPO", "GRPO_LOSSES", "GRPOResult", "GRPOSettings", "OBJECTIVES", "PREFERENCE_OBJECTIVES",
           "PREFERENCE_OPTIONS", "DataKind", "Objective", "ObjectiveResult", "PairObjective", "PreferenceObjective",
           "PreferenceSettings", "TrainerKind", "kto_objective", "objective_class", "pair_objective"]
