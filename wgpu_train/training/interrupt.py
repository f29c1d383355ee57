"""Interrupt, a part the Trainer owns: Ctrl-C during a run. The first asks the run to stop (after the step in
progress, saving a checkpoint; before the first step, with nothing written); the second aborts it."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class Interrupt:
    """Whether the run was asked to stop (`requested`: Ctrl-C, or the driver of data-parallel workers); log: the
    trainer's progress lines; started(): whether this invocation took a step yet."""

    def __init__(self, log, started):
        self.log, self.started = log, started
        self.requested = False
        self.in_step = False

    def request(self, message: str):
        """Ask the run to stop (once), saying why."""
        if not self.requested:
            self.requested = True
            self.log(message)

    @contextmanager
    def step(self):
        """An optimizer step in progress: Ctrl-C finishes it first."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    @contextmanager
    def handling(self):
        """Ctrl-C handled as the run's while it runs, unless this is not the main thread or SIGINT is ignored (a
        background job, nohup): then Ctrl-C keeps meaning what it meant."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            yield
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:    # whatever was there before (a handler set outside Python reads as None: then Python's default,
                    # as the handler cannot be put back)
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        if self.in_step:
            then = "finishing this step, then saving a checkpoint"
        elif not self.started():
            then = "stopping before the first step"
        else:
            then = "stopping, then saving a checkpoint"
        self.request(f"interrupted: {then} (Ctrl-C again to abort)")
