"""A GRPO generation's rows: the prompts' stream, the Generation a step's completions make (its micro-batches and
masks), the engines' scoring of them, and the array helpers the GRPO trainer cuts and pads them with."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from wgpu_train.data.batching import Example
from wgpu_train.data.preference_batching import PreferenceStream, row_batches
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.protocol import TokenObjective
from wgpu_train.training.config import PAD_MULTIPLE
from wgpu_train.training.evaluate import engine_batch
from wgpu_train.training.preference_scoring import token_losses


class GenerationStream(PreferenceStream):
    """The prompts of each generation, num_iterations steps in a row (TRL's mu reuses a generation), in a seeded
    order per epoch; a step's batch is its prompts' indices. Every step has prompts_per_step prompts: an epoch's
    prompts left over are not drawn (TRL's RepeatSampler drops an incomplete last batch), so a step's rows always
    split into its micro-batches."""

    def __init__(self, examples, prompts_per_step: int, seed: int, iterations: int):
        super().__init__(examples, prompts_per_step, seed, shuffle=True)
        self.iterations = iterations

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        return [b for b in super().epoch_batches(epoch) if len(b) == self.per_step for _ in range(self.iterations)]

    @staticmethod
    def example_ids(ex) -> tuple:
        return (ex.input_ids,)


@dataclass
class Generation:
    """One generation: G completions of each of a step's prompts (R rows in all), this process's micro-batches
    of prompt + completion rows (its whole groups: rows r0 .. r1; all of them in one process), and what the
    steps that reuse it need (advantages; the old and reference per-token log-probabilities of every row)."""

    indices: np.ndarray             # (P,) the step's prompts
    completions: np.ndarray         # (R, C) every row's completion ids, -1 past its end
    truncated: np.ndarray           # (R,) bool: cut at max_completion_length
    rows: tuple                     # (r0, r1): this process's rows
    micro: list                     # [(ids, targets, segment_ids, position_ids[, ImageTokens])] (B, T) each, this
    #                                 process's
    masks: list                     # [(B, T) bool]: their completion tokens that carry loss
    mask: np.ndarray                # (R, W) bool: every row's, W the longest micro-batch of all the rows'
    input_tokens: int               # every row's non-padding tokens
    advantages: np.ndarray          # (R,)
    policy_logps: np.ndarray | None  # (R, W) the policy's at generation time (scored when beta > 0, mu > 1 or cispo)
    old_logps: np.ndarray | None    # (R, W) the ratios' old policy (num_iterations > 1), else None (TRL's detach)
    ref_logps: np.ndarray | None    # (R, W) of the reference (beta > 0), else None
    metrics: dict                   # rewards and completions, by TRL's names
    tool_mask: np.ndarray | None = None     # (R, C) 0 on the tools' results (no loss), with tools
    prompt_ids: np.ndarray | None = None    # (R, P) with tools, every row's prompt ids (an environment's reset
    #                                         changes them), -1 past their end: prompt_table's


def build_generation(everyone, indices, completions, truncated, advantages, metrics: dict, rows: tuple,
                     batch_size: int, pad_id: int, mask_truncated: bool, tool_mask=None,
                     to_engine=engine_batch) -> Generation:
    """The Generation of a step's prompts `indices` (everyone: each row's prompt example, G in a row), every row's
    completions (R, C), truncation (R,) and advantages (R,): the micro-batches of this process's rows (r0, r1),
    every row's mask. mask_truncated: DAPO's overlong filtering (no loss at all on a cut completion). tool_mask
    (R, C): 0 on the tools' results, which carry no loss and are not counted in input_tokens (TRL's tool_mask).
    to_engine: a Batch -> its engine micro-batch (records with images: the VisionModel's engine_batch, the rows
    carrying their prompt's images)."""
    examples, tool_tokens = [], 0
    for r, (ex, ids, cut) in enumerate(zip(everyone, completion_lists(completions), truncated)):
        full = np.concatenate([ex.input_ids, np.asarray(ids, ex.input_ids.dtype)])
        labels = full.astype(np.int64)
        labels[:ex.input_ids.size] = IGNORE_INDEX
        if tool_mask is not None:
            tools = np.flatnonzero(np.asarray(tool_mask[r][:len(ids)]) == 0)
            labels[ex.input_ids.size + tools] = IGNORE_INDEX
            tool_tokens += tools.size
        if cut and mask_truncated:
            labels[:] = IGNORE_INDEX
        examples.append(Example(full, labels, bool(cut), list(ex.record.images)))
    r0, r1 = rows
    micro = [to_engine(b) for b in row_batches(examples[r0:r1], batch_size, pad_id, PAD_MULTIPLE)]
    every = micro if (r0, r1) == (0, len(examples)) else \
        [engine_batch(b) for b in row_batches(examples, batch_size, pad_id, PAD_MULTIPLE)]   # masks: no images
    width = max(mb[0].shape[1] for mb in every)
    mask = np.concatenate([padded(mb[1] != IGNORE_INDEX, width) for mb in every])            # (R, W)
    return Generation(indices, completions, truncated, (r0, r1), micro, [mb[1] != IGNORE_INDEX for mb in micro],
                      mask, int(sum((mb[2] > 0).sum() for mb in every)) - tool_tokens, advantages, None, None,
                      None, metrics, tool_mask)


def score_reference(engine, micro, masks, adapter_on: bool) -> np.ndarray:
    """The reference's per-token log-probabilities (R, T) of the micro-batches: `engine` with its adapter on
    (a --ref-adapter model) or switched off (the policy's engine)."""
    width = max(m[0].shape[1] for m in micro)
    engine.set_adapter_enabled(adapter_on)
    try:
        return np.concatenate([padded(-token_losses(engine, m).astype(np.float64) * mask, width)
                               for m, mask in zip(micro, masks)])
    finally:
        engine.set_adapter_enabled(True)


def score_rows(engine, micro, masks, reference: bool):
    """(the policy's, the reference's or None) per-token log-probabilities (R, T) of the micro-batches, T the
    longest one's length; with reference, the adapter switched off scores in the same engine calls."""
    width = max(m[0].shape[1] for m in micro)
    policy, ref = [], []
    for m, mask in zip(micro, masks):
        if reference:
            losses, ref_losses = token_losses(engine, m, reference=True)
            ref.append(padded(-ref_losses.astype(np.float64) * mask, width))
        else:
            losses = token_losses(engine, m)
        policy.append(padded(-losses.astype(np.float64) * mask, width))
    return np.concatenate(policy), (np.concatenate(ref) if reference else None)


def padded(a: np.ndarray, width: int) -> np.ndarray:
    """(B, T) -> (B, width), zeros (False) on the right."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])))


def cut_rows(objective: TokenObjective, r0: int, rows: int, width: int) -> TokenObjective:
    """A step's TokenObjective (R, T) cut to rows r0 .. r0 + rows and the first `width` positions (a
    micro-batch's)."""
    def cut(a):
        return None if a is None else a[r0:r0 + rows, :width]

    return dataclasses.replace(objective, scale=cut(objective.scale), advantages=objective.advantages[r0:r0 + rows],
                               old_logps=cut(objective.old_logps), ref_logps=cut(objective.ref_logps))


def weighted(micro, masks, dlogps: np.ndarray) -> list | None:
    """The micro-batches with per-token gradient weights: the engine divides the gradients by the step's
    trained tokens N and a token's loss is minus its log-probability, so -N * dloss/dlogp gives the objective's
    gradient. None when no token carries loss."""
    total = float(sum(m.sum() for m in masks))
    if not total:
        return None
    out, r0 = [], 0
    for (ids, targets, seg, pos, *images), mask in zip(micro, masks):
        rows, width = ids.shape
        w = np.where(mask, -total * dlogps[r0:r0 + rows, :width], 0.0)                   # (B, T)
        out.append((ids, targets, seg, pos, w.astype(np.float32), *images))              # images: ImageTokens
        r0 += rows
    return out


def prompt_table(everyone) -> np.ndarray:
    """(R, P): the prompt ids of every row's example, -1 past each one's end."""
    table = np.full((len(everyone), max(ex.input_ids.size for ex in everyone)), -1, np.int64)
    for r, ex in enumerate(everyone):
        table[r, :ex.input_ids.size] = ex.input_ids
    return table


def with_prompts(everyone, table: np.ndarray) -> list:
    """The examples of `everyone` with the prompt ids of prompt_table's `table` (a checkpoint's rows)."""
    return [dataclasses.replace(ex, input_ids=ids[ids >= 0].astype(ex.input_ids.dtype))
            for ex, ids in zip(everyone, table)]


def completion_lists(completions: np.ndarray) -> list:
    """Each row's completion ids of (R, C), -1 past its end."""
    return [[int(t) for t in row[row >= 0]] for row in completions]
