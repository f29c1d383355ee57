"""The steps of a Trainer's setup that read only what they are given (Trainer.setup calls them, in order): the
model a run trains and its LoRA setting (resolve_model), a supervised run's data (read_examples), the memory
estimate of its largest micro-batch (estimate_run_memory), and the lines that describe the run in the log."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.adapters.layout import describe_layout, describe_targets, lora_options, model_targets
from wgpu_train.engines.resources import count_trainable, estimate_memory, format_bytes
from wgpu_train.engines.shared.quant import describe_packed
from wgpu_train.errors import ConfigError
from wgpu_train.formats import hub
from wgpu_train.models.config import ModelConfig
from wgpu_train.training.tower_lora import check_continued, check_tower_targets, language_adapter
from wgpu_train.training.config import PAD_MULTIPLE, TrainConfig, default_model_dir, default_vision_model_dir


@dataclass
class ModelChoice:
    """The model a run trains, resolved from its config (resolve_model)."""

    config: TrainConfig          # the config as it trains: base_dtype, LoRA targets and layers resolved (a resume
    #                              reads them back)
    continued_from: Path | None  # the adapter folder the run starts from (adapter_path)
    name: str | None             # the model as given: a folder or a hub id (else the continued adapter's base)
    folder: Path                 # its folder (a hub id resolved; the embedded model by default)
    model_cfg: ModelConfig
    lora: LoraConfig | None      # the LoRA setting, None for full fine-tuning
    base_dtype: str
    embed_dtype: str


def resolve_model(cfg: TrainConfig, base_dtype, embed_dtype) -> ModelChoice:
    """The model of cfg (a folder or hub id, else the continued adapter's base, else the embedded one), its
    storage dtypes (None: base_dtype auto, as the checkpoint stores its weights) and its LoRA setting; options
    that contradict a continued adapter, and targets or layers the model lacks, refused before it loads."""
    from wgpu_train.adapters.files import adapter_base_model, adapter_base_name, adapter_folder, read_adapter

    continued_from = adapter_folder(cfg.adapter_path)      # None without adapter_path
    name = cfg.model or (adapter_base_name(continued_from) if continued_from else None)
    folder = (hub.resolve(cfg.model, "model") if cfg.model else
              (continued_from and adapter_base_model(continued_from))
              or (default_vision_model_dir() if cfg.images_demo else default_model_dir()))
    if cfg.images_demo and (cfg.data or continued_from or folder.resolve() != default_vision_model_dir().resolve()):
        raise ConfigError("--images-demo trains the embedded vision model on its own pictures: leave out --model, "
                          "--data and --adapter-path")
    model_cfg = ModelConfig.from_folder(folder)
    check_tower_targets(cfg, folder)
    if base_dtype is None:
        base_dtype, embed_dtype = cfg.storage_dtypes(model_cfg.checkpoint_dtype)
    if cfg.base_dtype != base_dtype:
        cfg = dataclasses.replace(cfg, base_dtype=base_dtype)
    if not continued_from and cfg.lora_targets != model_targets(cfg.lora_targets, model_cfg):
        cfg = dataclasses.replace(cfg, lora_targets=model_targets(cfg.lora_targets, model_cfg))
    lora = cfg.lora_config(model_cfg.num_hidden_layers) if cfg.method == "lora" else None
    if continued_from:
        lora = cfg.continued_lora(read_adapter(language_adapter(continued_from), model_cfg)[0], model_cfg)
        cfg = dataclasses.replace(cfg, **lora_options(lora))
    elif lora and cfg.lora_layers_last():          # as the layers it chose
        cfg = dataclasses.replace(cfg, lora_layers=lora_options(lora)["lora_layers"])
    if lora:
        lora.modules(model_cfg)
    return ModelChoice(cfg, continued_from, name, folder, model_cfg, lora, base_dtype, embed_dtype)


@dataclass
class Examples:
    """A supervised run's data, tokenized (read_examples)."""

    tokenizer: object
    splits: object               # data.sources' resolved splits (the test split is kept as records)
    max_seq_len: int             # --max-seq-len, at most the model's positions
    train: list
    valid: list
    n_skipped: int               # invalid lines, then refused chats
    truncated: int
    dropped: int                 # no response token left
    cut_in_image: int = 0        # records with images: rows dropped, cut inside or before an image
    images: int = 0              # records with images: the images of train and valid


def read_examples(model_dir: Path, data_path, cfg: TrainConfig, model_cfg: ModelConfig, log) -> Examples:
    """The tokenizer of model_dir and the data of data_path tokenized for a supervised run (records with images:
    read_image_examples); ConfigError for a tokenizer the model does not belong to, or early stopping without
    validation data; one line logged."""
    from wgpu_train.data.sources import resolve_data
    from wgpu_train.data.tokenize import tokenize_dataset
    from wgpu_train.data.vision_records import is_vision_data
    from wgpu_train.formats.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    images = cfg.images_demo or is_vision_data(data_path)
    check_tower_targets(cfg, model_dir, bool(images))
    check_continued(cfg, bool(images))
    s = None if images else resolve_data(data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid, cfg.columns)
    max_seq_len = min(cfg.max_seq_len, model_cfg.max_position_embeddings)
    if max_seq_len < cfg.max_seq_len:
        log(f"max_seq_len: using the model's {max_seq_len} positions ({cfg.max_seq_len} asked)")
    if images:
        data = read_image_examples(model_dir, data_path, cfg, tokenizer, max_seq_len)
    else:
        args = (max_seq_len, not cfg.no_chat_template, cfg.train_on_last_turn)
        train, train_stats = tokenize_dataset(tokenizer, s.train, *args, skip_invalid=cfg.skip_invalid)
        valid, valid_stats = tokenize_dataset(tokenizer, s.valid, *args, skip_invalid=cfg.skip_invalid)
        data = Examples(tokenizer, s, max_seq_len, train, valid, s.n_skipped + train_stats.n_skipped
                        + valid_stats.n_skipped, train_stats.n_truncated + valid_stats.n_truncated,
                        train_stats.n_dropped + valid_stats.n_dropped)
    train, valid, s = data.train, data.valid, data.splits
    top = max((int(e.input_ids.max()) for e in train + valid), default=0)
    if top >= model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer produces token id {top} but the model has vocab_size "
                          f"{model_cfg.vocab_size}: tokenizer and model do not belong together")
    if cfg.early_stop_patience and not valid:
        raise ConfigError("early_stop_patience needs validation data (a validation split, or valid_split > 0)")
    log(f"data: {s.files.get('train')} ({s.format} format): {len(train)} train, "
        f"{len(valid)} valid{' (held out)' if s.valid_held_out else ''}, {len(s.test)} test"
        + (f"; {data.n_skipped} invalid lines skipped" if data.n_skipped else "")
        + (f"; {data.truncated} truncated to {max_seq_len} tokens" if data.truncated else "")
        + (f"; {data.dropped} dropped (no response token left)" if data.dropped else "")
        + (f"; {data.cut_in_image} dropped (--max-seq-len {max_seq_len} cuts them inside or before an image)"
           if data.cut_in_image else "")
        + (f"; {data.images} images" if data.images else ""))
    return data


