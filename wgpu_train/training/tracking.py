"""Experiment tracking (--report-to): the rows of metrics.jsonl (train, validation, exact match, profile) sent
to TensorBoard, Weights & Biases, trackio or MLflow as well, each an optional extra imported only when asked."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from wgpu_train.errors import ConfigError

log = logging.getLogger("wgpu_train")

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
    def __init__(self, out: Path, config: dict, name: str, start_step: int = 0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            _missing("tensorboard")
        # a resumed run first drops what the earlier one logged after its checkpoint (as metrics.jsonl does)
        self.writer = SummaryWriter(logdir=str(out / "runs"), purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("config", "\n".join(f"{k}: {v}" for k, v in sorted(config.items())), 0)

    def log(self, step: int, values: dict):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict, name: str, start_step: int = 0):
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
    def __init__(self, out: Path, config: dict, name: str, start_step: int = 0):
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
    def __init__(self, out: Path, config: dict, name: str, start_step: int = 0):
        try:
            import mlflow
        except ImportError:
            _missing("mlflow")
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):       # a local store beside the run unless told otherwise
            try:
                import sqlalchemy
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
    """The tools a run reports to; `log(row)` sends one metrics.jsonl row to each. A tool that cannot start is
    one ConfigError line; one that fails later is dropped with a warning (the run goes on: metrics.jsonl has
    every row)."""

    def __init__(self, names, out: Path, config: dict, start_step: int = 0):
        self.tools = []
        try:
            for name in names:
                try:
                    self.tools.append((name, _CLASSES[name](Path(out), config, Path(out).name, start_step)))
                except ConfigError:
                    raise
                except Exception as e:  # noqa: BLE001 - the tool's own errors (bad URI, login, ...)
                    raise ConfigError(f"--report-to {name}: it could not start ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
        except BaseException:
            self.close()
            raise

    def log(self, row: dict):
        if self.tools:
            step, values = scalars(row)
            for name, tool in list(self.tools):
                try:
                    tool.log(step, values)
                except Exception as e:  # noqa: BLE001
                    log.warning("wgpu-train: --report-to %s failed (%s: %s); no more rows go there", name,
                                type(e).__name__, e)
                    self.tools.remove((name, tool))

    def close(self):
        for name, tool in self.tools:
            try:
                tool.close()
            except Exception as e:  # noqa: BLE001
                log.warning("wgpu-train: --report-to %s did not close cleanly (%s)", name, e)
        self.tools = []
