"""The Trainer: the setup of a run, the step loop with gradient accumulation on any engine, evaluation, early
stopping, and what it records (a checkpoint's state, metrics rows, the summary). It is made of parts it owns,
each given what it reads: its process's part in the run (processes.py), where its model lives (placement.py),
the run's files (run_files.py), the checkpoint it resumes (resume_point.py), its progress (progress.py) and
Ctrl-C (interrupt.py); the setup's steps that read only their arguments are trainer_setup.py's functions. The
settings are config.py's, the run folder policy run_folder.py's. A run starts from distributed.dispatch.finetune.
(Over 450 lines: one class whose methods set or read the trainer's own state, which the preference and GRPO
trainers extend method by method.)"""
from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from pathlib import Path

from wgpu_train.training import checkpoint, tracking
from wgpu_train.data.batching import split_batch
from wgpu_train.engines.resources import base_weight_bytes, count_trainable
from wgpu_train.engines.shared.parts import part_field
from wgpu_train.training.tower_lora import attach_tower, kept_tensors, language_adapter, restore_kept, tower_arrays
from wgpu_train.formats import hub
from wgpu_train.models.moe import router_aux_loss_coef
from wgpu_train.training.checkpoint import list_checkpoints
from wgpu_train.errors import ConfigError
from wgpu_train.training.evaluate import engine_batch, evaluate_loss, exact_match
from wgpu_train.training.metrics import Window, fmt, num
from wgpu_train.training.objectives import objective_class
from wgpu_train.training.run_files import RunFiles
from wgpu_train.training.summary import run_summary
from wgpu_train.training.run_folder import resolve_run
from wgpu_train.training.config import PAD_MULTIPLE, TrainConfig, default_data_dir
from wgpu_train.training.interrupt import Interrupt
from wgpu_train.training.placement import OneEngine
from wgpu_train.training.processes import OneProcess
from wgpu_train.training.progress import Progress
from wgpu_train.training.resume_point import ResumePoint
from wgpu_train.training.schedule import LRSchedule
from wgpu_train.training.vision_eval import image_exact_match
from wgpu_train.training.trainer_setup import (check_tokens_per_batch, describe_memory, describe_model,
                                               describe_training, estimate_run_memory, largest_micro_batch,
                                               read_examples, resolve_model)


