"""The preference Trainer: DPO, SimPO, ORPO and KTO (training/objectives/) on any engine. Each step turns the
objective's derivatives by the rows' sequence log-probabilities (the policy's, and the reference's: the adapter
switched off, or computed once before training) into per-token gradient weights of the engine's optimizer step:
for pairs inside the step's own forward (an engine SequenceObjective per micro-batch of whole pairs, one policy
forward), for KTO from the rows scored first; evaluation reports the objective and TRL's reward metrics on the
validation pairs. Records with images (TRL's vision preference records) ride the same path, each micro-batch with
the ImageTokens of its rows' images."""
from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

from wgpu_train.data.preference_batching import PreferenceStream, kl_partners
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.training.objectives import DataKind
from wgpu_train.training.metrics import fmt, num
from wgpu_train.training.preference_scoring import ADAPTER_OFF, PreferenceScorer, Scored, example_rows, mean_metrics
from wgpu_train.training.trainer import Trainer

REFERENCE_FILE = "reference_logps.npz"      # the precomputed reference log-probabilities, in the run folder
REFERENCE_ADAPTER_FILE = "reference_adapter.npz"    # --adapter-path: the starting adapter, the reference


class PreferenceTrainer(Trainer):
    """A Trainer whose objective is config.objective, a preference objective: the data are preference pairs or
    unpaired examples (KTO's, read in order as TRL's KTOTrainer reads them), batch_size of them per micro-batch.

    The reference model of an objective that uses one (DPO, KTO) is, as TRL's trainers take it for a PEFT model,
    the base model with the adapter switched off (engine protocol set_adapter_enabled), or with --adapter-path a
    frozen copy of the starting adapter swapped in to score. Its log-probabilities are computed once before
    training instead, and kept in the run folder, with --precompute-ref-log-probs, --ref-adapter (the base with
    that adapter), --method full and modules_to_save (the starting model: the adapter switch does not turn off
    trained copies)."""

    def __init__(self, config, log=None, process=None, placement=None):
        dropout = config.lora_dropout
        if dropout:     # TRL's disable_dropout (on by default): scores and gradients of one deterministic model
            config = dataclasses.replace(config, lora_dropout=0.0)
        super().__init__(config, log, process, placement)
        if dropout:
            self.log(f"lora_dropout {dropout:g} is off for --objective {config.objective}, as TRL's trainers "
                     "disable dropout")
        if config.ref_adapter:
            from wgpu_train.adapters.files import adapter_folder

            adapter_folder(config.ref_adapter)      # a folder without an adapter: refused before anything is read
        self.settings = config.preference_settings()
        self.check_resumed_objective(self.settings)
        self.unit = self.settings.unit             # the objective: its traits and its loss
        self.paired = self.unit.data is DataKind.PAIRS
        self.pref = {"train": [], "valid": []}       # tokenized PreferenceExample / UnpairedExample per split
        self.partners = {}                           # KTO: split -> (N,) the mismatched pair of each example
        self.image_ids = frozenset()                 # records with images: the tokens of an image's run
        self.reference = None                        # precomputed: split -> {"logps": (N, 2) or (N,), "kl": (N,)}
        self._reference_tensors = None               # --adapter-path: the starting adapter, the reference
        self._step_metrics: list = []                # the metrics of the steps since the last logged row
        self._accuracy = {"before": None, "after": None}   # validation reward accuracy before and after training

    # ---- data ---------------------------------------------------------------------------------------
    def _read_data(self, model_cfg):
        from wgpu_train.data.preference_demo import demo_preference_splits
        from wgpu_train.data.preference_tokenize import tokenize_preferences, tokenize_unpaired
        from wgpu_train.data.sources import resolve_data
        from wgpu_train.data.vision_records import is_vision_data
        from wgpu_train.formats.tokenizer import load_tokenizer

        cfg = self.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_seq_len = min(cfg.max_seq_len, model_cfg.max_position_embeddings)
        if is_vision_data(self.data_path):
            return self._read_image_data(model_cfg)
        if cfg.data is None:      # the embedded demo: pairs built from the embedded SFT dataset
            s = demo_preference_splits(resolve_data(self.data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid,
                                                    cfg.columns), cfg.seed, unpaired=not self.paired)
        else:
            s = resolve_data(self.data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid, cfg.columns,
                             kind=self.unit.data)
        self.splits = s
        tokenize = tokenize_preferences if self.paired else tokenize_unpaired
        lines, self.truncated, self.dropped = [], 0, 0
        for split in ("train", "valid"):
            self.pref[split], stats = tokenize(self.tokenizer, getattr(s, split), self.max_seq_len,
                                               max_prompt_length=cfg.max_prompt_length,
                                               use_chat_template=not cfg.no_chat_template,
                                               truncation_mode=cfg.truncation_mode, skip_invalid=cfg.skip_invalid)
            lines.append(f"{split} {stats.describe()}")
            self.truncated += stats.n_truncated
            self.dropped += stats.n_dropped
            if not self.paired:
                self.partners[split] = kl_partners(len(self.pref[split]), cfg.batch_size)
        self._check_examples(model_cfg, lines)
        self.log(f"data: {s.files.get('train', self.data_path)} ({s.format}); {'; '.join(lines)}; "
                 f"{len(s.test)} test")

    def _check_examples(self, model_cfg, lines: list):
        """The tokenized examples checked (some left to train, KTO's both labels, ids inside the vocabulary) and
        their rows made."""
        from wgpu_train.data.preference_records import check_labels

        s = self.splits
        if not self.pref["train"]:
            raise DataError(f"no training {'pairs' if self.paired else 'examples'} left after tokenization "
                            f"({lines[0]}): raise --max-seq-len")
        if not self.paired:     # truncation may have dropped every example of one label
            check_labels(self.pref["train"], str(s.files.get("train", self.data_path)))
        self.train_examples = self._rows(self.pref["train"])
        self.valid_examples = self._rows(self.pref["valid"])
        self.n_skipped = s.n_skipped
        top = max((int(e.input_ids.max()) for e in self.train_examples + self.valid_examples), default=0)
        if top >= model_cfg.vocab_size:
            raise ConfigError(f"the tokenizer produces token id {top} but the model has vocab_size "
                              f"{model_cfg.vocab_size}: tokenizer and model do not belong together")

    def _read_image_data(self, model_cfg):
        """TRL's vision preference records (one local JSON / JSONL file whose first record has `images`): split,
        read and tokenized (data/preference_vision.py), each image's placeholder expanded as the model's
        processor expands it; pairs cut inside or before an image dropped and counted."""
        import json

        from wgpu_train.data.preference_vision import tokenize_vision_preferences, vision_preference_records
        from wgpu_train.data.vision_records import model_image_span, vision_splits
        from wgpu_train.models.vision import VisionConfig

        cfg = self.config
        if cfg.no_chat_template or cfg.columns:
            raise ConfigError(f"{'--no-chat-template' if cfg.no_chat_template else '--columns'} is not supported "
                              f"with images yet")
        where = self.model_dir / "config.json"
        span = model_image_span(self.tokenizer, VisionConfig.from_config(json.loads(where.read_text()), str(where)),
                                self.model_dir)
        self.image_ids = frozenset(self.tokenizer.token_to_id(t) for t in span.token_names) - {None}
        s = vision_splits(self.data_path, cfg.valid_split, cfg.seed)
        file = str(self.data_path)
        as_video = getattr(span, "as_video", None)          # Qwen3-VL's videos
        s = dataclasses.replace(s, train=vision_preference_records(s.train, not self.paired, file, as_video),
                                valid=vision_preference_records(s.valid, not self.paired, file, as_video))
        self.splits = s
        lines, self.truncated, self.dropped, self.cut_in_image = [], 0, 0, 0
        for split in ("train", "valid"):
            self.pref[split], stats, cut = tokenize_vision_preferences(
                self.tokenizer, getattr(s, split), span, self.max_seq_len, self.image_ids, cfg.truncation_mode,
                cfg.max_prompt_length)
            lines.append(f"{split} {stats.describe()}" + (f", {cut} dropped (--max-seq-len {self.max_seq_len} "
                                                          f"cuts them inside or before an image)" if cut else ""))
            self.truncated += stats.n_truncated
            self.dropped += stats.n_dropped
            self.cut_in_image += cut
            if not self.paired:
                self.partners[split] = kl_partners(len(self.pref[split]), cfg.batch_size)
        self.n_images = sum(len(e.images) for split in self.pref.values() for e in split)
        self._check_examples(model_cfg, lines)
        self.log(f"data: {file} (vision {'pairs' if self.paired else 'unpaired'}); {'; '.join(lines)}; "
                 f"{self.n_images} images")

    def _rows(self, examples) -> list:
        return example_rows(examples, self.paired)

    @functools.cached_property
    def scorer(self) -> PreferenceScorer:
        """Scores this run's examples on an engine, batch_size examples per micro-batch (after the tokenizer)."""
        return PreferenceScorer(self.settings, self.config.batch_size, self.pad_id, self.vision, self.image_ids)

    def _make_stream(self, accum: int):
        return PreferenceStream(self.pref["train"], self.config.batch_size * accum, self.config.seed,
                                shuffle=self.paired)

    def _micro_batch_rows(self) -> int:
        return self.config.batch_size * (2 if self.paired else 1)     # a pair's chosen and rejected rows

    def held_out(self) -> tuple[str, list]:
        """Exact match's split as conversations: the prompt and the chosen (desirable) answer."""
        name, records = super().held_out()
        if self.vision is not None:     # image_exact_match's vision records
            from wgpu_train.data.preference_vision import with_images

            return name, [c for c in map(with_images, records) if c is not None]
        return name, [c for c in (_as_conversation(r) for r in records) if c is not None]

    # ---- the reference ------------------------------------------------------------------------------
    def _precomputes(self) -> bool:
        cfg = self.config
        return bool(self.unit.uses_reference and (cfg.precompute_ref_log_probs or cfg.ref_adapter
                                                      or cfg.method == "full" or cfg.modules_to_save))

    def _model_ready(self):
        if self.unit.uses_reference and self.continued_from and not self._precomputes():
            # TRL's reference for a pretrained adapter: a frozen copy of it ("ref"), swapped in to score
            self._reference_tensors = {k: np.array(v, copy=True) for k, v in self.engine.trainable().items()}

    def setup(self):
        super().setup()
        if self._precomputes():
            self.reference = self._load_reference() if self.resume else self._compute_reference()
            return self
        if self.resume:
            path = self.resume.folder.parent.parent / REFERENCE_ADAPTER_FILE
            if path.is_file():
                with np.load(path) as f:
                    self._reference_tensors = {k: f[k] for k in f.files}
                self._keep(self._reference_tensors)
        elif self._reference_tensors is not None:
            self._keep(self._reference_tensors)
        if self._reference_tensors is not None:
            self.log("reference: the starting adapter, scored with every step")
        elif self.unit.uses_reference:
            self.log("reference: the base model (the adapter switched off), scored with every step")
        return self

    def _keep(self, tensors: dict):
        """The starting adapter's tensors in this run's folder, for a resume (a fresh run replaces any there)."""
        path = self.out / REFERENCE_ADAPTER_FILE
        if self.writes_files and not (self.resume and path.exists()):
            np.savez(path, **tensors)
            if not self.resume:
                self.files.wrote(path)

    def _reference_engine(self):
        """(engine, whether its adapter is switched off while it scores, what it is for the log)."""
        cfg = self.config
        if cfg.ref_adapter:
            return (self.placement.reference_engine(self, cfg.ref_adapter), False,
                    f"the base model with the adapter {cfg.ref_adapter}")
        if cfg.method == "full" or cfg.modules_to_save:
            return self.engine, False, "the starting model"
        return self.engine, True, "the base model (the adapter switched off)"

    def _compute_reference(self) -> dict:
        engine, off, what = self._reference_engine()
        t0 = time.perf_counter()
        out = {}
        if off:
            engine.set_adapter_enabled(False)
        try:
            for split, examples in self.pref.items():
                indices = np.arange(len(examples))
                logps = self.scorer.score(engine, examples, indices).logps  # pairs: every chosen, then every rejected
                out[split] = {"logps": logps.reshape((2, -1)).T if self.paired else logps}
                if not self.paired:
                    out[split]["kl"] = self.scorer.score(engine, examples, indices, self.partners[split]).logps
        finally:
            if off:
                engine.set_adapter_enabled(True)
        path = self.out / REFERENCE_FILE
        if self.writes_files:
            np.savez(path, **{f"{split}.{k}": v for split, d in out.items() for k, v in d.items()},
                     fingerprint=np.array(self.stream.fingerprint()))
            self.files.wrote(path)
        self.log(f"reference: {what}; log-probabilities of {sum(len(v) for v in self.pref.values())} examples "
                 f"computed in {time.perf_counter() - t0:.1f} s, kept in {path}")
        return out

    def _load_reference(self) -> dict:
        """The precomputed reference of the run being resumed (its folder's REFERENCE_FILE)."""
        ckpt = self.resume.folder
        path = ckpt.parent.parent / REFERENCE_FILE
        if not path.is_file():
            raise ConfigError(f"resume: {path} is missing: the run being resumed did not precompute its reference "
                              f"(leave out --precompute-ref-log-probs), or the file was removed")
        with np.load(path) as f:
            if str(f["fingerprint"]) != self.stream.fingerprint():
                raise ConfigError(f"resume: {path} was computed for other training data")
            stored = {k: f[k] for k in f.files}
        out: dict = {}
        for key, value in stored.items():
            if key != "fingerprint":
                split, name = key.split(".")
                out.setdefault(split, {})[name] = value
        if self.writes_files and path.parent.resolve() != self.out.resolve():
            np.savez(self.out / REFERENCE_FILE, **stored)
        self.log(f"reference: the precomputed log-probabilities of {path}")
        return out

    # ---- scoring --------------------------------------------------------------------------------------
    def _reference(self, split: str):
        """The reference of examples of `split` (precomputed, the starting adapter swapped in, or the adapter
        switched off), as PreferenceScorer.objective takes it; None for objectives without one."""
        if not self.unit.uses_reference:
            return None
        examples, partners = self.pref[split], self.partners.get(split)
        if self.reference is not None:
            d = self.reference[split]

            def precomputed(indices, mismatched: bool):
                if mismatched:
                    return d["kl"][indices]
                return d["logps"][indices].T.reshape(-1) if self.paired else d["logps"][indices]
            return precomputed
        if self._reference_tensors is not None:
            def starting_adapter(indices, mismatched: bool):
                current = {k: np.array(v, copy=True) for k, v in self.engine.trainable().items()}
                self.engine.set_trainable(self._reference_tensors)
                try:
                    return self.scorer.score(self.engine, examples, indices, partners if mismatched else None).logps
                finally:
                    self.engine.set_trainable(current)
            return starting_adapter
        return ADAPTER_OFF

    def _objective(self, split: str, indices) -> tuple:
        """(ObjectiveResult, the policy's Scored rows) of examples[indices]."""
        return self.scorer.objective(self.engine, self.pref[split], indices, self._reference(split),
                                     self.partners.get(split))

    # ---- the step and evaluation --------------------------------------------------------------------
    def _step(self):
        cfg = self.config
        indices, epoch_done = self.next_batch()
        lr = self.schedule.lr_at(self.step + 1)
        t0 = time.perf_counter()
        with self.interrupt.step():
            if self._one_pass():
                result, scored, count, grad_norm, applied = self._one_pass_step(indices, lr)
            else:
                result, scored = self._objective("train", indices)
                weighted = self.weighted_micro_batches(result, scored)
                _, count, grad_norm, applied = self._train_step(weighted, cfg.optimizer_params(lr), self.step + 1)
        seconds = time.perf_counter() - t0
        self.step += 1
        self._step_metrics.append(result.metrics)
        if not applied:
            self._log_skipped()
        return scored.micro, epoch_done, lr, result.loss * count, count, grad_norm, seconds

    def _one_pass(self) -> bool:
        """Whether a step's own forward computes the log-probabilities its weights need (pairs: an engine
        SequenceObjective per micro-batch of whole pairs, one policy forward); KTO, whose KL rows are scored
        apart, scores its rows first and trains with the weights (two policy forwards), and so does a
        data-parallel worker, whose share of a step may cut its micro-batches' pairs, and a model whose engine
        takes no host function mid-step (pipeline stages)."""
        return self.paired and self.process.world == 1 and self.placement.sequence_objectives

    def _one_pass_step(self, indices, lr) -> tuple:
        """A step of pairs in one policy forward: the reference scored first (where the objective has one), then
        the step (PreferenceScorer.train_pairs). (ObjectiveResult, Scored rows in score's order, count,
        grad_norm, applied)."""
        examples = self.pref["train"]
        reference = self._reference("train")
        ref = None
        if reference is ADAPTER_OFF:
            self.engine.set_adapter_enabled(False)
            try:
                ref = self.scorer.score(self.engine, examples, indices).logps
            finally:
                self.engine.set_adapter_enabled(True)
        elif reference is not None:
            ref = reference(indices, False)
        hp, step = self.config.optimizer_params(lr), self.step + 1
        return self.scorer.train_pairs(self.engine, examples, indices, ref,
                                       lambda batches: self._train_step(batches, hp, step))

    @staticmethod
    def weighted_micro_batches(result, scored: "Scored") -> list:
        """The policy rows' micro-batches with per-token gradient weights. The engine divides the gradients by
        the step's trained tokens (every targeted token), so weights of -(those tokens) * dloss/dlogp of the
        token's row on completion tokens give the objective's gradient (a token's loss is minus its
        log-probability); ORPO's NLL adds (those tokens) * nll_grad on every token of the chosen rows."""
        total = float(scored.targets.sum())
        per_row = -total * result.dlogps
        n_chosen = len(per_row) // 2
        weighted, r0 = [], 0
        for (ids, targets, seg, pos, *images), mask in zip(scored.micro, scored.masks):
            rows = ids.shape[0]
            w = np.where(mask, per_row[r0:r0 + rows, None], 0.0)                             # (B, T)
            if result.nll_grad:
                chosen = (np.arange(r0, r0 + rows) < n_chosen)[:, None] & (targets != -100)
                w = w + np.where(chosen, total * result.nll_grad, 0.0)
            weighted.append((ids, targets, seg, pos, w.astype(np.float32), *images))   # images: ImageTokens
            r0 += rows
        return weighted

    def _step_model(self):
        """The engine: a step's micro-batches carry their ImageTokens already (PreferenceScorer.micro_batches)."""
        return self.engine

    def _input_tokens(self, batch) -> int:
        return int(sum((mb[2] > 0).sum() for mb in batch))

    def _progress_extra(self) -> dict:
        acc = self._step_metrics[-1].get("rewards/accuracies") if self._step_metrics else None
        return {} if acc is None else {"reward_acc": f"{acc:.2f}"}

    def rows_in(self, batch) -> int:
        return len(batch) * (2 if self.paired else 1)

    def evaluate(self) -> dict | None:
        """The objective and its metrics on the validation examples (None without them)."""
        return self.scorer.evaluate(self.engine, self.pref["valid"], self._reference("valid"),
                                    self.partners.get("valid"))

    def _valid_row(self, result: dict):
        metrics = {k: num(v) for k, v in result["metrics"].items()}
        self._write_row({"step": self.step, "epoch": self.epoch_float(), "split": "valid",
                         "loss": num(result["loss"]), "examples": result["tokens"], **metrics})
        acc = metrics.get("rewards/accuracies")
        self._accuracy["before" if self._accuracy["before"] is None and self.step == self.progress.start_step
                       and not self.resumed_from else "after"] = acc
        self.log(f"step {self.step}: valid {self.config.objective} loss {fmt(result['loss'])}"
                 + (f", reward accuracy {fmt(acc, '.1%')}" if acc is not None else "")
                 + (f", reward margin {fmt(metrics['rewards/margins'], '.4f')}" if "rewards/margins" in metrics
                    else ""))

    def _write_row(self, row: dict):
        if "split" not in row and "grad_norm" in row and self._step_metrics:
            row = {**row, **{k: num(v) for k, v in mean_metrics(self._step_metrics).items()}}
            self._step_metrics = []
        super()._write_row(row)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "objective": dataclasses.asdict(self.settings)}

    def _summary(self, *args) -> dict:
        summary = super()._summary(*args)
        summary["objective"] = {"name": self.config.objective, **vars(self.settings),
                                "reference": (None if not self.unit.uses_reference else
                                              "precomputed" if self.reference is not None else
                                              "starting adapter" if self._reference_tensors is not None else
                                              "adapter off"),
                                "reward_accuracy": dict(self._accuracy)}
        summary["n_train"], summary["n_valid"] = len(self.pref["train"]), len(self.pref["valid"])
        return summary


def _as_conversation(record):
    """A preference record as the conversation of its prompt and chosen answer (KTO: desirable records only;
    None otherwise); a conversation (the embedded demo's test split) as it is."""
    prompt = getattr(record, "prompt", None)
    if prompt is None:
        return record
    answer = getattr(record, "chosen", None)
    if answer is None:
        if not record.label:
            return None
        answer = record.completion
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(answer, str):
        answer = [{"role": "assistant", "content": answer}]
    return list(prompt) + list(answer)
