"""The one worker thread that owns the Model (engines are not thread-safe): jobs wait in order in a bounded
queue; the worker takes the oldest, with the jobs waiting behind it that share its adapter and sampling
settings (up to max_batch), and generates them together (Model.generate_batch), switching the adapter first
when it differs. Each job's text goes out as it comes; a job whose client left ends at its next token."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from wgpu_train.errors import WgpuTrainError
from wgpu_train.serve.adapters import AdapterRegistry
from wgpu_train.serve.text_stream import TextStream

log = logging.getLogger("wgpu_train.serve")


class QueueFull(Exception):
    """The queue holds max_queue jobs already."""


@dataclass(eq=False)          # jobs are told apart by identity in the queue
class Job:
    """One answer to generate: the prompt, its budget and sampling, and where its events go.

    emit(event) is called from the worker thread with ("text", piece), then ("done", finish_reason,
    prompt_tokens, completion_tokens) or ("error", status, message)."""

    adapter: str
    prompt: list
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stops: tuple
    emit: Callable
    cancelled: threading.Event = field(default_factory=threading.Event)

    def batch_key(self) -> tuple:
        """Jobs with one key can share a generate_batch call (its sampling settings are shared)."""
        if self.temperature == 0:
            return self.adapter, 0.0, 0, 1.0        # greedy: top_k and top_p change nothing
        return self.adapter, self.temperature, self.top_k, self.top_p


class Scheduler:
    """The queue and the worker thread (start, then close)."""

    def __init__(self, model, registry: AdapterRegistry, tokenizer, max_queue: int = 64, max_batch: int = 8):
        self.model = model
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._waiting: deque = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="wgpu-train-serve-worker", daemon=True)
        self.stats = {"jobs": 0, "batches": 0, "largest_batch": 0, "tokens": 0, "cancelled": 0}

    def start(self):
        self._thread.start()

    def close(self):
        """Stop taking jobs; the worker ends after its current batch."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def submit(self, jobs: list):
        """Queue the jobs of one request, all or none: QueueFull when they would pass max_queue."""
        with self._cond:
            if len(self._waiting) + len(jobs) > self.max_queue:
                raise QueueFull()
            self._waiting.extend(jobs)
            self._cond.notify()

    def cancel(self, job: Job):
        """The job's client is gone: drop it from the queue, or end it at its next token."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.stats["cancelled"] += 1

    def _next_batch(self) -> list | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            head = self._waiting.popleft()
            key = head.batch_key()
            batch = [head] + [j for j in self._waiting if j.batch_key() == key][:self.max_batch - 1]
            for j in batch[1:]:
                self._waiting.remove(j)
            return batch

    def _run(self):
        while (batch := self._next_batch()) is not None:
            try:
                self._generate(batch)
            except Exception as e:           # a bug: its requests get a 500, the server keeps serving
                log.exception("generation failed")
                for job in batch:
                    job.emit(("error", 500, f"internal error during generation ({type(e).__name__})"))

    def _generate(self, batch: list):
        head = batch[0]
        started = time.perf_counter()
        self.registry.activate(head.adapter)
        streams = [TextStream(self.tokenizer, job.stops) for job in batch]

        def on_token(i: int, token: int) -> bool:
            job, stream = batch[i], streams[i]
            if job.cancelled.is_set():
                return True
            piece = stream.push(token)
            if piece:
                job.emit(("text", piece))
            return stream.stopped

        try:
            out = self.model.generate_batch([job.prompt for job in batch], [job.max_tokens for job in batch],
                                            head.temperature, head.top_k, head.top_p, [job.seed for job in batch],
                                            self.tokenizer.stop_token_ids, on_token=on_token)
        except WgpuTrainError as e:         # checked before queueing; a request that still gets here is refused
            for job in batch:
                job.emit(("error", 400, str(e)))
            return
        stops = set(self.tokenizer.stop_token_ids)
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        for job, stream, ids in zip(batch, streams, out):
            self.stats["jobs"] += 1
            self.stats["tokens"] += len(ids)
            if job.cancelled.is_set():
                self.stats["cancelled"] += 1
                continue
            piece = stream.finish()
            if piece:
                job.emit(("text", piece))
            ended = stream.stopped or (ids and ids[-1] in stops)
            job.emit(("done", "stop" if ended else "length", len(job.prompt), len(ids)))
        log.info("%d answer(s) with %s: %d tokens in %.2f s", len(batch), head.adapter, sum(map(len, out)),
                 time.perf_counter() - started)