class Trainer:
    """One fine-tuning run: `setup()` reads data and model (and resumes), `train()` runs it, `run()` both.

    As it is constructed, before anything is loaded or written, it refuses an output folder that is a file or
    holds an earlier run (see run_folder.earlier_run; config.overwrite replaces that run, whose checkpoints are then
    deleted), a --resume path without a checkpoint or whose checkpoint was trained with another method, LoRA
    setting or storage dtype, and early stopping on a single data file without valid_split. A resumed run
    writes into the folder it resumes from (the default), or into one that holds no other run (or with
    overwrite); setup() refuses, before loading the model, a run that already reached its end. A run
    interrupted (or failing) before its first step removes what it wrote, so the folder can be used again.

    Each optimizer step draws one batch of batch_size * grad_accum samples from a seeded BatchStream and feeds
    it to engine.train_step as grad_accum micro-batches of batch_size rows; the engine normalises gradients by
    the trained tokens of the whole step, so accumulation changes memory use, not the result. With num_workers
    the step is grad_accum * num_workers micro-batches (data_parallel.py shares them out; this class alone
    trains them all, to the same result), and a resumed run keeps its checkpoint's number. The trainer uses
    only the engine protocol, so it runs on every backend.

    `process` is the trainer's part in its run (processes.OneProcess, the default: all of it; a data-parallel
    worker: a share of each step, with only rank 0 writing the run's files); `placement` where its model lives
    (placement.OneEngine, the default: one engine in this process; or pipeline stages). Its other parts: `files`
    (RunFiles), `resume` (a ResumePoint, or None), `progress` (Progress: step, tokens, history, the batch stream,
    kept there and read here as attributes of the trainer) and `interrupt` (Interrupt).
    """

    stream = part_field("progress", "stream", "The resumable stream of the steps' batches (setup).")
    step = part_field("progress", "step", "Optimizer steps taken, over every run of this job.")
    tokens = part_field("progress", "tokens", "Input (non-padding) tokens processed, over every run of this job.")
    trained_tokens = part_field("progress", "trained_tokens", "Tokens that carried loss.")
    history = part_field("progress", "history", "Evaluations before and best (summary.json, the checkpoints).")
    last_saved_step = part_field("progress", "last_saved_step", "The step of the last checkpoint.")

    def __init__(self, config: TrainConfig, log=None, process: OneProcess | None = None,
                 placement: OneEngine | None = None):
        if not isinstance(config, TrainConfig):
            raise ConfigError("Trainer needs a TrainConfig")
        self._constructed = time.perf_counter()
        self.process = process or OneProcess()
        self.placement = placement or OneEngine()
        if not self.process.writes_files:   # rank 0's files would look like an earlier run's to the others
            config = dataclasses.replace(config, overwrite=True)
        self.config = config
        self.folders = resolve_run(config.out, config.resume, config.overwrite)
        self.out = self.folders.out
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"the output folder {self.out} is a file; choose another --out")
        # as the base weights are stored; base_dtype auto: a resumed checkpoint's, else the model's (setup)
        auto = not config.base_dtype.resolved and config.method == "lora"
        self.base_dtype, self.embed_dtype = (None, None) if auto else config.storage_dtypes()
        # where activations are stored; auto: a resumed checkpoint's, else the engine's choice (setup)
        self.precision = config.precision if config.precision.resolved else None
        self.resume = (ResumePoint(config, self.out, self.base_dtype, self.embed_dtype, self.precision)
                       if config.resume else None)      # the checkpoint this run continues
        if self.resume:
            self.base_dtype, self.embed_dtype, self.precision = self.resume.dtypes
        found = self.folders.earlier
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
        self._held_lines = None                  # lines said while setup checks the run, before the engine's
        self.setup_s = self.backend_choice_s = None     # seconds before the first step, of the engine choice
        self.workers = config.num_workers or 1   # data-parallel workers sharing each step (data_parallel.py)
        self.device = config.device              # the adapter to train on (a data-parallel worker's own)
        self.progress = Progress()               # where the run is, its history (and its batch stream)
        self.interrupt = Interrupt(self.log, lambda: self.step != self.progress.start_step)    # Ctrl-C
        self.model = self.engine = self.tokenizer = self.splits = self.schedule = None
        self.vision = None                       # records with images: the model's VisionModel (setup)
        self.model_dir = self.data_path = None   # resolved by setup() (embedded defaults when not given)
        self.continued_from = None               # the adapter folder a run started from (adapter_path)
        self.model_name = None                   # the model as given: a folder or a hub id
        self.train_examples: list = []
        self.valid_examples: list = []
        self.resumed_from: Path | None = None
        self._quiet = False          # a data-parallel worker but rank 0, once training: rank 0 says it
        self.files = RunFiles(self.folders, self.process.writes_files, self.log)    # what the run writes

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run's files (of data-parallel workers, rank 0 alone)."""
        return self.process.writes_files

    def check_resumed_objective(self, settings):
        """ConfigError (one line) when the checkpoint being resumed trained other objective settings (a dataclass
        such as PreferenceSettings or GRPOSettings, as state_dict records it under "objective")."""
        if self.resume:
            self.resume.check_objective(settings)

    def log(self, msg: str):
        """One line of progress for the user (stderr, above the progress bar)."""
        if self._quiet:
            return
        if self._held_lines is not None:     # checking the run: said after the engine's line (setup)
            self._held_lines.append(msg)
            return
        if self._log_fn is not None:
            self._log_fn(msg)
            return
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)

    # ---- setup --------------------------------------------------------------------------------------
    def setup(self):
        """Check the data, the model files and the options, choose the engine (backend auto), read the model,
        attach LoRA (or enable full fine-tuning), and resume if asked. A mistake in what was given is said before
        the engine choice spends any time; the lines said while checking follow the engine's line, so that the
        run's first line names its engine."""
        self._held_lines = []
        try:
            model_cfg, lora = self._check_run()
            self._choose_backend(model_cfg)
        finally:
            self._say_held_lines()
        self._load_model(model_cfg, lora)
        cfg = self.config
        if self.resume:                # before anything is written: a checkpoint that does not fit is refused
            self.resume.restore(self.model, cfg)
            self.resumed_from = Path(self.resume.folder)
            if cfg.early_stop_patience:
                self.progress.best = self.resume.best(self.step, cfg.method)
        if self.process.world > 1:
            self.process.check_step_rows(*self._step_shares())
        self.files.prepare(self._resolved_settings(), bool(self.resumed_from))
        self.log(describe_training(cfg, self.total_steps, self.steps_per_epoch, self.micro_per_step, self.workers,
                                   self.step, self.resumed_from))
        self.memory_estimate = est = estimate_run_memory(
            cfg, model_cfg, lora, self.train_examples + self.valid_examples, self.max_seq_len,
            self._micro_batch_rows(), self.engine, self.base_dtype, self.embed_dtype, self.precision)
        self.log(describe_memory(est))
        self.placement.estimated(self, model_cfg, lora, est)
        return self

    def _check_run(self):
        """(model_cfg, lora): the model, its files and the data read and checked, the steps planned; the engine is
        not chosen yet."""
        from wgpu_train.models.weights import load_weights

        tracking.require(tracking.parse_report_to(self.config.report_to))
        chosen = resolve_model(self.config, self.base_dtype, self.embed_dtype)
        self.config = cfg = chosen.config       # as it trains (dtypes, LoRA targets and layers), for a resume
        self.continued_from, self.model_name, self.model_dir = chosen.continued_from, chosen.name, chosen.folder
        self.base_dtype, self.embed_dtype = chosen.base_dtype, chosen.embed_dtype
        model_cfg, lora = chosen.model_cfg, chosen.lora
        load_weights(self.model_dir, model_cfg)             # its tensors present and of their shapes
        self.data_path = cfg.data if cfg.data else None if cfg.images_demo else default_data_dir()
        self.eval_generate = cfg.data is None if cfg.eval_generate is None else bool(cfg.eval_generate)
        self._read_data(model_cfg)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        check_tokens_per_batch(cfg, self.train_examples, self.max_seq_len)
        # micro-batches per step: grad_accum on each of num_workers; a resumed run keeps its checkpoint's (the
        # same global batch, whatever number of workers made it or continues it)
        accum = cfg.grad_accum * self.workers
        accum = self.micro_per_step = int(self.resume.state.get("micro_batches", accum) if self.resume else accum)
        self.stream = self._make_stream(accum)
        self.steps_per_epoch = len(self.stream)
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        warmup = cfg.warmup_steps
        if warmup and warmup >= self.total_steps:      # e.g. the recipe's warmup in a run cut short by --max-steps
            warmup = self.total_steps - 1
            self.log(f"warmup_steps {cfg.warmup_steps} is not below the run's {self.total_steps} steps: warming up "
                     f"over {warmup}, so that the last step trains at --lr")
        self.schedule = LRSchedule(cfg.lr, cfg.lr_schedule, warmup, self.total_steps)
        if self.resume:
            self.progress.restore(self.resume.state)
            if self.done():
                raise ConfigError(f"the run in {self.folders.resumed} already finished at step {self.step}; "
                                  f"raise --max-steps or --epochs to train further")
        return model_cfg, lora

    def _choose_backend(self, model_cfg):
        """The engine of the run (engines/backend_choice.py; auto times nothing), said in the run's first line,
        ahead of the lines held while checking; how long the choice took is kept for the summary."""
        from wgpu_train.engines.backend_choice import choose_backend

        cfg = self.config
        coef = router_aux_loss_coef(model_cfg.moe, cfg.router_aux_loss_coef)
        if coef and not objective_class(cfg.objective).adds_router_aux_loss:
            raise ConfigError(f"the router's aux loss (router_aux_loss_coef {coef:g}) is trained with sft only for "
                              f"now, not {cfg.objective}; pass --router-aux-loss-coef 0 (as TRL's trainer with "
                              f"router_aux_loss_coef=0, which its {cfg.objective} adds by default on an MoE model)")
        started = time.perf_counter()
        choice = choose_backend(cfg.backend, self.device, model_cfg, self.base_dtype, self.embed_dtype)
        self.backend_choice_s = time.perf_counter() - started
        self.backend, self.device, self.backend_reason = choice.engine, choice.device, choice.reason
        if cfg.backend == "auto":
            self._held_lines.insert(0, f"backend: {self.backend} ({self.backend_reason})")

    def _say_held_lines(self):
        """Say the lines held while setup checked the run and chose its engine, and hold no more."""
        held, self._held_lines = self._held_lines or [], None
        for line in held:
            self.log(line)

    def _load_model(self, model_cfg, lora):
        """The model on the placement, its adapter (continued, new) or full fine-tuning set up, its precision
        resolved; described in the log."""
        cfg = self.config
        self.model = self.placement.load(self, model_cfg)
        self.engine = self.model.engine         # from here on the placement releases it, whatever fails after
        if self.with_images:        # the tower and projector beside it (on the CPU), whichever engine
            self.vision = attach_tower(self)     # with LoRA on its tower where --lora-targets names it
        if hub.is_hub_id(self.model_name):   # adapters name the hub id as their base, as PEFT writes them
            self.model.name_or_path = self.model_name
        if self.continued_from:
            self.model.load_adapter(language_adapter(self.continued_from), dropout=lora.dropout, seed=cfg.seed)
            self.log(f"adapter: continuing {self.continued_from} (fresh optimizer state)")
        elif lora:
            self.model.add_lora(lora, seed=cfg.seed)
        else:
            self.model.set_full_finetune()
        self.model.set_gradient_checkpointing(cfg.gradient_checkpointing)
        self.engine.set_router_aux_loss(router_aux_loss_coef(model_cfg.moe, cfg.router_aux_loss_coef))
        self.precision_reason = (self.engine.precision_reason if cfg.precision.resolved or self.precision is None
                                 else "auto: as the resumed checkpoint trained")
        self.precision = self.engine.precision
        if cfg.precision != self.precision:
            self.config = cfg = dataclasses.replace(cfg, precision=self.precision)     # recorded, for a resume
        self._model_ready()
        # as the WebGPU engine allocated them; the NumPy engine holds float32 copies: the planned device bytes
        self.base_weight_bytes = int(self.engine.base_weight_bytes
                                     or base_weight_bytes(model_cfg, self.base_dtype, self.embed_dtype)["total"])
        self.log(describe_model(self.model_dir, model_cfg, self.engine, lora, count_trainable(model_cfg, lora),
                                self.base_dtype, self.embed_dtype, self.base_weight_bytes))
        self.log(f"precision: {self.precision} ({self.precision_reason})"
                 + ("; dynamic loss scaling" if self.engine.loss_scaler is not None else ""))

    def _resolved_settings(self) -> dict:
        """train_config.json: the run's settings as resolved (a resume and generate read them back). The
        embedded dataset is recorded as no data (null), so that a resume builds the demo's records (pairs,
        prompts) and takes its defaults (GRPO's reward) as the run did."""
        model = self.model_name if hub.is_hub_id(self.model_name) else str(self.model_dir)   # a resume
        data = str(self.data_path) if self.config.data else None                            # re-resolves an id
        return self.config.to_dict() | dict(out=str(self.out), model=model, data=data,
                                            eval_generate=self.eval_generate, embed_dtype=self.embed_dtype,
                                            data_format=self.splits.format)   # for generate: how raw-mode prompts end

    def _read_data(self, model_cfg):
        """The tokenizer and the run's examples (the trainer kinds read their own)."""
        data = read_examples(self.model_dir, self.data_path, self.config, model_cfg, self.log)
        self.tokenizer, self.splits, self.max_seq_len = data.tokenizer, data.splits, data.max_seq_len
        self.train_examples, self.valid_examples = data.train, data.valid
        self.n_skipped, self.truncated, self.dropped = data.n_skipped, data.truncated, data.dropped
        self.cut_in_image, self.n_images = data.cut_in_image, data.images

    @property
    def with_images(self) -> bool:
        """Whether the run's records carry images (TRL's vision records: the model's tower runs around each step)."""
        return self.splits is not None and self.splits.format == "vision"

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
        """(rows, tokens per row) of the largest micro-batch this run forms; known once the data is read."""
        return largest_micro_batch(self.config, self.train_examples + self.valid_examples, self.max_seq_len,
                                   self._micro_batch_rows())

    # ---- batches ------------------------------------------------------------------------------------
    def epoch_float(self) -> float:
        """Epochs done, with the fraction of the current one."""
        return self.progress.epoch_float()

    def next_batch(self):
        """(the batch of the next step, whether it ends an epoch); a step never spans two epochs."""
        return self.progress.next_batch()

    def done(self) -> bool:
        """Whether the run reached its end (max_steps, else epochs)."""
        return self.progress.done(self.config.max_steps, self.config.epochs)

    # ---- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Validation loss and perplexity now (None without validation data)."""
        if not self.valid_examples:
            return None
        return evaluate_loss(self.engine, self.valid_examples, self.config.batch_size, self.pad_id, PAD_MULTIPLE,
                             self.vision.loss if self.vision else None)

    def held_out(self) -> tuple[str, list]:
        """The split exact match is measured on: test when present, else valid."""
        return ("test", self.splits.test) if self.splits.test else ("valid", self.splits.valid)

    def exact_match(self) -> dict:
        name, records = self.held_out()
        if self.vision:
            return image_exact_match(self.vision, self.tokenizer, records, self.config.max_new_tokens,
                                     self.config.max_eval_samples) | {"split": name}
        result = exact_match(self.model, self.tokenizer, records, not self.config.no_chat_template,
                             self.config.max_new_tokens, self.config.max_eval_samples,
                             batch_size=self.config.batch_size, max_seq_len=self.max_seq_len,
                             skip_invalid=self.config.skip_invalid)
        result["split"] = name
        return result

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict:
        """Run the optimizer steps; write the adapter (or model), metrics.jsonl, summary.json and loss.png;
        return the summary. Ctrl-C finishes the current step (or evaluation), saves a checkpoint and returns;
        before the first step it returns a summary of no steps and removes what the run wrote (as does an
        error before the first step), so the output folder is as it was."""
        if self.model is None:
            self.setup()
        t_start = self._constructed          # the summary's wall time covers the setup and the engine choice
        self.setup_s = time.perf_counter() - t_start
        self.progress.start_step = self.step
        self._quiet = not self.writes_files     # from here on rank 0 says what every worker would
        with self.interrupt.handling():
            return self._run_steps(t_start)

    def _run_steps(self, t_start: float) -> dict:
        """train() once Ctrl-C is the run's: the outputs opened, the steps run and the run finished."""
        try:
            self._open_outputs()
            if not self.resumed_from:
                self._evaluate_before()
            stopped, last_eval, last_eval_step, run = self._loop()
            return self._finish(stopped, last_eval, last_eval_step, run, time.perf_counter() - t_start)
        except BaseException:
            if self.step == self.progress.start_step:
                self.files.discard()
            raise
        finally:
            self.files.close()

    def run(self) -> dict:
        """setup() then train(); the placement released after."""
        try:
            return self.setup().train()
        finally:
            self.placement.close(self)

    def _evaluate_before(self):
        h = self.history
        before = self.process.from_first(self.evaluate)
        if before is not None:
            h["valid_loss_before"], h["valid_perplexity_before"] = num(before["loss"]), num(before["perplexity"])
            self._valid_row(before)
        if self.eval_generate and not self.interrupt.requested:
            em = self.process.from_first(self.exact_match)
            h["exact_match_before"] = em["exact_match"]
            self._exact_match_row(em, "before", self.step)

    def _step(self):
        """One optimizer step; returns (batch, ends an epoch, lr, loss_sum, count, grad_norm, seconds)."""
        cfg = self.config
        batch, epoch_done = self.next_batch()
        micro = split_batch(batch, cfg.batch_size, PAD_MULTIPLE, cfg.max_tokens_per_batch)
        micro = micro if self.vision else [engine_batch(b) for b in micro]     # the vision model: with its images
        lr = self.schedule.lr_at(self.step + 1)
        profile = bool(cfg.profile_interval) and (self.step + 1) % cfg.profile_interval == 0
        t0 = time.perf_counter()
        extra = {"profile": True} if profile else {}
        with self.interrupt.step():
            loss_sum, count, grad_norm, applied = self._train_step(micro, cfg.optimizer_params(lr), self.step + 1,
                                                                   **extra)
        seconds = time.perf_counter() - t0
        self.step += 1
        if profile:
            self._profile_row(seconds)
        if not applied:
            self._log_skipped()
        return batch, epoch_done, lr, loss_sum, count, grad_norm, seconds

    def _log_skipped(self):
        """Say that the step just taken skipped its update (non-finite gradients)."""
        scaler = self.engine.loss_scaler
        self.log(f"step {self.step}: non-finite gradients, update skipped"
                 + (f"; f16 loss scale now {scaler.scale:g}" if scaler is not None else ""))

    def _progress_extra(self) -> dict:
        """More values for the progress bar's postfix, after a step."""
        return {}

    def rows_in(self, batch) -> int:
        """The sample rows of a step's batch."""
        return int(batch.input_ids.shape[0])

    def _input_tokens(self, batch) -> int:
        """The input (non-padding) tokens of a step's batch."""
        return int(batch.attention_mask.sum())

    def _train_step(self, micro, hp, step: int, own: bool = False, **extra):
        """The engine's optimizer step over a step's micro-batches (this process's share of them; own: the
        micro-batches are this process's already): (loss_sum, count, grad_norm, applied) of the whole step."""
        result = self.process.train_step(self._step_model(), micro, hp, step, own=own, **extra)
        if self.process.stop_agreed:
            self.interrupt.request("interrupted on the driver: saving a checkpoint after this step")
        return result

    def _step_model(self):      # what takes a step's micro-batches: the VisionModel (it runs the tower), or the engine
        return self.vision or self.engine

    def _progress_bar(self):
        from tqdm import tqdm

        return self.process.progress_bar(lambda: tqdm(
            total=self.total_steps, initial=self.step, disable=self.config.no_progress, unit="step",
            dynamic_ncols=True, file=sys.stderr, desc="finetune"), self.total_steps, self.step)

    def _loop(self):
        """The optimizer steps with their logging, evaluations and checkpoints; returns (how it stopped, the
        last evaluation, its step, the run's Window)."""
        cfg = self.config
        stopped = "max_steps" if cfg.max_steps else "epochs"
        last_eval, last_eval_step = None, -1
        window, run = Window(), Window()
        bar = self._progress_bar()
        try:
            while not self.done():
                if self.interrupt.requested:
                    stopped = "interrupted"
                    break
                batch, epoch_done, lr, loss_sum, count, grad_norm, seconds = self._step()
                self._step_completed()
                n_in = self._input_tokens(batch)
                self.tokens += n_in
                self.trained_tokens += int(count)
                window.add(loss_sum, count, n_in, seconds)
                run.add(loss_sum, count, n_in, seconds)
                if self.history["train_loss_first"] is None:
                    self.history["train_loss_first"] = run.last_loss
                bar.set_postfix(loss=fmt(run.last_loss), lr=f"{lr:.2e}", tok_s=f"{window.tokens_per_s:.0f}",
                                **self._progress_extra(), refresh=False)
                bar.update(1)
                if self.step % cfg.log_every == 0 or epoch_done or self.done():
                    self._log_step(window, lr, grad_norm)
                    window = Window()
                if epoch_done or (cfg.eval_every and self.step % cfg.eval_every == 0):
                    last_eval, last_eval_step = self.process.from_first(self.evaluate), self.step
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
            last_eval, last_eval_step = self.process.from_first(self.evaluate), self.step
            if last_eval is not None:
                self._valid_row(last_eval)
                self._early_stop(last_eval)   # the last evaluation may be the best
        return stopped, last_eval, last_eval_step, run

    def _step_completed(self):
        """After each step: what a resumed run held back until a step completed is written (RunFiles.hold)."""
        self.files.step_completed()

    def _early_stop(self, result: dict) -> bool:
        """Track the best validation loss (Progress.track); True when early_stop_patience evaluations in a row
        did not improve on it."""
        return self.progress.track(result, self.config.early_stop_patience,
                                   lambda: kept_tensors(self.engine, self.vision))

    # ---- records ----------------------------------------------------------------------------------
    def counters(self) -> dict:
        """The engine's counters, added to those of the runs before a resume."""
        return self.progress.counters(self.engine)

    def state_dict(self) -> dict:
        """What a checkpoint needs beyond tensors: step, data position, schedule, dropout counter, history."""
        cfg = self.config
        return {
            "version": 1, "step": self.step, "epoch": self.epoch_float(), "data": self.stream.state_dict(),
            "schedule": dict(self.schedule.state_dict(), next_step=self.step + 1,
                             next_lr=self.schedule.lr_at(self.step + 1)),
            "engine": self.engine.state_dict(),
            "method": cfg.method, "lora": dataclasses.asdict(cfg.lora_config()) if cfg.method == "lora" else None,
            "base_dtype": self.base_dtype, "embed_dtype": self.embed_dtype, "precision": self.precision,
            "tokens": self.tokens, "trained_tokens": self.trained_tokens, "counters": self.counters(),
            "history": self.history, "seed": cfg.seed, "micro_batches": self.micro_per_step,
        }

    def checkpoint_arrays(self) -> dict:
        """Arrays a checkpoint keeps beside the state (name -> np.ndarray): the vision tower's LoRA, if any."""
        return tower_arrays(self.vision)

    def save_checkpoint(self) -> Path:
        """checkpoints/step-NNNNNN (RunFiles.save_checkpoint), written atomically; only the newest
        keep_checkpoints are kept, and with early stopping the best evaluation's."""
        if not self.writes_files:       # rank 0 writes it; the others know where
            self.last_saved_step = self.step
            return self.out / "checkpoints" / checkpoint.checkpoint_name(self.step)
        best = self.history["best_step"] if self.config.early_stop_patience else None
        path = self.files.save_checkpoint(self.step, self.model, self.state_dict(), self.config.keep_checkpoints,
                                          () if best is None else (checkpoint.checkpoint_name(best),),
                                          self.checkpoint_arrays())
        self.last_saved_step = self.step
        self.process.checkpointed(path)
        return path

    def _open_outputs(self):
        """metrics.jsonl (cut back to the resumed step) and the trackers (RunFiles.open)."""
        self.files.open(self.config.report_to, self.config.to_dict(), self.step if self.resumed_from else None)

    def _write_row(self, row: dict):
        self.files.write_row(row)

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
        if self.engine.loss_scaler is not None:       # f16: the scale the next step multiplies the loss by
            row["loss_scale"] = self.engine.loss_scaler.scale
        if self.engine.last_aux_loss is not None:     # a mixture of experts' router aux loss, of the last step
            row["aux_loss"] = self.engine.last_aux_loss
        self._write_row(row)
        if self.config.no_progress:
            self.log(f"step {self.step}/{self.total_steps} epoch {row['epoch']:.2f} loss {fmt(row['loss'])} "
                     f"lr {lr:.2e} grad_norm {fmt(row['grad_norm'], '.3f')} {window.tokens_per_s:.0f} tok/s")

    def _finish(self, stopped: str, last_eval, last_eval_step: int, run: Window, wall: float) -> dict:
        cfg = self.config
        h = self.history
        interrupted = stopped == "interrupted"
        if interrupted and self.step == self.progress.start_step:
            self.files.discard()
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
            kept = self.progress.best
            if kept is not None and kept[0] == best:
                adapter_step = best
                restore_kept(self.engine, self.vision, kept[1])
                after = {"loss": h["best_valid_loss"], "perplexity": h["best_valid_perplexity"]}
                self.log(f"writing the weights of step {best}, the best validation loss "
                         f"({fmt(h['best_valid_loss'])}); the checkpoint of step {self.step} holds the last ones")
            else:
                self.log(f"the best validation loss was at step {best}, whose weights were not kept across the "
                         f"resume; writing those of step {self.step}")
        em_after = None
        if self.eval_generate and not interrupted and not self.interrupt.requested:
            em_after = self.process.from_first(self.exact_match)
            self._exact_match_row(em_after, "after", adapter_step)
        summary = self._summary(stopped, adapter_step, after, em_after, ckpt, run, wall)
        self.files.write_outputs(self.vision if self.vision and cfg.method == "lora" else self.model, cfg.method,
                                 summary, ckpt)
        if interrupted:
            self.log(f"stopped at step {self.step}; resume with --resume {shlex.quote(str(ckpt))}")
        return summary

    def _summary(self, stopped: str, adapter_step, after, em_after, ckpt, run: Window, wall: float) -> dict:
        """The run's summary (summary.run_summary); the trainers of other kinds add their fields."""
        return run_summary(self, stopped, adapter_step, after, em_after, ckpt, run, wall)


__all__ = ["Trainer"]
