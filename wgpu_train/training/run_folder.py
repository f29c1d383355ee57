"""The run folder policy: which folder a --resume path belongs to, the settings a resumed run takes from it,
and what shows that a folder already holds a run (so that a new run refuses it)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .checkpoint import list_checkpoints
from .errors import ConfigError

RUN_FILES = ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", "model.safetensors",
             "summary.json", "train_config.json")


def earlier_run(out) -> list[str]:
    """What shows that the folder `out` holds a run: the RUN_FILES present, and "checkpoints/" when that
    folder is not empty; sorted, empty when there is none (unrelated files do not count)."""
    out = Path(out)
    try:
        found = [name for name in RUN_FILES if (out / name).exists()]
        if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
            found.append("checkpoints/")
    except OSError as e:
        raise ConfigError(f"cannot read the output folder {out}: {e.strerror or e}") from None
    return sorted(found)


def run_folder(resume) -> Path:
    """The output folder of the run a --resume path belongs to: RUN for RUN, RUN/checkpoints and
    RUN/checkpoints/step-NNNNNN (a path named checkpoints that holds a checkpoints/ folder is a run folder)."""
    path = Path(resume)
    if path.name == "checkpoints" and not list_checkpoints(path / "checkpoints"):
        return path.parent
    return path.parent.parent if path.parent.name == "checkpoints" else path


# say how a run is started, not what it is (a continued adapter's settings are recorded as the LoRA options)
INVOCATION_FIELDS = ("out", "resume", "overwrite", "no_progress", "adapter_path", "ray_address")


def run_settings(resume) -> dict:
    """The settings of the run that a --resume path continues, for the command line to fill the options it
    was not given: the run folder's train_config.json as that run resolved it (model and data folders,
    recipe values, dtypes), restricted to TrainConfig fields and without INVOCATION_FIELDS. {} when there
    is no such file; ConfigError when it cannot be read."""
    path = run_folder(resume) / "train_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable run settings ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: unreadable run settings (not a JSON object)")
    from .train_config import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)} - set(INVOCATION_FIELDS)
    return {k: v for k, v in raw.items() if k in names}


def same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
