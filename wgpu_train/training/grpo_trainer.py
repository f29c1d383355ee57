"""The GRPO Trainer (online RL with TRL GRPOTrainer's meanings): each generation samples --num-generations
completions of a step's prompts with the current adapter on the engine's KV cache, scores them with the reward
functions on the host, and turns the group-relative advantages into per-token gradient weights of the engine's
optimizer step (training/objectives/grpo.py: the clipped ratio to the old policy, the KL to the reference),
computed from the step's own forward (engine protocol TokenObjective / SequenceObjective: one policy forward a
step; the reference, the adapter off, scored once per generation); a generation serves --num-iterations steps.
With tools (TRL's tools / environment_factory: training/tools*.py; prompts with images too) a rollout runs the tool
loop, the tools' results masked out of the loss. (Over 450 lines: each method is the GRPO form of one of the
Trainer's hooks, data, step, records, evaluation and checkpoints; the rows are grpo_rows.py's, the tool loop
tools_rollouts.py's.) The completions and their rewards go to completions.jsonl."""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from wgpu_train.data.prompt_demo import DEMO_REWARD, demo_prompt_splits
from wgpu_train.data.prompt_tokenize import tokenize_prompts
from wgpu_train.data.prompt_vision import tokenize_vision_prompts, vision_prompt_record
from wgpu_train.data.vision_records import is_vision_data
from wgpu_train.data.sources import resolve_data
from wgpu_train.engines.protocol import SequenceObjective
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import load_tokenizer
from wgpu_train.training import checkpoint
from wgpu_train.training.grpo_rows import (Generation, GenerationStream, build_generation, completion_lists,
                                           cut_rows, padded, prompt_table, score_reference, score_rows, weighted,
                                           with_prompts)
from wgpu_train.training.metrics import fmt, num
from wgpu_train.training.objectives import objective_class
from wgpu_train.training.preference_scoring import mean_metrics
from wgpu_train.training.rewards import RewardFunction, check_reward_weights, compute_rewards, load_rewards
from wgpu_train.training.tools import run_toolbox
from wgpu_train.training.config import default_model_dir
from wgpu_train.training.evaluate import engine_batch
from wgpu_train.training.tools_demo import TOOL_DEMO_REWARD, demo_tokenizer, tool_demo_splits, warm_up
from wgpu_train.training.tools_rollouts import ToolRollouts
from wgpu_train.training.trainer import Trainer

COMPLETIONS_FILE = "completions.jsonl"


