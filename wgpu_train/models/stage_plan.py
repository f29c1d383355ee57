"""Pipeline stages as data: a model's layers cut into contiguous stages (by hand, `--stage-layers 0-11,12-23`, or
balanced by a cost per layer), and which tensors each stage holds (its layers'; the embedding on the first, the
final norm and head on the last, a tied embedding on both)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from wgpu_train.errors import ConfigError

EMBED = "model.embed_tokens.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def split_runs(n: int, parts: int, cost) -> list[tuple[int, int]]:
    """Cut n items into `parts` contiguous non-empty runs whose largest cost(k, start, end) (run k's: it may
    depend on the run's place) is as small as it can be: [(start, end), ...] in order. Needs parts <= n."""
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty runs")
    best = np.full((parts + 1, n + 1), np.inf)   # best[k, i]: the least largest cost of items[:i] in k runs
    best[0, 0] = 0.0
    start = np.zeros((parts + 1, n + 1), dtype=np.int64)   # where the last of those k runs starts
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1, j], cost(k - 1, j, i))
                if v < best[k, i]:
                    best[k, i], start[k, i] = v, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        runs.append((int(start[k, i]), i))
        i = int(start[k, i])
    return runs[::-1]


def partition(costs, parts: int) -> list[tuple[int, int]]:
    """Cut `costs` into `parts` contiguous non-empty runs whose largest sum is as small as it can be:
    [(start, end), ...] in order. Needs at least `parts` costs."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    return split_runs(len(costs), parts, lambda k, a, b: prefix[b] - prefix[a])


def layer_of(name: str) -> int | None:
    """The layer index of a tensor, LoRA module or trainable name under model.layers.N (None: outside layers)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StagePlan:
    """S contiguous stages of a model's L layers: stages[s] is the range of layers stage s holds."""

    stages: tuple
    num_layers: int
    tied: bool = False       # the head is the embedding: the last stage holds it too

    def __len__(self) -> int:
        return len(self.stages)

    def stage_of_layer(self, layer: int) -> int:
        return next(s for s, r in enumerate(self.stages) if layer in r)

    def holds(self, s: int, name: str) -> bool:
        """Whether stage s holds the tensor `name` (a weight, LoRA path or trainable name)."""
        layer = layer_of(name)
        if layer is not None:
            return layer in self.stages[s]
        if name == EMBED:
            return s == 0 or (self.tied and s == len(self.stages) - 1)
        return s == len(self.stages) - 1          # the final norm and lm_head

    def owner(self, name: str) -> int:
        """The one stage whose copy of `name` is trained and saved (a tied embedding's: the first's)."""
        return next(s for s in range(len(self.stages)) if self.holds(s, name))

    def describe(self) -> str:
        return ",".join(f"{r.start}-{r.stop - 1}" for r in self.stages)


def parse_stage_layers(text: str, num_layers: int) -> tuple:
    """`0-11,12-23` (a stage's first and last layer, or one layer alone) as ranges, refused in one line
    (ConfigError) unless they cover every layer exactly once, in order."""
    stages = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ConfigError(f"--stage-layers {text!r}: each stage is FIRST-LAST or one layer, e.g. 0-11,12-23")
        first, last = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if last < first:
            raise ConfigError(f"--stage-layers {text!r}: stage {part.strip()} ends before it starts")
        stages.append(range(first, last + 1))
    covered = [i for r in stages for i in r]
    if covered != list(range(num_layers)):
        twice = sorted({i for i in covered if covered.count(i) > 1})
        missing = sorted(set(range(num_layers)) - set(covered))
        what = (f"layer {twice[0]} is in two stages" if twice else f"layer {missing[0]} is in no stage" if missing
                else f"the model has layers 0-{num_layers - 1}" if max(covered) >= num_layers
                else "the stages are out of order")
        raise ConfigError(f"--stage-layers {text!r} must cover each of the model's {num_layers} layers exactly once, "
                          f"in order: {what}")
    return tuple(stages)


def per_stage(values: list, stages: int, option: str, what: str) -> list:
    """A per-stage option's values (--device, --device-memory): one for every stage, or one per stage; ConfigError
    (one line) for a list of another length."""
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        raise ConfigError(f"{option} lists {len(values)} {what} for {stages} pipeline stages: give one for all, or "
                          f"one per stage")
    return list(values)


def plan_stages(num_layers: int, stages: int, stage_layers: str | None = None, stage_cost=None,
                tied: bool = False) -> StagePlan:
    """The stages of a run: `stage_layers` as given (parse_stage_layers; its count must be `stages` where that is
    above 1), else `stages` stages whose largest stage_cost(stage, first layer, end) is as small as it can be
    (default: its number of layers). ConfigError (one line) for more stages than layers."""
    if stage_layers:
        ranges = parse_stage_layers(stage_layers, num_layers)
        if stages > 1 and len(ranges) != stages:
            raise ConfigError(f"--stage-layers {stage_layers!r} names {len(ranges)} stages, --pipeline-stages "
                              f"{stages}: give one, or both the same")
        return StagePlan(ranges, num_layers, tied)
    if stages < 1:
        raise ConfigError(f"--pipeline-stages must be at least 1, got {stages}")
    if stages > num_layers:
        raise ConfigError(f"--pipeline-stages {stages} is more than the model's {num_layers} layers: each stage "
                          f"holds at least one layer")
    runs = split_runs(num_layers, stages, stage_cost or (lambda k, a, b: b - a))
    return StagePlan(tuple(range(a, b) for a, b in runs), num_layers, tied)
