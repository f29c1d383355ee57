"""Learning-rate schedules: constant, linear or cosine decay, each after an optional linear warmup."""
from __future__ import annotations

import math
from dataclasses import dataclass

from wgpu_train.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of each optimizer step; steps count from 1.

    Warmup: step s <= warmup_steps gets base_lr * s / warmup_steps (so no step is wasted at lr 0).
    Afterwards, with p = (s - warmup_steps - 1) / (total_steps - warmup_steps) in [0, 1):
    constant keeps base_lr, linear gives base_lr * (1 - p), cosine base_lr * (1 + cos(pi p)) / 2.
    The first step after warmup trains at base_lr and the last one still at a small positive rate; warmup
    must end before the last step (warmup_steps < total_steps), so that the run trains at base_lr.
    """

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ConfigError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.base_lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.base_lr}")
        if self.warmup_steps and self.warmup_steps >= self.total_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be below the run's {self.total_steps} "
                              f"optimizer steps, or warmup takes the whole run")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based)."""
        step = max(int(step), 1)
        if step <= self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        p = min((step - self.warmup_steps - 1) / decay_steps, 1.0)
        if self.kind == "linear":
            return self.base_lr * (1.0 - p)
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * p))

    def state_dict(self) -> dict:
        """JSON-serialisable description (stored in checkpoints)."""
        return {"kind": self.kind, "base_lr": self.base_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps}
