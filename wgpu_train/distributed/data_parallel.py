"""One worker of a data-parallel run: a Trainer that trains its share of every step, all-reduces the gradients
through a collective, and leaves evaluation results and the run's files to rank 0 (ray_driver.py runs it on Ray)."""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from wgpu_train.training import checkpoint, tracking
from wgpu_train.errors import ConfigError
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.models.stage_plan import partition
from wgpu_train.training.preference_trainer import PreferenceTrainer
from wgpu_train.training.trainer import Trainer


def split_rows(micro: list, workers: int, step: int) -> list:
    """Engine micro-batches (ids, targets, segment_ids, position_ids) with the largest ones halved by rows
    until there are at least `workers` of them (a short step); ConfigError when it has fewer rows than workers."""
    micro = list(micro)
    while len(micro) < workers:
        i = max(range(len(micro)), key=lambda j: micro[j][0].shape[0])
        rows = micro[i][0].shape[0]
        if rows < 2:
            total = sum(m[0].shape[0] for m in micro)
            raise ConfigError(f"step {step} holds {total} sample row(s), fewer than the {workers} workers that "
                              f"share it: lower --num-workers or give more data")
        half = (rows + 1) // 2
        micro[i:i + 1] = [tuple(a[:half] for a in micro[i]), tuple(a[half:] for a in micro[i])]
    return micro


