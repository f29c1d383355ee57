"""A step's completions scored by every reward function, called as TRL 1.16's GRPOTrainer calls them, each answer
checked: one RewardError line naming the function and the step for a failure, NaN for TRL's None."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from wgpu_train.errors import RewardError
from wgpu_train.training.rewards.loading import RewardFunction, error_line

log = logging.getLogger("wgpu_train")


@dataclass(frozen=True)
class RewardState:
    """What reward functions get as `trainer_state`, standing in for transformers' TrainerState (TRL passes
    `self.state`) with the fields reward shaping reads: global_step and max_steps."""

    global_step: int
    max_steps: int = 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _rewards(values: Any, n: int, name: str, step: int) -> np.ndarray:
    """One function's answer as (N,) float64, NaN for None; RewardError for anything else than N numbers."""
    where = f"reward function {name!r}, step {step}"
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardError(f"{where}: returned {type(values).__name__}, not a list of rewards")
    if len(values) != n:
        raise RewardError(f"{where}: returned {len(values)} rewards for {n} completions (one per completion)")
    out = np.empty(n, dtype=np.float64)  # (N,)
    for i, value in enumerate(values):
        if value is None:
            out[i] = np.nan
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            out[i] = float(value)
        else:
            raise RewardError(f"{where}: returned {_short(value)} for completion {i}; a reward is a finite number "
                              "or None (not applicable)")
    return out


def compute_rewards(functions: Sequence[RewardFunction], prompts: Sequence, completions: Sequence,
                    columns: dict[str, Sequence], step: int, completion_ids: Sequence[Sequence[int]] | None = None,
                    max_steps: int = 0) -> np.ndarray:
    """Every function's rewards of N completions: (N, F) float64, NaN where a function returned None.

    Each function is called as TRL 1.16's GRPOTrainer calls it: f(prompts=, completions=, **kwargs), a row per
    completion (a prompt repeated for each of its completions), where kwargs are the records' columns as lists
    (`columns`, already repeated), `completion_ids` (each completion's token ids, when given) and `trainer_state`
    (a RewardState of `step` and `max_steps`). TRL's `log_extra` and `log_metric` callbacks are not passed.
    Completions are strings for standard prompts and [{"role": "assistant", "content": text}] for conversational
    ones, as TRL passes them.

    A function that raises, returns other than N values, or a value that is neither a finite number nor None:
    RewardError naming the function and `step`. A row for which every function returned None is logged as a
    warning (TRL warns too): it has no reward."""
    n = len(completions)
    kwargs: dict[str, Any] = dict(columns)
    kwargs["trainer_state"] = RewardState(step, max_steps)
    if completion_ids is not None:
        kwargs["completion_ids"] = completion_ids
    out = np.empty((n, len(functions)), dtype=np.float64)  # (N, F)
    for j, function in enumerate(functions):
        try:
            values = function(prompts, completions, **kwargs)
        except Exception as e:  # a user's function may raise anything; its line names it and the step
            raise RewardError(f"reward function {function.name!r}, step {step}: raised {error_line(e)}") from e
        out[:, j] = _rewards(values, n, function.name, step)
    unscored = np.flatnonzero(np.isnan(out).all(axis=1))
    if len(unscored):
        i = int(unscored[0])
        log.warning(f"step {step}: every reward function returned None for {len(unscored)} of {n} completions "
                    f"(the first: prompt {_short(prompts[i])}, completion {_short(completions[i])}); they get no "
                    "reward")
    return out
