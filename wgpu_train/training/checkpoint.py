"""Training checkpoints: checkpoints/step-NNNNNN folders (adapter or model, AdamW moments, trainer state)
written atomically, rotated, found again, and restored into any engine."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError

CHECKPOINT_RE = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
ARRAYS_FILE = "trainer_arrays.npz"      # a trainer's own arrays (GRPO: the generation that later steps reuse)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root) -> list[Path]:
    """Complete checkpoints under `root` (step-NNNNNN folders holding trainer_state.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := CHECKPOINT_RE.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_checkpoint(path) -> Path:
    """A checkpoint folder, or the newest checkpoint of an output folder (or of a checkpoints/ folder)."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    if not p.is_dir():
        raise ConfigError(f"resume: {p} does not exist")
    found = list_checkpoints(p / "checkpoints") or list_checkpoints(p)
    if not found:
        raise ConfigError(f"resume: no checkpoint in {p} (expected {STATE_FILE} or checkpoints/step-NNNNNN)")
    return found[-1]


def write_optimizer_state(path, state: dict):
    """AdamW moments {name: (m, v)} as one safetensors file (name.exp_avg, name.exp_avg_sq)."""
    from wgpu_train.formats.safetensors import write_safetensors

    tensors = {}
    for k, (m, v) in state.items():
        tensors[k + ".exp_avg"] = np.asarray(m)
        tensors[k + ".exp_avg_sq"] = np.asarray(v)
    write_safetensors(path, tensors, metadata={"format": "wgpu-train-optimizer"})


def read_optimizer_state(path) -> dict:
    """The {name: (m, v)} that write_optimizer_state wrote."""
    from wgpu_train.formats.safetensors import read_safetensors

    tensors = read_safetensors(path)
    names = sorted(k[:-len(".exp_avg")] for k in tensors if k.endswith(".exp_avg"))
    for n in names:
        if n + ".exp_avg_sq" not in tensors:
            raise ConfigError(f"{path}: optimizer state lacks {n}.exp_avg_sq")
    return {n: (tensors[n + ".exp_avg"], tensors[n + ".exp_avg_sq"]) for n in names}


def _write(folder: Path, model, state: dict, arrays: dict):
    if arrays:
        np.savez(folder / ARRAYS_FILE, **arrays)
    if model.method == "lora":
        model.save_adapter(folder / "adapter", convert=False)   # as trained: a resume rebuilds a PiSSA residual
    else:
        model.save_pretrained(folder / "model")
    write_optimizer_state(folder / OPTIMIZER_FILE, model.engine.optimizer_state())
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def save_checkpoint(root, step: int, model, state: dict, keep: int = 0, protect=(), arrays=None) -> Path:
    """Write root/step-NNNNNN atomically (with `arrays`, name -> np.ndarray, in ARRAYS_FILE; read_arrays reads
    them back): everything goes into a hidden temporary folder beside it, which is
    renamed into place only when complete (and removed if writing fails, leaving any earlier checkpoint of
    that step as it was). Then keep only the newest `keep` checkpoints (0 keeps all) besides those named in
    `protect`, and clear leftovers of writes that a killed process never finished."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}"
    old = root / f".{name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(tmp, model, state, arrays or {})
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.rename(old, final)
        raise
    for p in root.iterdir():
        if p.name.startswith(".step-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
    if keep:
        for p in list_checkpoints(root)[:-keep]:
            if p.name not in protect:
                shutil.rmtree(p, ignore_errors=True)
    return final


def read_arrays(ckpt) -> dict:
    """The arrays a trainer saved with a checkpoint ({} when it saved none)."""
    path = Path(ckpt) / ARRAYS_FILE
    if not path.is_file():
        return {}
    try:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable checkpoint arrays ({e})") from None


def read_state(ckpt) -> dict:
    """The trainer_state.json of a checkpoint."""
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: unreadable checkpoint state ({e})") from None
    return state


def check_state(ckpt, state: dict, method: str, lora_config, base_dtype: str, embed_dtype: str,
                precision: str | None = None):
    """Refuse (ConfigError naming the setting) to continue a checkpoint, given its trainer_state.json, with
    another method, LoRA setting (`lora_config`; None: not checked), storage dtype of the base
    weights or precision (None: not yet known, checked again by restore()); runs on the state alone, before any
    model is loaded."""
    if state.get("method") != method:
        raise ConfigError(f"checkpoint {ckpt} was trained with method={state.get('method')}, not {method}")
    for key, now in (("base_dtype", base_dtype), ("embed_dtype", embed_dtype), ("precision", precision)):
        if now is not None and key in state and state[key] != now:
            raise ConfigError(f"checkpoint {ckpt} was trained over {key} {state[key]}, not {now}: pass "
                              f"--{key.replace('_', '-')} {state[key]}")
    if method != "lora" or lora_config is None:
        return
    then = state.get("lora") or {}
    for key, value in dataclasses.asdict(lora_config).items():
        if key not in then:
            continue
        if key == "target_modules":
            same, shown, wanted = list(then[key]) == list(value), ",".join(then[key]), ",".join(value)
        else:   # as JSON holds it (tuples are lists there)
            same, shown, wanted = then[key] == json.loads(json.dumps(value)), then[key], value
        if not same:
            raise ConfigError(f"checkpoint {ckpt} has LoRA {key}={shown}, the config says {wanted}")


def read_trainable(ckpt, method: str) -> dict:
    """A checkpoint's trainable tensors, keyed as engine.trainable() keys them."""
    from wgpu_train.adapters.files import read_adapter
    from wgpu_train.formats.safetensors import read_safetensors

    ckpt = Path(ckpt)
    if method != "lora":
        return read_safetensors(ckpt / "model" / "model.safetensors")
    tensors = {}
    for k, v in read_adapter(ckpt / "adapter")[1].items():
        k = k.replace(".default.weight", ".weight").removeprefix("base_model.model.")
        if ".lora_" in k:          # path.lora_A, path.lora_B; a modules_to_save copy keeps its weight name
            k = k.removesuffix(".weight")
        tensors[k] = v
    return tensors


def restore(ckpt, model, state: dict, lora_config=None):
    """Put a checkpoint's trainable tensors, AdamW moments and dropout counter into `model`'s engine.

    The model must already be set up the same way (add_lora with `lora_config`, or set_full_finetune, and
    the base weights stored as in the run that saved it); a different method, LoRA setting or storage
    dtype raises ConfigError naming it (see check_state).
    """
    ckpt = Path(ckpt)
    engine = model.engine
    check_state(ckpt, state, model.method, lora_config, engine.base_dtype, engine.embed_dtype, engine.precision)
    tensors = read_trainable(ckpt, model.method)
    current = {k: tuple(v.shape) for k, v in engine.trainable().items()}
    problems = [f"missing {k}" for k in current if k not in tensors]
    problems += [f"{k} has shape {tuple(tensors[k].shape)}, expected {s}"
                 for k, s in current.items() if k in tensors and tuple(tensors[k].shape) != s]
    moments = read_optimizer_state(ckpt / OPTIMIZER_FILE)
    problems += [f"optimizer state for unknown tensor {k}" for k in moments if k not in current]
    if problems:
        raise ConfigError(f"checkpoint {ckpt} does not fit the model: {'; '.join(problems[:3])}")
    engine.set_trainable({k: tensors[k] for k in current})
    engine.load_optimizer_state(moments)
    engine.load_state_dict(state.get("engine", state))   # older checkpoints kept the dropout state at the top
