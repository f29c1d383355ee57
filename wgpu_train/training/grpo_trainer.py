"""The GRPO Trainer (online RL with TRL GRPOTrainer's meanings): each generation samples --num-generations
completions of a step's prompts with the current adapter on the engine's KV cache, scores them with the reward
functions on the host, and turns the group-relative advantages into per-token gradient weights of the engine's
optimizer step (training/objectives/grpo.py: the clipped ratio to the old policy, the KL to the reference),
computed from the step's own forward (engine protocol TokenObjective / SequenceObjective: one policy forward a
step; the reference, the adapter off, scored once per generation); a generation serves --num-iterations steps.
The completions and their rewards go to completions.jsonl. (Over 450 lines: each method is the GRPO form of one
of the Trainer's hooks, data, step, records, evaluation and checkpoints; the rows are grpo_rows.py's.)"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from wgpu_train.data.prompt_demo import DEMO_REWARD, demo_prompt_splits
from wgpu_train.data.prompt_tokenize import tokenize_prompts
from wgpu_train.data.sources import resolve_data
from wgpu_train.engines.protocol import SequenceObjective
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training import checkpoint
from wgpu_train.training.grpo_rows import (Generation, GenerationStream, build_generation, completion_lists,
                                           cut_rows, padded, score_reference, score_rows, weighted)
from wgpu_train.training.metrics import fmt, num
from wgpu_train.training.objectives import objective_class
from wgpu_train.training.preference_scoring import mean_metrics
from wgpu_train.training.rewards import RewardFunction, check_reward_weights, compute_rewards, load_rewards
from wgpu_train.training.trainer import Trainer

COMPLETIONS_FILE = "completions.jsonl"


class GRPOTrainer(Trainer):
    """A Trainer whose objective is GRPO (config.grpo_settings()) over prompt-only data: a step's batch is
    batch_size x grad_accum completions, num_generations of each of its prompts. reward_funcs: Python callables
    with TRL's signature f(prompts, completions, **columns) -> list[float | None], after config.reward's."""

    def __init__(self, config, log=None, reward_funcs=None, process=None, placement=None):
        dropout = config.lora_dropout
        if dropout:     # TRL's disable_dropout: a deterministic policy for its ratios
            config = dataclasses.replace(config, lora_dropout=0.0)
        super().__init__(config, log, process, placement)
        if dropout:
            self.log(f"lora_dropout {dropout:g} is off for --objective grpo, as TRL's trainers disable dropout")
        self.settings = config.grpo_settings()
        self.unit = objective_class(config.objective)(self.settings)       # its traits, advantages and loss
        specs = config.reward_specs() or ([] if reward_funcs else [DEMO_REWARD] if config.data is None else [])
        self.rewards = (load_rewards(specs, config.reward_pattern) if specs or not reward_funcs else []) + [
            RewardFunction(getattr(f, "__name__", f"reward_{i}"), f) for i, f in enumerate(reward_funcs or ())]
        try:
            weights = [float(w) for w in config.reward_weights.split(",")] if config.reward_weights else None
        except ValueError:
            raise ConfigError(f"--reward-weights takes comma-separated numbers, got {config.reward_weights!r}") \
                from None
        self.reward_weights = check_reward_weights(weights, self.rewards)          # (F,)
        self.check_resumed_objective(self.settings)
        self.prompts = {}                  # split -> [PromptExample]
        self._generation: Generation | None = None
        self._step_metrics: list = []
        self._reward = {"before": None, "after": None}
        self._completions = None           # completions.jsonl, open while training
        self._waiting: list = []           # its rows drawn before a resumed run's first step completed
        self.held_out_rewards = False      # the greedy reward on held-out prompts before and after (setup)
        self.part_seconds: dict = {}       # part of the steps -> (seconds, tokens) (_time)
        self._ref_engine = None            # the engine of the KL's reference adapter (setup)
        self.reference_adapter = None      # its folder: --ref-adapter, or the adapter the run started from

    # ---- data ---------------------------------------------------------------------------------------
    def _read_data(self, model_cfg):
        cfg = self.config
        self.tokenizer = load_tokenizer(self.model_dir)
        if cfg.data is None:
            s = demo_prompt_splits(self.data_path)
        else:
            s = resolve_data(self.data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid, cfg.columns,
                             kind=self.unit.data)
        self.splits = s
        self.max_seq_len = min(cfg.max_seq_len, model_cfg.max_position_embeddings)
        lines, self.truncated, self.dropped = [], 0, 0
        for split in ("train", "valid", "test"):
            self.prompts[split], stats = tokenize_prompts(self.tokenizer, getattr(s, split), cfg.max_prompt_length,
                                                          use_chat_template=not cfg.no_chat_template)
            lines.append(f"{split} {stats.describe()}")
            self.truncated += stats.n_truncated
        if not self.prompts["train"]:
            raise DataError(f"no training prompts in {s.files.get('train', self.data_path)}")
        self.train_examples, self.valid_examples = self.prompts["train"], self.prompts["valid"]
        self.n_skipped = s.n_skipped
        everything = [e for split in self.prompts.values() for e in split]
        top = max(int(e.input_ids.max()) for e in everything)
        if top >= model_cfg.vocab_size:
            raise ConfigError(f"the tokenizer produces token id {top} but the model has vocab_size "
                              f"{model_cfg.vocab_size}: tokenizer and model do not belong together")
        longest = max(e.input_ids.size for e in everything)
        room = model_cfg.max_position_embeddings
        if longest + self.settings.max_completion_length > room:
            raise ConfigError(f"a prompt of {longest} tokens and --max-completion-length "
                              f"{self.settings.max_completion_length} exceed the model's {room} positions: lower "
                              f"--max-completion-length or give --max-prompt-length")
        self.log(f"data: {s.files.get('train', self.data_path)} ({s.format}); {'; '.join(lines)}; rewards: "
                 + ", ".join(f"{r.name} x {w:g}" for r, w in zip(self.rewards, self.reward_weights)))

    def _make_stream(self, accum: int):
        """The prompts' stream; ConfigError (one line) when the training prompts do not fill one step."""
        rows, g, n = self.config.batch_size * accum, self.settings.num_generations, len(self.prompts["train"])
        if n < rows // g:
            raise ConfigError(f"a step of {rows} completions takes {rows // g} prompts ({g} completions each), but "
                              f"the training data holds {n}: give more prompts, or lower --batch-size or "
                              f"--grad-accum")
        return GenerationStream(self.prompts["train"], rows // g, self.config.seed, self.settings.num_iterations)

    def _micro_batch_rows(self) -> int:
        return self.config.batch_size

    # ---- a generation ---------------------------------------------------------------------------------
    def _sample(self, examples, seeds) -> tuple[list, np.ndarray]:
        """(completion ids of each row, (R,) whether each was cut at max_completion_length) for the prompts of
        `examples`, one row per seed, sampled with the current adapter. A completion ends where TRL 1.16's
        GRPOTrainer ends it: at the tokenizer's EOS or the generation config's (tokenizer.eos_token_ids), not at
        the vocabulary's other end-of-turn tokens that `generate` also stops at; one that ends in neither (nor in
        the pad token, as TRL counts it) was cut."""
        s = self.settings
        stops = list(self.tokenizer.eos_token_ids)
        out = self.model.generate_batch([e.input_ids for e in examples], max_new_tokens=s.max_completion_length,
                                        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seeds,
                                        stop_token_ids=stops)
        ended = set(stops) | {self.tokenizer.pad_token_id}
        cut = np.array([not (ids and ids[-1] in ended) for ids in out], bool)
        return out, cut

    def _texts(self, examples, completions) -> list:
        """The completions as TRL passes them to reward functions: strings, or for a conversational prompt one
        assistant message."""
        out = []
        for ex, ids in zip(examples, completions):
            text = self.tokenizer.decode([t for t in ids if t not in set(self.tokenizer.eos_token_ids)])
            out.append([{"role": "assistant", "content": text}] if isinstance(ex.record.prompt, list) else text)
        return out

    def _rewards(self, examples, completions, step: int) -> np.ndarray:
        """(R, F) rewards of the rows (NaN: a function's "not applicable")."""
        records = [ex.record for ex in examples]
        names = sorted({k for r in records for k in r.columns})
        columns = {k: [r.columns.get(k) for r in records] for k in names}
        return compute_rewards(self.rewards, [r.prompt for r in records], self._texts(examples, completions),
                               columns, step, completion_ids=[list(map(int, c)) for c in completions],
                               max_steps=self.total_steps)

    def _generate(self, indices, score_policy: bool = True) -> Generation:
        """A step's generation: its completions, rewards, advantages and the scores its steps need. This process
        samples and rewards its share of whole groups (a group's advantages need all its rewards); every
        process then holds every row's rewards and completions (process.gather) and computes the same
        advantages. score_policy False (the steps' own loss heads compute the policy's log-probabilities,
        _one_pass): only the reference is scored, with the adapter off; True: the policy too, in the same
        engine call, where mu, beta or cispo need it (the weighted steps' two-pass path, in one process)."""
        s, cfg = self.settings, self.config
        g = s.num_generations
        everyone = [self.prompts["train"][i] for i in indices for _ in range(g)]        # TRL's order: G in a row
        p0, p1 = self.process.share(len(indices))
        r0, r1 = p0 * g, p1 * g
        # the sampling RNG: one seed per row from (run seed, step), so a resumed run draws the same completions
        seeds = [int(x) for x in np.random.SeedSequence([cfg.seed, self.step]).generate_state(len(everyone))]
        t0 = time.perf_counter()
        completions, cut = self._sample(everyone[r0:r1], seeds[r0:r1])
        t1 = time.perf_counter()
        per_func = self._rewards(everyone[r0:r1], completions, self.step + 1)
        t2 = time.perf_counter()
        total = len(everyone)
        padded = np.full((r1 - r0, s.max_completion_length), -1, np.int64)           # (rows, C)
        for row, ids in zip(padded, completions):
            row[:len(ids)] = ids
        gathered = self.process.gather(np.concatenate([padded, cut[:, None], per_func], axis=1), r0, total)
        width = s.max_completion_length
        all_ids = gathered[:, :width].astype(np.int64)                                  # (R, C)
        all_cut = gathered[:, width].astype(bool)                                       # (R,)
        per_func = gathered[:, width + 1:].astype(np.float64)                           # (R, F)
        advantages, rewards, metrics = self.unit.advantages(per_func, self.reward_weights,
                                                            [r.name for r in self.rewards])
        metrics.update(self.unit.completion_metrics((all_ids >= 0).sum(axis=1), all_cut))
        gen = self._generation_of(np.asarray(indices), all_ids, all_cut, advantages, metrics)
        if not score_policy:
            # the step's own loss head computes the policy's log-probabilities (the first step's are the old
            # policy's of the next ones): only the reference, a forward with the adapter off, is scored here
            if s.uses_reference:
                gen.ref_logps = self._every_row(self._score_reference(gen.micro, gen.masks), gen)
        elif s.num_iterations > 1 or s.uses_reference or s.loss_type == "cispo":
            # the policy's scores serve the ratios' old policy (mu > 1), the KL (beta > 0) and cispo's logged
            # loss, whose value (not its gradient, the clamped ratio times the advantage) is the log-probabilities
            gen.policy_logps, gen.ref_logps = self._score(gen.micro, gen.masks, reference=s.uses_reference)
            gen.old_logps = gen.policy_logps if s.num_iterations > 1 else None
        self._time("generation", t1 - t0, sum(len(c) for c in completions))
        self._time("rewards", t2 - t1)
        self._time("scoring", time.perf_counter() - t2)
        self._log_completions(everyone, completion_lists(all_ids), per_func, rewards, advantages)
        return gen

    def _generation_of(self, indices, completions, truncated, advantages, metrics: dict) -> Generation:
        """The Generation of a step's prompts `indices`, every row's completions (R, C), truncation (R,) and
        advantages (R,) (from its rewards, or a checkpoint): this process's micro-batches and every row's mask."""
        g = self.settings.num_generations
        p0, p1 = self.process.share(len(indices))
        return build_generation([self.prompts["train"][i] for i in indices for _ in range(g)], indices, completions,
                                truncated, advantages, metrics, (p0 * g, p1 * g), self.config.batch_size,
                                self.pad_id, self.settings.mask_truncated_completions)

    def _every_row(self, mine: np.ndarray, gen: Generation) -> np.ndarray:
        """(R, W): this process's rows (its micro-batches' (rows, T) values) with every other process's."""
        r0, _ = gen.rows
        return self.process.gather(padded(mine, gen.mask.shape[1]), r0, gen.mask.shape[0])

    def _one_pass(self) -> bool:
        """Whether a step's own forward computes the log-probabilities its weights need: the engine's
        TokenObjective at the token importance-sampling level (the weights computed in the loss head), a
        SequenceObjective at GSPO's sequence level (a row's mean log-ratio: the host's weights between the
        head's forward and backward). The two-pass path (the policy scored, then the weighted step) serves GSPO
        on a model whose engine takes no host function mid-step (pipeline stages), and tests and benchmarks
        that compare with it."""
        return self.placement.sequence_objectives or self.settings.importance_sampling_level == "token"

    def _score_reference(self, micro, masks) -> np.ndarray:
        """The reference's per-token log-probabilities (R, T), no policy forward: the --ref-adapter model's, else
        forwards with the adapter switched off."""
        return score_reference(self._ref_engine or self.engine, micro, masks, self._ref_engine is not None)

    def _score(self, micro, masks, reference: bool):
        """(the policy's, the reference's or None) per-token log-probabilities (R, T) of the rows, T the longest
        micro-batch's length; with reference, the adapter switched off scores in the same engine calls."""
        if reference and self._ref_engine is not None:
            return score_rows(self.engine, micro, masks, False)[0], self._score_reference(micro, masks)
        return score_rows(self.engine, micro, masks, reference)

    def _time(self, part: str, seconds: float, tokens: int = 0):
        """Add to the run's time in one part of its steps (generation, rewards, scoring, train_step): the
        timings `bench --only grpo` reports; generation also counts its tokens."""
        seconds0, tokens0 = self.part_seconds.get(part, (0.0, 0))
        self.part_seconds[part] = (seconds0 + seconds, tokens0 + tokens)

    # ---- the step -----------------------------------------------------------------------------------
    def _step(self):
        cfg, s = self.config, self.settings
        indices, epoch_done = self.next_batch()
        lr = self.schedule.lr_at(self.step + 1)
        t0 = time.perf_counter()
        with self.interrupt.step():
            if self._generation is None or (self.stream.position - 1) % s.num_iterations == 0:
                self._generation = self._generate(indices, score_policy=not self._one_pass())
            gen = self._generation
            t_train = time.perf_counter()
            mask = gen.mask                                                                 # (R, W)
            first = (self.stream.position - 1) % s.num_iterations == 0
            if self._one_pass():
                result, count, grad_norm, applied = self._one_pass_step(gen, mask, first, lr)
            else:
                if first:            # the weights that generated: the scores taken then are the current ones
                    # (beta 0 and mu 1 but cispo: the ratio is 1 whatever they are, TRL's detach, and no forward
                    # scores them)
                    logps = gen.policy_logps if gen.policy_logps is not None else np.zeros(mask.shape)
                else:
                    logps, _ = self._score(gen.micro, gen.masks, reference=False)
                result = self.unit.step_loss(logps, gen.old_logps, gen.ref_logps, gen.advantages, mask,
                                             cfg.batch_size, int(mask.sum()))
                batches = weighted(gen.micro, gen.masks, result.dlogps)
                if batches is None:      # every completion masked: nothing carries a gradient
                    count, grad_norm, applied = 0, None, True
                else:
                    _, count, grad_norm, applied = self._train_step(batches, cfg.optimizer_params(lr),
                                                                    self.step + 1)
            self._time("train_step", time.perf_counter() - t_train)
        seconds = time.perf_counter() - t0
        self.step += 1
        self._step_metrics.append(gen.metrics | result.metrics)
        if not applied:
            self._log_skipped()
        return gen, epoch_done, lr, result.loss * max(count, 1), max(count, 1), grad_norm, seconds

    def _one_pass_step(self, gen: Generation, mask, first: bool, lr):
        """A step whose loss head computes its gradient weights from its own log-probabilities (one policy
        forward; at the sequence level through the host, _row_weights): (step_loss's result of the
        log-probabilities the heads read back, count, grad_norm, applied). This process trains its own rows
        (process.train_step with own=True); the weights' normalisers are those of every row (mask (R, W)), so
        the gradients summed over the processes are the step's. The first step of a generation has no old
        log-probabilities (the ratio is 1, TRL's detach); its log-probabilities are the old policy's of the
        steps that reuse the generation."""
        cfg, s = self.config, self.settings
        old = None if first else gen.old_logps
        objective = self.unit.token_objective(old, gen.ref_logps, gen.advantages, mask, cfg.batch_size,
                                              int(mask.sum()))
        logps = np.zeros(mask.shape)
        count, grad_norm, applied = 0, None, True
        if mask.any():              # else every completion is masked: nothing carries a gradient
            micro, r0 = [], gen.rows[0]
            for batch, m in zip(gen.micro, gen.masks):
                rows, width = m.shape
                micro.append(batch + (cut_rows(objective, r0, rows, width) if objective is not None else
                                      SequenceObjective(self._row_weights(gen, mask, old, r0, m)),))
                r0 += rows
            _, count, grad_norm, applied = self._train_step(micro, cfg.optimizer_params(lr), self.step + 1,
                                                            own=True)
            width = max(m.shape[1] for m in gen.masks)
            logps, entropies = (self._every_row(np.concatenate([padded(v.astype(np.float64) * m, width)
                                                                for v, m in zip(values, gen.masks)]), gen)
                                for values in (self.engine.step_logps, self.engine.step_entropies))
        else:
            entropies = None
        if first and s.num_iterations > 1:
            gen.policy_logps = gen.old_logps = logps
        result = self.unit.step_loss(logps, old, gen.ref_logps, gen.advantages, mask, cfg.batch_size,
                                     int(mask.sum()), entropies)
        return result, count, grad_norm, applied

    def _row_weights(self, gen: Generation, mask, old, r0: int, micro_mask):
        """A SequenceObjective's function for the micro-batch of rows r0 .. (GSPO's sequence level, whose ratio
        is a row's mean log-ratio): its tokens' weights -N * dloss/dlogp from its own log-probabilities. A row's
        derivatives depend on its own log-probabilities alone (the normalisers on the masks), so step_loss over
        the step with the other rows left at 0 gives this micro-batch's."""
        cfg = self.config
        rows, width = micro_mask.shape
        total = int(mask.sum())

        def weights(logps):
            full = np.zeros(mask.shape)
            full[r0:r0 + rows, :width] = np.asarray(logps, np.float64) * micro_mask
            dlogps = self.unit.step_loss(full, old, gen.ref_logps, gen.advantages, mask, cfg.batch_size,
                                         total).dlogps[r0:r0 + rows, :width]
            return np.where(micro_mask, -total * dlogps, 0.0).astype(np.float32)
        return weights

    def _input_tokens(self, gen: Generation) -> int:
        return gen.input_tokens

    def _step_shares(self) -> tuple[int, str]:
        return (min(len(b) for b in self.stream.epoch_batches(self.stream.epoch)),
                "prompt(s) (each worker samples whole groups of completions)")

    def _progress_extra(self) -> dict:
        reward = self._step_metrics[-1].get("reward") if self._step_metrics else None
        return {} if reward is None else {"reward": f"{reward:.3f}"}

    # ---- what a run shows ---------------------------------------------------------------------------
    def _log_completions(self, examples, completions, per_func, rewards, advantages):
        """completions.jsonl: each row of this generation, as TRL's log_completions shows them (a resumed run's,
        once its first step completes: RunFiles.hold)."""
        if not self.writes_files or (self._completions is None and not self.files.resumed):
            return
        texts = self._texts(examples, completions)
        for i, ex in enumerate(examples):
            row = {"step": self.step + 1, "prompt": ex.record.prompt,
                   "completion": texts[i] if isinstance(texts[i], str) else texts[i][0]["content"],
                   "completion_ids": [int(t) for t in completions[i]],
                   "rewards": {r.name: num(per_func[i, j]) for j, r in enumerate(self.rewards)},
                   "reward": num(rewards[i]), "advantage": num(advantages[i])}
            self._waiting.append(json.dumps(row) + "\n")
        if self._completions is not None:
            self._write_completions()

    def _write_completions(self):
        self._completions.writelines(self._waiting)
        self._completions.flush()
        self._waiting = []

    def _open_outputs(self):
        super()._open_outputs()
        if self.writes_files:
            self.files.hold(self._open_completions)

    def _open_completions(self):
        """completions.jsonl opened (a resumed run's cut back to its checkpoint's step), with the rows waiting."""
        path = self.out / COMPLETIONS_FILE
        if self.resumed_from and path.is_file():     # the generations after the resumed step are drawn again
            start = self.progress.start_step
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start]
            path.write_text("".join(line + "\n" for line in kept))
        self._completions = open(path, "a" if self.resumed_from else "w")
        if not self.resumed_from:
            self.files.wrote(path)
        self._write_completions()

    def train(self) -> dict:
        try:
            return super().train()
        finally:
            if self._completions is not None:
                self._completions.close()

    def _write_row(self, row: dict):
        if "split" not in row and "grad_norm" in row and self._step_metrics:
            row = {**row, **{k: num(v) for k, v in mean_metrics(self._step_metrics).items()}}
            self._step_metrics = []
        super()._write_row(row)

    # ---- evaluation: the mean reward of greedy answers on held-out prompts ----------------------------
    def evaluate(self) -> dict | None:
        return None

    def held_out(self) -> tuple[str, list]:
        return ("test", self.prompts["test"]) if self.prompts.get("test") else ("valid", self.prompts["valid"])

    def held_out_reward(self) -> dict | None:
        """{"reward", "n", "split"}: the mean weighted reward of greedy completions of the held-out prompts (at
        most max_eval_samples of them); None without held-out prompts."""
        split, examples = self.held_out()
        examples = examples[:self.config.max_eval_samples or None]
        if not examples:
            return None
        out = self.model.generate_batch([e.input_ids for e in examples],
                                        max_new_tokens=self.settings.max_completion_length, temperature=0.0,
                                        stop_token_ids=list(self.tokenizer.eos_token_ids))
        rewards = np.nansum(self._rewards(examples, out, self.step) * self.reward_weights, axis=1)
        return {"reward": float(rewards.mean()), "n": len(examples), "split": split}

    def _evaluate_before(self):
        if self.held_out_rewards:
            self._reward_row(self.process.from_first(self.held_out_reward), "before")

    def _reward_row(self, result, when: str):
        if result is None:
            return
        self._reward[when] = result["reward"]
        self._write_row({"step": self.step, "epoch": self.epoch_float(), "split": result["split"],
                         "held_out_reward": result["reward"], "n": result["n"]})
        self.log(f"reward {when} training: {fmt(result['reward'], '.3f')} (greedy, {result['n']} {result['split']} "
                 f"prompts)")

    # ---- checkpoints: a generation that later steps reuse (num_iterations > 1) is kept with them ------------
    def _reused(self) -> bool:
        """Whether the next step reuses the current generation."""
        return self._generation is not None and self.stream.position % self.settings.num_iterations != 0

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "objective": dataclasses.asdict(self.settings),
                 "reference_adapter": self.reference_adapter}
        if self._reused():
            state["generation"] = {"metrics": self._generation.metrics}
        return state

    def checkpoint_arrays(self) -> dict:
        """A reused generation's every row (any number of processes may resume it): its prompts, completions,
        truncation, advantages and log-probabilities."""
        if not self._reused():
            return {}
        gen = self._generation
        out = {"indices": gen.indices, "completions": gen.completions, "truncated": gen.truncated,
               "advantages": gen.advantages}
        for name in ("policy_logps", "old_logps", "ref_logps"):
            if getattr(gen, name) is not None:
                out[name] = getattr(gen, name)
        return out

    def setup(self):
        super().setup()
        # --eval-generate: the greedy reward on held-out prompts before and after, in place of exact match
        self.held_out_rewards, self.eval_generate = self.eval_generate, False
        # the policy's and the reference's log-probabilities at the sampling temperature, as TRL takes them
        self.engine.set_loss_temperature(self.settings.temperature)
        # the KL's reference: --ref-adapter, else the adapter the run started from (--adapter-path: TRL keeps a
        # frozen copy of a loaded adapter), recorded for a resume; else the base model (the adapter switched off)
        self.reference_adapter = (self.config.ref_adapter or (self.continued_from and str(self.continued_from))
                                  or (self.resume.state.get("reference_adapter") if self.resume else None))
        if self.settings.uses_reference and self.reference_adapter:
            self._ref_engine = self.placement.reference_engine(self, self.reference_adapter)
            self._ref_engine.set_loss_temperature(self.settings.temperature)
            self.log(f"reference: the base model with the adapter {self.reference_adapter}")
        elif self.settings.uses_reference:
            self.log("reference: the base model (the adapter switched off), scored with each generation")
        saved = self.resume.state.get("generation") if self.resume else None
        if saved:
            arrays = checkpoint.read_arrays(self.resume.folder)
            gen = self._generation_of(arrays["indices"], arrays["completions"], arrays["truncated"],
                                      arrays["advantages"], saved["metrics"])
            gen.policy_logps, gen.old_logps, gen.ref_logps = (arrays.get(n) for n in ("policy_logps", "old_logps",
                                                                                      "ref_logps"))
            self._generation = gen
        return self

    def _summary(self, stopped, adapter_step, after, em_after, ckpt, run, wall) -> dict:
        if adapter_step is not None and self.held_out_rewards and stopped != "interrupted":
            self._reward_row(self.process.from_first(self.held_out_reward), "after")
        summary = super()._summary(stopped, adapter_step, after, em_after, ckpt, run, wall)
        summary["objective"] = {"name": self.config.objective, **dataclasses.asdict(self.settings),
                                "rewards": [r.name for r in self.rewards],
                                "reward_weights": self.reward_weights.tolist()}
        summary.update(reward_before=self._reward["before"], reward_after=self._reward["after"],
                       reward_split=self.held_out()[0] if self.held_out_rewards else None)
        return summary
