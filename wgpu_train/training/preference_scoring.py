"""Scoring preference examples on an engine: sequence log-probabilities of their rows (engine protocol
token_losses), a preference objective over them, and its mean over a split; shared by the PreferenceTrainer's
steps and validation, `wgpu-train eval --objective` and `wgpu-train bench --only preference`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from wgpu_train.data.batching import Example
from wgpu_train.data.preference_batching import pair_rows, row_batches
from wgpu_train.engines.protocol import SequenceObjective
from wgpu_train.engines.shared.image_tokens import TowerImages
from wgpu_train.training.config import PAD_MULTIPLE
from wgpu_train.training.evaluate import engine_batch
from wgpu_train.training.objectives import DataKind, ObjectiveResult, PreferenceSettings

# The reference's summed log-probabilities of examples[indices]: fn(indices, mismatched) -> (R,), the rows in the
# order Scored holds them (pairs: every chosen row, then every rejected row; mismatched: KTO's KL rows).
Reference = Callable[[np.ndarray, bool], np.ndarray]
# The reference that is the policy's engine with its adapter switched off (TRL's reference of a PEFT model): scored
# with the policy in the same engine call, token_losses(..., reference=True) (one submission on the WebGPU engine)
ADAPTER_OFF = "adapter off"


@dataclass
class Scored:
    """Rows scored by an engine: per row the summed log-probability of its completion tokens, their count, the
    summed loss of every targeted token and their count; the engine micro-batches and their completion masks."""

    logps: np.ndarray           # (R,) float64
    tokens: np.ndarray          # (R,)
    loss_sums: np.ndarray       # (R,) float64
    targets: np.ndarray         # (R,)
    micro: list                 # [(ids, targets, segment_ids, position_ids)] of (B, T) each
    masks: list                 # [(B, T) bool] the completion tokens of each micro-batch
    reference_logps: np.ndarray | None = None   # (R,) float64: the adapter switched off (score's reference)


class PreferenceScorer:
    """Scores tokenized preference examples (PreferenceExample pairs, or KTO's UnpairedExample) on any engine,
    batch_size examples per micro-batch (a pair is two rows), and evaluates `settings`' objective over them.
    Examples with images: `vision` (the run's VisionModel) makes each micro-batch's ImageTokens (the tower's
    forward over its rows' images), which end its engine tuple and go to the engine scoring it; `image_ids`, the
    tokens of an image's run, are never trained (ORPO's NLL on the prompt leaves them out)."""

    def __init__(self, settings: PreferenceSettings, batch_size: int, pad_id: int, vision=None,
                 image_ids: frozenset = frozenset()):
        self.settings, self.batch_size, self.pad_id = settings, batch_size, pad_id
        self.unit = settings.unit                   # the objective: its traits and its loss
        self.paired = self.unit.data is DataKind.PAIRS
        self.vision, self.image_ids = vision, image_ids

    def micro_batches(self, rows: Sequence[Example]) -> list:
        """Engine micro-batches (ids, targets, segment_ids, position_ids[, ImageTokens]) of consecutive rows."""
        per_micro = self.batch_size * (2 if self.paired else 1)
        batches = row_batches(rows, per_micro, self.pad_id, PAD_MULTIPLE)
        return [self.vision.engine_batch(b) if self.vision is not None else engine_batch(b) for b in batches]

    def _whole(self, row: Example) -> Example:
        """A chosen row trained on every token (ORPO's NLL), an image's run left out."""
        labels = row.input_ids.astype(np.int64)                                          # (T,)
        labels[np.isin(labels, list(self.image_ids))] = -100
        return Example(row.input_ids, labels, row.truncated, row.images)

    def score(self, engine, examples: Sequence, indices, partners: np.ndarray | None = None,
              reference: bool = False) -> Scored:
        """The rows of examples[indices] (pairs: every chosen row, then every rejected row; with partners, KTO's
        (N,) mismatched partner of each example, its mismatched rows instead) scored by `engine`; with reference,
        also by the engine with its adapter switched off, in the same engine calls (reference_logps). The chosen
        rows of an objective that trains the prompt (ORPO: TRL's NLL term) are trained on every token, so their
        micro-batches target every token and the completion masks say which tokens make up the
        log-probabilities."""
        chosen = [examples[i] for i in indices]
        if partners is not None:
            rows = [examples[i].mismatched_row(examples[partners[i]]) for i in indices]
        else:
            rows = example_rows(chosen, self.paired)
        micro = self.micro_batches(rows)
        masks = [mb[1] != -100 for mb in micro]           # (B, T) completion tokens
        if self.unit.trains_prompt and partners is None:
            p = len(indices)
            micro = self.micro_batches([self._whole(r) if k < p else r for k, r in enumerate(rows)])
        logps, tokens, sums, counts = [np.zeros(0)], [np.zeros(0, np.int64)], [np.zeros(0)], [np.zeros(0, np.int64)]
        ref_logps = [np.zeros(0)]
        for mb, mask in zip(micro, masks):
            targets = mb[1]
            if reference:
                losses, ref_losses = token_losses(engine, mb, reference=True)                      # (B, T) each
                ref_logps.append(-(ref_losses.astype(np.float64) * mask).sum(axis=1))
            else:
                losses = token_losses(engine, mb)                                                  # (B, T)
            losses = losses.astype(np.float64)
            logps.append(-(losses * mask).sum(axis=1))
            tokens.append(mask.sum(axis=1))
            sums.append(losses.sum(axis=1))
            counts.append((targets != -100).sum(axis=1))
        return Scored(*(np.concatenate(x) for x in (logps, tokens, sums, counts)), micro, masks,
                      np.concatenate(ref_logps) if reference else None)

    def pair_micro_batches(self, examples: Sequence, indices) -> tuple[list, list, np.ndarray]:
        """The rows of the pairs examples[indices] as micro-batches that each hold whole pairs (batch_size pairs:
        their chosen rows, then their rejected rows), so that a step's own loss head can weigh a pair's rows
        (engine protocol SequenceObjective): (micro-batches, their completion masks, each of their rows' place in
        score's order, every chosen row then every rejected row). The chosen rows of an objective that trains
        the prompt target every token, as in score."""
        p = len(indices)
        rows = example_rows([examples[i] for i in indices], True)
        order = np.concatenate([np.r_[np.arange(k, min(k + self.batch_size, p)),
                                      p + np.arange(k, min(k + self.batch_size, p))]
                                for k in range(0, p, self.batch_size)])          # (2P,)
        rows = [rows[i] for i in order]
        micro = self.micro_batches(rows)
        masks = [mb[1] != -100 for mb in micro]           # (B, T) completion tokens
        if self.unit.trains_prompt:
            micro = self.micro_batches([self._whole(r) if i < p else r for r, i in zip(rows, order)])
        return micro, masks, order

    def train_pairs(self, engine, examples: Sequence, indices, ref: np.ndarray | None, train_step) -> tuple:
        """The optimizer step of the pairs examples[indices] in one policy forward: the engine's step with a
        SequenceObjective per micro-batch of whole pairs, whose host function turns the loss head's
        log-probabilities of its pairs into their tokens' weights (a pair's derivative depends on its own rows
        alone: the loss is a mean over pairs); the step's loss and metrics from the log-probabilities read back.
        ref: the reference's (2P,) summed log-probabilities in score's order (None without a reference);
        train_step(micro-batches) -> (loss_sum, count, grad_norm, applied), the engine's step (or a
        trainer's). (ObjectiveResult, Scored rows in score's order, count, grad_norm, applied)."""
        p = len(indices)
        micro, masks, order = self.pair_micro_batches(examples, indices)
        targets = np.concatenate([(mb[1] != -100).sum(axis=1) for mb in micro])           # (2P,) placed rows
        tokens = np.concatenate([m.sum(axis=1) for m in masks])
        total = float(targets.sum())
        nll_grad = 1.0 / max(int(targets[order < p].sum()), 1) if self.unit.trains_prompt else 0.0
        ref_placed = None if ref is None else ref[order]

        def weights_of(r0: int, mask, chosen_targets):
            def weights(logps):
                seq = (np.asarray(logps, np.float64) * mask).sum(axis=1)         # (2q,) this micro-batch's rows
                q = len(seq) // 2
                n = tokens[r0:r0 + 2 * q]
                rc, rr = (None, None) if ref_placed is None else (ref_placed[r0:r0 + q], ref_placed[r0 + q:r0 + 2 * q])
                part = self.unit.loss(seq[:q], seq[q:], n[:q], n[q:], rc, rr, nll=(0.0, 1))
                per_row = -total * part.dlogps * q / p                           # the step's mean over P pairs
                w = np.where(mask, per_row[:, None], 0.0)
                return (w + total * nll_grad * chosen_targets).astype(np.float32)
            return weights

        batches, r0 = [], 0
        for (ids, tg, seg, pos, *images), mask in zip(micro, masks):
            rows = ids.shape[0]
            chosen_targets = (np.arange(rows) < rows // 2)[:, None] & (tg != -100)
            batches.append((ids, tg, seg, pos, SequenceObjective(weights_of(r0, mask, chosen_targets)), *images))
            r0 += rows
        _, count, grad_norm, applied = train_step(batches)
        logps = np.concatenate([(lp.astype(np.float64) * m).sum(axis=1) for lp, m in zip(engine.step_logps, masks)])
        losses = np.concatenate([-(lp.astype(np.float64) * (mb[1] != -100)).sum(axis=1)
                                 for lp, mb in zip(engine.step_logps, micro)])
        back = np.argsort(order)                                                  # placed rows -> score's order
        logps, n, losses, targets = logps[back], tokens[back], losses[back], targets[back]
        result = self.unit.loss(logps[:p], logps[p:], n[:p], n[p:], None if ref is None else ref[:p],
                                None if ref is None else ref[p:], nll=(losses[:p].sum(), int(targets[:p].sum())))
        return result, Scored(logps, n, losses, targets, micro, masks, ref), count, grad_norm, applied

    def objective(self, engine, examples: Sequence, indices, reference: Reference | str | None = None,
                  partners: np.ndarray | None = None) -> tuple[ObjectiveResult, Scored]:
        """(ObjectiveResult, the policy's Scored rows) of examples[indices]: the policy is `engine`, the reference
        `reference` (objectives that use one; ADAPTER_OFF: `engine` with its adapter switched off, scored with the
        policy), KTO's mismatched pairs `partners` (the whole split's, see kl_partners)."""
        joint = self.unit.uses_reference and reference is ADAPTER_OFF
        scored = self.score(engine, examples, indices, reference=joint)
        logps, tokens = scored.logps, scored.tokens
        ref = None
        if self.unit.uses_reference:
            ref = scored.reference_logps if joint else reference(indices, False)
        if self.paired:
            p = len(indices)
            nll = (scored.loss_sums[:p].sum(), int(scored.targets[:p].sum()))
            result = self.unit.loss(logps[:p], logps[p:], tokens[:p], tokens[p:], None if ref is None else ref[:p],
                                    None if ref is None else ref[p:], nll=nll)
        else:
            kl = self.score(engine, examples, indices, partners, reference=joint)
            labels = np.array([examples[i].label for i in indices], bool)
            result = self.unit.loss(logps, ref, labels, kl.logps,
                                    kl.reference_logps if joint else reference(indices, True))
        return result, scored

    def evaluate(self, engine, examples: Sequence, reference: Reference | str | None = None,
                 partners: np.ndarray | None = None) -> dict | None:
        """The objective over every example, batch_size of them at a time as a training step takes them (KTO's KL
        estimate and ORPO's NLL are per step), and its metrics, each averaged over the steps weighted by their
        examples: {"loss", "perplexity": None, "tokens": the examples, "metrics"}; None without examples."""
        n = len(examples)
        if not n:
            return None
        losses, weights, metrics = [], [], []
        for i in range(0, n, self.batch_size):
            result, _ = self.objective(engine, examples, np.arange(i, min(i + self.batch_size, n)), reference,
                                       partners)
            losses.append(result.loss)
            weights.append(min(self.batch_size, n - i))
            metrics.append(result.metrics)
        return {"loss": float(np.average(losses, weights=weights)), "perplexity": None, "tokens": n,
                "metrics": mean_metrics(metrics, weights)}


def token_losses(engine, micro_batch: tuple, reference: bool = False):
    """engine.token_losses of an engine micro-batch (ids, targets, segment_ids, position_ids[, ImageTokens or
    TowerImages]), its images set on the engine while it scores; TowerImages of a tower with LoRA, with reference:
    two calls, the reference's with the adapter off before its images are made (the tower's LoRA off too)."""
    ids, targets, seg, pos, *images = micro_batch
    if reference and images and isinstance(images[0], TowerImages) and images[0].lora:     # the reference's: LoRA off
        policy = token_losses(engine, micro_batch)
        engine.set_adapter_enabled(False)
        try:
            return policy, token_losses(engine, micro_batch)
        finally:
            engine.set_adapter_enabled(True)
    if images:
        engine.set_images(images[0])
    try:
        return engine.token_losses(ids, targets, seg, pos, reference=True) if reference else \
            engine.token_losses(ids, targets, seg, pos)
    finally:
        if images:
            engine.set_images(None)


def example_rows(examples: Sequence, paired: bool) -> list[Example]:
    """The engine rows of examples: pairs' chosen rows, then their rejected rows; KTO's one row each."""
    return pair_rows(examples) if paired else [ex.row() for ex in examples]


def engine_reference(scorer: PreferenceScorer, engine, examples: Sequence,
                     partners: np.ndarray | None = None) -> Reference:
    """The reference that is `engine`'s scores of examples, the engine as it is (another model than the policy,
    e.g. the base with a reference adapter; the policy's own engine with its adapter off is ADAPTER_OFF)."""
    def reference(indices, mismatched: bool) -> np.ndarray:
        return scorer.score(engine, examples, indices, partners if mismatched else None).logps
    return reference


def mean_metrics(rows: list, weights=None) -> dict:
    """Each metric's (weighted) mean over the rows that have it."""
    weights = [1.0] * len(rows) if weights is None else weights
    keys = sorted({k for r in rows for k in r})
    return {k: float(np.average([r[k] for r in rows if k in r], weights=[w for r, w in zip(rows, weights) if k in r]))
            for k in keys}
