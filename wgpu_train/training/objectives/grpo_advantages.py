"""GRPO's rewards and advantages as TRL 1.16's GRPOTrainer forms them (_generate_and_score_completions, weighted
sum then normalisation), its completion-length metrics, and the NaN-aware statistics they share with grpo.py."""
from __future__ import annotations

import numpy as np

SCALE_REWARDS = ("group", "batch", "none")      # TRL's scale_rewards
STD_EPSILON = 1e-4                  # TRL divides by (std + 1e-4)
ZERO_STD = 1e-8                     # torch.isclose(std, 0)'s default atol: TRL's "zero std" groups


def nan_mean(x, axis=None, keepdims=False):
    """The mean of the non-NaN values (torch.nanmean), NaN where there is none, without NumPy's warning."""
    x = np.asarray(x, np.float64)
    present = ~np.isnan(x)
    count = present.sum(axis=axis, keepdims=keepdims)
    total = np.where(present, x, 0.0).sum(axis=axis, keepdims=keepdims)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def nan_std(x, axis=None):
    """TRL's nanstd: the unbiased (Bessel-corrected) standard deviation of the non-NaN values, NaN where fewer
    than two are present."""
    x = np.asarray(x, np.float64)
    count = (~np.isnan(x)).sum(axis=axis)
    variance = nan_mean((x - nan_mean(x, axis=axis, keepdims=True)) ** 2, axis=axis)
    return np.where(count > 1, np.sqrt(variance * count / np.maximum(count - 1, 1)), np.nan)


def nan_extreme(x, axis: int, take):
    """np.min or np.max (`take`) over the non-NaN values along `axis`, NaN where there is none (TRL's nanmin and
    nanmax)."""
    x = np.asarray(x, np.float64)
    present = ~np.isnan(x)
    fill = np.inf if take is np.min else -np.inf
    return np.where(present.any(axis=axis), take(np.where(present, x, fill), axis=axis), np.nan)


def logged_mean(values) -> float:
    """How TRL's log averages a metric's appended values: the mean of the non-NaN ones (NaN here where none is
    left; TRL shows None)."""
    return float(nan_mean(np.asarray(values, np.float64)))


def group_advantages(rewards_per_func, weights, num_generations: int, scale_rewards: str):
    """(advantages (N,), rewards (N,), zero-std flags (N,)) of N = prompts x G rows, each prompt's G completions
    consecutive: the weighted rewards summed over the functions that gave one (a row no function scored is NaN
    and is left out of the baselines), minus the group's mean, divided by (std + 1e-4) of the group ("group"), of
    the whole batch ("batch") or not at all ("none"); a NaN advantage becomes 0, as in TRL."""
    per_func = np.asarray(rewards_per_func, np.float64)        # (N, F), NaN where a function returned None
    unscorable = np.isnan(per_func).all(axis=1)                 # (N,)
    rewards = np.where(unscorable, np.nan, np.nansum(per_func * np.asarray(weights, np.float64), axis=1))
    groups = rewards.reshape(-1, num_generations)              # (prompts, G)
    baseline = np.repeat(nan_mean(groups, axis=1), num_generations)
    if scale_rewards == "batch":
        std = np.full_like(rewards, nan_std(rewards))
    else:       # "none" keeps the group's std for the zero-std share TRL logs
        std = np.repeat(nan_std(groups, axis=1), num_generations)
    advantages = rewards - baseline
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return np.nan_to_num(advantages, nan=0.0), rewards, np.abs(std) <= ZERO_STD


def reward_metrics(rewards_per_func, rewards, zero_std, reward_names) -> dict:
    """TRL's reward metrics of one step: each function's mean and std over the rows it scored, the weighted
    reward's mean and std over the scorable rows, and the share of rows whose std (the group's, or the batch's
    with scale_rewards "batch") is zero."""
    per_func = np.asarray(rewards_per_func, np.float64)
    metrics = {}
    for i, name in enumerate(reward_names):
        metrics[f"rewards/{name}/mean"] = float(nan_mean(per_func[:, i]))
        metrics[f"rewards/{name}/std"] = float(nan_std(per_func[:, i]))
    metrics["reward"] = float(nan_mean(rewards))
    metrics["reward_std"] = float(nan_std(rewards))
    metrics["frac_reward_zero_std"] = float(np.mean(zero_std))
    return metrics


def completion_metrics(lengths, truncated) -> dict:
    """TRL's completions/* metrics of a step's N completions: their lengths (N,) in tokens and whether each was
    cut at max_completion_length (N,) bool, ending in neither EOS nor padding; the terminated lengths are those of
    the others (0 when every completion was cut, as TRL reports it)."""
    lengths = np.asarray(lengths, np.float64)
    truncated = np.asarray(truncated, bool)
    terminated = lengths[~truncated] if (~truncated).any() else np.zeros(1)
    return {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(truncated.mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max())}
