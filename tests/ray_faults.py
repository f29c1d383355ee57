"""A Ray worker-process setup hook for tests/test_distributed.py and tests/test_pipeline.py: a worker kills its own
process when asked (a file kill-rank<R>-step<S> in $WGPU_TRAIN_TEST_FAULTS, removed first so that a restarted worker
goes on), and so does the actor of the pipeline stage whose first layer is L (kill-layer<L>-step<N>, before its
update of step N)."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def install():
    folder = os.environ.get("WGPU_TRAIN_TEST_FAULTS")
    if not folder:
        return
    from wgpu_train.distributed.data_parallel import DataParallelWorker

    train_step = DataParallelWorker.train_step

    def killing_train_step(self, engine, micro, hp, step, **extra):
        order = Path(folder) / f"kill-rank{self.rank}-step{step}"
        if order.exists():
            order.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self, engine, micro, hp, step, **extra)

    DataParallelWorker.train_step = killing_train_step

    from wgpu_train.engines.numpy.stage import NumpyStage

    stage_update = NumpyStage.stage_update

    def killing_stage_update(self, norm, hp, step):
        order = Path(folder) / f"kill-layer{self.span.start}-step{step}"
        if order.exists():
            order.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return stage_update(self, norm, hp, step)

    NumpyStage.stage_update = killing_stage_update