class GRPOTrainer(Trainer):
    """A Trainer whose objective is GRPO (config.grpo_settings()) over prompt-only data: a step's batch is
    batch_size x grad_accum completions, num_generations of each of its prompts. reward_funcs: Python callables
    with TRL's signature f(prompts, completions, **columns) -> list[float | None], after config.reward's. tools:
    Python functions the model may call (type hints and a docstring each), after config.tool's;
    environment_factory: TRL's, a class whose instance per rollout is reset() before it and whose public methods
    are tools (config.environment names one too); its get_reward() a reward named after the class."""

    def __init__(self, config, log=None, reward_funcs=None, process=None, placement=None, tools=None,
                 environment_factory=None):
        dropout = config.lora_dropout
        if dropout:     # TRL's disable_dropout: a deterministic policy for its ratios
            config = dataclasses.replace(config, lora_dropout=0.0)
        super().__init__(config, log, process, placement)
        if dropout:
            self.log(f"lora_dropout {dropout:g} is off for --objective grpo, as TRL's trainers disable dropout")
        self.settings = config.grpo_settings()
        self.unit = objective_class(config.objective)(self.settings)       # its traits, advantages and loss
        self.toolbox = run_toolbox(config, tools, environment_factory)
        if config.max_tool_calling_iterations is not None and not self.toolbox:
            raise ConfigError("--max-tool-calling-iterations limits the tool loop: give --tool or --environment")
        own = self.toolbox.reward_function()
        demo = TOOL_DEMO_REWARD if self.toolbox else DEMO_REWARD
        specs = config.reward_specs() or ([] if reward_funcs or own else [demo] if config.data is None else [])
        self.rewards = (load_rewards(specs, config.reward_pattern) if specs or not (reward_funcs or own) else []) + [
            RewardFunction(getattr(f, "__name__", f"reward_{i}"), f) for i, f in enumerate(reward_funcs or ())] + (
            [own] if own else [])
        try:
            weights = [float(w) for w in config.reward_weights.split(",")] if config.reward_weights else None
        except ValueError:
            raise ConfigError(f"--reward-weights takes comma-separated numbers, got {config.reward_weights!r}") \
                from None
        if own and weights is not None:        # TRL: the environment's reward column has weight 1
            weights.append(1.0)
        self.reward_weights = check_reward_weights(weights, self.rewards)          # (F,)
        self.check_resumed_objective(self.settings)
        self.prompts = {}                  # split -> [PromptExample]
        self._generation: Generation | None = None
        self._step_metrics: list = []
        self._reward = {"before": None, "after": None}
        self._tool_share = {"before": None, "after": None}
        self._completions = None           # completions.jsonl, open while training
        self._waiting: list = []           # its rows drawn before a resumed run's first step completed
        self.held_out_rewards = False      # the greedy reward on held-out prompts before and after (setup)
        self.part_seconds: dict = {}       # part of the steps -> (seconds, tokens) (_time)
        self._ref_engine = None            # the engine of the KL's reference adapter (setup)
        self.reference_adapter = None      # its folder: --ref-adapter, or the adapter the run started from
        self.tool_rollouts = None          # the tool loop's renderer and parser (_read_data), with tools
        self._span = None                  # records with images: how the model's images stand in the prompts

    # ---- data ---------------------------------------------------------------------------------------
    def _read_data(self, model_cfg):
        cfg = self.config
        self.tokenizer = load_tokenizer(self.model_dir)
        if self._tool_demo():
            self.tokenizer = demo_tokenizer(self.tokenizer)
        if is_vision_data(self.data_path):
            s = self._image_prompts()
        elif cfg.data is None:
            s = tool_demo_splits() if self.toolbox else demo_prompt_splits(self.data_path)
        else:
            s = resolve_data(self.data_path, cfg.valid_split, cfg.seed, cfg.skip_invalid, cfg.columns,
                             kind=self.unit.data)
        self.splits = s
        self.max_seq_len = min(cfg.max_seq_len, model_cfg.max_position_embeddings)
        lines, self.truncated, self.dropped = [], 0, 0
        for split in ("train", "valid", "test"):
            self.prompts[split], stats = (
                tokenize_vision_prompts(self.tokenizer, getattr(s, split), self._span) if self._span is not None else
                tokenize_prompts(self.tokenizer, getattr(s, split), cfg.max_prompt_length,
                                 use_chat_template=not cfg.no_chat_template))
            lines.append(f"{split} {stats.describe()}")
            self.truncated += stats.n_truncated
        if not self.prompts["train"]:
            raise DataError(f"no training prompts in {s.files.get('train', self.data_path)}")
        if self.toolbox:
            self._render_with_tools()
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

    def _image_prompts(self):
        """TRL's prompts with images (data/prompt_vision.py) of the run's vision file, split; the span of the
        model's images kept for their tokenization. The options that do not apply to them refused."""
        import json

        from wgpu_train.data.vision_records import model_image_span, vision_splits
        from wgpu_train.models.vision import VisionConfig

        cfg = self.config
        for flag, value in (("--no-chat-template", cfg.no_chat_template),
                            ("--max-prompt-length", cfg.max_prompt_length), ("--columns", cfg.columns)):
            if value:
                raise ConfigError(f"{flag} is not supported with images yet")
        where = self.model_dir / "config.json"
        vc = VisionConfig.from_config(json.loads(where.read_text()), str(where))
        self._span = model_image_span(self.tokenizer, vc, self.model_dir)
        s = vision_splits(self.data_path, cfg.valid_split, cfg.seed)
        rows = {split: [vision_prompt_record(r, f"{self.data_path}:{k + 1}") for k, r in enumerate(getattr(s, split))]
                for split in ("train", "valid")}
        self.n_images, self.cut_in_image = sum(len(r.images) for v in rows.values() for r in v), 0
        return dataclasses.replace(s, **rows)

    def _render_with_tools(self):
        """Tools: every prompt rendered with their schemas (TRL's apply_chat_template(tools=...)); they must be
        conversations, as TRL's tool loop reads a turn's parsed message; with images, their placeholders expanded."""
        if self.config.no_chat_template:
            raise ConfigError("tools are rendered by the chat template: leave out --no-chat-template")
        self.tool_rollouts = ToolRollouts(self.toolbox, self.tokenizer, self.config.max_tool_calling_iterations,
                                          self._span)
        for split, examples in self.prompts.items():
            for ex in examples:
                if not isinstance(ex.record.prompt, list):
                    raise DataError(f"{ex.record.source or split}: tools need conversational prompts (a list of "
                                    f"messages), as TRL's tool loop does")
                try:
                    ids = self.tool_rollouts.prompt_ids(ex.record.prompt, ex.record.images)
                except DataError as e:
                    raise DataError(f"{ex.record.source or split}: {e}") from None
                limit = self.config.max_prompt_length
                ex.input_ids = np.asarray(ids[-limit:] if limit else ids, np.int32)

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
        out = self._generate_rows(examples, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seeds)
        return out, self._cut(out)

    def _generate_rows(self, examples, **sampling) -> list:
        """Completions of the prompts of `examples` (generate_batch's sampling), up to max_completion_length
        tokens, ending at an EOS; records with images: each prompt's images prefilled with it (the tower's
        forward once per prompt, its rows sharing it)."""
        ids, images = [e.input_ids for e in examples], None
        if self.vision is not None:
            made: dict = {}
            for e in examples:
                if id(e) not in made:
                    made[id(e)] = self.vision.prompt_images(e.input_ids, e.record.images)
            ids, images = zip(*(made[id(e)] for e in examples))
        return self.model.generate_batch(list(ids), max_new_tokens=self.settings.max_completion_length,
                                         stop_token_ids=list(self.tokenizer.eos_token_ids),
                                         images=None if images is None else list(images), **sampling)

    def _cut(self, completions) -> np.ndarray:
        """(R,) whether each completion ends in neither an EOS nor the pad token (TRL's is_truncated)."""
        ended = set(self.tokenizer.eos_token_ids) | {self.tokenizer.pad_token_id}
        return np.array([not (ids and ids[-1] in ended) for ids in completions], bool)

    def _texts(self, examples, completions, tools=None) -> list:
        """The completions as TRL passes them to reward functions: strings, or for a conversational prompt one
        assistant message; with tools (a ToolBatch) each row's messages, every turn and tool result."""
        if tools is not None:
            return [r.turns for r in tools.rollouts]
        out = []
        for ex, ids in zip(examples, completions):
            text = self.tokenizer.decode([t for t in ids if t not in set(self.tokenizer.eos_token_ids)])
            out.append([{"role": "assistant", "content": text}] if isinstance(ex.record.prompt, list) else text)
        return out

    def _rewards(self, examples, completions, step: int, tools=None) -> np.ndarray:
        """(R, F) rewards of the rows (NaN: a function's "not applicable"); with tools (a ToolBatch) the rows'
        environments too, as TRL passes them (environments=)."""
        records = [ex.record for ex in examples]
        names = sorted({k for r in records for k in r.columns})
        columns = {k: [r.columns.get(k) for r in records] for k in names}
        if tools is not None and tools.environments is not None:
            columns["environments"] = tools.environments
        return compute_rewards(self.rewards, [r.prompt for r in records], self._texts(examples, completions, tools),
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
        tools = None
        if self.tool_rollouts is not None:      # the tool loop; an environment's reset may change the prompts
            tools = self.tool_rollouts.run(self.engine, everyone[r0:r1], s, seeds[r0:r1], vision=self.vision)
            everyone[r0:r1] = tools.examples
            completions = tools.completions
            cut = self._cut(completions)
        else:
            completions, cut = self._sample(everyone[r0:r1], seeds[r0:r1])
        t1 = time.perf_counter()
        per_func = self._rewards(everyone[r0:r1], completions, self.step + 1, tools)
        t2 = time.perf_counter()
        total, width = len(everyone), s.max_completion_length
        padded = np.full((r1 - r0, width), -1, np.int64)                                # (rows, C)
        tool_mask = np.ones((r1 - r0, width), np.int64)                                 # (rows, C) 0: a tool's
        counts = np.zeros((r1 - r0, 2), np.int64)                                       # (rows, 2) calls, failures
        for i, ids in enumerate(completions):
            padded[i, :len(ids)] = ids
            if tools is not None:
                tool_mask[i, :len(ids)] = tools.rollouts[i].tool_mask
                counts[i] = tools.rollouts[i].calls, tools.rollouts[i].failures
        parts = [padded, cut[:, None], per_func] + ([tool_mask, counts] if tools is not None else [])
        gathered = self.process.gather(np.concatenate(parts, axis=1), r0, total)
        all_ids = gathered[:, :width].astype(np.int64)                                  # (R, C)
        all_cut = gathered[:, width].astype(bool)                                       # (R,)
        per_func = gathered[:, width + 1:width + 1 + per_func.shape[1]].astype(np.float64)   # (R, F)
        all_mask = gathered[:, -width - 2:-2].astype(np.int64) if tools is not None else None   # (R, C)
        advantages, rewards, metrics = self.unit.advantages(per_func, self.reward_weights,
                                                            [r.name for r in self.rewards])
        model_tokens = ((all_ids >= 0) & (all_mask != 0) if tools is not None else all_ids >= 0).sum(axis=1)
        metrics.update(self.unit.completion_metrics(model_tokens, all_cut))      # TRL: tool tokens not counted
        if tools is not None:
            calls, failures = gathered[:, -2].sum(), gathered[:, -1].sum()
            metrics["tools/call_frequency"] = float(calls / total)
            metrics["tools/failure_frequency"] = float(failures / calls) if calls else 0.0
        turns = None
        if tools is not None:       # every row's prompt (its environment's reset) and turns, from every process
            everyone, turns = tools.every_row(self.process, everyone, r0)
        gen = self._generation_of(np.asarray(indices), all_ids, all_cut, advantages, metrics, all_mask, everyone)
        gen.prompt_ids = prompt_table(everyone) if tools is not None else None
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
        self._time("generation", t1 - t0, int(model_tokens[r0:r1].sum()))
        self._time("rewards", t2 - t1)
        self._time("scoring", time.perf_counter() - t2)
        self._log_completions(everyone, completion_lists(all_ids), per_func, rewards, advantages, turns)
        return gen

    def _generation_of(self, indices, completions, truncated, advantages, metrics: dict, tool_mask=None,
                       everyone=None) -> Generation:
        """The Generation of a step's prompts `indices`, every row's completions (R, C), truncation (R,) and
        advantages (R,) (from its rewards, or a checkpoint): this process's micro-batches and every row's mask.
        tool_mask (R, C): 0 on the tools' results (no loss); everyone: each row's prompt example (an
        environment's reset changes them), by default the prompts of `indices`."""
        g = self.settings.num_generations
        p0, p1 = self.process.share(len(indices))
        everyone = everyone or [self.prompts["train"][i] for i in indices for _ in range(g)]
        return build_generation(everyone, indices, completions, truncated, advantages, metrics, (p0 * g, p1 * g),
                                self.config.batch_size, self.pad_id, self.settings.mask_truncated_completions,
                                tool_mask, self.vision.engine_batch if self.vision is not None else engine_batch)

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
                micro.append(batch[:4] + (cut_rows(objective, r0, rows, width) if objective is not None else
                                          SequenceObjective(self._row_weights(gen, mask, old, r0, m)),) + batch[4:])
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

    def _step_model(self):      # the micro-batches carry their ImageTokens already (build_generation's)
        return self.engine

    def _input_tokens(self, gen: Generation) -> int:
        return gen.input_tokens

    def _step_shares(self) -> tuple[int, str]:
        return (min(len(b) for b in self.stream.epoch_batches(self.stream.epoch)),
                "prompt(s) (each worker samples whole groups of completions)")

    def _progress_extra(self) -> dict:
        reward = self._step_metrics[-1].get("reward") if self._step_metrics else None
        return {} if reward is None else {"reward": f"{reward:.3f}"}

    # ---- what a run shows ---------------------------------------------------------------------------
    def _log_completions(self, examples, completions, per_func, rewards, advantages, turns=None):
        """completions.jsonl: each row of this generation, as TRL's log_completions shows them (a resumed run's,
        once its first step completes: RunFiles.hold); with tools, every row's turns (row -> messages: each
        assistant turn with its calls, each tool result)."""
        if not self.writes_files or (self._completions is None and not self.files.resumed):
            return
        texts = self._texts(examples, completions)
        for i, ex in enumerate(examples):
            row = {"step": self.step + 1, "prompt": ex.record.prompt,
                   "completion": texts[i] if isinstance(texts[i], str) else texts[i][0]["content"],
                   "completion_ids": [int(t) for t in completions[i]],
                   "rewards": {r.name: num(per_func[i, j]) for j, r in enumerate(self.rewards)},
                   "reward": num(rewards[i]), "advantage": num(advantages[i])}
            if turns is not None and i in turns:
                row["turns"] = turns[i]
            self._waiting.append(json.dumps(row, default=str) + "\n")
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
        tools = None
        if self.tool_rollouts is not None:
            tools = self.tool_rollouts.run(self.engine, examples, self.settings, greedy=True, vision=self.vision)
            examples, out = tools.examples, tools.completions
        else:
            out = self._generate_rows(examples, temperature=0.0)
        rewards = np.nansum(self._rewards(examples, out, self.step, tools) * self.reward_weights, axis=1)
        result = {"reward": float(rewards.mean()), "n": len(examples), "split": split}
        if tools is not None:           # the share of rollouts that called a tool
            result["tool_share"] = float(np.mean([r.calls > 0 for r in tools.rollouts]))
        return result

    def _evaluate_before(self):
        if self.held_out_rewards:
            self._reward_row(self.process.from_first(self.held_out_reward), "before")

    def _reward_row(self, result, when: str):
        if result is None:
            return
        self._reward[when] = result["reward"]
        share = self._tool_share[when] = result.get("tool_share")
        self._write_row({"step": self.step, "epoch": self.epoch_float(), "split": result["split"],
                         "held_out_reward": result["reward"], "n": result["n"],
                         **({} if share is None else {"held_out_tool_share": share})})
        self.log(f"reward {when} training: {fmt(result['reward'], '.3f')} (greedy, {result['n']} {result['split']} "
                 f"prompts" + ("" if share is None else f"; {share:.0%} of them called a tool") + ")")

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
        truncation, advantages and log-probabilities; with tools, the rows' prompt ids and tool masks."""
        if not self._reused():
            return {}
        gen = self._generation
        out = {"indices": gen.indices, "completions": gen.completions, "truncated": gen.truncated,
               "advantages": gen.advantages}
        for name in ("policy_logps", "old_logps", "ref_logps", "tool_mask", "prompt_ids"):
            if getattr(gen, name) is not None:
                out[name] = getattr(gen, name)
        return out

    def _tool_demo(self) -> bool:
        """Whether this is the embedded tool demo: tools, and no --model, --data, adapter or resume."""
        cfg = self.config
        return bool(self.toolbox) and cfg.data is None and not cfg.resume and (
            getattr(self, "_warmed_up", False) or (cfg.model is None and not cfg.adapter_path))

    def setup(self):
        if self._tool_demo():          # its SFT warm-up first, then GRPO's LoRA on the model it wrote
            if "calculator" not in [t.__name__ for t in self.toolbox.all_tools()]:
                raise ConfigError("the embedded tool demo (no --data) asks for sums: give --tool calculator, or "
                                  "--data with prompts for your tools")
            tokenizer = demo_tokenizer(load_tokenizer(default_model_dir()))
            self.config = dataclasses.replace(self.config, model=str(warm_up(self.config, tokenizer, self.log)))
            self._warmed_up = True
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
            everyone = None
            if "prompt_ids" in arrays:      # the prompts the rollouts had (an environment's reset changes them)
                g = self.settings.num_generations
                everyone = with_prompts([self.prompts["train"][i] for i in arrays["indices"] for _ in range(g)],
                                        arrays["prompt_ids"])
            gen = self._generation_of(arrays["indices"], arrays["completions"], arrays["truncated"],
                                      arrays["advantages"], saved["metrics"], arrays.get("tool_mask"), everyone)
            gen.prompt_ids = arrays.get("prompt_ids")
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
        if self.toolbox:
            summary["objective"]["tools"] = [t.__name__ for t in self.toolbox.all_tools()]
            summary.update(tool_share_before=self._tool_share["before"], tool_share_after=self._tool_share["after"])
        return summary
