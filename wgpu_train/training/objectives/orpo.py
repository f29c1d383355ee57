"""ORPO (TRL's ORPOTrainer) over chosen / rejected pairs: no reference; an odds-ratio term of the average
log-probabilities, weighted by beta (ORPO's lambda), plus the NLL of the chosen rows, prompt included."""
from __future__ import annotations

import numpy as np

from wgpu_train.training.objectives.base import PairObjective, log_sigmoid, reward_metrics, sigmoid


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (as TRL's ORPO computes it)."""
    x = np.asarray(x, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


class ORPO(PairObjective):
    """ORPO: the odds-ratio term per pair here; PairObjective.loss adds the NLL (trains_prompt)."""

    name = "orpo"
    length_normalised = True
    trains_prompt = True

    def pair_losses(self, ac, ar, rc, rr, nc, nr):
        """Minus beta times the log-sigmoid of the log odds ratio of the average log-probabilities ac, ar."""
        beta = self.settings.beta
        log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
        ratio = log_sigmoid(log_odds)
        loss = -beta * ratio
        # d log_odds / d a_chosen = 1 / (1 - exp(a_chosen)), d log_odds / d a_rejected = -1 / (1 - exp(a_rejected))
        g = -beta * sigmoid(-log_odds)                 # d(-beta * ratio) / d log_odds
        dc = g / -np.expm1(ac)
        dr = -g / -np.expm1(ar)
        metrics = reward_metrics(beta * ac, beta * ar, ac, ar)
        metrics.update({"log_odds_ratio": float(ratio.mean()), "log_odds_chosen": float(log_odds.mean())})
        return loss, dc, dr, metrics
