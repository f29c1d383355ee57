"""GRPO's rewards: the built-in reward functions (builtin.py), --reward specs loaded and --reward-weights checked
(loading.py), and a step's completions scored by them, as TRL 1.16's GRPOTrainer calls them (scoring.py)."""
from __future__ import annotations

from wgpu_train.training.rewards.builtin import BUILTIN_REWARDS, FORMAT_REWARD, completion_text
from wgpu_train.training.rewards.loading import RewardFunction, check_reward_weights, load_rewards
from wgpu_train.training.rewards.scoring import RewardState, compute_rewards

__all__ = ["BUILTIN_REWARDS", "FORMAT_REWARD", "RewardFunction", "RewardState", "check_reward_weights",
           "completion_text", "compute_rewards", "load_rewards"]
