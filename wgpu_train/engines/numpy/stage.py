"""One pipeline stage on the NumPy engine: the layers of a range (with the embedding on the first stage, the final
norm, head and loss on the last), its forward from the boundary's activations and its backward from the boundary's
gradient, its layers' share of the router's load-balancing statistics, its own LoRA gradients and AdamW update with the
global norm of every stage's."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.engine import NumpyEngine
from wgpu_train.engines.numpy.steps import objective_scale
from wgpu_train.engines.numpy.walk import Walk
from wgpu_train.engines.shared.boundary import pack_boundary, unpack_boundary
from wgpu_train.engines.shared.recurrent_state import advance, new_states, row_runs
from wgpu_train.models.layer_plan import OUTPUT


class NumpyStage(NumpyEngine):
    """A NumpyEngine over the weights of `layers` (and the embedding where `first`; the norm and head where `last`)
    that runs the protocol's PipelineStage methods. Micro-batches are keyed by their number in the step: a forward
    keeps its activations until that micro-batch's backward. Each forward of a training micro-batch advances the
    dropout position, as one process's forward_backward does, so every stage draws the masks one process would."""

    def __init__(self, cfg, weights: dict, span: range, first: bool, last: bool, **kw):
        super().__init__(cfg, weights, **kw)
        self.span, self.first, self.last = span, first, last
        self.counters["boundary_bytes_sent"] = 0
        self._kept: dict = {}        # micro-batch -> the cache of its forward
        self._caches: dict = {}      # generation's KV caches by the driver's key
        self._reference: dict = {}   # the reference adapter's LoraModules of its layers (stage_set_reference)
        self._policy: dict | None = None     # the policy's, while the reference is switched in
        self._images: dict = {}      # micro-batch (None: an untrained forward's) -> its ImageTokens (stage_set_images)

    def stage_set_images(self, micro, images):
        """The images of micro-batch `micro` (a shared/image_tokens.ImageTokens, or None): every stage's attention
        takes their blocks, the first stage puts their embeddings in place of the placeholders' rows (and its
        backward leaves their rows' gradient in image_grad); a training micro-batch's are dropped after its
        backward."""
        self._images[micro] = images

    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """KvCacheGeneration's cache for this stage's layers alone (keyed by layer)."""
        shape = (batch, max_len, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return {"k": {i: np.zeros(shape, self.dtype) for i in self.span},
                "v": {i: np.zeros(shape, self.dtype) for i in self.span},
                "len": 0, "batch": batch, "max_len": max_len, "dtype": self.kv_dtype,
                **new_states(self.layer_ops.plans, self.span, batch, self.dtype)}

    def stage_new_cache(self, key: int, batch: int, max_len: int):
        """See PipelineStage.stage_new_cache."""
        self._caches[key] = self.new_kv_cache(batch, max_len)

    def stage_free_cache(self, key: int):
        """See PipelineStage.stage_free_cache."""
        self._caches.pop(key, None)

    def stage_rows(self, key: int, inputs, rows, positions, last, long_rope: bool):
        """See PipelineStage.stage_rows."""
        self.training = False
        kv = self._caches[key]
        self.set_images(self._images.get(None))     # a prefill with whole images: their blocks (and embeddings)
        images = self.images
        walk = Walk(1, len(rows), np.asarray(positions)[None], None, kv, rows, long_rope,
                    runs=row_runs(kv, np.asarray(rows), np.asarray(positions)),
                    blocks=None if images is None else images.blocks,
                    rope_positions=None if images is None else images.positions)
        x = self._embed(np.asarray(inputs)) if self.first else unpack_boundary(inputs).astype(self.dtype, copy=False)
        if self.first and images is not None:
            x[images.flat] = images.embeds
        for i in self.span:
            x = self.layer_ops.forward(i, x, walk)[OUTPUT]
            if images is not None:          # Qwen3-VL's DeepStack features at the image tokens
                x = images.add_deepstack(x, i)
        advance(kv, walk.runs)
        if not self.last:
            return self._send(x)
        return self._generation_head(x[last])                                  # (m, V)

    def weight_names(self) -> list:
        """The base weights this stage holds."""
        return list(self.w)

    def weight(self, name: str):
        """One base weight (float32), as weights() holds it."""
        return self.w[name].astype(np.float32)

    def _send(self, x):
        packed = pack_boundary(x, self.precision)
        self.counters["boundary_bytes_sent"] += packed.nbytes
        return packed

    def _stage_forward(self, inputs, segment_ids, position_ids) -> tuple:
        """(this stage's output (N, C), its cache) from its input: ids (B, T) on the first stage, else the previous
        stage's packed output."""
        cache = {"walk": self._walk(segment_ids, position_ids)}
        if self.first:
            cache["ids"] = np.asarray(inputs).reshape(-1)
            x = self._embed(cache["ids"])
            if self.images is not None:     # the projector's embeddings in place of the placeholders'
                x[self.images.flat] = self.images.embeds
        else:
            x = unpack_boundary(inputs).astype(self.dtype, copy=False)
        return self._layers_forward(x, self.span, cache), cache

    def stage_forward(self, micro, inputs, segment_ids, position_ids):
        """See PipelineStage.stage_forward."""
        self.training = micro is not None
        if self.training:
            self.dropout_calls += 1
        # a training forward counts its layers' routing where the router's aux loss is on (its weight comes with
        # the backward)
        self.mode.router_loss_weight = self.steps.router_aux_loss_coef
        self.set_images(self._images.get(micro))
        x, cache = self._stage_forward(inputs, segment_ids, position_ids)
        if self.training:
            self._kept[micro] = cache
        self.training, self.mode.router_loss_weight = False, 0.0
        return self._send(x)

    def stage_balance(self, micro, previous=None):
        """See PipelineStage.stage_balance."""
        own = self._kept[micro]["walk"].router_loss.stats()
        return own if previous is None else np.asarray(previous, np.float64) + own

    def stage_loss(self, micro, inputs, targets, segment_ids, position_ids, grad_scale, objective=None,
                   balance=None, aux_weight=0.0):
        """See PipelineStage.stage_loss."""
        self.training = True
        self.dropout_calls += 1
        self.mode.router_loss_weight = aux_weight
        self.steps.count_head()
        self.set_images(self._images.pop(micro, None))
        x, cache = self._stage_forward(inputs, segment_ids, position_ids)
        total = None
        if aux_weight:      # the whole forward's statistics: the earlier stages' and this one's
            router_loss = cache["walk"].router_loss
            total = router_loss.stats() if balance is None else np.asarray(balance, np.float64) + router_loss.stats()
            router_loss.use_stats(total, aux_weight)
        flat = self._head_forward(x, cache) / np.float32(self.loss_temperature)          # (N, V)
        loss_sum, count, lse = ops.cross_entropy_forward(flat, targets.reshape(-1))
        scale, logps, entropies = objective_scale(flat, targets, lse, grad_scale, objective)
        dx = None
        if count:       # through the temperature, as StepRunner._forward_backward
            t = np.float32(self.loss_temperature)
            dlogits = ops.cross_entropy_backward(flat, targets.reshape(-1), lse, scale / t, self.cfg.logit_softcap / t)
            dx = self._stage_backward(self._head_backward(dlogits, cache), cache)
        self.training, self.mode.router_loss_weight = False, 0.0
        return loss_sum, count, dx, logps, entropies, total

    def stage_backward(self, micro, d_outputs, balance=None, aux_weight=0.0):
        """See PipelineStage.stage_backward."""
        cache = self._kept.pop(micro)
        self.set_images(self._images.pop(micro, None))
        if d_outputs is None:
            return None
        if balance is not None:
            cache["walk"].router_loss.use_stats(balance, aux_weight)
        return self._stage_backward(unpack_boundary(d_outputs).astype(self.dtype, copy=False), cache)

    def _stage_backward(self, dx, cache):
        dx = self._layers_backward(dx, self.span, cache)
        if self.first:
            self._embed_backward(dx, cache["ids"])
            return None
        return self._send(dx)

    def stage_scores(self, inputs, targets, segment_ids, position_ids, rows: bool):
        """See PipelineStage.stage_scores."""
        self.steps.count_head()
        self.set_images(self._images.get(None))
        x, cache = self._stage_forward(inputs, segment_ids, position_ids)
        logits = self._head_forward(x, cache)                                   # (N, V)
        if targets is None:
            return logits.astype(np.float32).reshape(*np.shape(segment_ids), -1)
        if rows:
            out, _ = ops.cross_entropy_rows(logits / np.float32(self.loss_temperature), targets.reshape(-1))
            return out.astype(np.float32).reshape(np.shape(segment_ids))
        loss_sum, count, _ = ops.cross_entropy_forward(logits, targets.reshape(-1))
        return loss_sum, count

    def stage_set_reference(self, modules: dict):
        """See PipelineStage.stage_set_reference."""
        self._reference = self._lora_modules(modules)

    def stage_use_reference(self, on: bool):
        """See PipelineStage.stage_use_reference."""
        if on and self._policy is None:
            self._policy, self.lora = self.lora, self._reference
        elif not on and self._policy is not None:
            self.lora, self._policy = self._policy, None

    def stage_unscale(self):
        """See PipelineStage.stage_unscale."""
        if self.loss_scaler is not None:
            self.optimizer.unscale(self.loss_scaler.scale)

    def stage_grad_square(self, leave_out=()) -> float:
        """See PipelineStage.stage_grad_square."""
        return float(sum(float(np.sum(np.square(g, dtype=np.float64))) for k, g in self.grads.items()
                         if k not in leave_out))

    def set_gradients(self, grads: dict):
        """See PipelineStage.set_gradients."""
        for k, g in grads.items():
            self.grads[k][...] = g

    def stage_update(self, norm: float, hp, step: int) -> bool:
        """See PipelineStage.stage_update."""
        _, applied = self.apply_update(norm, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.max_grad_norm,
                                       step, hp.lora_b_lr_ratio)
        if self.loss_scaler is not None:
            self.loss_scaler.update(applied)
        return applied