def read_image_examples(model_dir: Path, data_path, cfg: TrainConfig, tokenizer, max_seq_len: int) -> Examples:
    """TRL's vision records (data/vision_records.py; the embedded image demo's with images_demo) of a Gemma 3 or SmolVLM
    model folder, split and tokenized: each image's
    placeholder expanded as the processor expands it, a row cut inside or before an image dropped and counted.
    The options that do not apply to them refused in one line."""
    import json

    from wgpu_train.data.vision_demo import image_demo_splits
    from wgpu_train.data.vision_records import model_image_span, tokenize_vision_dataset, vision_splits
    from wgpu_train.models.vision import VisionConfig

    for flag, value in (("--pack", cfg.pack), ("--train-on-last-turn", cfg.train_on_last_turn),
                        ("--no-chat-template", cfg.no_chat_template), ("--columns", cfg.columns)):
        if value:
            raise ConfigError(f"{flag} is not supported with images yet")
    where = Path(model_dir) / "config.json"
    vc = VisionConfig.from_config(json.loads(where.read_text()), str(where))
    span = model_image_span(tokenizer, vc, model_dir)
    s = image_demo_splits() if cfg.images_demo else vision_splits(data_path, cfg.valid_split, cfg.seed)
    (train, ts), (valid, vs) = (tokenize_vision_dataset(tokenizer, r, span, max_seq_len) for r in (s.train, s.valid))
    return Examples(tokenizer, s, max_seq_len, train, valid, 0, ts.n_truncated + vs.n_truncated,
                    ts.n_dropped + vs.n_dropped, ts.n_cut_in_image + vs.n_cut_in_image,
                    sum(len(e.images) for e in train + valid))


