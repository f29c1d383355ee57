"""The Trainer: the step loop with gradient accumulation on any engine, evaluation, early stopping, Ctrl-C. Its
setup is trainer_setup.py's, what it writes (checkpoints, metrics rows, summary) trainer_records.py's; the
settings are config.py's, the run folder policy run_folder.py's, the metrics metrics.py's. A run starts from
distributed.dispatch.finetune, which picks this process or Ray workers."""
from __future__ import annotations

import dataclasses
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from wgpu_train.training import checkpoint
from wgpu_train.data.batching import split_batch
from wgpu_train.engines.shared.quant import check_dtypes
from wgpu_train.training.checkpoint import find_checkpoint, list_checkpoints
from wgpu_train.errors import ConfigError
from wgpu_train.training.evaluate import engine_batch, evaluate_loss, exact_match
from wgpu_train.training.metrics import Window, fmt, num
from wgpu_train.training.run_folder import resolve_run
from wgpu_train.training.config import PAD_MULTIPLE, TrainConfig
from wgpu_train.training.placement import OneEngine
from wgpu_train.training.processes import OneProcess
from wgpu_train.training.trainer_records import TrainerRecords
from wgpu_train.training.trainer_setup import TrainerSetup

class Trainer(TrainerSetup, TrainerRecords):
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
    (placement.OneEngine, the default: one engine in this process; or pipeline stages).
    """

    def __init__(self, config: TrainConfig, log=None, process: OneProcess | None = None,
                 placement: OneEngine | None = None):
        if not isinstance(config, TrainConfig):
            raise ConfigError("Trainer needs a TrainConfig")
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
        self._resume = self._check_resume() if config.resume else None   # (checkpoint folder, its state)
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
        self.workers = config.num_workers or 1   # data-parallel workers sharing each step (data_parallel.py)
        self.device = config.device              # the adapter to train on (a data-parallel worker's own)
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
        self._quiet = False          # a data-parallel worker but rank 0, once training: rank 0 says it
        self._metrics = None
        self._trackers = None

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run's files (of data-parallel workers, rank 0 alone)."""
        return self.process.writes_files

    def _check_resume(self) -> tuple[Path, dict]:
        """The checkpoint that config.resume names and its state, refused unless it fits the config; with
        base_dtype auto, the storage dtypes become the ones the checkpoint trained with."""
        cfg = self.config
        ckpt = find_checkpoint(cfg.resume)
        if cfg.out is None and (self.out / checkpoint.STATE_FILE).is_file():
            raise ConfigError(f"resume: {self.out} is a checkpoint outside a run's checkpoints/ folder; pass --out "
                              f"DIR to say where the run continues")
        state = checkpoint.read_state(ckpt)
        if self.base_dtype is None and state.get("base_dtype"):      # auto: the run continues as it trained
            self.base_dtype, self.embed_dtype = check_dtypes(state["base_dtype"], cfg.embed_dtype)
        if self.precision is None and state.get("precision"):
            self.precision = state["precision"]
        # lora_layers "N" needs the model's layer count: its LoRA setting is checked by restore() in setup
        lora = cfg.lora_config() if cfg.method == "lora" and not cfg.lora_layers_last() else None
        checkpoint.check_state(ckpt, state, cfg.method, lora, self.base_dtype, self.embed_dtype, self.precision)
        return ckpt, state

    def check_resumed_objective(self, settings):
        """ConfigError (one line) when the checkpoint being resumed trained other objective settings (a dataclass
        such as PreferenceSettings or GRPOSettings, as state_dict records it under "objective")."""
        saved = self._resume[1].get("objective") if self._resume else None
        now = dataclasses.asdict(settings)
        if saved is not None and saved != now:
            changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v)
            raise ConfigError(f"resume: the run trained another objective setting ({changed}); leave those options "
                              f"out to continue it as it trained")

    def log(self, msg: str):
        """One line of progress for the user (stderr, above the progress bar)."""
        if self._quiet:
            return
        if self._log_fn is not None:
            self._log_fn(msg)
            return
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stderr)

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
        self._quiet = not self.writes_files     # from here on rank 0 says what every worker would
        installed, previous = self._install_sigint()
        try:
            self._open_outputs()
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
        """setup() then train(); the placement released after."""
        try:
            return self.setup().train()
        finally:
            self.placement.close(self)

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

    def _evaluate_before(self):
        h = self.history
        before = self.process.from_first(self.evaluate)
        if before is not None:
            h["valid_loss_before"], h["valid_perplexity_before"] = num(before["loss"]), num(before["perplexity"])
            self._valid_row(before)
        if self.eval_generate and not self._stop_requested:
            em = self.process.from_first(self.exact_match)
            h["exact_match_before"] = em["exact_match"]
            self._exact_match_row(em, "before", self.step)

    def _step(self):
        """One optimizer step; returns (batch, ends an epoch, lr, loss_sum, count, grad_norm, seconds)."""
        cfg = self.config
        batch, epoch_done = self.next_batch()
        micro = [engine_batch(b) for b in split_batch(batch, cfg.batch_size, PAD_MULTIPLE, cfg.max_tokens_per_batch)]
        lr = self.schedule.lr_at(self.step + 1)
        profile = bool(cfg.profile_interval) and (self.step + 1) % cfg.profile_interval == 0
        t0 = time.perf_counter()
        extra = {"profile": True} if profile else {}
        self._stepping = True
        try:
            loss_sum, count, grad_norm, applied = self._train_step(micro, cfg.optimizer_params(lr), self.step + 1,
                                                                   **extra)
        finally:
            self._stepping = False
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
        result = self.process.train_step(self.engine, micro, hp, step, own=own, **extra)
        if self.process.stop_agreed and not self._stop_requested:
            self._stop_requested = True
            self.log("interrupted on the driver: saving a checkpoint after this step")
        return result

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
                if self._stop_requested:
                    stopped = "interrupted"
                    break
                batch, epoch_done, lr, loss_sum, count, grad_norm, seconds = self._step()
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


__all__ = ["Trainer"]
