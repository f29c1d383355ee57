"""RunFiles, a part the Trainer owns: the files a run writes in its output folder (train_config.json, metrics.jsonl
and the trackers, the checkpoints, the final adapter or model with summary.json and loss.png), one-line errors
when the folder cannot be written, and the clean-up of a run that trained nothing. Only the process that writes
the run's files (of data-parallel workers, rank 0) touches the folder; the others write their rows nowhere. A
resumed run changes nothing in its folder until its first step completes (`hold`, `step_completed`): a resume that
fails before (a reward that raises, a bad option) leaves the run as it was, to be resumed again."""
from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

from wgpu_train.errors import ConfigError
from wgpu_train.training import checkpoint, tracking
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.training.metrics import keep_metrics_until, plot_losses
from wgpu_train.training.run_folder import RunFolders


class RunFiles:
    """The files of one run in `folders.out`; writes_files: whether this process writes them; log: the
    trainer's progress lines."""

    def __init__(self, folders: RunFolders, writes_files: bool, log):
        self.folders, self.out, self.writes_files, self.log = folders, folders.out, writes_files, log
        self.written: list = []      # files this invocation wrote that a run which trained nothing removes
        self.made_out = False        # whether this invocation created the output folder
        self.metrics = None          # metrics.jsonl, open while training (os.devnull where rows go nowhere)
        self.trackers = None
        self.resumed = False         # the run continues a checkpoint: its changes wait for a completed step
        self._held: list = []        # those changes, callables run in order by step_completed

    def prepare(self, resolved: dict, resumed: bool):
        """The output folder with train_config.json (`resolved`: the run's settings as resolved), before anything
        else is written; a new run's files replace an earlier run's, whose checkpoints are removed unless the
        run continues in its folder; a resumed run keeps those it finds, and writes train_config.json once its
        first step completes."""
        self.resumed = resumed
        if not self.writes_files:
            return
        self.written = [self.out / name for name in ("train_config.json", "metrics.jsonl")
                        if not resumed or not (self.out / name).exists()]
        self.made_out = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}") from None
        self.hold(lambda: self._write_config(resolved))
        if not self.folders.in_place:
            stale = list_checkpoints(self.out / "checkpoints")
            if stale:
                self.log(f"removing {len(stale)} checkpoint(s) of an earlier run in {self.out / 'checkpoints'}")
                for p in stale:
                    shutil.rmtree(p, ignore_errors=True)

    def _write_config(self, resolved: dict):
        try:
            (self.out / "train_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}") from None

    def hold(self, change):
        """Make `change` (a callable that changes the run folder) now in a new run; in a resumed run once its first
        step completes (step_completed), so that a resume which fails before leaves the folder as it was."""
        if self.resumed:
            self._held.append(change)
        else:
            change()

    def step_completed(self):
        """A step completed: the changes a resumed run held back are made now, in the order held."""
        held, self._held = self._held, []
        for change in held:
            change()

    def wrote(self, path: Path):
        """A file of the run's kind (a trainer's own) that the clean-up of a run which trained nothing removes."""
        self.written.append(path)

    def open(self, report_to: str, settings: dict, resumed_step: int | None):
        """metrics.jsonl (cut back to resumed_step when the run resumes) and the trackers of report_to; in a
        resumed run once its first step completes (hold)."""
        if not self.writes_files:
            self.metrics = open(os.devnull, "w")
            self.trackers = tracking.Trackers([], self.out, {})
            return
        self.hold(lambda: self._open(report_to, settings, resumed_step))

    def _open(self, report_to: str, settings: dict, resumed_step: int | None):
        if resumed_step is not None:
            keep_metrics_until(self.out / "metrics.jsonl", resumed_step)
        self.metrics = open(self.out / "metrics.jsonl", "a" if resumed_step is not None else "w")
        self.trackers = tracking.Trackers(tracking.parse_report_to(report_to), self.out, settings, resumed_step or 0)

    def write_row(self, row: dict):
        """One row of metrics.jsonl, also to the trackers. A row tells of a completed step (or of a run's start,
        which a resumed run does not evaluate): a resumed run's held changes are made first."""
        self.step_completed()
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        self.trackers.log(row)

    def save_checkpoint(self, step: int, model, state: dict, keep: int, protect: tuple, arrays: dict) -> Path:
        """checkpoints/step-NNNNNN (checkpoint.save_checkpoint: written atomically, the newest `keep` and those
        named in `protect` kept), by the process that writes the run's files. A failed write (disk full) is a
        ConfigError naming the last good checkpoint, which the atomic write leaves intact."""
        root = self.out / "checkpoints"
        try:
            return checkpoint.save_checkpoint(root, step, model, state, keep, protect=protect, arrays=arrays)
        except OSError as e:
            kept = list_checkpoints(root)
            good = (f"the last good checkpoint is {kept[-1]} (resume with --resume {shlex.quote(str(kept[-1]))})"
                    if kept else "no checkpoint of this run was written")
            raise ConfigError(f"cannot write the checkpoint of step {step} in {root}: {e.strerror or e}; "
                              f"{good}") from None

    def write_outputs(self, model, method: str, summary: dict, ckpt):
        """The adapter (LoRA) or the model, summary.json and loss.png (without matplotlib, a line saying what to
        install instead)."""
        if not self.writes_files:
            return
        try:
            if method == "lora":
                model.save_adapter(self.out)
            else:
                model.save_pretrained(self.out)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}; the checkpoint "
                              f"{ckpt} holds the run") from None
        self.metrics.flush()
        if not plot_losses(self.out / "metrics.jsonl", self.out / "loss.png"):
            self.log("loss.png skipped: matplotlib is not installed (pip install 'wgpu-train[plot]')")

    def close(self):
        """metrics.jsonl and the trackers closed (the run is over)."""
        if self.metrics is not None:
            self.metrics.close()
        if self.trackers is not None:
            self.trackers.close()

    def discard(self):
        """Remove what this invocation wrote (a run that trained nothing), and the output folder when it made it
        and nothing else is there."""
        if self.metrics is not None:
            self.metrics.close()
        for path in self.written:
            path.unlink(missing_ok=True)
        if self.made_out:
            try:
                self.out.rmdir()
            except OSError:
                pass
