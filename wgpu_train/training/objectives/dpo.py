"""DPO (TRL's DPOTrainer) over chosen / rejected pairs against a reference model: its loss types sigmoid, IPO,
hinge and robust."""
from __future__ import annotations

import numpy as np

from wgpu_train.training.objectives.base import PairObjective, log_sigmoid, reward_metrics, sigmoid

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")      # TRL's loss_type


class DPO(PairObjective):
    """DPO with TRL's loss types; label smoothing applies to the robust loss only."""

    name = "dpo"
    uses_reference = True
    options = ("beta", "dpo_loss", "label_smoothing")

    @classmethod
    def smooths_labels(cls, settings) -> bool:
        return settings.dpo_loss == "robust"

    def pair_losses(self, pc, pr, rc, rr, nc, nr):
        """TRL DPOTrainer's loss types over the log-ratios."""
        s = self.settings
        beta, eps = s.beta, s.label_smoothing
        delta = (pc - rc) - (pr - rr)
        if s.dpo_loss == "sigmoid":
            loss = -log_sigmoid(beta * delta)
            d = -beta * sigmoid(-beta * delta)
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
            loss = (-(1 - eps) * log_sigmoid(beta * delta) + eps * log_sigmoid(-beta * delta)) / (1 - 2 * eps)
            d = (-(1 - eps) * beta * sigmoid(-beta * delta) - eps * beta * sigmoid(beta * delta)) / (1 - 2 * eps)
            dc, dr = d, -d
        metrics = reward_metrics(beta * (pc - rc), beta * (pr - rr), pc, pr)
        return loss, dc, dr, metrics