class DataParallelTrainer(Trainer):
    """Rank `collective.rank` of `collective.world` workers, each with its own engine, running the same loop
    over the same seeded data stream (so every decision is the same on every worker).

    Each step's micro-batches (batch_size x grad_accum x workers samples in all, as one process would form
    them) are cut into one contiguous run per worker, balanced by the tokens they compute (rows x length);
    the worker trains its run, and inside engine.train_step its gradients, weighted by its share of the step's
    trained tokens, are summed over the workers (collective.all_reduce), so clipping and AdamW see the
    gradients of the whole step and stay identical everywhere. The LoRA dropout masks of micro-batch j are
    those one process would draw for it (the engine's dropout position is set to the step's start + j):
    different on every worker, deterministic, and a run equals one worker's with the whole batch.

    Rank 0 evaluates (the results are broadcast) and alone writes metrics, checkpoints, the adapter and the
    summary. `sink` (optional) takes the log lines, the progress, the checkpoints written, and says whether
    the driver asked to stop; a stop is agreed on by every worker after the step it came in.
    """

    def __init__(self, config, collective, sink=None):
        self.collective, self.rank, self.world, self.sink = collective, collective.rank, collective.world, sink
        self.writes_files = self.rank == 0
        if config.num_workers != self.world:
            raise ValueError(f"num_workers {config.num_workers} for a collective of {self.world} workers")
        # only rank 0 writes: the others would find its files and take them for an earlier run
        super().__init__(config if self.rank == 0 else dataclasses.replace(config, overwrite=True),
                         log=None if sink is None else sink.log)
        self.step_times: list = []     # (step, all-reduce, wait for the other workers) seconds of each step
        self._step_tokens = 0
        self._reduce_s = self._wait_s = 0.0

    def setup(self) -> "DataParallelTrainer":
        super().setup()
        self._quiet = self.rank > 0     # from here on rank 0 says what every worker would
        return self

    _quiet = False

    def log(self, msg: str):
        if not self._quiet:
            super().log(msg)

    # ---- the step -------------------------------------------------------------------------------
    def _train_step(self, micro, hp, step: int, **extra):
        started = time.perf_counter()
        n_micro = len(micro)
        micro = split_rows(micro, self.world, step)
        j0, j1 = partition([m[0].size for m in micro], self.world)[self.rank]
        self._step_tokens = sum(int((m[1] != IGNORE_INDEX).sum()) for m in micro)
        self._reduce_s = self._wait_s = 0.0
        state = self.engine.state_dict()
        calls = int(state["dropout_calls"])
        self.engine.load_state_dict({**state, "dropout_calls": calls + j0})
        loss_sum, count, norm, applied = self.engine.train_step(micro[j0:j1], hp, step, reduce=self._reduce,
                                                                **extra)
        self.engine.load_state_dict({**state, "dropout_calls": calls + n_micro})
        stop = self.rank == 0 and self.sink is not None and self.sink.stop_requested()
        totals = self.collective.all_reduce(np.array([loss_sum, count, float(stop)], np.float64))
        if totals[2] > 0 and not self._stop_requested:
            self._stop_requested = True
            self.log("interrupted on the driver: saving a checkpoint after this step")
        self.step_times.append((time.perf_counter() - started, self._reduce_s, self._wait_s))
        return float(totals[0]), int(round(totals[1])), norm, applied

    def _reduce(self, grads: np.ndarray, tokens: int) -> np.ndarray:
        """The engine's reduce: this worker's gradients (normalised by its tokens) weighted by its share of the
        step's trained tokens, summed over the workers. A one-number all-reduce first brings the workers
        together, so that the gradients' own is timed apart from the wait for the slowest worker."""
        t0 = time.perf_counter()
        self.collective.all_reduce(np.zeros(1, np.float32))
        t1 = time.perf_counter()
        out = self.collective.all_reduce(grads * np.float32(tokens / max(self._step_tokens, 1)))
        self._wait_s += t1 - t0
        self._reduce_s += time.perf_counter() - t1
        return out

    # ---- evaluation: rank 0's, broadcast ----------------------------------------------------------
    def evaluate(self):
        return self.collective.broadcast(super().evaluate() if self.rank == 0 else None)

    def exact_match(self):
        return self.collective.broadcast(super().exact_match() if self.rank == 0 else None)

    # ---- files: rank 0's ----------------------------------------------------------------------------
    def _prepare_out(self):
        # (setup calls it once the data stream is formed, before anything is written)
        fewest = min(self.rows_in(b) for b in self.stream.epoch_batches(self.stream.epoch))
        if fewest < self.world:
            raise ConfigError(f"a step of this run holds {fewest} sample row(s), fewer than the {self.world} "
                              f"workers that share it: lower --num-workers, or raise --batch-size or --grad-accum")
        if self.rank == 0:
            super()._prepare_out()

    def _open_outputs(self):
        if self.rank == 0:
            return super()._open_outputs()
        self._metrics = open(os.devnull, "w")
        self._trackers = tracking.Trackers([], self.out, {})

    def save_checkpoint(self):
        if self.rank != 0:
            self.last_saved_step = self.step
            return self.out / "checkpoints" / checkpoint.checkpoint_name(self.step)
        path = super().save_checkpoint()
        if self.sink is not None:
            self.sink.checkpointed(str(path))
        return path

    def _write_outputs(self, summary: dict, ckpt):
        if self.rank == 0:
            super()._write_outputs(summary, ckpt)

    def _summary(self, *args) -> dict:
        """The summary, with this worker's step, gradient all-reduce and wait times (medians, past the first
        step of this invocation where there are more: it compiles and tunes) and the all-reduce's share."""
        summary = super()._summary(*args)
        times = np.array(self.step_times or [(0.0, 0.0, 0.0)])
        times = times[1:] if len(times) > 2 else times
        med = [round(float(np.median(times[:, i])), 6) for i in range(3)]
        summary["data_parallel"] = {
            "workers": self.world, "micro_batches_per_step": self.micro_per_step, "step_s_median": med[0],
            "allreduce_s_median": med[1], "wait_s_median": med[2],
            "allreduce_share": round(float(times[:, 1].sum() / max(times[:, 0].sum(), 1e-12)), 4)}
        return summary

    def _progress_bar(self):
        if self.sink is None:
            return super()._progress_bar()
        return _SinkBar(self.sink if self.rank == 0 else None, self.total_steps, self.step)


class DataParallelPreferenceTrainer(DataParallelTrainer, PreferenceTrainer):
    """A data-parallel worker of a preference run: every worker scores the whole step (the policy's and the
    reference's log-probabilities of every row, so every worker computes the same objective and per-token
    weights), then trains its share of the weighted micro-batches; the weights are normalised by the step's
    trained tokens, as DataParallelTrainer's gradient reduction is."""

    def _one_pass(self) -> bool:
        """Two passes: a worker's share of a step may cut its micro-batches' pairs (split_rows), whose weights
        a SequenceObjective computes from both rows."""
        return False


class _SinkBar:
    """The progress bar's calls, sent to the driver's bar through the sink (rank 0) or dropped (others)."""

    def __init__(self, sink, total: int, initial: int):
        self.sink, self.n, self.postfix = sink, initial, {}
        if sink is not None:
            sink.progress(initial, total, {})

    def set_postfix(self, refresh=False, **values):
        self.postfix = values

    def update(self, n: int = 1):
        self.n += n
        if self.sink is not None:
            self.sink.progress(self.n, None, self.postfix)

    def close(self):
        pass
