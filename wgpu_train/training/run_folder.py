"""The run folder policy, resolved in one place (RunFolders): where a run writes, which run a --resume path
belongs to and whether the run continues there, what shows that a folder already holds a run (so that a new
run refuses it), and the settings a run recorded (train_config.json)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.errors import ConfigError

DEFAULT_OUT = "wgpu-train-out"
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


def recorded_settings(resume) -> dict:
    """The train_config.json of the run that a --resume path belongs to, as that run resolved it (model and
    data folders, recipe values, dtypes); {} when there is no such file, ConfigError when it cannot be read.
    (config.resumed_settings keeps what a resumed run takes from it.)"""
    path = run_folder(resume) / "train_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable run settings ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: unreadable run settings (not a JSON object)")
    return raw


def output_folder(out, resume) -> Path:
    """The output folder: `out`, else the folder of the run that `resume` continues, else DEFAULT_OUT."""
    if out is not None:
        return Path(out)
    return run_folder(resume) if resume else Path(DEFAULT_OUT)


@dataclass(frozen=True)
class RunFolders:
    """The folders of one run, resolved once (resolve_run)."""

    out: Path                   # where the run writes
    resumed: Path | None        # the folder of the run that --resume continues
    in_place: bool              # the run continues that run in its own folder
    earlier: tuple              # what shows that `out` holds another run (see earlier_run); () with overwrite


def resolve_run(out, resume, overwrite: bool) -> RunFolders:
    """The folders of a run given its out, resume and overwrite settings."""
    folder = output_folder(out, resume)
    resumed = run_folder(resume) if resume else None
    in_place = resumed is not None and same_folder(folder, resumed)
    earlier = () if in_place or overwrite else tuple(earlier_run(folder))
    return RunFolders(folder, resumed, in_place, earlier)


def same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
