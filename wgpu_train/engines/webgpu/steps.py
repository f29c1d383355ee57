"""The WebGPU engine's steps (StepRunner, a part that WgpuEngine owns): logits, loss, forward-backward and the
whole optimizer step recorded into one command encoder (or several submissions, planned from the last step's
time), a data-parallel gradient reduction, and the counted submissions."""
from __future__ import annotations

import os
import time

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig
from wgpu_train.models.layer_plan import INPUT
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages
from wgpu_train.engines.shared.quant import F16_MAX
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.buffers import BucketCache
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.device.recorder import count_submissions, submit
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.dora import DoraNorms
from wgpu_train.engines.webgpu.dropout_seeds import DropoutSeeds
from wgpu_train.engines.webgpu.layers import LayerRecorder
from wgpu_train.engines.webgpu.optimizer import Optimizer
from wgpu_train.engines.webgpu.tensors import F32
from wgpu_train.engines.protocol import LossScaler, Precision, SequenceObjective, TokenObjective


def _logps(results, at_row: int, n_head: int, head_order, shape, sign: float = -1.0) -> np.ndarray:
    """A micro-batch's (B, T) float32 log-probabilities (sign -1: the loss rows) or entropies (sign 1) from the
    loss head's rows read back at results[at_row:] in the head's row order (0 where a position has no target)."""
    logps = np.zeros(int(np.prod(shape)), np.float32)
    rows = sign * results[at_row:at_row + n_head]
    if head_order is None:
        logps[:] = rows
    else:
        logps[head_order] = rows
    return logps.reshape(shape)


def _copy_rows(rec, results, at_row: int, acts) -> tuple:
    """Record copies of a micro-batch's loss rows and entropy rows into results at at_row (read back with the
    rest); where they lie: (at_row, rows, the head's row order), as _read_rows takes it."""
    K.copy(rec, (results, at_row), acts.loss_rows, acts.n_head)
    K.copy(rec, (results, at_row + acts.n_head), acts.entropy_rows, acts.n_head)
    return at_row, acts.n_head, acts.head_order


def _read_rows(out, where: tuple, targets) -> tuple:
    """The (B, T) log-probabilities and entropies (0 where targets are ignored) of a micro-batch whose rows
    _copy_rows put at `where` of the read-back results out."""
    at_row, n_head, head_order = where
    logps = _logps(out, at_row, n_head, head_order, targets.shape)
    entropies = (targets != IGNORE_INDEX) * _logps(out, at_row + n_head, n_head, head_order, targets.shape, sign=1.0)
    return logps, entropies