def check_tokens_per_batch(cfg: TrainConfig, examples: list, max_seq_len: int):
    """--max-tokens-per-batch at least the longest training row (a packed row: max_seq_len), else one line."""
    longest = max_seq_len if cfg.pack else max(e.input_ids.size for e in examples)
    if cfg.max_tokens_per_batch and cfg.max_tokens_per_batch < longest:
        raise ConfigError(f"max_tokens_per_batch ({cfg.max_tokens_per_batch}) is below the longest training "
                          f"{'row' if cfg.pack else 'sample'} ({longest} tokens): raise it or lower --max-seq-len")


def largest_micro_batch(cfg: TrainConfig, examples: list, max_seq_len: int, micro_batch_rows: int) -> tuple:
    """(rows, tokens per row) of the largest micro-batch a run forms: micro_batch_rows rows of the longest of
    `examples` (max_seq_len when packing), padded to PAD_MULTIPLE."""
    longest = max((e.input_ids.size for e in examples), default=1)
    length = max_seq_len if cfg.pack else min(max_seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
    rows = micro_batch_rows if not cfg.max_tokens_per_batch else max(1, cfg.max_tokens_per_batch // length)
    return rows, length


def estimate_run_memory(cfg: TrainConfig, model_cfg: ModelConfig, lora, examples: list, max_seq_len: int,
                        micro_batch_rows: int, engine, base_dtype, embed_dtype, precision) -> dict:
    """resources.estimate_memory for the largest micro-batch a run forms (largest_micro_batch); plus that batch
    and length. On a WebGPU device its max storage binding sizes the weight chunks and the loss head's logits, as
    the engine does."""
    rows, length = largest_micro_batch(cfg, examples, max_seq_len, micro_batch_rows)
    est = estimate_memory(model_cfg, rows, length, lora, cfg.method, base_dtype, embed_dtype,
                          cfg.gradient_checkpointing, engine.max_binding, precision=precision)
    return {**est, "batch": rows, "length": length}


def describe_model(model_dir, model_cfg: ModelConfig, engine, lora, n_params: int, base_dtype, embed_dtype,
                   base_weight_bytes: int) -> str:
    """The log line of the model a run trains: where, on what, which parameters (an MoE model's: how many sit in
    its experts, and which expert tensors LoRA takes), its base weights' storage."""
    in_experts = count_trainable(model_cfg, lora, experts_only=True) if model_cfg.moe is not None else None
    return (f"model: {model_dir} ({model_cfg.label}) on {engine.name}, {engine.device_description}; "
            + (f"LoRA r={lora.r} alpha={lora.alpha:g} on {describe_targets(lora, model_cfg)}"
               + describe_layout(lora) if lora
               else "full fine-tuning") + f", {n_params:,} trainable parameters"
            + (f" ({in_experts:,} in the experts)" if in_experts is not None else "") + "; base weights "
            f"{base_dtype} (embedding {embed_dtype}{describe_packed(model_cfg.packed_experts, base_dtype)}), "
            f"{base_weight_bytes:,} bytes"
            + (" on a GPU (the NumPy engine holds float32 copies)" if engine.name == "numpy" else ""))


def describe_training(cfg: TrainConfig, total_steps: int, steps_per_epoch: int, accum: int, workers: int,
                      step: int, resumed_from) -> str:
    """The log line of a run's steps: how many, of what, over how many workers, from where."""
    return (f"training: {total_steps} steps"
            + ("" if cfg.max_steps else f" ({cfg.epochs} epochs of {steps_per_epoch})")
            + (f", {cfg.batch_size * accum} samples per step"
               + (f" ({accum} micro-batches of {cfg.batch_size})" if accum > 1 else "")
               if not cfg.max_tokens_per_batch else
               f", {accum} micro-batch{'es' if accum > 1 else ''} of up to "
               f"{cfg.max_tokens_per_batch} tokens per step")
            + (f" over {workers} workers" if workers > 1 else "")
            + (", gradient checkpointing" if cfg.gradient_checkpointing else "")
            + (f", resuming at step {step} from {resumed_from}" if resumed_from else ""))


def describe_memory(est: dict) -> str:
    """The log line of a run's memory estimate (estimate_run_memory's)."""
    return (f"GPU memory of training (estimate, largest micro-batch {est['batch']} x {est['length']}): "
            f"{format_bytes(est['total'])}: base weights {format_bytes(est['weights'])}, trainable state "
            f"{format_bytes(est['trainable_state'])}, activations {format_bytes(est['activations'])}, logits "
            f"{format_bytes(est['logits'])}")
