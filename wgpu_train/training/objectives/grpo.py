"""GRPO (TRL 1.16's GRPOTrainer): online RL over prompts, whose completions are sampled and rewarded in the loop;
its settings, its advantages (grpo_advantages.py) and its loss types dapo, grpo, dr_grpo, bnpo, cispo and sapo
over per-token log-probabilities, with the derivatives that become the engine's per-token weights and TRL's
metrics."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wgpu_train.engines.protocol import TokenObjective
from wgpu_train.errors import ConfigError
from wgpu_train.training.objectives.base import DataKind, Objective, TrainerKind, sigmoid
from wgpu_train.training.objectives.grpo_advantages import (SCALE_REWARDS, completion_metrics, group_advantages,
                                                            logged_mean, nan_extreme, reward_metrics)

GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo")     # TRL's loss_type
CLIPPED_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")                   # PPO's clipped surrogate
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def _check_int(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO's parameters with TRL GRPOConfig's names and defaults (but max_completion_length: TRL's is 512), each
    checked. epsilon_high None means epsilon, as in TRL, for cispo too, where it is the upper clamp of the
    ratio itself (TRL recommends 5.0 there). scale_rewards takes TRL's strings only (not True / False)."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off
    mask_truncated_completions: bool = False
    scale_rewards: str = "group"
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    num_iterations: int = 1
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    use_bias_correction_kl: bool = True     # the KL term times the importance ratio (DeepSeek-V3.2), TRL's default

    def __post_init__(self):
        _check_int("num_generations", self.num_generations, 2)     # advantages need a group of at least two
        _check_int("max_completion_length", self.max_completion_length, 1)
        _check_int("top_k", self.top_k, 0)
        _check_int("num_iterations", self.num_iterations, 1)
        for name, allowed in (("scale_rewards", SCALE_REWARDS), ("loss_type", GRPO_LOSSES),
                              ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not self.epsilon >= 0 or not (self.epsilon_high is None or self.epsilon_high >= 0):
            raise ConfigError(f"epsilon and epsilon_high must be >= 0, got {self.epsilon} and {self.epsilon_high}")
        if not self.beta >= 0:
            raise ConfigError(f"beta must be >= 0, got {self.beta}")
        if not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ConfigError("sapo_temperature_pos and sapo_temperature_neg must be positive")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term to the reference model (beta != 0)."""
        return self.beta != 0

    @property
    def upper_epsilon(self) -> float:
        """epsilon_high as TRL resolves it: epsilon where not given."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class GRPOResult:
    """A step's loss (TRL's micro-batch losses summed), its derivative by every policy log-probability (R, T)
    float64 (0 off the mask), and TRL's loss metrics averaged over the micro-batches as TRL's log averages them."""

    loss: float
    dlogps: np.ndarray
    metrics: dict


class GRPO(Objective):
    """GRPO as a unit: its traits, its advantages and its loss, with `settings` (a GRPOSettings). The class
    trait uses_reference is False; an instance's says whether its beta scores the reference."""

    name = "grpo"
    data = DataKind.PROMPTS
    trainer = TrainerKind.ONLINE
    options = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k",
               "mask_truncated_completions", "scale_rewards", "grpo_loss", "epsilon", "epsilon_high", "beta",
               "num_iterations", "importance_sampling_level", "reward", "reward_weights", "reward_pattern", "tool",
               "environment", "max_tool_calling_iterations")

    def __init__(self, settings: GRPOSettings):
        self.settings = settings
        self.uses_reference = settings.uses_reference

    @classmethod
    def check_run(cls, config) -> None:
        if config.early_stop_patience:
            raise ConfigError("early stopping watches the validation loss, which --objective grpo does not compute "
                              "(its held-out measure is the greedy reward, --eval-generate): leave out "
                              "--early-stop-patience")

    def advantages(self, rewards_per_func, weights, reward_names: list[str]):
        """(advantages (N,), rewards (N,), metrics) of a step's N = prompts x num_generations completions, each
        prompt's consecutive (rows g*G .. g*G+G-1): rewards_per_func (N, F) float64, NaN where a function returned
        None; weights (F,); reward_names the F functions' names. Rewards are the weighted sums over the functions
        that scored a row (NaN where none did); metrics are TRL's reward, reward_std, frac_reward_zero_std and
        rewards/<name>/mean and /std (NaN where TRL's are NaN)."""
        s = self.settings
        per_func = np.asarray(rewards_per_func, np.float64)
        if per_func.ndim != 2 or per_func.shape[0] % s.num_generations or per_func.shape[1] != len(reward_names):
            raise ValueError(f"rewards_per_func {per_func.shape}: (prompts x {s.num_generations}, "
                             f"{len(reward_names)} functions) expected")
        advantages, rewards, zero_std = group_advantages(per_func, weights, s.num_generations, s.scale_rewards)
        return advantages, rewards, reward_metrics(per_func, rewards, zero_std, reward_names)

    @staticmethod
    def completion_metrics(lengths, truncated) -> dict:
        """TRL's completions/* metrics of a step's completion lengths (N,) and truncation flags (N,) bool."""
        return completion_metrics(lengths, truncated)

    def step_loss(self, logps, old_logps, ref_logps, advantages, mask, rows_per_micro: int, num_items: int,
                  entropies=None) -> GRPOResult:
        """One optimizer step of R rows, TRL's gradient-accumulation micro-batches of rows_per_micro rows in
        order: logps (R, T) the policy's log-probabilities of the completion tokens; old_logps (R, T) those of the
        policy that sampled them (None: logps itself, TRL's detached copy when num_iterations is 1); ref_logps
        (R, T) the reference's (where beta != 0); advantages (R,); mask (R, T) the tokens that count; num_items
        the step's counted tokens (TRL's num_items_in_batch); entropies (R, T), if given, logged as "entropy"."""
        s = self.settings
        logps = np.asarray(logps, np.float64)                      # (R, T)
        rows = logps.shape[0]
        if rows % rows_per_micro:
            raise ValueError(f"{rows} rows do not split into micro-batches of {rows_per_micro}")
        if s.uses_reference and ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        mask = np.asarray(mask, np.float64)                        # (R, T) 0 / 1
        advantages = np.asarray(advantages, np.float64).reshape(rows, 1)
        tokens = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)  # (R, 1)
        log_ratio = logps - (logps if old_logps is None else np.asarray(old_logps, np.float64))
        sequence_level = s.importance_sampling_level == "sequence"
        # GSPO: one ratio per row, of its mean log-ratio over its tokens; (R, 1) or (R, T) from here on
        log_weights = (log_ratio * mask).sum(axis=1, keepdims=True) / tokens if sequence_level else log_ratio
        ratio = np.exp(log_weights)
        policy, dpolicy_dlogw, dpolicy_dlogp = self._policy_loss(ratio, advantages, logps)
        weights = self._token_weights(mask, tokens, rows_per_micro, num_items)   # d loss / d per-token loss
        per_token = np.broadcast_to(policy, logps.shape)
        dloss_dlogw = weights * dpolicy_dlogw                      # (R, T) through each token's log weight
        dlogps = weights * dpolicy_dlogp                           # (R, T) the direct part
        metrics = {}
        if s.uses_reference:
            ref_gap = np.asarray(ref_logps, np.float64) - logps
            kl = np.exp(ref_gap) - ref_gap - 1.0                   # the k3 estimator of KL(policy || reference)
            dkl = 1.0 - np.exp(ref_gap)
            if s.use_bias_correction_kl:    # k3 times the (differentiated) ratio: the unbiased reverse-KL gradient
                dloss_dlogw = dloss_dlogw + s.beta * weights * kl * ratio
                kl, dkl = kl * ratio, dkl * ratio
            per_token = per_token + s.beta * kl
            dlogps = dlogps + s.beta * weights * dkl
            metrics["kl"] = self._masked_mean(kl, mask, rows_per_micro)
        # a sequence's log weight is its tokens' mean log-ratio
        dlogps = dlogps + (dloss_dlogw.sum(axis=1, keepdims=True) * mask / tokens if sequence_level else dloss_dlogw)
        loss = float((weights * per_token).sum())
        if entropies is not None:
            metrics["entropy"] = self._masked_mean(np.asarray(entropies, np.float64), mask, rows_per_micro)
        metrics.update(self._clip_metrics(ratio, advantages, mask, rows_per_micro))
        return GRPOResult(loss, dlogps, metrics)

    def token_objective(self, old_logps, ref_logps, advantages, mask, rows_per_micro: int,
                        num_items: int) -> TokenObjective | None:
        """The step's loss as the engine's per-token objective (TokenObjective over all R rows: the trainer cuts it
        into its micro-batches), so that the step's own forward computes the log-probabilities its gradient
        weights need: the derivative step_loss gives by them, as -scale * d(token loss) / d logp, scale being
        the step's counted tokens times d(step loss) / d(token loss). Arguments as step_loss's. None at the
        sequence importance-sampling level (GSPO), whose ratio is a mean over a row's tokens: the trainer
        gives the engine a SequenceObjective there, step_loss's derivatives of the head's log-probabilities."""
        s = self.settings
        if s.importance_sampling_level != "token":
            return None
        mask = np.asarray(mask, np.float64)                        # (R, T) 0 / 1
        tokens = np.maximum(mask.sum(axis=1, keepdims=True), 1.0)  # (R, 1)
        scale = self._token_weights(mask, tokens, rows_per_micro, num_items) * mask.sum()
        loss = "clipped" if s.loss_type in CLIPPED_LOSSES else s.loss_type
        return TokenObjective(scale.astype(np.float32), np.asarray(advantages, np.float32).reshape(-1),
                              None if old_logps is None else np.asarray(old_logps, np.float32),
                              ref_logps if s.uses_reference else None, loss=loss, epsilon_low=s.epsilon,
                              epsilon_high=s.upper_epsilon, beta=s.beta, bias_correction_kl=s.use_bias_correction_kl,
                              temperature_pos=s.sapo_temperature_pos, temperature_neg=s.sapo_temperature_neg)

    def _policy_loss(self, ratio, advantages, logps):
        """The per-token policy loss of the loss type, its derivative by the log importance weight and its direct
        derivative by the log-probability (cispo's), each broadcastable to (R, T)."""
        s = self.settings
        if s.loss_type == "cispo":
            # the clamped ratio is a constant factor (TRL detaches it): the gradient flows through logps alone
            factor = -np.minimum(ratio, s.upper_epsilon) * advantages
            return factor * logps, 0.0, factor
        if s.loss_type == "sapo":
            temperature = np.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
            gate = sigmoid(temperature * (ratio - 1.0))
            return -gate * 4.0 / temperature * advantages, -4.0 * gate * (1.0 - gate) * ratio * advantages, 0.0
        clipped = np.clip(ratio, 1.0 - s.epsilon, 1.0 + s.upper_epsilon)
        # -min(ratio A, clipped A): where the unclipped term is the smaller or equal (inside the clip range the two
        # are one function of the ratio) its gradient, ratio A, flows; where the clipped term is the smaller, the
        # ratio lies outside the range and the clipped term is a constant
        unclipped = ratio * advantages <= clipped * advantages
        loss = -np.minimum(ratio * advantages, clipped * advantages)
        return loss, np.where(unclipped, -ratio * advantages, 0.0), 0.0

    def _token_weights(self, mask, tokens, rows_per_micro: int, num_items: int):
        """d (the step's summed loss) / d (each per-token loss) (R, T): how TRL's loss type normalises a
        micro-batch's tokens, divided by the accumulation steps (except dapo and cispo, whose normaliser, the
        step's token count, already spans them)."""
        s = self.settings
        micro_batches = mask.shape[0] // rows_per_micro
        if s.loss_type in ("grpo", "sapo"):     # each row's mean, averaged over the micro-batch's rows
            return mask / tokens / rows_per_micro / micro_batches
        if s.loss_type == "bnpo":               # the micro-batch's token mean
            micro_tokens = mask.reshape(micro_batches, -1).sum(axis=1)
            return mask / np.repeat(np.maximum(micro_tokens, 1.0), rows_per_micro)[:, None] / micro_batches
        if s.loss_type == "dr_grpo":            # a constant: rows x max_completion_length
            return mask / (rows_per_micro * s.max_completion_length) / micro_batches
        return mask / max(num_items, 1)         # dapo, cispo: the step's token mean

    @staticmethod
    def _masked_mean(values, mask, rows_per_micro: int) -> float:
        """TRL's global_masked_mean per micro-batch, averaged as its log averages: values (R, T) over the mask,
        or (R, 1), one per row, over the rows."""
        micro_batches = values.shape[0] // rows_per_micro
        if values.shape[1] == 1:
            return logged_mean(values.reshape(micro_batches, -1).mean(axis=1))
        sums = (values * mask).reshape(micro_batches, -1).sum(axis=1)
        return logged_mean(sums / np.maximum(mask.reshape(micro_batches, -1).sum(axis=1), 1.0))

    def _clip_metrics(self, ratio, advantages, mask, rows_per_micro: int) -> dict:
        """TRL's clip_ratio/* metrics (cispo: cispo_clip_ratio; sapo: none) from ratio (R, T) or (R, 1)."""
        s = self.settings
        if s.loss_type == "cispo":
            clipped = ((ratio > s.upper_epsilon) & (advantages > 0)).astype(np.float64)
            return {"cispo_clip_ratio": self._masked_mean(clipped, mask, rows_per_micro)}
        if s.loss_type not in CLIPPED_LOSSES:
            return {}
        low = ((ratio < 1.0 - s.epsilon) & (advantages < 0)).astype(np.float64)
        high = ((ratio > 1.0 + s.upper_epsilon) & (advantages > 0)).astype(np.float64)
        micro_batches = ratio.shape[0] // rows_per_micro

        def row_means(x):       # (micro-batches, rows): NaN for a row without tokens, as TRL's 0 / 0
            if x.shape[1] == 1:
                return x.reshape(micro_batches, -1)
            with np.errstate(invalid="ignore"):
                return ((x * mask).sum(axis=1) / mask.sum(axis=1)).reshape(micro_batches, -1)

        return {"clip_ratio/low_mean": self._masked_mean(low, mask, rows_per_micro),
                "clip_ratio/low_min": logged_mean(nan_extreme(row_means(low), 1, np.min)),
                "clip_ratio/high_mean": self._masked_mean(high, mask, rows_per_micro),
                "clip_ratio/high_max": logged_mean(nan_extreme(row_means(high), 1, np.max)),
                "clip_ratio/region_mean": self._masked_mean(np.maximum(low, high), mask, rows_per_micro)}
