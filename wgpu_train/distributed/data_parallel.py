"""One worker of a data-parallel run: the trainer's part (DataParallelWorker) that trains its share of every
step, all-reduces the gradients through a collective, and leaves evaluation results and the run's files to
rank 0 (ray_driver.py runs the workers on Ray)."""
from __future__ import annotations

import json
import time

import numpy as np

from wgpu_train.data.batching import Batch
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages
from wgpu_train.errors import ConfigError
from wgpu_train.models.stage_plan import partition
from wgpu_train.training.processes import OneProcess
from wgpu_train.training.trainers import make_trainer


def split_rows(micro: list, workers: int, step: int) -> list:
    """Engine micro-batches (ids, targets, segment_ids, position_ids), or batches of records with images
    (data/batching.Batch: each row's images with it), with the largest ones halved by rows until there are at
    least `workers` of them (a short step); ConfigError when it has fewer rows than workers."""
    micro = list(micro)
    while len(micro) < workers:
        i = max(range(len(micro)), key=lambda j: _ids(micro[j]).shape[0])
        rows = _ids(micro[i]).shape[0]
        if rows < 2:
            total = sum(_ids(m).shape[0] for m in micro)
            raise ConfigError(f"step {step} holds {total} sample row(s), fewer than the {workers} workers that "
                              f"share it: lower --num-workers or give more data")
        half = (rows + 1) // 2
        micro[i:i + 1] = [_rows(micro[i], 0, half), _rows(micro[i], half, rows)]
    return micro


def _ids(m) -> np.ndarray:
    """A micro-batch's token ids (B, T), of an engine tuple or a Batch with images."""
    return m.input_ids if isinstance(m, Batch) else m[0]


def _rows(m, r0: int, r1: int):
    """Rows r0:r1 of a micro-batch (a Batch: with their images; an engine tuple: its arrays', and its
    ImageTokens' or TowerImages' for those rows)."""
    if not isinstance(m, Batch):
        return tuple(a.rows(r0, r1) if isinstance(a, (ImageTokens, TowerImages)) else a[r0:r1] for a in m)
    labels = m.labels[r0:r1]
    return Batch(m.input_ids[r0:r1], labels, m.attention_mask[r0:r1], m.segment_ids[r0:r1], m.position_ids[r0:r1],
                 int((labels[:, 1:] != IGNORE_INDEX).sum()), None if m.images is None else m.images[r0:r1])


def _trained(m) -> int:
    """The tokens a micro-batch trains (its shifted targets' counted positions)."""
    return m.n_tokens if isinstance(m, Batch) else int((m[1] != IGNORE_INDEX).sum())