class StepRunner:
    """Runs the protocol's passes over the engine's other parts: it uploads each micro-batch into a bucket
    (buckets), records the layers (layers), draws dropout seeds (dropout) and updates (optimizer), and keeps
    what a step leaves: `results` (loss sums, the norm, log-probabilities), `step_logps`, `last_step`,
    `last_profile`, `last_timing`, and the dispatches per submission planned from the last step's time."""

    def __init__(self, rt: Runtime, cfg: ModelConfig, precision: Precision, buckets: BucketCache, layers: LayerRecorder,
                 dropout: DropoutSeeds, optimizer: Optimizer, dora: DoraNorms, step_buf, counters: dict):
        """step_buf: the step's scalars (grad_scale first), which layers' cross-entropy backward reads."""
        self.rt, self.cfg, self.precision, self.counters = rt, cfg, precision, counters
        self.buckets, self.layers, self.dropout, self.optimizer, self.dora = buckets, layers, dropout, optimizer, dora
        self.step_buf = step_buf
        self.results = rt.buffer(4 * F32, "results")       # loss_sum, count, (norm, clip, finite)
        self.scored_rows = rt.buffer(F32, "scored_rows")     # token_losses(reference=True): both passes' loss rows
        self.step_logps: list = []      # the last train_step's log-probabilities of its TokenObjective micro-batches
        self.step_entropies: list = []  # and the entropies of its policy's distributions there
        self.last_step: dict = {}
        self.last_profile: dict = {}
        self.last_timing: dict = {}
        # GPU seconds one submission may hold (WGPU_TRAIN_MAX_SUBMIT_S), and the dispatches per submission
        # that keep a step under it (0: the whole step in one), measured from the previous step
        self.max_submit_s = float(os.environ.get("WGPU_TRAIN_MAX_SUBMIT_S", "1.0"))
        self.dispatch_budget = 0
        self.router_aux_loss_coef = 0.0   # the engine's set_router_aux_loss
        self.last_aux_loss = None         # the last train_step's router aux loss (mean over micro-batches), or None
        self.tower = None       # the vision tower TowerImages run through (engine.set_vision_tower), or None

    def logits(self, ids, segment_ids, position_ids):
        """(B, T, V) float32 logits; ids (B, T), or a stage's input (BucketCache.upload_batch)."""
        b, t = segment_ids.shape
        acts = self.buckets.activations(b, t, train=False)
        self.buckets.upload_batch(acts, ids, segment_ids, position_ids)
        before = dict(self.rt.counters)
        self.layers.training = False
        rec = self.rt.recorder()
        self.layers.record_forward(rec, acts)
        rec.submit()
        v, c = self.cfg.vocab_size, self.cfg.hidden_size
        out = np.empty((acts.n, v), np.float32)
        for r0 in range(0, acts.n, acts.head_rows):
            rows = min(acts.head_rows, acts.n - r0)
            rec = self.rt.recorder()
            self.layers.head_logits(rec, acts, at(acts.xf, r0 * c), rows)
            rec.submit()
            out[r0:r0 + rows] = self.rt.read(acts.logits, np.float32, (rows, v))
        count_submissions(self.rt, self.counters, before)
        return out.reshape(b, t, v)

    def _record_scoring(self, ids, targets, segment_ids, position_ids) -> tuple:
        """A batch uploaded and its forward and loss head recorded, no backward: (recorder, bucket, counters before)."""
        b, t = segment_ids.shape
        acts = self.buckets.activations(b, t, train=False)
        self.buckets.upload_batch(acts, ids, segment_ids, position_ids, targets)
        before = dict(self.rt.counters)
        self.layers.training = False
        rec = self.rt.recorder()
        self.layers.record_forward(rec, acts)
        self.layers.record_head(rec, acts, backward=False)
        return rec, acts, before

    def loss(self, ids, targets, segment_ids, position_ids):
        return self.submit_loss(*self._record_scoring(ids, targets, segment_ids, position_ids))

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """(B, T) float32: each position's loss, minus the log-probability of its target (0 where ignored); one
        submission, one readback of the loss head's rows. With reference, (the policy's, the reference's): the
        forward and loss head recorded with the adapter as it is, its loss rows copied aside, then again with
        the adapter switched off, and both read back: still one submission and one readback."""
        rec, acts, before = self._record_scoring(ids, targets, segment_ids, position_ids)
        m = acts.n_head
        if reference:
            self._reserve_scored_rows(2 * m)
            rec.copy(acts.loss_rows, 0, self.scored_rows, 0, m * F32)
            enabled, self.layers.adapter_enabled = self.layers.adapter_enabled, False
            try:
                self.layers.record_forward(rec, acts)
                self.layers.record_head(rec, acts, backward=False)
            finally:
                self.layers.adapter_enabled = enabled
            rec.copy(acts.loss_rows, 0, self.scored_rows, m * F32, m * F32)
            rec.read_back(self.scored_rows, np.float32, (2, m))
        else:
            rec.read_back(acts.loss_rows, np.float32, (1, m))
        rec.submit()
        rows = rec.result()                                      # (passes, n_head) in the loss head's row order
        count_submissions(self.rt, self.counters, before)
        out = np.zeros((len(rows), segment_ids.size), np.float32)        # (passes, B*T)
        if acts.head_order is None:
            out[:] = rows
        else:
            out[:, acts.head_order] = rows
        out = out.reshape((len(rows),) + segment_ids.shape)               # (passes, B, T)
        return (out[0], out[1]) if reference else out[0]

    def _reserve_scored_rows(self, n: int):
        """Room for n float32 loss rows in scored_rows (before the recording that uses it is submitted)."""
        if self.scored_rows.size < n * F32:
            old, self.scored_rows = self.scored_rows, self.rt.buffer(n * F32, "scored_rows")
            self.rt.release(old)

    def submit_loss(self, rec, acts, before) -> tuple:
        """Sum the recorded micro-batch's loss rows, submit, and read back (loss_sum, trained tokens)."""
        K.cross_entropy_reduce(rec, self.results, acts.loss_rows, acts.valid_rows, acts.n_head)
        rec.read_back(self.results, np.float32, (2,))
        rec.submit()
        loss_sum, count = rec.result()
        count_submissions(self.rt, self.counters, before)
        return float(loss_sum), int(round(count))

    def submit_loss_rows(self, rec, acts, before, targets) -> tuple:
        """submit_loss, and the micro-batch's log-probabilities and entropies (B, T) (0 where targets are ignored)
        read back with it: (loss_sum, trained tokens, log-probabilities, entropies)."""
        m = acts.n_head
        if self.results.size < (2 + 2 * m) * F32:
            old, self.results = self.results, self.rt.buffer((2 + 2 * m) * F32, "results")
            self.rt.release(old)
        K.cross_entropy_reduce(rec, self.results, acts.loss_rows, acts.valid_rows, m)
        where = _copy_rows(rec, self.results, 2, acts)
        rec.read_back(self.results, np.float32, (2 + 2 * m,))
        rec.submit()
        out = rec.result()
        count_submissions(self.rt, self.counters, before)
        return (float(out[0]), int(round(out[1])), *_read_rows(out, where, targets))

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch (gradients accumulate); grad_scale one number or a
        weight per token (B, T); returns (loss_sum, count), the loss unweighted."""
        return self.submit_loss(*self.record_forward_backward(ids, targets, segment_ids, position_ids, grad_scale))

    def record_forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale, objective=None,
                                aux_weight=None, prior=None) -> tuple:
        """forward_backward's micro-batch uploaded and recorded, not submitted: (recorder, bucket, counters
        before); ids (B, T), or a stage's input (BucketCache.upload_batch). With a TokenObjective, grad_scale (one
        number) times the weights the loss head computes from its own rows, and the entropies written too. The
        router's aux loss at aux_weight (None: the coefficient's full weight); prior (a pipeline's last stage): a
        buffer of the earlier stages' load-balancing statistics (2E + 1) f32, added to this forward's before the
        backward (None: none)."""
        b, t = segment_ids.shape
        acts = self.buckets.activations(b, t, train=True)
        per_token = objective is None and np.ndim(grad_scale) > 0
        self.buckets.upload_batch(acts, ids, segment_ids, position_ids, targets,
                                  weights=grad_scale if per_token else None, objective=objective)
        acts.entropies = objective is not None
        self.rt.write(self.step_buf, np.array([1.0 if per_token else grad_scale], np.float32))
        self.dropout.write(0, self.layers.lora)
        before = dict(self.rt.counters)
        rec = self.rt.recorder()
        # the router's aux loss by default at the coefficient's full weight (transformers' loss: the mean token loss
        # plus coef times the aux loss), as the NumPy engine's forward_backward
        self.layers.training = True
        self.layers.router_aux_weight = self.router_aux_loss_coef if aux_weight is None else aux_weight
        self.layers.record_forward(rec, acts)
        if prior is not None and acts.moe is not None:
            K.add_inplace(rec, acts.moe.balance, prior, 2 * self.cfg.moe.num_experts + 1)
        self.layers.record_backward(rec, acts)
        self.layers.training, self.layers.router_aux_weight = False, 0.0
        return rec, acts, before

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None,
                   scaler: LossScaler | None = None):
        """One optimizer step over micro-batches [(ids, targets, segment_ids, position_ids[, weights]), ...] in
        one submit (weights (B, T): each token's gradient weight, uploaded with the batch); a micro-batch may end
        with its images (shared/image_tokens.ImageTokens), uploaded into its slot, or with TowerImages: the vision
        tower's forward recorded into the slot's embeddings, and with LoRA on it, its backward after the
        micro-batch's, from the image rows' gradient (the tower's LoRA trains with the engine's: optimizer.set_tower).

        The only readback is [loss_sum, count] per micro-batch and the gradient norm with its
        finite flag. Returns (loss_sum, token_count, grad_norm, applied). With `reduce` (the engine
        protocol's), the step is two submits: the first ends by reading the gradients back (the packed LoRA
        gradient buffer in one readback; with full fine-tuning, one per gradient buffer), `reduce`'s result is
        uploaded in one write per buffer, and the second clips and updates. With profile=True,
        `last_profile` holds GPU seconds per op group (timestamp queries), or the wall-clock time of
        the submission where the adapter has no timestamp queries; profile="total" gives the GPU's
        busy time as one figure. `last_timing` holds the Python recording time and the step's wall time.
        scaler: f16's LossScaler, which the step applies and updates (None in fp32 / bf16).
        """
        started = time.perf_counter()
        total = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        rt = self.rt
        before = dict(rt.counters)
        n_micro = len(micro_batches)
        # results: [loss_sum, count] per micro-batch, [norm, clip, finite], the router's aux loss per micro-batch
        # (where it is on), then the loss rows and the entropy rows of the micro-batches with an objective (their
        # log-probabilities and entropies, read back with the rest)
        objectives = [mb[4] if len(mb) > 4 and isinstance(mb[4], (TokenObjective, SequenceObjective)) else None
                      for mb in micro_batches]
        aux_at, n_aux = 2 * n_micro + 3, n_micro if self.router_aux_loss_coef else 0
        size = aux_at + n_aux + 2 * sum(mb[0].size for mb, o in zip(micro_batches, objectives) if o is not None)
        if self.results.size < size * F32:
            self.results = rt.buffer(size * F32, "results")
        # scaler: f16's loss scaling (the engine's), the loss gradient scaled, the gradients unscaled
        rt.write(self.step_buf, np.array([1.0 / max(total, 1) * (scaler.scale if scaler is not None else 1.0)],
                                         np.float32))
        self.dropout.reserve(n_micro)
        if self.tower is None:      # no tower here (a reference engine's): the images' embeddings from the host
            micro_batches = [(*mb[:-1], mb[-1].host()) if isinstance(mb[-1], TowerImages) else mb
                             for mb in micro_batches]
        towered = [len(mb[-1].pixels) for mb in micro_batches if isinstance(mb[-1], TowerImages)]   # images, or
        # Qwen's patches
        trains_tower = bool(towered) and self.tower.params is not None
        if towered:     # every buffer of the tower's forwards (and backwards) allocated before they are recorded
            self.tower.check_batch(max(towered))
            self.tower.reserve(max(towered), trains_tower)
        rec = rt.recorder(profile=profile, max_dispatches=self.dispatch_budget)
        self.optimizer.record_zero_grads(rec)
        self.layers.training = True
        # each micro-batch's share of the step's gradient, as the token loss's (f16: times the loss scale)
        self.layers.router_aux_weight = self.router_aux_loss_coef / n_micro * (scaler.scale if scaler else 1.0)
        used, scored, at_row = [], [], aux_at + n_aux
        early = []          # GPU seconds per op group of the submissions a SequenceObjective ended (profile)
        images = self.buckets.images
        for j, (ids, targets, seg, pos, *extra) in enumerate(micro_batches):
            # every micro-batch has its own input slot: queue writes all land before the submission runs
            b, t = ids.shape
            acts = self.buckets.activations(b, t, train=True, keep=used)
            used.append(acts.key)
            objective = objectives[j]
            host = isinstance(objective, SequenceObjective)
            own = extra.pop() if extra and isinstance(extra[-1], (ImageTokens, TowerImages)) else None   # its images
            tokens = images.tokens if images is not None else None
            if own is not None:
                images.tokens = own
            try:
                self.buckets.upload_batch(acts, ids, seg, pos, targets, slot=j,
                                          objective=None if host else objective,
                                          weights=extra[0] if extra and objective is None else None)
            finally:
                if own is not None:
                    images.tokens = tokens
            acts.entropies = objective is not None
            self.dropout.write(j, self.layers.lora)
            im = acts.images if acts.images is not None and acts.images.pixels is not None else None
            if im is not None:      # the tower's embeddings of the micro-batch's images, in its slot
                tower_cache = self.tower.record_forward(rec, im.pixels, im.outputs, slot=j, keep=trains_tower)
            self.layers.record_forward(rec, acts)
            if host:     # the step so far submitted, the head's log-probabilities to the host and its weights back
                self.layers.record_head(rec, acts, backward=False, part="forward")
                rec.read_back(acts.loss_rows, np.float32, (acts.n_head,))
                rec.submit()
                logps = _logps(rec.result(), 0, acts.n_head, acts.head_order, ids.shape)
                early.append(rec.timings() if profile else {})
                self.buckets.upload_row_weights(acts, objective.weights(logps), slot=j)
                rec = rt.recorder(profile=profile, max_dispatches=self.dispatch_budget)
            self.layers.record_backward(rec, acts, head_part="backward" if host else None)
            if im is not None and trains_tower:     # the tower's LoRA gradients from the image rows' (and DeepStack's)
                self.tower.record_backward(rec, im.output_grads, tower_cache)
            K.cross_entropy_reduce(rec, (self.results, 2 * j), acts.loss_rows, acts.valid_rows, acts.n_head)
            if n_aux:
                self.layers.record_router_aux_loss(rec, acts, (self.results, aux_at + j))
            if objective is not None:
                scored.append(_copy_rows(rec, self.results, at_row, acts))
                at_row += 2 * acts.n_head
            else:
                scored.append(None)
        self.layers.training, self.layers.router_aux_weight = False, 0.0
        if scaler is not None:
            self.optimizer.record_unscale(rec, scaler.scale)
        first = {}
        if reduce is not None:
            first = self.reduce_gradients(rec, reduce, total, profile)
            rec = rt.recorder(profile=profile, max_dispatches=self.dispatch_budget)
        norm_at = (self.results, 2 * n_micro)
        self.optimizer.record_update(rec, hp, step, norm_at)
        self.dora.stale = True          # A and B moved: the next forward recomputes DoRA's norms
        rec.read_back(self.results, np.float32, (at_row,))
        submitted = time.perf_counter()
        rec.submit()
        out = rec.result()
        done = time.perf_counter()
        self.last_timing = {"record_s": submitted - started, "wall_s": done - started,
                            **({"reduce_s": first["reduce_s"]} if first else {})}
        self._plan_submissions(rec, done - submitted)
        if profile:
            prof = {}
            for part in early + [first.get("profile", {})]:
                for k, v in part.items():
                    prof[k] = prof.get(k, 0.0) + v
            for k, v in rec.timings().items():
                prof[k] = prof.get(k, 0.0) + v
            self.last_profile = prof or {"whole step (wall clock: no timestamp-query)": done - submitted}
        count_submissions(self.rt, self.counters, before)
        rows = [(None, None) if where is None else _read_rows(out, where, mb[1])
                for where, mb in zip(scored, micro_batches)]
        self.step_logps = [logps for logps, _ in rows]
        self.step_entropies = [entropies for _, entropies in rows]
        self.last_aux_loss = float(np.mean(out[aux_at:aux_at + n_aux], dtype=np.float64)) if n_aux else None
        loss_sum = float(out[0:2 * n_micro:2].sum())
        if self.precision.loss_scaling and not np.isfinite(loss_sum):
            # a non-finite loss comes from the forward (the loss scale only scales the backward)
            j = int(np.flatnonzero(~np.isfinite(out[0:2 * n_micro:2]))[0])
            self._refuse_f16_overflow(micro_batches[j])
        norm, finite = float(out[2 * n_micro]), out[2 * n_micro + 2] > 0.5
        if not finite:
            self.counters["nonfinite_skipped"] += 1
        if scaler is not None:
            scaler.update(bool(finite))
        self.last_step = {k: rt.counters[k] - before[k] for k in ("submits", "readbacks", "bytes_uploaded", "bytes_read")}
        return loss_sum, total, norm if finite else float("nan"), bool(finite)

    def _refuse_f16_overflow(self, micro_batch):
        """Raise the one-line ConfigError of engines/numpy/precision.py for a micro-batch whose f16 forward gave a
        non-finite loss, naming where its activations first overflow: the embedding, or the first layer whose
        output (the residual stream, which an overflow anywhere in the layer reaches) holds inf or NaN. A forward
        in one submission, then one readback per layer up to that one: only on the way to stopping the run."""
        ids, targets, seg, pos, *_ = micro_batch
        acts = self.buckets.activations(*ids.shape, train=True)
        self.buckets.upload_batch(acts, ids, seg, pos, targets)
        rec = self.rt.recorder()
        self.layers.record_forward(rec, acts)
        submit(self.rt, self.counters, rec)
        n, span = acts.n * self.cfg.hidden_size, self.layers.span
        outputs = [("the embedding", acts.layers[span.start][INPUT])] + \
            [(f"layer {i}", acts.layers[i + 1][INPUT] if i + 1 in acts.layers else acts.x_final) for i in span]
        for where, buf in outputs:
            values = storage.read(self.rt, buf, n)
            if not np.isfinite(values).all():
                raise ConfigError(f"activations overflow float16 in {where} (its output holds inf or NaN; float16 "
                                  f"holds {F16_MAX:g}): train with --precision bf16, which has float32's range")

    def reduce_gradients(self, rec, reduce, total: int, profile) -> dict:
        """Submit what `rec` holds, reading the gradients back (the first span with it), pass them through
        `reduce` and upload its result; {"reduce_s": seconds in reduce, "profile": GPU seconds per op group}."""
        spans = self.optimizer.grad_spans()
        if spans:
            buf, off, n = spans[0]
            rec.read_back(buf, np.float32, (n,), off * F32)
        rec.submit()
        parts = [rec.result()] if spans else []
        prof = rec.timings() if profile else {}
        parts += [self.rt.read(buf, np.float32, (n,), offset=off * F32) for buf, off, n in spans[1:]]
        flat = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        t0 = time.perf_counter()
        out = np.asarray(reduce(flat, int(total)), dtype=np.float32)
        reduce_s = time.perf_counter() - t0
        if out.shape != flat.shape:
            raise ValueError(f"train_step: reduce returned {out.shape[0]} gradients for {flat.shape[0]}")
        at = 0
        for buf, off, n in spans:
            self.rt.write(buf, out[at:at + n], off * F32)
            at += n
        return {"reduce_s": reduce_s, "profile": prof}

    def _plan_submissions(self, rec, last_part_s: float):
        """Split the next steps into submissions of at most about max_submit_s of GPU work each (Windows resets a
        device whose command buffer runs for 2 s, macOS has a watchdog too), from the time the last submission
        of this step took to finish: the earlier ones ran while the rest was recorded, so only the last one's
        time is the GPU's alone."""
        part = rec.dispatches - rec.flushed_at
        if last_part_s > self.max_submit_s and part > 1:
            self.dispatch_budget = max(1, int(part * self.max_submit_s / last_part_s))
        elif self.dispatch_budget and last_part_s < 0.5 * self.max_submit_s:
            grown = 2 * self.dispatch_budget
            self.dispatch_budget = 0 if grown >= rec.dispatches else grown

