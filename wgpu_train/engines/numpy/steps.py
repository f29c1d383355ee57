"""The NumPy engine's steps through the engine protocol (a part of engine.NumpyEngine): logits, losses, a micro-batch's
forward and backward with its loss head (weights, a TokenObjective or a SequenceObjective), the optimizer step
with global-norm clipping and AdamW, and the optimizer state."""
from __future__ import annotations

import contextlib
import time

import numpy as np

from wgpu_train.adapters.dora import MAGNITUDE
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.optim import adamw_update, clip_scale, grad_norm
from wgpu_train.engines.protocol import SequenceObjective, TokenObjective


class NumpySteps:
    """engine.NumpyEngine's protocol steps (a mixin over its forward, backward and tensors)."""

    def logits(self, ids, segment_ids, position_ids):
        self.training = False
        return self.forward(ids, segment_ids, position_ids)[0].astype(np.float32)

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch; grads accumulate scaled by grad_scale per token (one
        number, or a weight per token (B, T)).

        Returns (loss_sum, token_count) of the micro-batch (the loss unweighted).
        """
        return self._forward_backward(ids, targets, segment_ids, position_ids, grad_scale)[:2]

    def _forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale, objective=None):
        """forward_backward, or with a TokenObjective (or a SequenceObjective: its host function) the gradient
        weights computed from the head's own log-probabilities (times grad_scale, one number): (loss_sum, count,
        the (B, T) float32 log-probabilities and entropies of the policy's distributions, or None and None
        without an objective)."""
        self.training = True
        self.dropout_calls += 1
        self._count_head()
        logits, cache = self.forward(ids, segment_ids, position_ids)
        flat = logits.reshape(-1, logits.shape[-1]) / np.float32(self.loss_temperature)          # (N, V)
        loss_sum, count, lse = ops.cross_entropy_forward(flat, targets.reshape(-1))
        logps = entropies = None
        if objective is not None:
            rows, _ = ops.cross_entropy_rows(flat, targets.reshape(-1))          # (B*T,) -logp
            logps = (-rows).astype(np.float32).reshape(ids.shape)
            entropies = ops.softmax_entropy_forward(flat, lse).reshape(ids.shape) * (targets != ops.IGNORE_INDEX)
            if isinstance(objective, SequenceObjective):
                weights = np.asarray(objective.weights(logps), np.float32).reshape(-1)
            else:
                weights = ops.token_objective_backward(rows, objective.terms(), objective)
            scale = np.float32(grad_scale) * weights
        else:
            scale = np.reshape(grad_scale, -1) if np.ndim(grad_scale) else grad_scale
        if count:       # through the temperature: 1 / T on the gradient, the cap's derivative in tempered units
            t = np.float32(self.loss_temperature)
            self.backward(ops.cross_entropy_backward(flat, targets.reshape(-1), lse, scale / t,
                                                     self.cfg.logit_softcap / t), cache)
        self.training = False
        return loss_sum, count, logps, entropies

    def set_loss_temperature(self, temperature: float = 1.0):
        """The loss head of training steps and token_losses scores logits / temperature (GRPO's log-probabilities
        at its sampling temperature, as TRL takes them); loss() and generation keep the model's own."""
        self.loss_temperature = float(temperature)

    def _count_head(self):
        """One loss head run: a forward of the policy (adapter on) or of the reference (adapter off)."""
        self.counters["policy_forwards" if self.adapter_enabled else "reference_forwards"] += 1

    def loss(self, ids, targets, segment_ids, position_ids):
        self._count_head()
        logits = self.forward(ids, segment_ids, position_ids)[0]
        loss_sum, count, _ = ops.cross_entropy_forward(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss_sum, count

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """(B, T) float32: each position's loss, minus the log-probability of its target (0 where ignored); with
        reference, (the policy's, the reference's): a second forward with the adapter switched off."""
        policy = self._token_losses(ids, targets, segment_ids, position_ids)
        if not reference:
            return policy
        enabled, self.adapter_enabled = self.adapter_enabled, False
        try:
            return policy, self._token_losses(ids, targets, segment_ids, position_ids)
        finally:
            self.adapter_enabled = enabled

    def _token_losses(self, ids, targets, segment_ids, position_ids):
        self.training = False
        self._count_head()
        logits = self.forward(ids, segment_ids, position_ids)[0] / np.float32(self.loss_temperature)
        rows, _ = ops.cross_entropy_rows(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return rows.astype(np.float32).reshape(ids.shape)

    def gradients(self) -> dict:
        return {k: v.astype(np.float32) for k, v in self.grads.items()}

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """One optimizer step over micro-batches [(ids, targets, segment_ids, position_ids[, weights]), ...].

        Gradients are normalised by the total number of counted tokens of all micro-batches, so the
        step equals the full-batch step; a micro-batch's per-token weights (B, T), when given, multiply its
        tokens' gradients. `reduce` (the engine protocol's) may replace them before the update. With f16's
        loss scaler the loss gradient is scaled by its scale and the gradients unscaled before `reduce`; a
        non-finite step is skipped and the scaler updated. Returns (loss_sum, token_count, grad_norm, applied).
        """
        started = time.perf_counter()
        total = sum(int((mb[1] != ops.IGNORE_INDEX).sum()) for mb in micro_batches)
        self.zero_grads()
        loss_sum = 0.0
        scaler = self.loss_scaler
        grad_scale = 1.0 / max(total, 1) * (scaler.scale if scaler is not None else 1.0)
        with np.errstate(over="ignore", invalid="ignore") if scaler is not None else contextlib.nullcontext():
            self.step_logps, self.step_entropies = [], []
            for ids, targets, seg, pos, *extra in micro_batches:   # f16's overflows are the scaler's to handle
                objective = extra[0] if extra and isinstance(extra[0], (TokenObjective, SequenceObjective)) else None
                if objective is not None or not extra:
                    scale = grad_scale
                else:
                    scale = np.float32(grad_scale) * np.asarray(extra[0], np.float32)
                loss, _, logps, entropies = self._forward_backward(ids, targets, seg, pos, scale, objective)
                loss_sum += loss
                self.step_logps.append(logps)
                self.step_entropies.append(entropies)
        if scaler is not None:
            for g in self.grads.values():
                g *= self.dtype.type(1.0 / scaler.scale)       # exact: the scale is a power of two
        if reduce is not None:
            self._reduce_grads(reduce, total)
        norm, applied = self.optimizer_step(hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay,
                                            hp.max_grad_norm, step, hp.lora_b_lr_ratio)
        if scaler is not None:
            scaler.update(applied)
        if profile:
            self.last_profile = {"whole step (NumPy engine, wall clock)": time.perf_counter() - started}
        return loss_sum, total, norm, applied

    def _reduce_grads(self, reduce, total: int):
        """Pass the gradients through `reduce` as one flat float32 array (self.grads' order) and take its result."""
        names = list(self.grads)
        flat = np.concatenate([self.grads[k].astype(np.float32).reshape(-1) for k in names]) if names else \
            np.zeros(0, np.float32)
        out = np.asarray(reduce(flat, int(total)), dtype=np.float32)
        if out.shape != flat.shape:
            raise ValueError(f"train_step: reduce returned {out.shape[0]} gradients for {flat.shape[0]}")
        at = 0
        for k in names:
            g = self.grads[k]
            g[...] = out[at:at + g.size].reshape(g.shape)
            at += g.size

    def optimizer_step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                       lora_b_lr_ratio=1.0):
        """Clip by the global norm, then AdamW on every trainable tensor (the LoRA B matrices at lr times
        lora_b_lr_ratio: LoRA+); returns (grad_norm, applied)."""
        return self.apply_update(grad_norm(list(self.grads.values())), lr, beta1, beta2, eps, weight_decay,
                                 max_grad_norm, step, lora_b_lr_ratio)

    def apply_update(self, norm, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                     lora_b_lr_ratio=1.0):
        """optimizer_step with the gradients' global norm given (a pipeline stage's: every stage's together);
        a non-finite norm skips the update. (norm, applied)."""
        params = self.trainable()
        if not np.isfinite(norm):
            self.counters["nonfinite_skipped"] += 1
            self.zero_grads()
            return norm, False
        scale = clip_scale(norm, max_grad_norm)
        for k, p in params.items():
            if k not in self.moments:
                self.moments[k] = (np.zeros_like(p), np.zeros_like(p))
            m, v = self.moments[k]
            # LoRA+: PEFT's create_loraplus_optimizer gives B and every 1-D parameter (DoRA's magnitudes) B's lr
            rate = lr * lora_b_lr_ratio if k.endswith((".lora_B", MAGNITUDE)) else lr
            adamw_update(p, self.grads[k], m, v, rate, beta1, beta2, eps, weight_decay, step, grad_scale=scale)
        self.zero_grads()
        return norm, True

    def optimizer_state(self) -> dict:
        return {k: (m.copy(), v.copy()) for k, (m, v) in self.moments.items()}

    def load_optimizer_state(self, state: dict):
        self.moments = {k: (m.astype(self.dtype), v.astype(self.dtype)) for k, (m, v) in state.items()}
