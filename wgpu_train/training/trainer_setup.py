"""The Trainer's setup (TrainerSetup, a part of trainer.Trainer): the model, tokenizer and data read, LoRA attached
or full fine-tuning enabled, a resume's progress and tensors restored, the output folder prepared, the memory
estimated and the run described in the log."""
from __future__ import annotations

import dataclasses
import json
import shutil

from wgpu_train.formats import hub
from wgpu_train.training import tracking
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.models.config import ModelConfig
from wgpu_train.errors import ConfigError
from wgpu_train.adapters.layout import describe_layout, lora_options, model_targets
from wgpu_train.engines.resources import base_weight_bytes, count_trainable, estimate_memory, format_bytes
from wgpu_train.training.schedule import LRSchedule
from wgpu_train.training.config import PAD_MULTIPLE, default_data_dir, default_model_dir


class TrainerSetup:
    """train.Trainer's setup (a mixin: it sets the Trainer's model, data, stream and schedule)."""

    def setup(self):
        """Read the data and the model, attach LoRA (or enable full fine-tuning), and resume if asked."""
        from wgpu_train.engines.backend_choice import choose_backend

        from wgpu_train.adapters.files import adapter_base_model, adapter_base_name, adapter_folder, read_adapter

        cfg = self.config
        tracking.require(tracking.parse_report_to(cfg.report_to))
        self.continued_from = adapter_folder(cfg.adapter_path)      # None without adapter_path
        # the model as given (a folder or hub id), else the continued adapter's base, else the embedded one
        self.model_name = cfg.model or (adapter_base_name(self.continued_from) if self.continued_from else None)
        self.model_dir = (hub.resolve(cfg.model, "model") if cfg.model else
                          (self.continued_from and adapter_base_model(self.continued_from)) or default_model_dir())
        self.data_path = cfg.data if cfg.data else default_data_dir()
        self.eval_generate = cfg.data is None if cfg.eval_generate is None else bool(cfg.eval_generate)
        model_cfg = ModelConfig.from_folder(self.model_dir)
        if self.base_dtype is None:           # base_dtype auto: as the checkpoint stores its weights
            self.base_dtype, self.embed_dtype = cfg.storage_dtypes(model_cfg.checkpoint_dtype)
        if cfg.base_dtype != self.base_dtype:
            self.config = cfg = dataclasses.replace(cfg, base_dtype=self.base_dtype)     # recorded, for a resume
        if not self.continued_from and cfg.lora_targets != model_targets(cfg.lora_targets, model_cfg):
            self.config = cfg = dataclasses.replace(       # recorded as trained, for a resume
                cfg, lora_targets=model_targets(cfg.lora_targets, model_cfg))
        lora = cfg.lora_config(model_cfg.num_hidden_layers) if cfg.method == "lora" else None
        if self.continued_from:         # before anything is read: options that contradict it are refused
            lora = cfg.continued_lora(read_adapter(self.continued_from, model_cfg)[0], model_cfg)
            self.config = cfg = dataclasses.replace(     # recorded as trained: a resume rebuilds this adapter
                cfg, **lora_options(lora))
        elif lora and cfg.lora_layers_last():          # recorded as the layers it chose, for a resume
            self.config = cfg = dataclasses.replace(cfg, lora_layers=lora_options(lora)["lora_layers"])
        if lora:
            lora.modules(model_cfg)      # targets or layers the model lacks: refused before it loads
        choice = choose_backend(cfg.backend, self.device, model_cfg, self.base_dtype, self.embed_dtype,
                                self.precision or "auto", (cfg.batch_size, cfg.max_seq_len))
        self.backend, self.device, self.backend_reason = choice.engine, choice.device, choice.reason
        if cfg.backend == "auto":
            self.log(f"backend: {self.backend} ({self.backend_reason})")
        self._read_data(model_cfg)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = self.max_seq_len if cfg.pack else max(e.input_ids.size for e in self.train_examples)
        if cfg.max_tokens_per_batch and cfg.max_tokens_per_batch < longest:
            raise ConfigError(f"max_tokens_per_batch ({cfg.max_tokens_per_batch}) is below the longest training "
                              f"{'row' if cfg.pack else 'sample'} ({longest} tokens): raise it or lower --max-seq-len")
        # micro-batches per step: grad_accum on each of num_workers; a resumed run keeps its checkpoint's (the
        # same global batch, whatever number of workers made it or continues it)
        accum = self.micro_per_step = int(self._resume[1].get("micro_batches", cfg.grad_accum * self.workers)
                                          if self._resume else cfg.grad_accum * self.workers)
        self.stream = self._make_stream(accum)
        self.steps_per_epoch = len(self.stream)
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        warmup = cfg.warmup_steps
        if warmup and warmup >= self.total_steps:      # e.g. the recipe's warmup in a run cut short by --max-steps
            warmup = self.total_steps - 1
            self.log(f"warmup_steps {cfg.warmup_steps} is not below the run's {self.total_steps} steps: warming up "
                     f"over {warmup}, so that the last step trains at --lr")
        self.schedule = LRSchedule(cfg.lr, cfg.lr_schedule, warmup, self.total_steps)
        if self._resume:
            self._resume_progress(self._resume[1])
            if self.done():
                raise ConfigError(f"the run in {self.folders.resumed} already finished at step {self.step}; "
                                  f"raise --max-steps or --epochs to train further")

        self.model = self.placement.load(self, model_cfg)
        if hub.is_hub_id(self.model_name):   # adapters name the hub id as their base, as PEFT writes them
            self.model.name_or_path = self.model_name
        if self.continued_from:
            self.model.load_adapter(self.continued_from, dropout=lora.dropout, seed=cfg.seed)
            self.log(f"adapter: continuing {self.continued_from} (fresh optimizer state)")
        elif lora:
            self.model.add_lora(lora, seed=cfg.seed)
        else:
            self.model.set_full_finetune()
        self.model.set_gradient_checkpointing(cfg.gradient_checkpointing)
        self.engine = self.model.engine
        self.precision_reason = (self.engine.precision_reason if cfg.precision.resolved or self.precision is None
                                 else "auto: as the resumed checkpoint trained")
        self.precision = self.engine.precision
        if cfg.precision != self.precision:
            self.config = cfg = dataclasses.replace(cfg, precision=self.precision)     # recorded, for a resume
        self._model_ready()
        # as the WebGPU engine allocated them; the NumPy engine holds float32 copies: the planned device bytes
        self.base_weight_bytes = int(self.engine.base_weight_bytes
                                     or base_weight_bytes(model_cfg, self.base_dtype, self.embed_dtype)["total"])
        n_params = count_trainable(model_cfg, lora)
        self.log(f"model: {self.model_dir} ({model_cfg.label}) on {self.engine.name}, "
                 f"{self.engine.device_description}; "
                 + (f"LoRA r={lora.r} alpha={lora.alpha:g} on {','.join(lora.targets_in(model_cfg))}"
                    + describe_layout(lora) if lora
                    else "full fine-tuning") + f", {n_params:,} trainable parameters; base weights "
                 f"{self.base_dtype} (embedding {self.embed_dtype}), {self.base_weight_bytes:,} bytes"
                 + (" on a GPU (the NumPy engine holds float32 copies)" if self.engine.name == "numpy" else ""))
        self.log(f"precision: {self.precision} ({self.precision_reason})"
                 + ("; dynamic loss scaling" if self.engine.loss_scaler is not None else ""))
        if self._resume:                # before anything is written: a checkpoint that does not fit is refused
            self._resume_tensors(*self._resume)
        self._prepare_out()
        self.log(f"training: {self.total_steps} steps"
                 + ("" if cfg.max_steps else f" ({cfg.epochs} epochs of {self.steps_per_epoch})")
                 + (f", {cfg.batch_size * accum} samples per step"
                    + (f" ({accum} micro-batches of {cfg.batch_size})" if accum > 1 else "")
                    if not cfg.max_tokens_per_batch else
                    f", {accum} micro-batch{'es' if accum > 1 else ''} of up to "
                    f"{cfg.max_tokens_per_batch} tokens per step")
                 + (f" over {self.workers} workers" if self.workers > 1 else "")
                 + (", gradient checkpointing" if cfg.gradient_checkpointing else "")
                 + (f", resuming at step {self.step} from {self.resumed_from}" if self.resumed_from else ""))
        self.memory_estimate = self._estimate_memory(model_cfg, lora)
        est = self.memory_estimate
        self.log(f"GPU memory of training (estimate, largest micro-batch {est['batch']} x {est['length']}): "
                 f"{format_bytes(est['total'])}: base weights {format_bytes(est['weights'])}, trainable state "
                 f"{format_bytes(est['trainable_state'])}, activations {format_bytes(est['activations'])}, logits "
                 f"{format_bytes(est['logits'])}")
        self.placement.estimated(self, model_cfg, lora, est)
        return self

    def _model_ready(self):
        """Called once the model holds its starting weights, before a resume restores a checkpoint's."""

    def _make_stream(self, accum: int):
        """The resumable stream of the steps' batches: batch_size * accum samples each."""
        from wgpu_train.data.batching import BatchStream

        cfg = self.config
        return BatchStream(self.train_examples, cfg.batch_size * accum, cfg.seed, pack=cfg.pack,
                           max_seq_len=self.max_seq_len, pad_id=self.pad_id, pad_to_multiple=PAD_MULTIPLE,
                           max_tokens=cfg.max_tokens_per_batch, micro_batches=accum)

    def _step_shares(self) -> tuple[int, str]:
        """(the fewest rows a step of this epoch holds, what a row is): the units processes share a step by."""
        return min(self.rows_in(b) for b in self.stream.epoch_batches(self.stream.epoch)), "sample row(s)"

    def _micro_batch_rows(self) -> int:
        """The rows of a full micro-batch of --batch-size samples."""
        return self.config.batch_size

    def largest_micro_batch(self) -> tuple[int, int]:
        """(rows, tokens per row) of the largest micro-batch this run forms: its rows of the longest example
        (max_seq_len when packing), padded to PAD_MULTIPLE; known once the data is read."""
        cfg = self.config
        longest = max((e.input_ids.size for e in self.train_examples + self.valid_examples), default=1)
        length = self.max_seq_len if cfg.pack else min(self.max_seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        rows = self._micro_batch_rows() if not cfg.max_tokens_per_batch else max(1, cfg.max_tokens_per_batch // length)
        return rows, length

    def _estimate_memory(self, model_cfg: ModelConfig, lora) -> dict:
        """memory.estimate_memory for the largest micro-batch this run forms (largest_micro_batch); plus that
        batch and length. On a WebGPU device its max storage binding sizes the weight chunks and the loss head's
        logits, as the engine does."""
        cfg = self.config
        rows, length = self.largest_micro_batch()
        max_binding = self.engine.max_binding
        est = estimate_memory(model_cfg, rows, length, lora, cfg.method, self.base_dtype, self.embed_dtype,
                              cfg.gradient_checkpointing, max_binding, precision=self.precision)
        return {**est, "batch": rows, "length": length}

    def _read_data(self, model_cfg: ModelConfig):
        from wgpu_train.data.sources import resolve_data
        from wgpu_train.data.tokenize import tokenize_dataset
        from wgpu_train.formats.tokenizer import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.splits = s = resolve_data(self.data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid, cfg.columns)
        self.max_seq_len = min(cfg.max_seq_len, model_cfg.max_position_embeddings)
        if self.max_seq_len < cfg.max_seq_len:
            self.log(f"max_seq_len: using the model's {self.max_seq_len} positions ({cfg.max_seq_len} asked)")
        args = (self.max_seq_len, not cfg.no_chat_template, cfg.train_on_last_turn)
        self.train_examples, train_stats = tokenize_dataset(self.tokenizer, s.train, *args, skip_invalid=cfg.skip_invalid)
        self.valid_examples, valid_stats = tokenize_dataset(self.tokenizer, s.valid, *args, skip_invalid=cfg.skip_invalid)
        self.n_skipped = s.n_skipped + train_stats.n_skipped + valid_stats.n_skipped   # lines, then refused chats
        self.truncated = train_stats.n_truncated + valid_stats.n_truncated
        self.dropped = train_stats.n_dropped + valid_stats.n_dropped
        top = max((int(e.input_ids.max()) for e in self.train_examples + self.valid_examples), default=0)
        if top >= model_cfg.vocab_size:
            raise ConfigError(f"the tokenizer produces token id {top} but the model has vocab_size "
                              f"{model_cfg.vocab_size}: tokenizer and model do not belong together")
        if cfg.early_stop_patience and not self.valid_examples:
            raise ConfigError("early_stop_patience needs validation data (a validation split, or valid_split > 0)")
        self.log(f"data: {s.files.get('train')} ({s.format} format): {len(self.train_examples)} train, "
                 f"{len(self.valid_examples)} valid{' (held out)' if s.valid_held_out else ''}, {len(s.test)} test"
                 + (f"; {self.n_skipped} invalid lines skipped" if self.n_skipped else "")
                 + (f"; {self.truncated} truncated to {self.max_seq_len} tokens" if self.truncated else "")
                 + (f"; {self.dropped} dropped (no response token left)" if self.dropped else ""))

    def _prepare_out(self):
        # (called once the data stream is formed, before anything is written)
        if self.process.world > 1:
            self.process.check_step_rows(*self._step_shares())
        if not self.writes_files:
            return
        cfg = self.config
        # a new run's files replace an earlier run's (with overwrite); a resumed run keeps those it finds
        self._written = [self.out / name for name in ("train_config.json", "metrics.jsonl")
                         if not self.resumed_from or not (self.out / name).exists()]
        self._made_out = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            resolved = cfg.to_dict()
            model = self.model_name if hub.is_hub_id(self.model_name) else str(self.model_dir)   # a resume
            resolved.update(out=str(self.out), model=model, data=str(self.data_path),       # re-resolves an id
                            eval_generate=self.eval_generate, embed_dtype=self.embed_dtype,
                            data_format=self.splits.format)   # for generate: how raw-mode prompts end
            (self.out / "train_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}") from None
        if not self.folders.in_place:
            stale = list_checkpoints(self.out / "checkpoints")
            if stale:
                self.log(f"removing {len(stale)} checkpoint(s) of an earlier run in {self.out / 'checkpoints'}")
                for p in stale:
                    shutil.rmtree(p, ignore_errors=True)
