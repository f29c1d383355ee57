"""KTO (TRL's KTOTrainer, loss_type "kto") over unpaired examples labelled desirable or not, against a reference
model, with the KL estimate of mismatched (prompt, completion) pairs."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives.base import DataKind, ObjectiveResult, PreferenceObjective, sigmoid


class KTO(PreferenceObjective):
    """KTO: beta, and a weight for the desirable and for the undesirable examples' losses."""

    name = "kto"
    data = DataKind.UNPAIRED
    uses_reference = True
    options = ("beta", "desirable_weight", "undesirable_weight")

    @classmethod
    def check_run(cls, config) -> None:
        if config.batch_size < 2:
            raise ConfigError("kto needs --batch-size of at least 2: its KL estimate pairs each prompt with another "
                              "example's completion in the micro-batch (TRL's KTOTrainer refuses a batch of 1 too)")
        if config.truncation_mode != "keep_start":
            raise ConfigError("kto data is truncated keep_start only, as TRL's KTOTrainer truncates it")

    def loss(self, logps, ref_logps, desirable, kl_logps, ref_kl_logps) -> ObjectiveResult:
        """KTO over N examples: summed log-probabilities of the policy and the reference (N,), their desirable
        labels (N,) bool, and the mismatched (prompt, completion) pairs' log-probabilities under both (M,), whose
        mean difference, clamped at 0 and not differentiated, is the KL estimate. The loss is the mean over the
        examples of the weighted per-example losses."""
        s = self.settings
        lp, rp = np.asarray(logps, np.float64), np.asarray(ref_logps, np.float64)
        good = np.asarray(desirable, bool)
        kl = max(float(np.mean(np.asarray(kl_logps, np.float64) - np.asarray(ref_kl_logps, np.float64))), 0.0) \
            if len(kl_logps) else 0.0
        ratio = lp - rp
        z = np.where(good, s.beta * (ratio - kl), s.beta * (kl - ratio))
        weight = np.where(good, s.desirable_weight, s.undesirable_weight)
        loss = weight * (1.0 - sigmoid(z))
        # d(1 - sigmoid(z)) / dz = -sigmoid(z) sigmoid(-z); dz / dlogp = +beta (desirable), -beta (undesirable)
        d = weight * -sigmoid(z) * sigmoid(-z) * np.where(good, s.beta, -s.beta)
        n = lp.size
        rewards = s.beta * ratio
        metrics = {"kl": kl}
        if good.any():
            metrics.update({"rewards/chosen": float(rewards[good].mean()), "logps/chosen": float(lp[good].mean())})
        if (~good).any():
            metrics.update({"rewards/rejected": float(rewards[~good].mean()),
                            "logps/rejected": float(lp[~good].mean())})
        if good.any() and (~good).any():
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return ObjectiveResult(float(loss.mean()), d / n, metrics)
