"""One pipeline stage on the WebGPU engine: the layers of a range on one device (the embedding on the first stage,
the final norm, head and loss on the last), its forward from the boundary's activations and its backward from the
boundary's gradient, each micro-batch in flight in buckets of its own, its layers' share of the router's
load-balancing statistics, and its AdamW update clipped by the global norm of every stage's gradients."""
from __future__ import annotations

import itertools

import numpy as np

from wgpu_train.adapters.dora import split_entry
from wgpu_train.engines.shared.boundary import pack_boundary, unpack_boundary
from wgpu_train.engines.webgpu.buffers import BucketCache
from wgpu_train.engines.webgpu.device.recorder import count_submissions, submit
from wgpu_train.engines.webgpu.engine import WgpuEngine
from wgpu_train.errors import ConfigError


class WgpuStage(WgpuEngine):
    """A WgpuEngine over the weights of the layers of `span` (and the embedding where `first`; the norm and head
    where `last`) that runs the protocol's PipelineStage methods. A training micro-batch's forward keeps its
    activations, in a bucket cache of its own (`slot`), until that micro-batch's backward, so a schedule may run
    several forwards first (GPipe, 1F1B); its dropout seeds keep the same slot. Each training forward advances
    the dropout position, as one process's micro-batch does, so every stage draws the masks one process would.
    Each call is one submission, whose inputs are written to the device and whose outputs are read back."""

    def __init__(self, cfg, weights: dict, rt, span: range, first: bool, last: bool, **kw):
        super().__init__(cfg, weights, rt, span=span, first=first, last=last, **kw)
        self.span, self.first, self.last = span, first, last
        self.counters["boundary_bytes_sent"] = 0
        self._spare: list = []       # the bucket caches of slots 1, 2, ... (slot 0 is the engine's own)
        self._kept: dict = {}        # micro-batch -> (slot, its activations), from its forward to its backward
        self._caches: dict = {}      # generation's KV caches by the driver's key
        self._reference = None       # --ref-adapter's modules of its layers: (path -> GpuLora, packed buffers)
        self._reference_on = False   # whether forwards run the reference's modules (stage_use_reference)
        self._balance: dict = {}     # micro-batch -> its forward's load-balancing statistics (2E + 1,) float64
        self._prior = None           # the last stage's buffer of the earlier stages' statistics (stage_loss)
        self._images: dict = {}      # micro-batch (None: an untrained forward's) -> its ImageTokens (stage_set_images)

    # ---- a bucket cache per micro-batch in flight ------------------------------------------------------------
    def _take_slot(self) -> int:
        """The first slot no kept micro-batch holds, its bucket cache made (sized for the adapter as it is) and
        its dropout seeds' room reserved."""
        held = {slot for slot, _ in self._kept.values()}
        slot = next(k for k in itertools.count() if k not in held)
        while len(self._spare) < slot:
            spare = BucketCache(self.rt, self.cfg, self.precision, self.counters, self.span, self.first, self.last)
            spare.set_adapter(self.lora, self._group_of, self.expert_lora)
            spare.set_checkpointing(self.gradient_checkpointing)
            spare.images = self.image_inputs      # each slot's image buffers are its own (images.ImageInputs)
            self._spare.append(spare)
        self.dropout.reserve(slot + 1, keep=True)
        return slot

    def _bucket_cache(self, slot: int) -> BucketCache:
        return self.buckets if slot == 0 else self._spare[slot - 1]

    def _release_acts(self):
        """Every bucket freed (the adapter or the trained tensors changed): the spare slots' caches dropped."""
        super()._release_acts()
        for spare in self._spare:
            spare.release()
        self._spare = []

    def set_gradient_checkpointing(self, on: bool = True):
        super().set_gradient_checkpointing(on)
        self._release_acts()

    # ---- images ---------------------------------------------------------------------------------------------
    def stage_set_images(self, micro, images):
        """The images of micro-batch `micro` (a shared/image_tokens.ImageTokens, or None; micro None: the untrained
        forwards'): every stage's attention takes their blocks and RoPE their M-RoPE positions, the stage holding
        a DeepStack layer adds its features, the first stage puts their embeddings in place of the placeholders'
        rows (and its backward gathers their rows' gradient: image_grad); a training micro-batch's are dropped
        after its backward."""
        self._images[micro] = images

    def _use_images(self, micro, drop: bool = False):
        """The uploads that follow take micro-batch `micro`'s images (dropped from the stage's where `drop`)."""
        self.set_images(self._images.pop(micro, None) if drop else self._images.get(micro))

    # ---- the boundary ---------------------------------------------------------------------------------------
    def _send(self, x) -> np.ndarray:
        packed = pack_boundary(x, self.precision)
        self.counters["boundary_bytes_sent"] += packed.nbytes
        return packed

    def stage_forward(self, micro, inputs, segment_ids, position_ids):
        """See PipelineStage.stage_forward."""
        training = micro is not None
        slot = self._take_slot() if training else 0
        cache = self._bucket_cache(slot)
        acts = cache.activations(*np.shape(segment_ids), train=training)
        self._use_images(micro)
        cache.upload_batch(acts, np.asarray(inputs), segment_ids, position_ids, slot=slot)
        if training:
            self.dropout.write(slot, self.layers.lora)
        # a training forward counts its layers' routing where the router's aux loss is on (its weight comes with
        # the backward)
        counted = training and self.steps.router_aux_loss_coef > 0
        self._submit(self.layers.record_forward, acts, training, self.steps.router_aux_loss_coef if counted else 0.0)
        if training:
            self._kept[micro] = (slot, acts)
        if counted:
            self._balance[micro] = self._read_balance(acts)
        return self._read_boundary(cache, acts.x_final, acts.n)

    def _submit(self, record, acts, training: bool, aux_weight: float = 0.0):
        """One submission of the layers' `record` (record_forward or record_backward) over acts, LoRA dropout on
        while training, the router's aux loss at aux_weight (0: off)."""
        rec = self.rt.recorder()
        self.layers.training, self.layers.router_aux_weight = training, aux_weight
        try:
            record(rec, acts)
        finally:
            self.layers.training, self.layers.router_aux_weight = False, 0.0
        submit(self.rt, self.counters, rec)

    def _read_balance(self, acts) -> np.ndarray:
        """The load-balancing statistics (2E + 1,) float64 of the forward just run over acts (zeros where the
        stage has no sparse layer)."""
        size = 2 * self.cfg.moe.num_experts + 1
        if acts.moe is None:
            return np.zeros(size)
        before = dict(self.rt.counters)
        stats = self.rt.read(acts.moe.balance, np.float32, (size,))
        count_submissions(self.rt, self.counters, before)
        return stats.astype(np.float64)

    def stage_balance(self, micro, previous=None):
        """See PipelineStage.stage_balance."""
        own = self._balance.pop(micro)
        return own if previous is None else np.asarray(previous, np.float64) + own

    def _read_boundary(self, cache: BucketCache, buf, n: int) -> np.ndarray:
        """The first n rows of an activation buffer (an output, or an input's gradient) read back and packed."""
        before = dict(self.rt.counters)
        values = cache.read_activations(buf, n)                                 # (n, C)
        count_submissions(self.rt, self.counters, before)
        return self._send(values)

    def stage_loss(self, micro, inputs, targets, segment_ids, position_ids, grad_scale, objective=None,
                   balance=None, aux_weight=0.0):
        """See PipelineStage.stage_loss. The last stage's ops each finish their micro-batch, so it keeps none and
        runs in the engine's own buckets and dropout slot, as one process's forward_backward. The earlier stages'
        load-balancing statistics are written to a buffer of their own and added to its forward's on the device,
        before its backward."""
        prior = None
        if aux_weight and balance is not None:
            if self._prior is None:
                self._prior = self.rt.buffer(4 * len(balance), "moe.prior_balance")
            self.rt.write(self._prior, np.asarray(balance, np.float32))
            prior = self._prior
        self._use_images(micro, drop=True)
        rec, acts, before = self.steps.record_forward_backward(np.asarray(inputs), targets, segment_ids,
                                                               position_ids, grad_scale, objective,
                                                               aux_weight=aux_weight, prior=prior)
        logps = entropies = None
        if objective is None:
            loss_sum, count = self.steps.submit_loss(rec, acts, before)
        else:
            loss_sum, count, logps, entropies = self.steps.submit_loss_rows(rec, acts, before, targets)
        dx = None if self.first or not count else self._read_boundary(self.buckets, acts.d_res, acts.n)
        total = None
        if aux_weight:      # the whole forward's statistics (the earlier stages' where this stage routes none)
            total = self._read_balance(acts) if acts.moe is not None or balance is None else \
                np.asarray(balance, np.float64)
        return loss_sum, count, dx, logps, entropies, total

    def stage_backward(self, micro, d_outputs, balance=None, aux_weight=0.0):
        """See PipelineStage.stage_backward: the whole forward's load-balancing statistics written where its
        routers' backward reads them."""
        slot, acts = self._kept.pop(micro)
        self._images.pop(micro, None)
        if d_outputs is None:
            return None
        cache = self._bucket_cache(slot)
        cache.write_activations(acts.d_res, unpack_boundary(d_outputs))        # the output's gradient
        if balance is not None and acts.moe is not None:
            self.rt.write(acts.moe.balance, np.asarray(balance, np.float32))
        self.dropout.micro = slot
        self._submit(self.layers.record_backward, acts, True, aux_weight if balance is not None else 0.0)
        return None if self.first else self._read_boundary(cache, acts.d_res, acts.n)

    def stage_scores(self, inputs, targets, segment_ids, position_ids, rows: bool):
        """See PipelineStage.stage_scores."""
        self._use_images(None)
        inputs = np.asarray(inputs)
        if targets is None:
            return self.steps.logits(inputs, segment_ids, position_ids)
        if rows:
            return self.steps.token_losses(inputs, targets, segment_ids, position_ids)
        return self.steps.loss(inputs, targets, segment_ids, position_ids)

    def stage_set_reference(self, modules: dict):
        """See PipelineStage.stage_set_reference: the reference's LoRA tensors packed in buffers of their own (no
        optimizer state); a DoRA reference is refused in one line (its norms would need a DoraNorms of their
        own)."""
        if any(split_entry(e)[4] is not None for e in modules.values()):
            raise ConfigError("a DoRA --ref-adapter through WebGPU pipeline stages is not supported: --backend numpy")
        if self._reference is not None:
            self.rt.release(*(packed.buf for packed in self._reference[1]))
        self._reference = self._upload_lora(modules)

    def stage_use_reference(self, on: bool):
        """See PipelineStage.stage_use_reference: the buckets and the layer recording given the reference's
        modules (or the policy's back); the policy's tensors, gradients and moments stay as they are."""
        if bool(on) == self._reference_on:
            return
        lora = self._reference[0] if on else self.lora
        groups = self._lora_groups(lora) if on else self._group_of
        self.buckets.set_adapter(lora, groups)
        self.layers.set_adapter(lora, groups)
        self._reference_on = bool(on)

    # ---- gradients and the update ---------------------------------------------------------------------------
    def stage_unscale(self):
        """See PipelineStage.stage_unscale."""
        if self.loss_scaler is not None:
            rec = self.rt.recorder()
            self.optimizer.record_unscale(rec, self.loss_scaler.scale)
            submit(self.rt, self.counters, rec)

    def stage_grad_square(self, leave_out=()) -> float:
        """See PipelineStage.stage_grad_square: the partial sums of one process's norm (a float32 sum per
        workgroup) read back and added in float64, not the gradients themselves."""
        rec = self.rt.recorder()
        slots = self.optimizer.record_norm_partials(rec, leave_out)
        rec.read_back(self.optimizer.partials, np.float32, (max(slots, 1),))
        submit(self.rt, self.counters, rec)
        return float(np.sum(rec.result()[:slots], dtype=np.float64))

    def set_gradients(self, grads: dict):
        """See PipelineStage.set_gradients."""
        for k, g in grads.items():
            self._write(self.optimizer.grads[k], np.asarray(g, np.float32))

    def stage_update(self, norm: float, hp, step: int) -> bool:
        """See PipelineStage.stage_update (WgpuEngine.apply_update)."""
        _, applied = self.apply_update(norm, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.max_grad_norm,
                                       step, hp.lora_b_lr_ratio)
        if self.loss_scaler is not None:
            self.loss_scaler.update(applied)
        return applied

    # ---- generation: the KV cache of its layers -------------------------------------------------------------
    def stage_new_cache(self, key: int, batch: int, max_len: int):
        """See PipelineStage.stage_new_cache."""
        self._caches[key] = self.new_kv_cache(batch, max_len)

    def stage_free_cache(self, key: int):
        """See PipelineStage.stage_free_cache."""
        kv = self._caches.pop(key, None)
        if kv is not None:
            self.free_kv_cache(kv)

    def stage_rows(self, key: int, inputs, rows, positions, last, long_rope: bool):
        """See PipelineStage.stage_rows: a prefill with whole images takes their blocks (and embeddings, M-RoPE
        positions and DeepStack features)."""
        self._use_images(None)
        out = self.kv.rows_forward(np.asarray(inputs), np.asarray(rows), np.asarray(positions), self._caches[key],
                                   np.asarray(last), long_rope)
        return out if self.last else self._send(out)

    def weight_names(self) -> list:
        """The base weights this stage holds."""
        return list(self.w)

    def weight(self, name: str):
        """One base weight (float32), as weights() holds it."""
        return self._weight(name)

