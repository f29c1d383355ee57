"""GRPO's multi-turn rollouts (TRL 1.16's GRPOTrainer._tool_call_loop): a turn that ends in a tool call gets the
tools' results, rendered as the chat template renders tool messages, and generation goes on after them, up to
max_tool_calling_iterations, each row continuing in its own KV cache row (a held DecodeBatch row, extended: only the
new tokens are prefilled). The tool results' tokens carry no loss (the tool mask)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from wgpu_train.engines.generate import DecodeBatch, Sampling


@dataclass
class Rollout:
    """One row's completion over all its turns."""

    ids: list                                       # (C,) the model's turns and the tool results between them
    tool_mask: list                                 # (C,) 1: the model's tokens, 0: a tool result's
    turns: list = field(default_factory=list)       # messages: parsed assistant turns and tool messages
    calls: int = 0
    failures: int = 0


class TurnSampler:
    """The rows of one DecodeBatch, held between turns: first samples every row's first turn, resume runs some of
    them on after tokens appended to what they generated. Row i draws from default_rng(seeds[i]) throughout.
    images: each prompt's ImageTokens (1, T) or None (VisionModel.prompt_images, with its engine ids as the prompt):
    prefilled with its first turn, kept in its cache row for the turns after."""

    def __init__(self, engine, prompts: Sequence[np.ndarray], max_len: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seeds=None, stop_token_ids=(), images=None):
        self.prompts = [np.asarray(p, np.int64) for p in prompts]
        self.images = list(images) if images is not None else [None] * len(self.prompts)
        self.batch = DecodeBatch(engine, len(self.prompts), max_len)
        seeds = list(seeds) if seeds is not None else [None] * len(self.prompts)
        self.sampling = [Sampling(temperature, top_k, top_p, s) for s in seeds]
        self.stops = list(stop_token_ids)
        self.slot_of: dict = {}

    def _run(self, rows) -> dict:
        out = {i: [] for i in rows}
        row_of = {self.slot_of[i]: i for i in rows}
        while len(self.batch):
            for token in self.batch.step():
                out[row_of[token.slot]].append(token.id)
        return out

    def first(self, budget: int) -> list:
        """Every row's first turn (ids, up to budget tokens, a stop token included)."""
        if budget < 1:
            return [[] for _ in self.prompts]
        for i, p in enumerate(self.prompts):
            self.slot_of[i] = self.batch.add(p, budget, self.sampling[i], self.stops, images=self.images[i],
                                             hold=True)
        out = self._run(range(len(self.prompts)))
        return [out[i] for i in range(len(self.prompts))]

    def resume(self, rows: Sequence[int], appended: Sequence, budgets: Sequence[int]) -> list:
        """The next turn of each of `rows`, after `appended` (each row's tokens after its last turn) and up to its
        budget (0: no turn)."""
        going = [i for i, n in zip(rows, budgets) if n > 0]
        for i, ids, n in zip(rows, appended, budgets):
            if n > 0:
                self.batch.extend(self.slot_of[i], ids, n)
        out = self._run(going)
        return [out.get(i, []) for i in rows]

    def close(self):
        self.batch.close()


def tool_rollouts(sampler, prompt_ids: Sequence, parse: Callable, suffix_ids: Callable, toolsets: Sequence[dict],
                  run_calls: Callable, max_completion: int, max_positions: int, max_iterations: int) -> list:
    """Each row's Rollout, as TRL's _tool_call_loop makes them: sampler.first gives every first turn; a row whose
    last turn (parse(ids, prefix ids) -> an assistant message) has tool_calls gets run_calls(calls, its toolset)
    -> (tool messages, calls, failures), their tokens suffix_ids(tool messages) and a next turn (sampler.resume)
    with the budget left of max_completion, until no row calls a tool or max_iterations rounds are done. Tool
    results that would take a row past max_completion tokens, or to max_positions, are dropped with the row's
    turns kept as they are (TRL's overlong roll-back)."""
    first = sampler.first(max_completion)
    rows = [Rollout(list(ids), [1] * len(ids)) for ids in first]
    pending = []
    for i, (r, ids) in enumerate(zip(rows, first)):
        r.turns.append(parse(ids, list(prompt_ids[i])))
        if r.turns[-1].get("tool_calls"):
            pending.append(i)
    iteration = 0
    while pending and iteration < max_iterations:
        going, suffixes = [], []
        for i in pending:
            r = rows[i]
            messages, calls, failures = run_calls(r.turns[-1]["tool_calls"], toolsets[i])
            r.calls += calls
            r.failures += failures
            suffix = list(suffix_ids(messages))
            total = len(prompt_ids[i]) + len(r.ids) + len(suffix)
            if len(r.ids) + len(suffix) > max_completion or total >= max_positions:
                continue                                # dropped: the row ends with its tool call
            r.turns += messages
            going.append(i)
            suffixes.append(suffix)
        if not going:
            break
        budgets = [max_completion - len(rows[i].ids) - len(s) for i, s in zip(going, suffixes)]
        turns = sampler.resume(going, suffixes, budgets)
        pending = []
        for i, suffix, ids in zip(going, suffixes, turns):
            r = rows[i]
            prefix = list(prompt_ids[i]) + r.ids + suffix
            r.ids += suffix + list(ids)
            r.tool_mask += [0] * len(suffix) + [1] * len(ids)
            if ids:
                r.turns.append(parse(list(ids), prefix))
                if r.turns[-1].get("tool_calls"):
                    pending.append(i)
        iteration += 1
    return rows
