"""The one worker thread that owns the Model (engines are not thread-safe) and its running batch (continuous
batching): answers wait in order in a bounded queue; at every step the worker admits waiting answers into free
rows of one KV cache (a DecodeBatch, whose free rows keep their keys and values for prompts of the same adapter
that begin alike), each row with its own adapter out of the engine's bank (or, where an adapter
cannot join a bank, answers of the batch's adapter only: another adapter's wait PATIENCE steps at most, then
the batch drains and switches), takes one token of every running row, sends each answer's text as it comes, and
frees the row of an answer that ended, met a stop string or lost its client."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from wgpu_train.engines.generate import DecodeBatch, Sampling
from wgpu_train.engines.protocol import PREFILL_TOKENS
from wgpu_train.serve.adapters import AdapterRegistry
from wgpu_train.serve.metrics import ServeMetrics
from wgpu_train.serve.text_stream import TextStream

log = logging.getLogger("wgpu_train.serve")
# without a bank (an adapter with DoRA, modules_to_save or a PiSSA residual): steps an answer for another adapter
# than the running batch's waits while the batch admits answers of its own; then the batch admits none, drains,
# and switches
PATIENCE = 16


class QueueFull(Exception):
    """The queue holds max_queue jobs already."""


@dataclass(eq=False)          # jobs are told apart by identity in the queue
class Job:
    """One answer to generate: the prompt, its budget and sampling, and where its events go.

    emit(event) is called from the worker thread with ("prompt", first id, entries of the others) first when
    echo asks for the prompt's log-probabilities, then ("text", piece, entries), then ("done", finish_reason, prompt_tokens,
    completion_tokens) or ("error", status, message). entries: None without logprobs, else (id, logprob,
    [(id, logprob)] of the `logprobs` likeliest) of each token whose text the piece completes."""

    adapter: str
    prompt: list
    max_tokens: int
    sampling: Sampling
    stops: tuple
    emit: Callable
    logprobs: int | None = None         # alternatives per token with its log-probability; None: none
    echo: bool = False                  # the prompt's log-probabilities too (with logprobs)
    special_tokens: bool = False        # the text keeps special tokens (an answer whose tool calls are parsed)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued: float = field(default_factory=time.perf_counter)
    queued_step: int = 0                # the scheduler's step count when it was queued


@dataclass(eq=False)
class _Running:
    """A job in a row of the batch."""

    job: Job
    stream: TextStream
    tokens: int = 0
    entries: list = field(default_factory=list)     # logprobs of tokens whose text is held back
    last: float = 0.0                               # when its latest token came


class Scheduler:
    """The queue and the worker thread (start, then close). context: the positions of each row of the batch's
    KV cache, which bounds a prompt and its answer."""

    def __init__(self, model, registry: AdapterRegistry, tokenizer, max_queue: int = 64, max_batch: int = 8,
                 context: int | None = None):
        self.model = model
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.context = min(context or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.metrics = ServeMetrics(max_batch)
        self._waiting: deque = deque()
        self._running: dict[int, _Running] = {}         # batch slot -> its job
        self._batch: DecodeBatch | None = None
        self.mixed = False              # the adapters in one bank: rows of any adapters share the batch
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="wgpu-train-serve-worker", daemon=True)
        # joined: answers admitted into a batch already running
        self.stats = {"jobs": 0, "steps": 0, "largest_batch": 0, "tokens": 0, "cancelled": 0, "joined": 0}

    def start(self):
        """The adapters put in one bank where they can be (mixed adapters in a batch), the batch's KV cache
        allocated (a DeviceError when it does not fit), then the worker started."""
        self.mixed = self.registry.build_bank()
        self._batch = DecodeBatch(self.model.engine, self.max_batch, self.context)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the worker thread serves."""
        return self._thread.is_alive() and not self._closed

    def close(self):
        """Stop taking jobs; the worker ends after its current step, its running answers cut off."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        if self._batch is not None:
            self._batch.close()
            self._batch = None

    def submit(self, jobs: list):
        """Queue the jobs of one request, all or none: QueueFull when they would pass max_queue."""
        with self._cond:
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull()
            for job in jobs:
                job.queued_step = self.stats["steps"]
            self._waiting.extend(jobs)
            self.metrics.queue.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job):
        """The job's client is gone: drop it from the queue, or free its row before the next step."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.queue.set(len(self._waiting))
                self._count_cancelled(job)

    def _count_cancelled(self, job: Job):
        self.stats["cancelled"] += 1
        self.metrics.requests.labels(job.adapter, "cancelled").inc()

    def _run(self):
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                admitted = self._admit()
            try:
                self._step(admitted)
            except Exception as e:           # a bug: the running answers get a 500, the server keeps serving
                log.exception("generation failed")
                running = {id(run.job) for run in self._running.values()}
                jobs = [run.job for run in self._running.values()] + [j for j in admitted if id(j) not in running]
                for job in jobs:                # the admitted ones too, whether or not they got a row
                    job.emit(("error", 500, f"internal error during generation ({type(e).__name__})"))
                    self.metrics.requests.labels(job.adapter, "error").inc()
                for slot in list(self._running):
                    self._free(slot)

    def _admit(self) -> list:
        """Waiting jobs that take free rows now (the lock held), oldest first: any, with the adapters in a bank;
        else an idle batch takes the oldest job's adapter, and a running batch admits jobs of its adapter until
        a job for another has waited PATIENCE steps, then none, so that it drains and that job's adapter comes
        next. Admission also stops once the
        prompts admitted but not yet prefilled pass a step's token budget."""
        steps = self.stats["steps"]
        if self.mixed:
            adapter = None
        elif self._running:
            adapter = self.registry.active
            if any(j.adapter != adapter and steps - j.queued_step >= PATIENCE for j in self._waiting):
                return []
        else:
            adapter = self._waiting[0].adapter
        admitted, pending = [], self._batch.prefilling()
        for job in list(self._waiting):
            if len(admitted) == self._batch.free_slots() or pending >= PREFILL_TOKENS:
                break
            if adapter is None or job.adapter == adapter:
                self._waiting.remove(job)
                admitted.append(job)
                pending += len(job.prompt)
        self.metrics.queue.set(len(self._waiting))
        return admitted

    def _step(self, admitted: list):
        if admitted:
            if not self.mixed:
                self.registry.activate(admitted[0].adapter)     # only ever switched with the batch empty
            self.stats["joined"] += len(admitted) if self._running else 0
        now = time.perf_counter()
        for job in admitted:
            reused = self._batch.reused
            slot = self._batch.add(job.prompt, job.max_tokens, job.sampling, self.tokenizer.stop_token_ids,
                                   job.logprobs, job.echo and job.logprobs is not None,
                                   self.registry.row_adapter(job.adapter) if self.mixed else -1, job.adapter)
            self._running[slot] = _Running(job, TextStream(self.tokenizer, job.stops, not job.special_tokens), last=now)
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.prefix_reused.inc(self._batch.reused - reused)
        for slot, run in list(self._running.items()):
            if run.job.cancelled.is_set():
                self._count_cancelled(run.job)
                self._free(slot)
        self.metrics.running.set(len(self._running))
        if not self._running:
            return
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self._running))
        tokens = self._batch.step()
        self.stats["steps"] += 1
        self.metrics.steps.inc()
        now = time.perf_counter()
        for token in tokens:
            self._deliver(token, now)
        self.metrics.running.set(len(self._running))

    def _deliver(self, token, now: float):
        run = self._running[token.slot]
        job = run.job
        run.tokens += 1
        self.stats["tokens"] += 1
        self.metrics.generation_tokens.inc()
        if run.tokens == 1:
            self.metrics.ttft.observe(now - job.queued)
            if token.prompt is not None:
                job.emit(("prompt", job.prompt[0], token.prompt))
        else:
            self.metrics.per_token.observe(now - run.last)
        run.last = now
        if job.cancelled.is_set():
            self._count_cancelled(job)
            self._free(token.slot)
            return
        if job.logprobs is not None:
            run.entries.append((token.id, token.logprob, token.top))
        piece = run.stream.push(token.id)
        if piece:
            job.emit(("text", piece, self._entries(run)))
        if token.finished or run.stream.stopped:
            rest = run.stream.finish()
            if rest or run.entries:
                job.emit(("text", rest, self._entries(run)))
            reason = "stop" if token.finished == "stop" or run.stream.stopped else "length"
            job.emit(("done", reason, len(job.prompt), run.tokens))
            self.stats["jobs"] += 1
            self.metrics.requests.labels(job.adapter, reason).inc()
            log.info("answer with %s: %d prompt and %d new tokens in %.2f s", job.adapter, len(job.prompt),
                     run.tokens, now - job.queued)
            self._free(token.slot)

    def _entries(self, run: _Running):
        if run.job.logprobs is None:
            return None
        entries, run.entries = run.entries, []
        return entries

    def _free(self, slot: int):
        self._running.pop(slot, None)
        self._batch.remove(slot)