class DataParallelWorker(OneProcess):
    """Rank `collective.rank` of `collective.world` workers, each a trainer with its own engine, running the same
    loop over the same seeded data stream (so every decision is the same on every worker): the trainer's part
    (processes.OneProcess) in a data-parallel run.

    Each step's micro-batches (batch_size x grad_accum x workers samples in all, as one process would form
    them) are cut into one contiguous run per worker, balanced by the tokens they compute (rows x length);
    the worker trains its run, and inside engine.train_step its gradients, weighted by its share of the step's
    trained tokens, are summed over the workers (collective.all_reduce), so clipping and AdamW see the
    gradients of the whole step and stay identical everywhere. The LoRA dropout masks of micro-batch j are
    those one process would draw for it (the engine's dropout position is set to the step's start + j):
    different on every worker, deterministic, and a run equals one worker's with the whole batch. A GRPO step
    is shared by whole groups instead (share, gather: grpo_trainer.py).

    Rank 0 evaluates (the results are broadcast) and alone writes metrics, checkpoints, the adapter and the
    summary. `sink` (optional) takes the log lines, the progress, the checkpoints written, and says whether
    the driver asked to stop; a stop is agreed on by every worker after the step it came in.
    """

    def __init__(self, collective, sink=None):
        self.collective, self.rank, self.world, self.sink = collective, collective.rank, collective.world, sink
        self.step_times: list = []     # (step, all-reduce, wait for the other workers) seconds of each step
        self._step_tokens = 0
        self._reduce_s = self._wait_s = 0.0

    # ---- the step -------------------------------------------------------------------------------
    def train_step(self, engine, micro, hp, step: int, own: bool = False, **extra):
        started = time.perf_counter()
        self._reduce_s = self._wait_s = 0.0
        if own:         # this worker's own rows (GRPO's groups): the step's tokens are every worker's together
            tokens = sum(_trained(m) for m in micro)
            self._step_tokens = int(self.collective.all_reduce(np.array([tokens], np.float64))[0])
            loss_sum, count, norm, applied = engine.train_step(micro, hp, step, reduce=self._reduce, **extra)
        else:
            n_micro = len(micro)
            micro = split_rows(micro, self.world, step)
            j0, j1 = partition([_ids(m).size for m in micro], self.world)[self.rank]
            self._step_tokens = sum(_trained(m) for m in micro)
            state = engine.state_dict()
            calls = int(state["dropout_calls"])
            engine.load_state_dict({**state, "dropout_calls": calls + j0})
            loss_sum, count, norm, applied = engine.train_step(micro[j0:j1], hp, step, reduce=self._reduce,
                                                               **extra)
            engine.load_state_dict({**state, "dropout_calls": calls + n_micro})
        stop = self.rank == 0 and self.sink is not None and self.sink.stop_requested()
        totals = self.collective.all_reduce(np.array([loss_sum, count, float(stop)], np.float64))
        self.stop_agreed = bool(totals[2] > 0)
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

    # ---- what the workers share -------------------------------------------------------------------
    def from_first(self, compute):
        return self.collective.broadcast(compute() if self.rank == 0 else None)

    def share(self, units: int) -> tuple[int, int]:
        return partition([1] * units, self.world)[self.rank]

    def gather(self, rows: np.ndarray, start: int, total: int) -> np.ndarray:
        """An all-gather through the collective's sum: zeros but for this worker's rows (NaN travels as a
        flag, since it would spoil the sum)."""
        rows = np.asarray(rows)
        nan = np.isnan(rows) if rows.dtype.kind == "f" else np.zeros(rows.shape, bool)
        full = np.zeros((total,) + rows.shape[1:], np.float64)
        flags = np.zeros_like(full)
        full[start:start + len(rows)] = np.where(nan, 0.0, rows)
        flags[start:start + len(rows)] = nan
        summed = self.collective.all_reduce(np.stack([full, flags]))
        return np.where(summed[1] > 0, np.nan, summed[0]).astype(rows.dtype)

    def gather_objects(self, objects: list, start: int, total: int) -> list:
        """Each object as JSON bytes through gather: their lengths first, then the bytes padded to the longest."""
        mine = [json.dumps(o, default=str).encode() for o in objects]
        lengths = self.gather(np.array([len(b) for b in mine], np.int64), start, total)            # (total,)
        width = max(int(lengths.max(initial=0)), 1)
        rows = np.zeros((len(mine), width), np.int32)                                             # (rows, B)
        for i, b in enumerate(mine):
            rows[i, :len(b)] = np.frombuffer(b, np.uint8)
        every = self.gather(rows, start, total)                                                   # (total, B)
        out = [json.loads(every[i, :n].astype(np.uint8).tobytes()) for i, n in enumerate(lengths)]
        out[start:start + len(objects)] = objects
        return out

    def check_step_rows(self, fewest: int, what: str):
        if fewest < self.world:
            raise ConfigError(f"a step of this run holds {fewest} {what}, fewer than the {self.world} workers "
                              f"that share it: lower --num-workers, or raise --batch-size or --grad-accum")

    def checkpointed(self, path):
        if self.sink is not None:
            self.sink.checkpointed(str(path))

    def progress_bar(self, make_bar, total: int, initial: int):
        if self.sink is None:
            return make_bar()
        return _SinkBar(self.sink if self.rank == 0 else None, total, initial)

    def summary(self, micro_per_step: int) -> dict:
        """This worker's step, gradient all-reduce and wait times (medians, past the first step of this
        invocation where there are more: it compiles and tunes) and the all-reduce's share."""
        times = np.array(self.step_times or [(0.0, 0.0, 0.0)])
        times = times[1:] if len(times) > 2 else times
        med = [round(float(np.median(times[:, i])), 6) for i in range(3)]
        return {"data_parallel": {
            "workers": self.world, "micro_batches_per_step": micro_per_step, "step_s_median": med[0],
            "allreduce_s_median": med[1], "wait_s_median": med[2],
            "allreduce_share": round(float(times[:, 1].sum() / max(times[:, 0].sum(), 1e-12)), 4)}}


def data_parallel_trainer(config, collective, sink=None, reward_funcs=None, placement=None, tools=None,
                          environment_factory=None):
    """The trainer of config.objective's kind (training/trainers.py) as one worker of a data-parallel run;
    placement: where its model lives (default one engine; a 2-D grid: the worker's own pipeline stages); GRPO's
    Python objects (each worker its own tools and environments)."""
    if config.num_workers != collective.world:
        raise ValueError(f"num_workers {config.num_workers} for a collective of {collective.world} workers")
    return make_trainer(config, None if sink is None else sink.log, DataParallelWorker(collective, sink),
                        reward_funcs, placement, tools, environment_factory)


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
