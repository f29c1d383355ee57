"""The NumPy engine's steps through the engine protocol (StepRunner, a part of engine.NumpyEngine): logits, losses, a
micro-batch's forward and backward with its loss head (weights, a TokenObjective or a SequenceObjective), the
optimizer step with global-norm clipping and AdamW (optim.Optimizer), a vision tower's LoRA too (tower_step.py)."""
from __future__ import annotations

import contextlib
import time

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.optim import Optimizer, grad_norm, reduce_together
from wgpu_train.engines.numpy.walk import Mode
from wgpu_train.engines.protocol import LossScaler, SequenceObjective, TokenObjective
from wgpu_train.engines.shared.image_tokens import ImageTokens, TowerImages


class StepRunner:
    """The protocol's steps over the engine's walk: forward (ids, segment_ids, position_ids -> logits (B, T, V) and
    the cache of the backward) and backward (dlogits (N, V), cache: the gradients added into the optimizer's);
    mode: the engine's (training, the adapter, the loss temperature, the dropout position); optimizer: the engine's
    gradients and moments; loss_scaler: f16's or None; counters: the engine's; set_images: the engine's, which
    a micro-batch's ImageTokens go to for its forward."""

    def __init__(self, cfg: ModelConfig, mode: Mode, optimizer: Optimizer, loss_scaler: LossScaler | None,
                 counters: dict, forward, backward, set_images=None):
        self.cfg, self.mode, self.optimizer, self.loss_scaler, self.counters = cfg, mode, optimizer, loss_scaler, \
            counters
        self.forward, self.backward, self.set_images = forward, backward, set_images
        self.last_profile: dict = {}
        self.step_logps: list = []      # the last train_step's log-probabilities of its TokenObjective micro-batches
        self.step_entropies: list = []  # and the entropies of its policy's distributions there
        self.router_aux_loss_coef = 0.0   # the engine's set_router_aux_loss
        self.micro_aux_losses: list = []  # the router aux loss of each training forward since the step began
        self.last_aux_loss = None         # the last train_step's router aux loss (mean over micro-batches), or None
        self.tower = None                 # the vision tower TowerImages run through (tower_step.TowerStep), or None
        self.image_grad = lambda: (None, {})    # the engine's image rows' and DeepStack features' gradients of the
        # last backward

    def logits(self, ids, segment_ids, position_ids):
        self.mode.training = False
        return self.forward(ids, segment_ids, position_ids)[0].astype(np.float32)

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch; grads accumulate scaled by grad_scale per token (one
        number, or a weight per token (B, T)).

        Returns (loss_sum, token_count) of the micro-batch (the loss unweighted). A mixture of experts with the
        router's auxiliary loss adds its gradient at the coefficient's full weight (transformers' loss: the mean
        token loss plus coef times the aux loss, with grad_scale 1 / tokens).
        """
        return self._forward_backward(ids, targets, segment_ids, position_ids, grad_scale,
                                      aux_weight=self.router_aux_loss_coef)[:2]

    def _forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale, objective=None,
                          aux_weight=0.0):
        """forward_backward, or with a TokenObjective (or a SequenceObjective: its host function) the gradient
        weights computed from the head's own log-probabilities (times grad_scale, one number): (loss_sum, count,
        the (B, T) float32 log-probabilities and entropies of the policy's distributions, or None and None
        without an objective)."""
        self.mode.training = True
        self.mode.dropout_calls += 1
        self.mode.router_loss_weight = aux_weight
        self.count_head()
        logits, cache = self.forward(ids, segment_ids, position_ids)
        router_loss = cache["walk"].router_loss
        self.micro_aux_losses.append(router_loss.value if router_loss is not None else None)
        flat = logits.reshape(-1, logits.shape[-1]) / np.float32(self.mode.loss_temperature)          # (N, V)
        loss_sum, count, lse = ops.cross_entropy_forward(flat, targets.reshape(-1))
        scale, logps, entropies = objective_scale(flat, targets, lse, grad_scale, objective)
        if count:       # through the temperature: 1 / T on the gradient, the cap's derivative in tempered units
            t = np.float32(self.mode.loss_temperature)
            self.backward(ops.cross_entropy_backward(flat, targets.reshape(-1), lse, scale / t,
                                                     self.cfg.logit_softcap / t), cache)
        self.mode.training, self.mode.router_loss_weight = False, 0.0
        return loss_sum, count, logps, entropies

    def count_head(self):
        """One loss head run: a forward of the policy (adapter on) or of the reference (adapter off)."""
        self.counters["policy_forwards" if self.mode.adapter_enabled else "reference_forwards"] += 1

    def loss(self, ids, targets, segment_ids, position_ids):
        self.count_head()
        logits = self.forward(ids, segment_ids, position_ids)[0]
        loss_sum, count, _ = ops.cross_entropy_forward(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss_sum, count

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """(B, T) float32: each position's loss, minus the log-probability of its target (0 where ignored); with
        reference, (the policy's, the reference's): a second forward with the adapter switched off."""
        policy = self._token_losses(ids, targets, segment_ids, position_ids)
        if not reference:
            return policy
        enabled, self.mode.adapter_enabled = self.mode.adapter_enabled, False
        try:
            return policy, self._token_losses(ids, targets, segment_ids, position_ids)
        finally:
            self.mode.adapter_enabled = enabled

    def _token_losses(self, ids, targets, segment_ids, position_ids):
        self.mode.training = False
        self.count_head()
        logits = self.forward(ids, segment_ids, position_ids)[0] / np.float32(self.mode.loss_temperature)
        rows, _ = ops.cross_entropy_rows(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return rows.astype(np.float32).reshape(ids.shape)

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """One optimizer step over micro-batches [(ids, targets, segment_ids, position_ids[, weights]), ...]; a
        micro-batch may end with its images (shared/image_tokens.ImageTokens), which its forward takes, or with
        TowerImages: the tower's forward gives them, and with LoRA on it, its backward follows the micro-batch's and
        its gradients join the engine's (reduced with them, one global norm, clipped and updated together).

        Gradients are normalised by the total number of counted tokens of all micro-batches, so the
        step equals the full-batch step; a micro-batch's per-token weights (B, T), when given, multiply its
        tokens' gradients. `reduce` (the engine protocol's) may replace them before the update. With f16's
        loss scaler the loss gradient is scaled by its scale and the gradients unscaled before `reduce`; a
        non-finite step is skipped and the scaler updated. Returns (loss_sum, token_count, grad_norm, applied).
        """
        started = time.perf_counter()
        total = sum(int((mb[1] != ops.IGNORE_INDEX).sum()) for mb in micro_batches)
        optimizers = [self.optimizer] + ([self.tower.optimizer] if self.tower is not None and self.tower.trains else [])
        for opt in optimizers:
            opt.zero_grads()
        loss_sum = 0.0
        scaler = self.loss_scaler
        grad_scale = 1.0 / max(total, 1) * (scaler.scale if scaler is not None else 1.0)
        aux_weight = self.router_aux_loss_coef / len(micro_batches) * (scaler.scale if scaler is not None else 1.0)
        self.micro_aux_losses = []
        with np.errstate(over="ignore", invalid="ignore") if scaler is not None else contextlib.nullcontext():
            self.step_logps, self.step_entropies = [], []
            for ids, targets, seg, pos, *extra in micro_batches:   # f16's overflows are the scaler's to handle
                images = extra.pop() if extra and isinstance(extra[-1], (ImageTokens, TowerImages)) else None
                cache = None
                if isinstance(images, TowerImages) and self.tower is None:     # no tower here: the host's
                    images = images.host()
                elif isinstance(images, TowerImages):
                    images, cache = self.tower.forward(images)
                if images is not None:
                    self.set_images(images)
                objective = extra[0] if extra and isinstance(extra[0], (TokenObjective, SequenceObjective)) else None
                if objective is not None or not extra:
                    scale = grad_scale
                else:
                    scale = np.float32(grad_scale) * np.asarray(extra[0], np.float32)
                loss, _, logps, entropies = self._forward_backward(ids, targets, seg, pos, scale, objective,
                                                                   aux_weight)
                if images is not None:
                    self.set_images(None)
                if cache is not None:
                    self.tower.backward(*self.image_grad(), cache)
                loss_sum += loss
                self.step_logps.append(logps)
                self.step_entropies.append(entropies)
        aux = [v for v in self.micro_aux_losses if v is not None]
        self.last_aux_loss = float(np.mean(aux)) if aux else None
        for opt in optimizers if scaler is not None else ():
            opt.unscale(scaler.scale)
        if reduce is not None:
            reduce_together(optimizers, reduce, total)
        norm = grad_norm([g for opt in optimizers for g in opt.grads.values()])
        for opt in optimizers:
            _, applied = opt.apply_update(norm, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.max_grad_norm,
                                          step, hp.lora_b_lr_ratio)
        if scaler is not None:
            scaler.update(applied)
        if profile:
            self.last_profile = {"whole step (NumPy engine, wall clock)": time.perf_counter() - started}
        return loss_sum, total, norm, applied


def objective_scale(flat, targets, lse, grad_scale, objective=None) -> tuple:
    """The loss head's per-row gradient scale of a micro-batch from its tempered logits flat (N, V), targets (B, T)
    and the logits' log-sum-exp (N,): grad_scale as it is (one number, or (B, T) weights), or with a TokenObjective
    (or a SequenceObjective: its host function) grad_scale (one number) times the weights the objective computes
    from the head's own log-probabilities. (scale, the (B, T) float32 log-probabilities and entropies of the
    policy's distributions, or None and None without an objective)."""
    if objective is None:
        return (np.reshape(grad_scale, -1) if np.ndim(grad_scale) else grad_scale), None, None
    rows, _ = ops.cross_entropy_rows(flat, targets.reshape(-1))          # (B*T,) -logp
    logps = (-rows).astype(np.float32).reshape(targets.shape)
    entropies = ops.softmax_entropy_forward(flat, lse).reshape(targets.shape) * (targets != ops.IGNORE_INDEX)
    if isinstance(objective, SequenceObjective):
        weights = np.asarray(objective.weights(logps), np.float32).reshape(-1)
    else:
        weights = ops.token_objective_backward(rows, objective.terms(), objective)
    return np.float32(grad_scale) * weights, logps, entropies
