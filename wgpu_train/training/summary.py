"""summary.json of a run: what it did, how long each part took, where it ran and what it wrote."""
from __future__ import annotations

from wgpu_train.training.metrics import Window, num


def run_summary(trainer, stopped: str, adapter_step, after, em_after, ckpt, run: Window, wall: float) -> dict:
    """The run's summary; `after` and `em_after` are the evaluation and exact match of the weights written
    (those of adapter_step; None when nothing was written)."""
    cfg = trainer.config
    h = trainer.history
    return {
        "steps": trainer.step, "epochs": trainer.epoch_float(), "stopped": stopped,
        "interrupted": stopped == "interrupted", "adapter_step": adapter_step,
        "tokens": trainer.tokens, "trained_tokens": trainer.trained_tokens, "wall_time_s": round(wall, 3),
        "setup_time_s": _seconds(trainer.setup_s), "backend_choice_time_s": _seconds(trainer.backend_choice_s),
        "train_time_s": round(run.time, 3), "tokens_per_s": round(run.tokens_per_s, 2) if run.time else None,
        "train_loss_first": h["train_loss_first"], "train_loss_last": run.last_loss,
        "valid_loss_before": h["valid_loss_before"], "valid_perplexity_before": h["valid_perplexity_before"],
        "valid_loss_after": num(after["loss"]) if after else None,
        "valid_perplexity_after": num(after["perplexity"]) if after else None,
        "best_valid_loss": h["best_valid_loss"], "best_step": h["best_step"],
        "exact_match_before": h["exact_match_before"],
        "exact_match_after": em_after["exact_match"] if em_after else None,
        "exact_match_split": trainer.held_out()[0] if trainer.eval_generate else None,
        "exact_match_n": em_after["n"] if em_after else None,
        "exact_match_samples": em_after["samples"] if em_after else [],
        "backend": trainer.engine.name, "backend_reason": trainer.backend_reason,
        "device": trainer.engine.device_description, "method": cfg.method,
        "base_dtype": trainer.base_dtype, "embed_dtype": trainer.embed_dtype,
        "base_weight_bytes": trainer.base_weight_bytes,
        "precision": trainer.precision, "precision_reason": trainer.precision_reason,
        "memory_estimate": trainer.memory_estimate,
        "model": str(trainer.model_dir), "data": str(trainer.data_path) if trainer.data_path else None,
        "data_format": trainer.splits.format,
        "n_train": len(trainer.train_examples), "n_valid": len(trainer.valid_examples),
        "n_test": len(trainer.splits.test),
        "skipped_lines": trainer.n_skipped, "truncated": trainer.truncated, "dropped": trainer.dropped,
        "counters": trainer.counters(), "output": str(trainer.out), "checkpoint": str(ckpt) if ckpt else None,
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None,
        "continued_from": str(trainer.continued_from) if trainer.continued_from else None,
    } | ({"images": trainer.n_images, "rows_cut_in_image": trainer.cut_in_image} if trainer.with_images else {}) \
        | trainer.process.summary(trainer.micro_per_step) | trainer.placement.summary(trainer)


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
