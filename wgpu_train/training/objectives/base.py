"""What every training objective is: its traits (the data it reads, the trainer that runs it, its reference, its
options), and for the preference objectives a loss of sequence log-probabilities with its derivatives and TRL's
metrics; the numerically stable helpers those losses share. (GRPO's loss, of per-token log-probabilities, is its
own: grpo.py.)"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from wgpu_train.data.kinds import DataKind   # the records an objective reads (data/ reads them)


class TrainerKind(enum.Enum):
    """The training loop that runs an objective (distributed/ maps each to its trainer classes)."""

    SUPERVISED = "supervised"   # the Trainer: the engine's token cross-entropy
    PREFERENCE = "preference"   # the PreferenceTrainer: rows scored, the loss's derivatives as per-token weights
    ONLINE = "online"           # online RL (GRPO): completions sampled with the current adapter and rewarded in the
                                # loop, the loss's per-token derivatives as per-token weights


class Objective:
    """One training objective as a unit: its traits, as class attributes, read by the trainers, the scorer, the
    config checks and the command line instead of its name. Subclasses are registered in registry.OBJECTIVES."""

    name: ClassVar[str]                      # --objective's value
    data: ClassVar[DataKind]
    trainer: ClassVar[TrainerKind]
    uses_reference: ClassVar[bool] = False   # scores a reference model (DPO, KTO)
    length_normalised: ClassVar[bool] = False   # reads average (per token) log-probabilities (SimPO, ORPO)
    trains_prompt: ClassVar[bool] = False    # adds an NLL term over the chosen rows, prompt included (ORPO)
    adds_router_aux_loss: ClassVar[bool] = False   # adds an MoE router's load-balancing loss to its own (SFT)
    options: ClassVar[tuple[str, ...]] = ()  # the TrainConfig fields it reads (preference: PreferenceSettings too)

    @classmethod
    def smooths_labels(cls, settings) -> bool:
        """Whether `settings`' label_smoothing applies to this objective."""
        return False

    @classmethod
    def check_run(cls, config) -> None:
        """ConfigError (one line) for a run's settings (a TrainConfig) that this objective cannot train with."""


@dataclass
class ObjectiveResult:
    """One step's loss, d loss / d (summed log-probability) of every policy sequence (rows in the order given),
    and the metrics by TRL's names."""

    loss: float
    dlogps: np.ndarray          # (R,) float64
    metrics: dict
    nll_grad: float = 0.0       # ORPO: d loss / d (each token loss of the chosen rows, prompt tokens included)


class PreferenceObjective(Objective):
    """An objective of sequence log-probabilities, trained by the PreferenceTrainer with `settings` (a
    PreferenceSettings): subclasses define `loss`, whose arguments follow their data kind."""

    trainer = TrainerKind.PREFERENCE
    options = ("beta",)

    def __init__(self, settings):
        self.settings = settings


class PairObjective(PreferenceObjective):
    """An objective of chosen / rejected pairs: `pair_losses` gives per-pair losses and their derivatives;
    `loss` averages them over a step's pairs, through the averages of length-normalised objectives, with the
    NLL term of an objective that trains the prompt."""

    data = DataKind.PAIRS

    def pair_losses(self, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens):
        """(per-pair loss, d loss / d chosen, d loss / d rejected, metrics), all (P,) but the metrics: chosen and
        rejected are the policy's summed log-probabilities, or their averages when length-normalised."""
        raise NotImplementedError

    def loss(self, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen=None, ref_rejected=None,
             nll=None) -> ObjectiveResult:
        """The objective over P pairs: summed log-probabilities chosen, rejected (P,) of the policy (and ref_* of
        the reference where it uses one), the completion token counts (P,); where it trains the prompt, nll =
        (the summed token losses of the chosen rows over prompt and completion, their token count), TRL's NLL
        term. The loss is the mean over the pairs (plus the NLL, the mean token loss of the chosen rows, whose
        per-token derivative is nll_grad); dlogps holds the chosen rows' derivatives, then the rejected rows'."""
        pc, pr = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
        nc, nr = (np.maximum(np.asarray(n, np.float64), 1.0) for n in (chosen_tokens, rejected_tokens))
        rc, rr = ((np.asarray(ref_chosen, np.float64), np.asarray(ref_rejected, np.float64)) if self.uses_reference
                  else (None, None))
        if self.length_normalised:
            losses, dc, dr, metrics = self.pair_losses(pc / nc, pr / nr, rc, rr, nc, nr)
            dc, dr = dc / nc, dr / nr                         # through the averages
        else:
            losses, dc, dr, metrics = self.pair_losses(pc, pr, rc, rr, nc, nr)
        dlogps = np.concatenate([dc, dr]) / pc.size
        if not self.trains_prompt:
            return ObjectiveResult(float(losses.mean()), dlogps, metrics)
        nll_sum, nll_tokens = nll
        mean_nll = float(nll_sum) / max(int(nll_tokens), 1)
        metrics["nll_loss"] = mean_nll
        return ObjectiveResult(mean_nll + float(losses.mean()), dlogps, metrics, nll_grad=1.0 / max(int(nll_tokens), 1))


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def sigmoid(x):
    return np.exp(log_sigmoid(x))


def reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    """TRL's rewards/* and logps/* metrics of a step's pairs."""
    return {"rewards/chosen": float(chosen_rewards.mean()), "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "logps/chosen": float(chosen_logps.mean()), "logps/rejected": float(rejected_logps.mean())}
