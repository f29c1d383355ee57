"""What the Trainer writes (TrainerRecords, a part of trainer.Trainer): checkpoints and their restoring, the rows
of metrics.jsonl and the trackers, the log lines of steps and evaluations, the summary and the final adapter
or model, and the clean-up of a run that trained nothing."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path

from wgpu_train.training import checkpoint, tracking
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.errors import ConfigError
from wgpu_train.training.metrics import Window, fmt, keep_metrics_until, num, plot_losses


class TrainerRecords:
    """train.Trainer's records (a mixin: it reads the Trainer's progress, history and engine)."""

    def counters(self) -> dict:
        """The engine's counters, added to those of the runs before a resume."""
        now = dict(self.engine.counters)
        return {k: int(now.get(k, 0)) + int(self.counters_base.get(k, 0))
                for k in sorted(set(now) | set(self.counters_base))}

    def state_dict(self) -> dict:
        """What a checkpoint needs beyond tensors: step, data position, schedule, dropout counter, history."""
        cfg = self.config
        return {
            "version": 1, "step": self.step, "epoch": self.epoch_float(), "data": self.stream.state_dict(),
            "schedule": dict(self.schedule.state_dict(), next_step=self.step + 1,
                             next_lr=self.schedule.lr_at(self.step + 1)),
            "engine": self.engine.state_dict(),
            "method": cfg.method, "lora": dataclasses.asdict(cfg.lora_config()) if cfg.method == "lora" else None,
            "base_dtype": self.base_dtype, "embed_dtype": self.embed_dtype, "precision": self.precision,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens, "counters": self.counters(),
            "history": self.history, "seed": cfg.seed, "micro_batches": self.micro_per_step,
        }

    def checkpoint_arrays(self) -> dict:
        """Arrays a checkpoint keeps beside the state (name -> np.ndarray); none for this trainer."""
        return {}

    def save_checkpoint(self) -> Path:
        """checkpoints/step-NNNNNN, written atomically; only the newest keep_checkpoints are kept, and with
        early stopping the best evaluation's. A failed write (disk full) is a ConfigError naming the last
        good checkpoint, which the atomic write leaves intact."""
        root = self.out / "checkpoints"
        if not self.writes_files:       # rank 0 writes it; the others know where
            self.last_saved_step = self.step
            return root / checkpoint.checkpoint_name(self.step)
        best = self.history["best_step"] if self.config.early_stop_patience else None
        try:
            path = checkpoint.save_checkpoint(root, self.step, self.model, self.state_dict(),
                                              self.config.keep_checkpoints,
                                              protect=() if best is None else (checkpoint.checkpoint_name(best),),
                                              arrays=self.checkpoint_arrays())
        except OSError as e:
            kept = list_checkpoints(root)
            good = (f"the last good checkpoint is {kept[-1]} (resume with --resume {shlex.quote(str(kept[-1]))})"
                    if kept else "no checkpoint of this run was written")
            raise ConfigError(f"cannot write the checkpoint of step {self.step} in {root}: {e.strerror or e}; "
                              f"{good}") from None
        self.last_saved_step = self.step
        self.process.checkpointed(path)
        return path

    def _resume_progress(self, state: dict):
        """Continue a checkpoint's progress: data position, step, token counts, counters and history."""
        self.stream.load_state_dict(state["data"])
        self.step = self.last_saved_step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.trained_tokens = int(state.get("trained_tokens", 0))
        self.counters_base = dict(state.get("counters", {}))
        self.history.update(state.get("history", {}))

    def _resume_tensors(self, ckpt: Path, state: dict):
        """Put a checkpoint's tensors, moments and dropout counter into the engine; with early stopping, also
        take up the best evaluation's tensors when its checkpoint is still there."""
        cfg = self.config
        checkpoint.restore(ckpt, self.model, state, cfg.lora_config() if cfg.method == "lora" else None)
        self.resumed_from = Path(ckpt)
        best = self.history.get("best_step")
        if cfg.early_stop_patience and best is not None:
            found = ckpt if best == self.step else ckpt.parent / checkpoint.checkpoint_name(best)
            if (found / checkpoint.STATE_FILE).is_file():
                self._best = (best, checkpoint.read_trainable(found, cfg.method))

    def _open_outputs(self):
        """metrics.jsonl (cut back to the resumed step) and the trackers (nowhere, but in the process that
        writes the run's files)."""
        if not self.writes_files:
            self._metrics = open(os.devnull, "w")
            self._trackers = tracking.Trackers([], self.out, {})
            return
        if self.resumed_from:
            keep_metrics_until(self.out / "metrics.jsonl", self.step)
        self._metrics = open(self.out / "metrics.jsonl", "a" if self.resumed_from else "w")
        self._trackers = tracking.Trackers(tracking.parse_report_to(self.config.report_to), self.out,
                                           self.config.to_dict(), self.step if self.resumed_from else 0)

    def _write_row(self, row: dict):
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self._trackers.log(row)

    def _valid_row(self, result: dict):
        self._write_row({"step": self.step, "epoch": self.epoch_float(), "split": "valid",
                         "loss": num(result["loss"]), "perplexity": num(result["perplexity"]),
                         "tokens": result["tokens"]})
        self.log(f"step {self.step}: valid loss {fmt(result['loss'])}, "
                 f"perplexity {fmt(result['perplexity'], '.3f')}")

    def _exact_match_row(self, em: dict, when: str, step: int):
        self._write_row({"step": step, "epoch": self.epoch_float(), "split": em["split"],
                         "exact_match": em["exact_match"], "n": em["n"]})
        self.log(f"exact match {when} training: {fmt(em['exact_match'], '.1%')} of {em['n']} {em['split']} samples")

    def _profile_row(self, step_seconds: float):
        """Print the last step's time per op group and record it in metrics.jsonl."""
        prof = dict(self.engine.last_profile)
        total = sum(prof.values())
        lines = [f"profile of step {self.step}: {total * 1e3:.1f} ms measured of {step_seconds * 1e3:.1f} ms wall"]
        for name, sec in sorted(prof.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<44} {sec * 1e3:9.2f} ms {sec / max(total, 1e-12):6.1%}")
        self.log("\n".join(lines))
        self._write_row({"step": self.step, "profile_ms": {k: round(v * 1e3, 4) for k, v in prof.items()},
                         "step_wall_ms": round(step_seconds * 1e3, 3)})

    def _log_step(self, window: Window, lr: float, grad_norm):
        c = self.counters()
        row = {"step": self.step, "epoch": self.epoch_float(), "loss": num(window.mean_loss), "lr": lr,
               "grad_norm": num(grad_norm), "tokens": self.tokens, "trained_tokens": self.trained_tokens,
               "tokens_per_s": round(window.tokens_per_s, 2), "submits": c.get("submits", 0),
               "readbacks": c.get("readbacks", 0), "nonfinite_skipped": c.get("nonfinite_skipped", 0)}
        if self.engine.loss_scaler is not None:       # f16: the scale the next step multiplies the loss by
            row["loss_scale"] = self.engine.loss_scaler.scale
        self._write_row(row)
        if self.config.no_progress:
            self.log(f"step {self.step}/{self.total_steps} epoch {row['epoch']:.2f} loss {fmt(row['loss'])} "
                     f"lr {lr:.2e} grad_norm {fmt(row['grad_norm'], '.3f')} {window.tokens_per_s:.0f} tok/s")

    def _finish(self, stopped: str, last_eval, last_eval_step: int, run: Window, wall: float) -> dict:
        cfg = self.config
        h = self.history
        interrupted = stopped == "interrupted"
        if interrupted and self.step == self._start_step:
            self._discard()
            ckpt = self.resumed_from
            self.log("interrupted before the first step: nothing trained"
                     + (f"; resume with --resume {shlex.quote(str(ckpt))}" if ckpt else ""))
            return self._summary(stopped, None, None, None, ckpt, run, wall)
        ckpt = (self.save_checkpoint() if self.last_saved_step != self.step
                else self.out / "checkpoints" / checkpoint.checkpoint_name(self.step))
        adapter_step = self.step
        after = last_eval if last_eval_step == self.step else None   # only an evaluation of what is written
        best = h["best_step"]
        if cfg.early_stop_patience and not interrupted and best is not None and best != self.step:
            if self._best is not None and self._best[0] == best:
                adapter_step = best
                self.engine.set_trainable(self._best[1])
                after = {"loss": h["best_valid_loss"], "perplexity": h["best_valid_perplexity"]}
                self.log(f"writing the weights of step {best}, the best validation loss "
                         f"({fmt(h['best_valid_loss'])}); the checkpoint of step {self.step} holds the last ones")
            else:
                self.log(f"the best validation loss was at step {best}, whose weights were not kept across the "
                         f"resume; writing those of step {self.step}")
        em_after = None
        if self.eval_generate and not interrupted and not self._stop_requested:
            em_after = self.process.from_first(self.exact_match)
            self._exact_match_row(em_after, "after", adapter_step)
        summary = self._summary(stopped, adapter_step, after, em_after, ckpt, run, wall)
        self._write_outputs(summary, ckpt)
        if interrupted:
            self.log(f"stopped at step {self.step}; resume with --resume {shlex.quote(str(ckpt))}")
        return summary

    def _write_outputs(self, summary: dict, ckpt):
        """The adapter (or model), summary.json and loss.png (by the process that writes the run's files)."""
        if not self.writes_files:
            return
        try:
            if self.config.method == "lora":
                self.model.save_adapter(self.out)
            else:
                self.model.save_pretrained(self.out)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}; the checkpoint "
                              f"{ckpt} holds the run") from None
        self._metrics.flush()
        plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")

    def _summary(self, stopped: str, adapter_step, after, em_after, ckpt, run: Window, wall: float) -> dict:
        """The run's summary; `after` and `em_after` are the evaluation and exact match of the weights written
        (those of adapter_step; None when nothing was written)."""
        cfg = self.config
        h = self.history
        return {
            "steps": self.step, "epochs": self.epoch_float(), "stopped": stopped,
            "interrupted": stopped == "interrupted", "adapter_step": adapter_step,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens, "wall_time_s": round(wall, 3),
            "train_time_s": round(run.time, 3), "tokens_per_s": round(run.tokens_per_s, 2) if run.time else None,
            "train_loss_first": h["train_loss_first"], "train_loss_last": run.last_loss,
            "valid_loss_before": h["valid_loss_before"], "valid_perplexity_before": h["valid_perplexity_before"],
            "valid_loss_after": num(after["loss"]) if after else None,
            "valid_perplexity_after": num(after["perplexity"]) if after else None,
            "best_valid_loss": h["best_valid_loss"], "best_step": h["best_step"],
            "exact_match_before": h["exact_match_before"],
            "exact_match_after": em_after["exact_match"] if em_after else None,
            "exact_match_split": self.held_out()[0] if self.eval_generate else None,
            "exact_match_n": em_after["n"] if em_after else None,
            "exact_match_samples": em_after["samples"] if em_after else [],
            "backend": self.engine.name, "backend_reason": self.backend_reason,
            "device": self.engine.device_description, "method": cfg.method,
            "base_dtype": self.base_dtype, "embed_dtype": self.embed_dtype, "base_weight_bytes": self.base_weight_bytes,
            "precision": self.precision, "precision_reason": self.precision_reason,
            "memory_estimate": self.memory_estimate,
            "model": str(self.model_dir), "data": str(self.data_path), "data_format": self.splits.format,
            "n_train": len(self.train_examples), "n_valid": len(self.valid_examples), "n_test": len(self.splits.test),
            "skipped_lines": self.n_skipped, "truncated": self.truncated, "dropped": self.dropped,
            "counters": self.counters(), "output": str(self.out), "checkpoint": str(ckpt) if ckpt else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "continued_from": str(self.continued_from) if self.continued_from else None,
        } | self.process.summary(self.micro_per_step) | self.placement.summary(self)

    def _discard(self):
        """Remove what this invocation wrote (see _prepare_out) when it trained nothing, and the output folder
        when it made it and nothing else is there."""
        if self._metrics is not None:
            self._metrics.close()
        for path in self._written:
            path.unlink(missing_ok=True)
        if self._made_out:
            try:
                self.out.rmdir()
            except OSError:
                pass
