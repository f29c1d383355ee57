"""SimPO (TRL's CPOTrainer with loss_type "simpo" and cpo_alpha 0) over chosen / rejected pairs: no reference, a
target margin over average log-probabilities."""
from __future__ import annotations

from wgpu_train.training.objectives.base import PairObjective, log_sigmoid, reward_metrics, sigmoid


class SimPO(PairObjective):
    """SimPO: beta scales the rewards, simpo_gamma is the target margin, label smoothing applies."""

    name = "simpo"
    length_normalised = True
    options = ("beta", "label_smoothing", "simpo_gamma")

    @classmethod
    def smooths_labels(cls, settings) -> bool:
        return True

    def pair_losses(self, ac, ar, rc, rr, nc, nr):
        """SimPO over the average log-probabilities ac, ar."""
        s = self.settings
        beta, eps = s.beta, s.label_smoothing
        x = beta * (ac - ar) - s.simpo_gamma
        loss = -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x)
        d = beta * (-(1 - eps) * sigmoid(-x) + eps * sigmoid(x))
        return loss, d, -d, reward_metrics(beta * ac, beta * ar, ac, ar)
