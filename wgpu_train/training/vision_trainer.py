"""`finetune` on images (Gemma 3, the NumPy engine): TRL's vision records read from a JSONL file (image paths
relative to it), LoRA on the language model trained with the tower frozen, in rows of whole records (no packing),
train_config.json, metrics.jsonl, the adapter and a summary written. Only the TrainConfig fields in HONOURED are
used; any other set away from its default (validation, checkpoints, resume, packing, the other objectives) is
refused in one line for now."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from wgpu_train.data.vision_records import ImageSpan, tokenize_vision_dataset
from wgpu_train.engines.vision_model import load_vision_model
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training.config import TrainConfig
from wgpu_train.training.run_files import RunFiles
from wgpu_train.training.run_folder import resolve_run
from wgpu_train.training.schedule import LRSchedule

log = logging.getLogger("wgpu_train")

# the TrainConfig fields a run with images uses; any other must keep its default (docs/guides/vision.md lists them)
HONOURED = ("model", "data", "out", "overwrite", "backend", "base_dtype", "embed_dtype", "precision", "lora_rank",
            "lora_alpha", "lora_dropout", "lora_targets", "rslora", "loraplus_lr_ratio", "lora_layers",
            "lora_rank_pattern", "lora_alpha_pattern", "epochs", "max_steps", "batch_size", "grad_accum", "lr",
            "lr_schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "adam_eps", "max_grad_norm",
            "max_seq_len", "seed", "no_progress", "log_every")


def is_vision_data(path) -> bool:
    """Whether a data file holds TRL's vision records: a JSONL (or .json array) file whose first record has an
    `images` (or `image`) field."""
    path = Path(path) if path else None
    if path is None or not path.is_file() or path.suffix not in (".jsonl", ".json"):
        return False
    with path.open(encoding="utf-8") as f:
        text = f.read(1 << 20).lstrip()
    first = text[1:] if text.startswith("[") else text
    try:
        record, _ = json.JSONDecoder().raw_decode(first.lstrip())
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and ("images" in record or "image" in record)


def read_vision_records(path) -> list[dict]:
    """The records of a vision JSONL (or JSON array) file, each image path made relative to the file's folder."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON: {e}") from None
    for row in rows:
        if isinstance(row, dict) and "images" not in row and "image" in row:
            row["images"] = [row.pop("image")]
        if isinstance(row, dict) and isinstance(row.get("images"), list):
            row["images"] = [str(path.parent / im) if isinstance(im, str) else im for im in row["images"]]
    return rows


def _check_config(config: TrainConfig):
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name not in HONOURED and getattr(config, field.name) != getattr(defaults, field.name):
            raise ConfigError(f"--{field.name.replace('_', '-')} is not supported with images yet (they take only "
                              f"the options docs/guides/vision.md lists)")
    if config.backend not in ("auto", "numpy"):
        raise ConfigError(f"images train on the NumPy engine only for now (--backend numpy), not {config.backend}")


def finetune_vision(config: TrainConfig) -> dict:
    """A LoRA run over a vision dataset as `config` says; returns the summary (also written to summary.json)."""
    _check_config(config)
    if not config.model or not (Path(config.model) / "config.json").is_file():
        raise ConfigError(f"--model {config.model}: images need a local Gemma 3 model folder (config.json)")
    folders = resolve_run(config.out, None, config.overwrite)
    if folders.earlier:
        raise ConfigError(f"{folders.out} holds another run ({folders.earlier[0]}); --overwrite replaces it")
    started = time.perf_counter()
    vm = load_vision_model(config.model, backend="numpy", base_dtype=config.base_dtype,
                           embed_dtype=config.embed_dtype, precision=config.precision)
    tok = load_tokenizer(config.model)
    vc = vm.vision
    span = ImageSpan.from_ids(tok, vc.boi_token_id, vc.image_token_id, vc.eoi_token_id, vc.mm_tokens_per_image)
    examples, stats = tokenize_vision_dataset(tok, read_vision_records(config.data), span, config.max_seq_len)
    if not examples:
        raise DataError(f"{config.data}: no record has a response token left to train on")
    if stats.n_cut_in_image:
        log.warning("wgpu-train: %d rows dropped: --max-seq-len %d cuts them inside or before an image",
                    stats.n_cut_in_image, config.max_seq_len)
    log.info("wgpu-train: %d records with %d images on the NumPy engine (the WebGPU engine does not run images "
             "yet)", stats.n_examples, sum(len(e.images) for e in examples))
    vm.model.add_lora(config.lora_config(vm.model.config.num_hidden_layers), seed=config.seed)
    files = RunFiles(folders, True, lambda line: log.info("wgpu-train: %s", line))
    files.prepare(config.to_dict() | dict(out=str(folders.out), data=str(config.data), data_format="vision"), False)
    files.open("none", config.to_dict(), None)
    try:
        summary = _train(config, vm, examples, stats, files)
    except BaseException:
        files.discard()
        raise
    summary["seconds"] = round(time.perf_counter() - started, 3)
    files.write_outputs(vm, "lora", summary, None)
    files.close()
    return summary


def _train(config: TrainConfig, vm, examples, stats, files: RunFiles) -> dict:
    """The steps of the run, each a row of metrics.jsonl; the summary (its time left to the caller)."""
    rng = np.random.default_rng(config.seed)
    per_step = config.batch_size * config.grad_accum
    steps = config.max_steps or config.epochs * math.ceil(len(examples) / per_step)
    warmup = config.warmup_steps
    if warmup and warmup >= steps:         # as the text trainer: the last step trains at --lr
        warmup = steps - 1
        log.info("wgpu-train: warmup_steps %d is not below the run's %d steps: warming up over %d, so that the "
                 "last step trains at --lr", config.warmup_steps, steps, warmup)
    schedule = LRSchedule(config.lr, config.lr_schedule, warmup, steps)
    order, losses = [], []
    for step in range(1, steps + 1):
        while len(order) < per_step:
            order += list(rng.permutation(len(examples)))
        rows, order = [examples[i] for i in order[:per_step]], order[per_step:]
        micro = [rows[i:i + config.batch_size] for i in range(0, per_step, config.batch_size)]
        lr = schedule.lr_at(step)
        loss_sum, count, norm, _ = vm.train_step(micro, config.optimizer_params(lr), step)
        losses.append(loss_sum / max(count, 1))
        files.write_row({"step": step, "epoch": step * per_step / len(examples), "loss": float(losses[-1]),
                         "lr": lr, "grad_norm": float(norm), "tokens": int(count)})
        if step % config.log_every == 0 or step in (1, steps):
            log.info("step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e", step, steps, losses[-1], norm, lr)
    return {"method": "lora", "steps": steps, "examples": stats.n_examples,
            "rows_cut_in_image": stats.n_cut_in_image,
            "rows_dropped": stats.n_dropped, "rows_truncated": stats.n_truncated, "first_loss": losses[0],
            "last_loss": losses[-1], "images": sum(len(e.images) for e in examples), "output": str(files.out)}
