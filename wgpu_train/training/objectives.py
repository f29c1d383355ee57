"""Preference objectives as functions of sequence log-probabilities, with TRL's meanings: DPO's loss types
(sigmoid, IPO, hinge, robust), SimPO, ORPO and KTO. Each gives the loss of a step, its derivative with respect to
every sequence's summed log-probability, and TRL's metrics; the trainer turns the derivatives into per-token
gradient weights of the engines' loss head (a sequence's log-probability is a sum over its completion tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wgpu_train.errors import ConfigError

OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
PAIRED = ("dpo", "simpo", "orpo")           # chosen / rejected pairs; kto reads unpaired examples
WITH_REFERENCE = ("dpo", "kto")             # the others need no reference model


@dataclass(frozen=True)
class PreferenceSettings:
    """A preference objective and its parameters, with TRL's names and defaults (DPOConfig, CPOConfig with
    loss_type "simpo" and cpo_alpha 0, ORPOConfig, KTOConfig)."""

    objective: str
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        if self.objective not in OBJECTIVES[1:]:
            raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.dpo_loss not in DPO_LOSSES:
            raise ConfigError(f"dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.dpo_loss!r}")
        if not self.beta > 0:
            raise ConfigError(f"beta must be positive, got {self.beta}")
        smoothing_applies = self.objective == "simpo" or (self.objective == "dpo" and self.dpo_loss == "robust")
        if self.label_smoothing and not smoothing_applies:
            raise ConfigError("label_smoothing applies to --dpo-loss robust (TRL's robust DPO) and to SimPO only")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError("desirable_weight and undesirable_weight must be positive")

    @property
    def uses_reference(self) -> bool:
        return self.objective in WITH_REFERENCE

    @property
    def length_normalised(self) -> bool:
        """Whether the objective reads average (per token) log-probabilities: SimPO and ORPO."""
        return self.objective in ("simpo", "orpo")


@dataclass
class ObjectiveResult:
    """One step's loss, d loss / d (summed log-probability) of every policy sequence (rows in the order given),
    and the metrics by TRL's names."""

    loss: float
    dlogps: np.ndarray          # (R,) float64
    metrics: dict


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return np.exp(_log_sigmoid(x))


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (as TRL's ORPO computes it)."""
    x = np.asarray(x, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
    return {"rewards/chosen": float(chosen_rewards.mean()), "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "logps/chosen": float(chosen_logps.mean()), "logps/rejected": float(rejected_logps.mean())}


def pair_objective(s: PreferenceSettings, chosen, rejected, chosen_tokens, rejected_tokens, ref_chosen=None,
                   ref_rejected=None) -> ObjectiveResult:
    """DPO, SimPO or ORPO over P pairs: summed log-probabilities chosen, rejected (P,) of the policy (and ref_*
    of the reference for DPO), the completion token counts (P,). The loss is the mean over the pairs; dlogps
    holds the chosen rows' derivatives, then the rejected rows'. The helpers below return per-pair losses and
    the derivatives of their sum with respect to each summed log-probability."""
    pc, pr = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
    nc, nr = (np.maximum(np.asarray(n, np.float64), 1.0) for n in (chosen_tokens, rejected_tokens))
    p = pc.size
    if s.objective == "dpo":
        loss, dc, dr, metrics = _dpo(s, pc, pr, np.asarray(ref_chosen, np.float64),
                                     np.asarray(ref_rejected, np.float64), nc, nr)
    elif s.objective == "simpo":
        loss, dc, dr, metrics = _simpo(s, pc / nc, pr / nr)
        dc, dr = dc / nc, dr / nr                         # through the averages
    else:
        loss, dc, dr, metrics = _orpo(s, pc, pr, nc, nr)
    return ObjectiveResult(float(loss.mean()), np.concatenate([dc, dr]) / p, metrics)


def _dpo(s, pc, pr, rc, rr, nc, nr):
    """TRL DPOTrainer's loss types over the log-ratios; (per-pair loss, dloss/dchosen, dloss/drejected, metrics)
    where the derivatives are of the per-pair losses (the caller averages)."""
    beta, eps = s.beta, s.label_smoothing
    delta = (pc - rc) - (pr - rr)
    if s.dpo_loss == "sigmoid":
        loss = -_log_sigmoid(beta * delta)
        d = -beta * _sigmoid(-beta * delta)
        dc, dr = d, -d
    elif s.dpo_loss == "hinge":
        margin = 1.0 - beta * delta
        loss = np.maximum(margin, 0.0)
        d = np.where(margin > 0, -beta, 0.0)
        dc, dr = d, -d
    elif s.dpo_loss == "ipo":
        # TRL normalises IPO's log-ratios by the completions' token counts
        gap = (pc - rc) / nc - (pr - rr) / nr - 1.0 / (2.0 * beta)
        loss = gap ** 2
        dc, dr = 2.0 * gap / nc, -2.0 * gap / nr
    else:   # robust
        loss = (-(1 - eps) * _log_sigmoid(beta * delta) + eps * _log_sigmoid(-beta * delta)) / (1 - 2 * eps)
        d = (-(1 - eps) * beta * _sigmoid(-beta * delta) - eps * beta * _sigmoid(beta * delta)) / (1 - 2 * eps)
        dc, dr = d, -d
    metrics = _reward_metrics(beta * (pc - rc), beta * (pr - rr), pc, pr)
    return loss, dc, dr, metrics


def _simpo(s, ac, ar):
    """SimPO (TRL's CPOTrainer, loss_type "simpo", cpo_alpha 0) over average log-probabilities."""
    beta, eps = s.beta, s.label_smoothing
    x = beta * (ac - ar) - s.simpo_gamma
    loss = -(1 - eps) * _log_sigmoid(x) - eps * _log_sigmoid(-x)
    d = beta * (-(1 - eps) * _sigmoid(-x) + eps * _sigmoid(x))
    return loss, d, -d, _reward_metrics(beta * ac, beta * ar, ac, ar)


def _orpo(s, pc, pr, nc, nr):
    """ORPO (TRL's ORPOTrainer): the chosen responses' NLL (the mean over all their tokens) minus beta times the
    log-sigmoid of the log odds ratio of the average log-probabilities; per pair, the NLL plus the pair's own
    odds term, so that their mean is the loss."""
    p = pc.size
    ac, ar = pc / nc, pr / nr
    log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
    ratio = _log_sigmoid(log_odds)
    nll = -pc.sum() / nc.sum()
    loss = nll - s.beta * ratio
    # d log_odds / d a_chosen = 1 / (1 - exp(a_chosen)), d log_odds / d a_rejected = -1 / (1 - exp(a_rejected))
    g = -s.beta * _sigmoid(-log_odds)                 # d(-beta * ratio) / d log_odds
    dc = g / -np.expm1(ac) / nc - p / nc.sum()        # each pair's NLL term counts every chosen token
    dr = -g / -np.expm1(ar) / nr
    metrics = _reward_metrics(s.beta * ac, s.beta * ar, ac, ar)
    metrics.update({"nll_loss": float(nll), "log_odds_ratio": float(ratio.mean()),
                    "log_odds_chosen": float(log_odds.mean())})
    return loss, dc, dr, metrics


def kto_objective(s: PreferenceSettings, logps, ref_logps, desirable, kl_logps, ref_kl_logps) -> ObjectiveResult:
    """KTO (TRL's KTOTrainer, loss_type "kto") over N unpaired examples: summed log-probabilities of the
    policy and the reference (N,), their desirable labels (N,) bool, and the mismatched (prompt, completion)
    pairs' log-probabilities under both (M,), whose mean difference, clamped at 0 and not differentiated, is the
    KL estimate. The loss is the mean over the examples of the weighted per-example losses."""
    lp, rp = np.asarray(logps, np.float64), np.asarray(ref_logps, np.float64)
    good = np.asarray(desirable, bool)
    kl = max(float(np.mean(np.asarray(kl_logps, np.float64) - np.asarray(ref_kl_logps, np.float64))), 0.0) \
        if len(kl_logps) else 0.0
    ratio = lp - rp
    z = np.where(good, s.beta * (ratio - kl), s.beta * (kl - ratio))
    weight = np.where(good, s.desirable_weight, s.undesirable_weight)
    loss = weight * (1.0 - _sigmoid(z))
    # d(1 - sigmoid(z)) / dz = -sigmoid(z) sigmoid(-z); dz / dlogp = +beta (desirable), -beta (undesirable)
    d = weight * -_sigmoid(z) * _sigmoid(-z) * np.where(good, s.beta, -s.beta)
    n = lp.size
    rewards = s.beta * ratio
    metrics = {"kl": kl}
    if good.any():
        metrics.update({"rewards/chosen": float(rewards[good].mean()), "logps/chosen": float(lp[good].mean())})
    if (~good).any():
        metrics.update({"rewards/rejected": float(rewards[~good].mean()), "logps/rejected": float(lp[~good].mean())})
    if good.any() and (~good).any():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return ObjectiveResult(float(loss.mean()), d / n, metrics)
