"""Training metrics: the per-step window the trainer logs from, JSON-safe numbers, metrics.jsonl kept to one row
per step after a resume, and the loss plot."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

def num(x):
    """A float for JSON, None when missing or not finite."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def fmt(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


class Window:
    """Sums over the steps since the last logged row."""

    def __init__(self):
        self.loss = self.time = 0.0
        self.count = self.tokens = 0
        self.last_loss = None   # mean loss of the newest step

    def add(self, loss_sum, count, tokens, seconds):
        self.loss += float(loss_sum)
        self.count += int(count)
        self.tokens += tokens
        self.time += seconds
        self.last_loss = num(float(loss_sum) / max(int(count), 1))

    @property
    def mean_loss(self):
        return self.loss / self.count if self.count else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time if self.time > 0 else 0.0


def keep_metrics_until(path: Path, step: int):
    """Drop the rows of metrics.jsonl after `step` (written after the checkpoint a run resumes from, before it
    was stopped) and a torn last line, so that each step appears once; replaced atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def plot_losses(metrics_path, png_path) -> bool:
    """Draw train and validation loss from metrics.jsonl into a PNG; False when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    train, valid = [], []
    for line in Path(metrics_path).read_text().splitlines():
        row = json.loads(line)
        if row.get("loss") is None:
            continue
        if "split" not in row:
            train.append((row["step"], row["loss"]))
        elif row["split"] == "valid":
            valid.append((row["step"], row["loss"]))
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean per token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    return True
