"""Experiment tracking (--report-to): the rows of metrics.jsonl (train, validation, exact match, profile) sent
to TensorBoard, Weights & Biases, trackio or MLflow as well, each an optional extra imported only when asked."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

TOOLS = ("tensorboard", "wandb", "trackio", "mlflow")
EXTRAS = {"tensorboard": "tensorboardX", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
PROJECT = "wgpu-train"


def parse_report_to(spec: str | None) -> tuple[str, ...]:
    """'tensorboard,mlflow' -> ("tensorboard", "mlflow"); "none" or empty -> (); an unknown name: ConfigError."""
    names = tuple(n.strip() for n in (spec or "none").split(",") if n.strip() and n.strip() != "none")
    for name in names:
        if name not in TOOLS:
            raise ConfigError(f"report_to: unknown tool {name!r}; choose from {', '.join(TOOLS)} or none")
    return names


def scalars(row: dict) -> tuple[int, dict]:
    """(step, {"<split>/<name>": number}) of one metrics.jsonl row: train rows under train/, validation and
    exact-match rows under their split, profile times under profile/."""
    step = int(row["step"])
    prefix = row.get("split", "train")
    out = {}
    for key, value in row.items():
        if key in ("step", "split"):
            continue
        if key == "profile_ms" and isinstance(value, dict):
            out.update({f"profile/{name}_ms": float(v) for name, v in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            out[f"{prefix}/{key}"] = float(value)
    return step, out


def require(names) -> None:
    """ConfigError (one line naming the extra) unless each tool's package imports; before a run starts."""
    import importlib

    for name in names:
        try:
            importlib.import_module(EXTRAS[name])
        except ImportError:
            _missing(name)


def _missing(tool: str):
    raise ConfigError(f"--report-to {tool} needs the {EXTRAS[tool]} package: pip install 'wgpu-train[{tool}]'")


class _TensorBoard:
    def __init__(self, out: Path, config: dict, name: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            _missing("tensorboard")
        self.writer = SummaryWriter(logdir=str(out / "runs"))
        self.writer.add_text("config", "\n".join(f"{k}: {v}" for k, v in sorted(config.items())), 0)

    def log(self, step: int, values: dict):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict, name: str):
        try:
            import wandb
        except ImportError:
            _missing("wandb")
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, dir=str(out),
                              config=config, reinit=True)

    def log(self, step: int, values: dict):
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


class _Trackio:
    def __init__(self, out: Path, config: dict, name: str):
        try:
            import trackio
        except ImportError:
            _missing("trackio")
        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config)

    def log(self, step: int, values: dict):
        self.trackio.log(values, step=step)

    def close(self):
        self.trackio.finish()


class _MLflow:
    def __init__(self, out: Path, config: dict, name: str):
        try:
            import mlflow
        except ImportError:
            _missing("mlflow")
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):       # a local store beside the run unless told otherwise
            try:
                import sqlalchemy  # noqa: F401  (MLflow's database store)
                mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlflow.db').resolve()}")
            except ImportError:                              # mlflow-skinny: the file store, which MLflow 3
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # keeps behind this opt-in
                mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, step: int, values: dict):
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def close(self):
        self.mlflow.end_run()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio, "mlflow": _MLflow}


class Trackers:
    """The tools a run reports to; `log(row)` sends one metrics.jsonl row to each."""

    def __init__(self, names, out: Path, config: dict):
        self.tools = []
        try:
            for name in names:
                self.tools.append(_CLASSES[name](Path(out), config, Path(out).name))
        except BaseException:
            self.close()
            raise

    def log(self, row: dict):
        if self.tools:
            step, values = scalars(row)
            for tool in self.tools:
                tool.log(step, values)

    def close(self):
        for tool in self.tools:
            tool.close()
        self.tools = []
