"""A Ray worker-process setup hook for tests/test_distributed.py and tests/test_pipeline.py: a worker kills its own
process when asked (a file kill-rank<R>-step<S> in $WGPU_TRAIN_TEST_FAULTS, removed first so that a restarted worker
goes on), and so does the actor of the pipeline stage whose first layer is L (kill-layer<L>-step<N>, before its
update of step N); with the order tool-calls there, GRPO's tool loop parses turns as called_parse does."""
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

    from wgpu_train.training.tools_rollouts import ToolRollouts

    parse, calls = ToolRollouts.parse, called_parse(ToolRollouts.parse)

    def ordered_parse(self, ids, prefix):
        return (calls if (Path(folder) / "tool-calls").exists() else parse)(self, ids, prefix)

    ToolRollouts.parse = ordered_parse


def called_parse(parse):
    """ToolRollouts.parse for a random model, whose turns are made tool calls by a rule of their ids (the first
    id mod 3: 0 calls add(a, b), which raises for b 3; 1 calls the environment's bump(k); 2 calls nothing), so the
    tool loop runs as a trained model's would: tests/test_grpo_tools_distributed.py's, and a Ray worker's where
    $WGPU_TRAIN_TEST_FAULTS holds the order tool-calls."""
    def parse_calls(self, ids, prefix):
        message = parse(self, ids, prefix)
        if not ids or ids[0] % 3 == 2:
            return message
        call = ({"name": "add", "arguments": {"a": int(ids[0]), "b": len(ids) % 4}} if ids[0] % 3 == 0 else
                {"name": "bump", "arguments": {"k": int(ids[-1])}})
        return {**message, "tool_calls": [{"type": "function", "function": call}]}
    return parse_calls
