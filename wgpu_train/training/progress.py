"""Progress, a part the Trainer owns: where a run is (its step, its position in the batch stream, the tokens it
processed, the engine counters of the runs before a resume) and its history of evaluations, with early
stopping's best weights; what a checkpoint's state records of it, and its restoring."""
from __future__ import annotations

import numpy as np

from wgpu_train.training.metrics import num


def new_history() -> dict:
    """A run's history before its first evaluation (summary.json and the checkpoints' state carry it)."""
    return {"train_loss_first": None, "valid_loss_before": None, "valid_perplexity_before": None,
            "exact_match_before": None, "best_valid_loss": None, "best_valid_perplexity": None,
            "best_step": None, "evals_without_improvement": 0}


class Progress:
    """A run's progress; `stream` (the resumable stream of the steps' batches) is set once the data is read."""

    def __init__(self):
        self.stream = None
        self.step = 0
        self.tokens = 0                 # input (non-padding) tokens processed, over every run of this job
        self.trained_tokens = 0         # tokens that carried loss
        self.counters_base: dict = {}   # engine counters of the runs before a resume
        self.history = new_history()
        self.last_saved_step = 0
        self.start_step = 0             # the step this invocation started at
        self.best = None                # early stopping: (step, trainable tensors) of the best evaluation

    # ---- the batch stream ---------------------------------------------------------------------------
    def epochs_completed(self) -> int:
        """Whole epochs done (the current one counts once its last batch is drawn)."""
        st = self.stream
        return st.epoch + (1 if st.position >= len(st.epoch_batches(st.epoch)) else 0)

    def epoch_float(self) -> float:
        """Epochs done, with the fraction of the current one."""
        st = self.stream
        n = len(st.epoch_batches(st.epoch))
        return round(st.epoch + (st.position / n if n else 0.0), 4)

    def next_batch(self):
        """(the batch of the next step, whether it ends an epoch); a step never spans two epochs."""
        st = self.stream
        if st.position >= len(st.epoch_batches(st.epoch)):
            st.epoch += 1
            st.position = 0
        batches = st.epoch_batches(st.epoch)
        batch = batches[st.position]
        st.position += 1
        return batch, st.position >= len(batches)

    def done(self, max_steps: int, epochs: int) -> bool:
        """Whether the run reached its end: max_steps steps, else `epochs` epochs."""
        if max_steps:
            return self.step >= max_steps
        return self.epochs_completed() >= epochs

    # ---- evaluations --------------------------------------------------------------------------------
    def track(self, result: dict, patience: int, trainable) -> bool:
        """Track the best validation loss of evaluation `result` (with early stopping, also its trainable
        tensors, trainable() copied in memory); True when `patience` evaluations in a row did not improve on it."""
        h = self.history
        loss = result["loss"]
        if loss is None:
            return False
        if h["best_valid_loss"] is None or loss < h["best_valid_loss"]:
            h.update(best_valid_loss=float(loss), best_valid_perplexity=num(result["perplexity"]), best_step=self.step,
                     evals_without_improvement=0)
            if patience:
                self.best = (self.step, {k: np.array(v, copy=True) for k, v in trainable().items()})
            return False
        h["evals_without_improvement"] += 1
        return bool(patience) and h["evals_without_improvement"] >= patience

    # ---- checkpoints --------------------------------------------------------------------------------
    def counters(self, engine) -> dict:
        """The engine's counters, added to those of the runs before a resume."""
        now = dict(engine.counters)
        return {k: int(now.get(k, 0)) + int(self.counters_base.get(k, 0))
                for k in sorted(set(now) | set(self.counters_base))}

    def restore(self, state: dict):
        """Continue a checkpoint's progress: data position, step, token counts, counters and history."""
        self.stream.load_state_dict(state["data"])
        self.step = self.last_saved_step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.trained_tokens = int(state.get("trained_tokens", 0))
        self.counters_base = dict(state.get("counters", {}))
        self.history.update(state.get("history", {}))
