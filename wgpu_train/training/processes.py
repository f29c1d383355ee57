"""A trainer's part in its run, an object the Trainer owns: OneProcess trains the whole run here; a data-parallel
worker (distributed/data_parallel.py) trains a share of each step with the other workers through a collective."""
from __future__ import annotations

import numpy as np


class OneProcess:
    """The part of a trainer that trains the whole run in this process: rank 0 of 1, which writes the run's
    files. Each method is what a data-parallel worker does differently."""

    rank = 0
    world = 1
    stop_agreed = False        # whether every process agreed, in the last step, that the driver asked to stop

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run's files (rank 0's)."""
        return self.rank == 0

    def train_step(self, engine, micro, hp, step: int, own: bool = False, **extra):
        """The engine's optimizer step over the step's micro-batches (a worker: its share of them, or with own
        the micro-batches it formed of its own rows; the gradients summed over the workers): (loss_sum, count,
        grad_norm, applied) of the whole step."""
        return engine.train_step(micro, hp, step, **extra)

    def from_first(self, compute):
        """compute()'s result on rank 0, which every process gets (an evaluation runs once)."""
        return compute()

    def share(self, units: int) -> tuple[int, int]:
        """This process's contiguous share [start, end) of a step's `units` (whole GRPO groups)."""
        return 0, units

    def gather(self, rows: np.ndarray, start: int, total: int) -> np.ndarray:
        """(total, ...): every process's `rows`, this one's placed at `start` (an all-gather in row order)."""
        return rows

    def gather_objects(self, objects: list, start: int, total: int) -> list:
        """(total,): every process's JSON-serialisable `objects`, this one's placed at `start` (another process's
        come back as json.loads makes them)."""
        return list(objects)

    def check_step_rows(self, fewest: int, what: str):
        """ConfigError where a step holds fewer than `world` rows (`what`: what a row is) to share."""

    def checkpointed(self, path):
        """Rank 0 wrote a checkpoint at `path`."""

    def progress_bar(self, make_bar, total: int, initial: int):
        """The progress bar of a run of `total` steps, at step `initial`: make_bar()'s, or the driver's for a
        worker."""
        return make_bar()

    def summary(self, micro_per_step: int) -> dict:
        """Fields the process adds to the run's summary."""
        return {}
