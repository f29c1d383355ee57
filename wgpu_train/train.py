"""Fine-tuning: the Trainer (AdamW steps with gradient accumulation on any engine, evaluation, metrics,
atomic checkpoints, resume, Ctrl-C) and finetune(config) -> summary. The settings are train_config.py's, the
run folder policy run_folder.py's, the metrics metrics.py's."""
from __future__ import annotations

import dataclasses
import json
import math
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from . import checkpoint, hub, tracking
from .checkpoint import find_checkpoint, list_checkpoints
from .config import LoraConfig, ModelConfig
from .errors import ConfigError
from .lora_layout import describe_layout, lora_options
from .evaluate import engine_batch, evaluate_loss, exact_match
from .memory import base_weight_bytes, estimate_memory, format_bytes
from .metrics import Window, fmt, keep_metrics_until, num, plot_losses
from .run_folder import earlier_run, run_folder, same_folder
from .schedule import LRSchedule
from .train_config import PAD_MULTIPLE, TrainConfig, default_data_dir, default_model_dir

def count_trainable(cfg: ModelConfig, lora: LoraConfig | None) -> int:
    """Trainable parameters of a model: the LoRA matrices and modules_to_save copies, or every weight (from
    shapes, nothing read back)."""
    from .hf import expected_shapes
    from .saved_modules import count

    if lora is not None:
        return sum(r * sum(cfg.linear_shape(p.rsplit(".", 1)[1])) for p, (r, _) in
                   lora.modules(cfg.num_hidden_layers).items()) + count(cfg, lora)
    n = sum(math.prod(s) for s in expected_shapes(cfg).values())
    return n + (cfg.num_hidden_layers * (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0)


def split_batch(batch, rows: int, multiple: int = PAD_MULTIPLE, max_tokens: int | None = None) -> list:
    """Micro-batches of at most `rows` rows of `batch` (with max_tokens: the runs of rows data.token_groups
    forms, as make_batches formed them), each trimmed to its longest row rounded up to `multiple` (fewer
    distinct shapes for engines that cache buffers per shape; padding is masked)."""
    from .data import IGNORE_INDEX, Batch, token_groups

    out = []
    width = batch.input_ids.shape[1]
    n_rows = batch.input_ids.shape[0]
    if max_tokens:
        mask = batch.attention_mask
        lengths = [int(np.flatnonzero(mask[r])[-1]) + 1 if mask[r].any() else 1 for r in range(n_rows)]
        spans = token_groups(lengths, max_tokens, multiple)
    else:
        spans = [(r0, min(n_rows, r0 + rows)) for r0 in range(0, n_rows, rows)]
    for r0, r1 in spans:
        sl = slice(r0, r1)
        used = np.flatnonzero(batch.attention_mask[sl].any(axis=0))
        t = min(width, -(-(int(used[-1]) + 1 if used.size else 1) // multiple) * multiple)
        labels = batch.labels[sl, :t]
        out.append(Batch(batch.input_ids[sl, :t], labels, batch.attention_mask[sl, :t], batch.segment_ids[sl, :t],
                         batch.position_ids[sl, :t], int((labels[:, 1:] != IGNORE_INDEX).sum())))
    return out


class Trainer:
    """One fine-tuning run: `setup()` reads data and model (and resumes), `train()` runs it, `run()` both.

    As it is constructed, before anything is loaded or written, it refuses an output folder that is a file or
    holds an earlier run (see earlier_run; config.overwrite replaces that run, whose checkpoints are then
    deleted), a --resume path without a checkpoint or whose checkpoint was trained with another method, LoRA
    setting or storage dtype, and early stopping on a single data file without valid_split. A resumed run
    writes into the folder it resumes from (the default), or into one that holds no other run (or with
    overwrite); setup() refuses, before loading the model, a run that already reached its end. A run
    interrupted (or failing) before its first step removes what it wrote, so the folder can be used again.

    Each optimizer step draws one batch of batch_size * grad_accum samples from a seeded BatchStream and feeds
    it to engine.train_step as grad_accum micro-batches of batch_size rows; the engine normalises gradients by
    the trained tokens of the whole step, so accumulation changes memory use, not the result. The trainer uses
    only the engine protocol, so it runs on every backend.
    """

    def __init__(self, config: TrainConfig, log=None):
        if not isinstance(config, TrainConfig):
            raise ConfigError("Trainer needs a TrainConfig")
        self.config = config
        self.out = config.output_dir()
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"the output folder {self.out} is a file; choose another --out")
        self.base_dtype, self.embed_dtype = config.storage_dtypes()   # as the base weights are stored
        self._resume = self._check_resume() if config.resume else None   # (checkpoint folder, its state)
        self.continues_in_place = bool(config.resume) and same_folder(self.out, run_folder(config.resume))
        found = [] if self.continues_in_place or config.overwrite else earlier_run(self.out)
        if found:
            resume = (f", --resume {shlex.quote(str(self.out))} to continue it"
                      if not config.resume and list_checkpoints(self.out / "checkpoints") else "")
            raise ConfigError(f"the output folder {self.out} already holds a run ({', '.join(found)}); pass "
                              f"--overwrite to replace it{resume}, or choose another --out")
        if (config.early_stop_patience and config.valid_split == 0 and config.data and Path(config.data).is_file()
                and Path(config.data).suffix != ".json"):
            # a single file has no validation file beside it (a folder's is looked for as the data is read)
            raise ConfigError("early_stop_patience needs validation data (a validation split, or valid_split > 0)")
        self._log_fn = log
        self.model = self.engine = self.tokenizer = self.splits = self.stream = self.schedule = None
        self.model_dir = self.data_path = None   # resolved by setup() (embedded defaults when not given)
        self.continued_from = None               # the adapter folder a run started from (adapter_path)
        self.model_name = None                   # the model as given: a folder or a hub id
        self.train_examples: list = []
        self.valid_examples: list = []
        self.step = 0
        self.tokens = 0                 # input (non-padding) tokens processed, over every run of this job
        self.trained_tokens = 0         # tokens that carried loss
        self.counters_base: dict = {}   # engine counters of the runs before a resume
        self.history = {"train_loss_first": None, "valid_loss_before": None, "valid_perplexity_before": None,
                        "exact_match_before": None, "best_valid_loss": None, "best_valid_perplexity": None,
                        "best_step": None, "evals_without_improvement": 0}
        self.last_saved_step = 0
        self.resumed_from: Path | None = None
        self._best = None            # early stopping: (step, trainable tensors) of the best evaluation
        self._start_step = 0         # the step this invocation started at
        self._written: list = []     # files this invocation wrote that a run which trained nothing removes
        self._made_out = False       # whether this invocation created the output folder
        self._stepping = False
        self._stop_requested = False
        self._metrics = None
        self._trackers = None

    def _check_resume(self) -> tuple[Path, dict]:
        """The checkpoint that config.resume names and its state, refused unless it fits the config."""
        cfg = self.config
        ckpt = find_checkpoint(cfg.resume)
        if cfg.out is None and (self.out / checkpoint.STATE_FILE).is_file():
            raise ConfigError(f"resume: {self.out} is a checkpoint outside a run's checkpoints/ folder; pass --out "
                              f"DIR to say where the run continues")
        state = checkpoint.read_state(ckpt)
        # lora_layers "N" needs the model's layer count: its LoRA setting is checked by restore() in setup
        lora = cfg.lora_config() if cfg.method == "lora" and not cfg.lora_layers_last() else None
        checkpoint.check_state(ckpt, state, cfg.method, lora, self.base_dtype, self.embed_dtype)
        return ckpt, state

    def log(self, msg: str):
        """One line of progress for the user (stderr, above the progress bar)."""
        if self._log_fn is not None:
            self._log_fn(msg)
            return
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)

    # ---- setup --------------------------------------------------------------------------------------
    def setup(self) -> "Trainer":
        """Read the data and the model, attach LoRA (or enable full fine-tuning), and resume if asked."""
        from .data import BatchStream
        from .model import load_model

        from .hf import adapter_base_model, adapter_base_name, adapter_folder, read_adapter

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
        lora = cfg.lora_config(model_cfg.num_hidden_layers) if cfg.method == "lora" else None
        if self.continued_from:         # before anything is read: options that contradict it are refused
            lora = cfg.continued_lora(read_adapter(self.continued_from, model_cfg.num_hidden_layers)[0],
                                      model_cfg.num_hidden_layers)
            self.config = cfg = dataclasses.replace(     # recorded as trained: a resume rebuilds this adapter
                cfg, **lora_options(lora))
        elif lora and cfg.lora_layers_last():          # recorded as the layers it chose, for a resume
            self.config = cfg = dataclasses.replace(cfg, lora_layers=lora_options(lora)["lora_layers"])
        self._read_data(model_cfg)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = self.max_seq_len if cfg.pack else max(e.input_ids.size for e in self.train_examples)
        if cfg.max_tokens_per_batch and cfg.max_tokens_per_batch < longest:
            raise ConfigError(f"max_tokens_per_batch ({cfg.max_tokens_per_batch}) is below the longest training "
                              f"{'row' if cfg.pack else 'sample'} ({longest} tokens): raise it or lower --max-seq-len")
        self.stream = BatchStream(self.train_examples, cfg.batch_size * cfg.grad_accum, cfg.seed, pack=cfg.pack,
                                  max_seq_len=self.max_seq_len, pad_id=self.pad_id, pad_to_multiple=PAD_MULTIPLE,
                                  max_tokens=cfg.max_tokens_per_batch, micro_batches=cfg.grad_accum)
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
                raise ConfigError(f"the run in {run_folder(cfg.resume)} already finished at step {self.step}; "
                                  f"raise --max-steps or --epochs to train further")

        self.model = load_model(self.model_dir.resolve(), backend=cfg.backend, device=cfg.device,
                                base_dtype=self.base_dtype, embed_dtype=self.embed_dtype)
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
        # as the WebGPU engine allocated them; the NumPy engine holds float32 copies: the planned device bytes
        self.base_weight_bytes = int(self.engine.base_weight_bytes
                                     or base_weight_bytes(model_cfg, self.base_dtype, self.embed_dtype)["total"])
        n_params = count_trainable(model_cfg, lora)
        self.log(f"model: {self.model_dir} ({model_cfg.architecture}) on {self.engine.name}, "
                 f"{self.engine.device_description}; "
                 + (f"LoRA r={lora.r} alpha={lora.alpha:g} on {','.join(lora.target_modules)}"
                    + describe_layout(lora) if lora
                    else "full fine-tuning") + f", {n_params:,} trainable parameters; base weights "
                 f"{self.base_dtype} (embedding {self.embed_dtype}), {self.base_weight_bytes:,} bytes"
                 + (" on a GPU (the NumPy engine holds float32 copies)" if self.engine.name == "numpy" else ""))
        if self._resume:                # before anything is written: a checkpoint that does not fit is refused
            self._resume_tensors(*self._resume)
        self._prepare_out()
        self.log(f"training: {self.total_steps} steps"
                 + ("" if cfg.max_steps else f" ({cfg.epochs} epochs of {self.steps_per_epoch})")
                 + (f", {cfg.batch_size * cfg.grad_accum} samples per step"
                    + (f" ({cfg.grad_accum} micro-batches of {cfg.batch_size})" if cfg.grad_accum > 1 else "")
                    if not cfg.max_tokens_per_batch else
                    f", {cfg.grad_accum} micro-batch{'es' if cfg.grad_accum > 1 else ''} of up to "
                    f"{cfg.max_tokens_per_batch} tokens per step")
                 + (", gradient checkpointing" if cfg.gradient_checkpointing else "")
                 + (f", resuming at step {self.step} from {self.resumed_from}" if self.resumed_from else ""))
        self.memory_estimate = self._estimate_memory(model_cfg, lora)
        est = self.memory_estimate
        self.log(f"GPU memory of training (estimate, largest micro-batch {est['batch']} x {est['length']}): "
                 f"{format_bytes(est['total'])}: base weights {format_bytes(est['weights'])}, trainable state "
                 f"{format_bytes(est['trainable_state'])}, activations {format_bytes(est['activations'])}, logits "
                 f"{format_bytes(est['logits'])}")
        return self

    def _estimate_memory(self, model_cfg: ModelConfig, lora) -> dict:
        """memory.estimate_memory for the largest micro-batch this run forms: batch_size rows of the longest
        example (max_seq_len when packing), padded to PAD_MULTIPLE; plus that batch and length. On a WebGPU
        device its max storage binding sizes the weight chunks and the loss head's logits, as the engine does."""
        cfg = self.config
        longest = max((e.input_ids.size for e in self.train_examples + self.valid_examples), default=1)
        length = self.max_seq_len if cfg.pack else min(self.max_seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        max_binding = self.engine.max_binding
        rows = cfg.batch_size if not cfg.max_tokens_per_batch else max(1, cfg.max_tokens_per_batch // length)
        est = estimate_memory(model_cfg, rows, length, lora, cfg.method, self.base_dtype, self.embed_dtype,
                              cfg.gradient_checkpointing, max_binding)
        return {**est, "batch": rows, "length": length}

    def _read_data(self, model_cfg: ModelConfig):
        from .data import resolve_data, tokenize_dataset
        from .tokenizer import load_tokenizer

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
        if not self.continues_in_place:
            stale = list_checkpoints(self.out / "checkpoints")
            if stale:
                self.log(f"removing {len(stale)} checkpoint(s) of an earlier run in {self.out / 'checkpoints'}")
                for p in stale:
                    shutil.rmtree(p, ignore_errors=True)

    # ---- batches ------------------------------------------------------------------------------------
    def epochs_completed(self) -> int:
        st = self.stream
        return st.epoch + (1 if st.position >= len(st.epoch_batches(st.epoch)) else 0)

    def epoch_float(self) -> float:
        """Epochs done, with the fraction of the current one."""
        st = self.stream
        n = len(st.epoch_batches(st.epoch))
        return round(st.epoch + (st.position / n if n else 0.0), 4)

    def next_batch(self):
        """(the batch of the next step, whether it ends an epoch); a step never spans two epochs."""
        st = self.stream
        if st.position >= len(st.epoch_batches(st.epoch)):
            st.epoch += 1
            st.position = 0
        batches = st.epoch_batches(st.epoch)
        batch = batches[st.position]
        st.position += 1
        return batch, st.position >= len(batches)

    def done(self) -> bool:
        if self.config.max_steps:
            return self.step >= self.config.max_steps
        return self.epochs_completed() >= self.config.epochs

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Validation loss and perplexity now (None without validation data)."""
        if not self.valid_examples:
            return None
        return evaluate_loss(self.engine, self.valid_examples, self.config.batch_size, self.pad_id, PAD_MULTIPLE)

    def held_out(self) -> tuple[str, list]:
        """The split exact match is measured on: test when present, else valid."""
        return ("test", self.splits.test) if self.splits.test else ("valid", self.splits.valid)

    def exact_match(self) -> dict:
        name, records = self.held_out()
        result = exact_match(self.model, self.tokenizer, records, not self.config.no_chat_template,
                             self.config.max_new_tokens, self.config.max_eval_samples,
                             batch_size=self.config.batch_size, max_seq_len=self.max_seq_len,
                             skip_invalid=self.config.skip_invalid)
        result["split"] = name
        return result

    # ---- checkpoints --------------------------------------------------------------------------------
    def counters(self) -> dict:
        """The engine's counters, added to those of the runs before a resume."""
        now = dict(self.engine.counters)
        return {k: int(now.get(k, 0)) + int(self.counters_base.get(k, 0))
                for k in sorted(set(now) | set(self.counters_base))}

    def state_dict(self) -> dict:
        """What a checkpoint needs beyond tensors: step, data position, schedule, dropout counter, history."""
        cfg = self.config
        return {
            "version": 1, "step": self.step, "epoch": self.epoch_float(), "data": self.stream.state_dict(),
            "schedule": dict(self.schedule.state_dict(), next_step=self.step + 1,
                             next_lr=self.schedule.lr_at(self.step + 1)),
            "engine": self.engine.state_dict(),
            "method": cfg.method, "lora": dataclasses.asdict(cfg.lora_config()) if cfg.method == "lora" else None,
            "base_dtype": self.base_dtype, "embed_dtype": self.embed_dtype,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens, "counters": self.counters(),
            "history": self.history, "seed": cfg.seed,
        }

    def save_checkpoint(self) -> Path:
        """checkpoints/step-NNNNNN, written atomically; only the newest keep_checkpoints are kept, and with
        early stopping the best evaluation's. A failed write (disk full) is a ConfigError naming the last
        good checkpoint, which the atomic write leaves intact."""
        root = self.out / "checkpoints"
        best = self.history["best_step"] if self.config.early_stop_patience else None
        try:
            path = checkpoint.save_checkpoint(root, self.step, self.model, self.state_dict(),
                                              self.config.keep_checkpoints,
                                              protect=() if best is None else (checkpoint.checkpoint_name(best),))
        except OSError as e:
            kept = list_checkpoints(root)
            good = (f"the last good checkpoint is {kept[-1]} (resume with --resume {shlex.quote(str(kept[-1]))})"
                    if kept else "no checkpoint of this run was written")
            raise ConfigError(f"cannot write the checkpoint of step {self.step} in {root}: {e.strerror or e}; "
                              f"{good}") from None
        self.last_saved_step = self.step
        return path

    def _resume_progress(self, state: dict):
        """Continue a checkpoint's progress: data position, step, token counts, counters and history."""
        self.stream.load_state_dict(state["data"])
        self.step = self.last_saved_step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.trained_tokens = int(state.get("trained_tokens", 0))
        self.counters_base = dict(state.get("counters", {}))
        self.history.update(state.get("history", {}))

    def _resume_tensors(self, ckpt: Path, state: dict):
        """Put a checkpoint's tensors, moments and dropout counter into the engine; with early stopping, also
        take up the best evaluation's tensors when its checkpoint is still there."""
        cfg = self.config
        checkpoint.restore(ckpt, self.model, state, cfg.lora_config() if cfg.method == "lora" else None)
        self.resumed_from = Path(ckpt)
        best = self.history.get("best_step")
        if cfg.early_stop_patience and best is not None:
            found = ckpt if best == self.step else ckpt.parent / checkpoint.checkpoint_name(best)
            if (found / checkpoint.STATE_FILE).is_file():
                self._best = (best, checkpoint.read_trainable(found, cfg.method))

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run the optimizer steps; write the adapter (or model), metrics.jsonl, summary.json and loss.png;
        return the summary. Ctrl-C finishes the current step (or evaluation), saves a checkpoint and returns;
        before the first step it returns a summary of no steps and removes what the run wrote (as does an
        error before the first step), so the output folder is as it was."""
        if self.model is None:
            self.setup()
        t_start = time.perf_counter()
        self._start_step = self.step
        installed, previous = self._install_sigint()
        try:
            if self.resumed_from:
                keep_metrics_until(self.out / "metrics.jsonl", self.step)
            self._metrics = open(self.out / "metrics.jsonl", "a" if self.resumed_from else "w")
            self._trackers = tracking.Trackers(tracking.parse_report_to(self.config.report_to), self.out,
                                               self.config.to_dict(), self.step if self.resumed_from else 0)
            if not self.resumed_from:
                self._evaluate_before()
            stopped, last_eval, last_eval_step, run = self._loop()
            return self._finish(stopped, last_eval, last_eval_step, run, time.perf_counter() - t_start)
        except BaseException:
            if self.step == self._start_step:
                self._discard()
            raise
        finally:
            if installed:       # whatever was there before (a handler set outside Python reads as None: then
                                # Python's default, as the handler cannot be put back)
                signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
            if self._metrics is not None:
                self._metrics.close()
            if self._trackers is not None:
                self._trackers.close()

    def run(self) -> dict:
        """setup() then train()."""
        return self.setup().train()

    def _install_sigint(self) -> tuple[bool, object]:
        """(installed, the handler before): the Ctrl-C handler, unless this is not the main thread or SIGINT is
        ignored (a background job, nohup): then Ctrl-C keeps meaning what it meant."""
        if threading.current_thread() is not threading.main_thread():
            return False, None
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return False, signal.SIG_IGN

        def handler(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            if self._stepping:
                then = "finishing this step, then saving a checkpoint"
            elif self.step == self._start_step:
                then = "stopping before the first step"
            else:
                then = "stopping, then saving a checkpoint"
            self.log(f"interrupted: {then} (Ctrl-C again to abort)")

        return True, signal.signal(signal.SIGINT, handler)

    def _write_row(self, row: dict):
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        self._trackers.log(row)

    def _valid_row(self, result: dict):
        self._write_row({"step": self.step, "epoch": self.epoch_float(), "split": "valid",
                         "loss": num(result["loss"]), "perplexity": num(result["perplexity"]),
                         "tokens": result["tokens"]})
        self.log(f"step {self.step}: valid loss {fmt(result['loss'])}, "
                 f"perplexity {fmt(result['perplexity'], '.3f')}")

    def _exact_match_row(self, em: dict, when: str, step: int):
        self._write_row({"step": step, "epoch": self.epoch_float(), "split": em["split"],
                         "exact_match": em["exact_match"], "n": em["n"]})
        self.log(f"exact match {when} training: {fmt(em['exact_match'], '.1%')} of {em['n']} {em['split']} samples")

    def _evaluate_before(self):
        h = self.history
        before = self.evaluate()
        if before is not None:
            h["valid_loss_before"], h["valid_perplexity_before"] = num(before["loss"]), num(before["perplexity"])
            self._valid_row(before)
        if self.eval_generate and not self._stop_requested:
            em = self.exact_match()
            h["exact_match_before"] = em["exact_match"]
            self._exact_match_row(em, "before", self.step)

    def _step(self):
        """One optimizer step; returns (batch, ends an epoch, lr, loss_sum, count, grad_norm, seconds)."""
        cfg = self.config
        batch, epoch_done = self.next_batch()
        micro = [engine_batch(b) for b in split_batch(batch, cfg.batch_size, max_tokens=cfg.max_tokens_per_batch)]
        lr = self.schedule.lr_at(self.step + 1)
        profile = bool(cfg.profile_interval) and (self.step + 1) % cfg.profile_interval == 0
        t0 = time.perf_counter()
        extra = {"profile": True} if profile else {}
        self._stepping = True
        try:
            loss_sum, count, grad_norm, applied = self.engine.train_step(micro, cfg.optimizer_params(lr),
                                                                         self.step + 1, **extra)
        finally:
            self._stepping = False
        seconds = time.perf_counter() - t0
        self.step += 1
        if profile:
            self._profile_row(seconds)
        if not applied:
            self.log(f"step {self.step}: non-finite gradients, update skipped")
        return batch, epoch_done, lr, loss_sum, count, grad_norm, seconds

    def _loop(self):
        """The optimizer steps with their logging, evaluations and checkpoints; returns (how it stopped, the
        last evaluation, its step, the run's Window)."""
        from tqdm import tqdm

        cfg = self.config
        stopped = "max_steps" if cfg.max_steps else "epochs"
        last_eval, last_eval_step = None, -1
        window, run = Window(), Window()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=cfg.no_progress, unit="step",
                   dynamic_ncols=True, file=sys.stderr, desc="finetune")
        try:
            while not self.done():
                if self._stop_requested:
                    stopped = "interrupted"
                    break
                batch, epoch_done, lr, loss_sum, count, grad_norm, seconds = self._step()
                n_in = int(batch.attention_mask.sum())
                self.tokens += n_in
                self.trained_tokens += int(count)
                window.add(loss_sum, count, n_in, seconds)
                run.add(loss_sum, count, n_in, seconds)
                if self.history["train_loss_first"] is None:
                    self.history["train_loss_first"] = run.last_loss
                bar.set_postfix(loss=fmt(run.last_loss), lr=f"{lr:.2e}", tok_s=f"{window.tokens_per_s:.0f}",
                                refresh=False)
                bar.update(1)
                if self.step % cfg.log_every == 0 or epoch_done or self.done():
                    self._log_step(window, lr, grad_norm)
                    window = Window()
                if epoch_done or (cfg.eval_every and self.step % cfg.eval_every == 0):
                    last_eval, last_eval_step = self.evaluate(), self.step
                    if last_eval is not None:
                        self._valid_row(last_eval)
                        if self._early_stop(last_eval):
                            stopped = "early_stop"
                            self.log(f"early stop: no lower validation loss in {cfg.early_stop_patience} evaluations")
                            break
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
        if stopped != "interrupted" and last_eval_step != self.step:
            last_eval, last_eval_step = self.evaluate(), self.step
            if last_eval is not None:
                self._valid_row(last_eval)
                self._early_stop(last_eval)   # the last evaluation may be the best
        return stopped, last_eval, last_eval_step, run

    def _profile_row(self, step_seconds: float):
        """Print the last step's time per op group and record it in metrics.jsonl."""
        prof = dict(self.engine.last_profile)
        total = sum(prof.values())
        lines = [f"profile of step {self.step}: {total * 1e3:.1f} ms measured of {step_seconds * 1e3:.1f} ms wall"]
        for name, sec in sorted(prof.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<44} {sec * 1e3:9.2f} ms {sec / max(total, 1e-12):6.1%}")
        self.log("\n".join(lines))
        self._write_row({"step": self.step, "profile_ms": {k: round(v * 1e3, 4) for k, v in prof.items()},
                         "step_wall_ms": round(step_seconds * 1e3, 3)})

    def _log_step(self, window: Window, lr: float, grad_norm):
        c = self.counters()
        row = {"step": self.step, "epoch": self.epoch_float(), "loss": num(window.mean_loss), "lr": lr,
               "grad_norm": num(grad_norm), "tokens": self.tokens, "trained_tokens": self.trained_tokens,
               "tokens_per_s": round(window.tokens_per_s, 2), "submits": c.get("submits", 0),
               "readbacks": c.get("readbacks", 0), "nonfinite_skipped": c.get("nonfinite_skipped", 0)}
        self._write_row(row)
        if self.config.no_progress:
            self.log(f"step {self.step}/{self.total_steps} epoch {row['epoch']:.2f} loss {fmt(row['loss'])} "
                     f"lr {lr:.2e} grad_norm {fmt(row['grad_norm'], '.3f')} {window.tokens_per_s:.0f} tok/s")

    def _early_stop(self, result: dict) -> bool:
        """Track the best validation loss (with early stopping, also its trainable tensors, in memory); True
        when early_stop_patience evaluations in a row did not improve on it."""
        h = self.history
        loss = result["loss"]
        if loss is None:
            return False
        if h["best_valid_loss"] is None or loss < h["best_valid_loss"]:
            h.update(best_valid_loss=float(loss), best_valid_perplexity=num(result["perplexity"]), best_step=self.step,
                     evals_without_improvement=0)
            if self.config.early_stop_patience:
                self._best = (self.step, {k: np.array(v, copy=True) for k, v in self.engine.trainable().items()})
            return False
        h["evals_without_improvement"] += 1
        patience = self.config.early_stop_patience
        return bool(patience) and h["evals_without_improvement"] >= patience

    def _finish(self, stopped: str, last_eval, last_eval_step: int, run: Window, wall: float) -> dict:
        cfg = self.config
        h = self.history
        interrupted = stopped == "interrupted"
        if interrupted and self.step == self._start_step:
            self._discard()
            ckpt = self.resumed_from
            self.log("interrupted before the first step: nothing trained"
                     + (f"; resume with --resume {shlex.quote(str(ckpt))}" if ckpt else ""))
            return self._summary(stopped, None, None, None, ckpt, run, wall)
        ckpt = (self.save_checkpoint() if self.last_saved_step != self.step
                else self.out / "checkpoints" / checkpoint.checkpoint_name(self.step))
        adapter_step = self.step
        after = last_eval if last_eval_step == self.step else None   # only an evaluation of what is written
        best = h["best_step"]
        if cfg.early_stop_patience and not interrupted and best is not None and best != self.step:
            if self._best is not None and self._best[0] == best:
                adapter_step = best
                self.engine.set_trainable(self._best[1])
                after = {"loss": h["best_valid_loss"], "perplexity": h["best_valid_perplexity"]}
                self.log(f"writing the weights of step {best}, the best validation loss "
                         f"({fmt(h['best_valid_loss'])}); the checkpoint of step {self.step} holds the last ones")
            else:
                self.log(f"the best validation loss was at step {best}, whose weights were not kept across the "
                         f"resume; writing those of step {self.step}")
        em_after = None
        if self.eval_generate and not interrupted and not self._stop_requested:
            em_after = self.exact_match()
            self._exact_match_row(em_after, "after", adapter_step)
        summary = self._summary(stopped, adapter_step, after, em_after, ckpt, run, wall)
        try:
            if cfg.method == "lora":
                self.model.save_adapter(self.out)
            else:
                self.model.save_pretrained(self.out)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as e:
            raise ConfigError(f"cannot write to the output folder {self.out}: {e.strerror or e}; the checkpoint "
                              f"{ckpt} holds the run") from None
        self._metrics.flush()
        plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")
        if interrupted:
            self.log(f"stopped at step {self.step}; resume with --resume {shlex.quote(str(ckpt))}")
        return summary

    def _summary(self, stopped: str, adapter_step, after, em_after, ckpt, run: Window, wall: float) -> dict:
        """The run's summary; `after` and `em_after` are the evaluation and exact match of the weights written
        (those of adapter_step; None when nothing was written)."""
        cfg = self.config
        h = self.history
        return {
            "steps": self.step, "epochs": self.epoch_float(), "stopped": stopped,
            "interrupted": stopped == "interrupted", "adapter_step": adapter_step,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens, "wall_time_s": round(wall, 3),
            "train_time_s": round(run.time, 3), "tokens_per_s": round(run.tokens_per_s, 2) if run.time else None,
            "train_loss_first": h["train_loss_first"], "train_loss_last": run.last_loss,
            "valid_loss_before": h["valid_loss_before"], "valid_perplexity_before": h["valid_perplexity_before"],
            "valid_loss_after": num(after["loss"]) if after else None,
            "valid_perplexity_after": num(after["perplexity"]) if after else None,
            "best_valid_loss": h["best_valid_loss"], "best_step": h["best_step"],
            "exact_match_before": h["exact_match_before"],
            "exact_match_after": em_after["exact_match"] if em_after else None,
            "exact_match_split": self.held_out()[0] if self.eval_generate else None,
            "exact_match_n": em_after["n"] if em_after else None,
            "exact_match_samples": em_after["samples"] if em_after else [],
            "backend": self.engine.name, "device": self.engine.device_description, "method": cfg.method,
            "base_dtype": self.base_dtype, "embed_dtype": self.embed_dtype, "base_weight_bytes": self.base_weight_bytes,
            "memory_estimate": self.memory_estimate,
            "model": str(self.model_dir), "data": str(self.data_path), "data_format": self.splits.format,
            "n_train": len(self.train_examples), "n_valid": len(self.valid_examples), "n_test": len(self.splits.test),
            "skipped_lines": self.n_skipped, "truncated": self.truncated, "dropped": self.dropped,
            "counters": self.counters(), "output": str(self.out), "checkpoint": str(ckpt) if ckpt else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "continued_from": str(self.continued_from) if self.continued_from else None,
        }

    def _discard(self):
        """Remove what this invocation wrote (see _prepare_out) when it trained nothing, and the output folder
        when it made it and nothing else is there."""
        if self._metrics is not None:
            self._metrics.close()
        for path in self._written:
            path.unlink(missing_ok=True)
        if self._made_out:
            try:
                self.out.rmdir()
            except OSError:
                pass


def finetune(config: TrainConfig | None = None, **overrides) -> dict:
    """Fine-tune as `config` says (fields may also be given or overridden as keywords); returns the summary
    that is also written to summary.json in the output folder."""
    config = config or TrainConfig()
    if overrides:
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field {unknown[0]!r}")
        config = dataclasses.replace(config, **overrides)
    return Trainer(config).run()


__all__ = ["Trainer", "finetune", "split_batch", "count_trainable"]
