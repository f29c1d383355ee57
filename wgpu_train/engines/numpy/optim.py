"""NumPy AdamW and global gradient-norm clipping, the oracle for shaders/adamw.wgsl; the NumPy engine's Optimizer
part (its gradients and moments)."""
from __future__ import annotations

import numpy as np

from wgpu_train.adapters.dora import MAGNITUDE


def grad_norm(grads):
    """Global L2 norm over a list of gradient arrays (accumulated in float64)."""
    return float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads)))


def clip_scale(norm, max_norm):
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    """One decoupled-weight-decay Adam step in place (as torch.optim.AdamW); step counts from 1."""
    g = grad * grad_scale
    param *= 1.0 - lr * weight_decay
    m *= beta1
    m += (1.0 - beta1) * g
    v *= beta2
    v += (1.0 - beta2) * g * g
    m_hat = m / (1.0 - beta1 ** step)
    v_hat = v / (1.0 - beta2 ** step)
    param -= lr * m_hat / (np.sqrt(v_hat) + eps)


def reduce_together(optimizers, reduce, total: int):
    """Pass the gradients of `optimizers` (Optimizer's, each in its grads' order, one after another) through
    `reduce` as one flat float32 array and take its result."""
    grads = [g for opt in optimizers for g in opt.grads.values()]
    flat = np.concatenate([g.astype(np.float32).reshape(-1) for g in grads]) if grads else np.zeros(0, np.float32)
    out = np.asarray(reduce(flat, int(total)), dtype=np.float32)
    if out.shape != flat.shape:
        raise ValueError(f"train_step: reduce returned {out.shape[0]} gradients for {flat.shape[0]}")
    at = 0
    for g in grads:
        g[...] = out[at:at + g.size].reshape(g.shape)
        at += g.size


class Optimizer:
    """The gradients and AdamW moments of a NumPy engine's trainable tensors, which `trainable` (a function: name ->
    array, the engine's trainable()) lists; dtype: the engine's; counters: the engine's (skipped steps counted)."""

    def __init__(self, trainable, dtype, counters: dict):
        self.trainable, self.dtype, self.counters = trainable, dtype, counters
        self.grads: dict = {}
        self.moments: dict = {}

    def reset(self):
        """New trainable tensors: no moments, zero gradients."""
        self.moments = {}
        self.zero_grads()

    def zero_grads(self):
        self.grads = {k: np.zeros_like(v) for k, v in self.trainable().items()}

    def add(self, name: str, g):
        """Add g into the gradient of `name` where that tensor trains."""
        if name in self.grads:
            self.grads[name] += g

    def gradients(self) -> dict:
        return {k: v.astype(np.float32) for k, v in self.grads.items()}

    def unscale(self, scale: float):
        """Divide every gradient by the loss scaler's scale (exact: a power of two)."""
        for g in self.grads.values():
            g *= self.dtype.type(1.0 / scale)

    def reduce(self, reduce, total: int):
        """Pass the gradients through `reduce` as one flat float32 array (self.grads' order) and take its result."""
        reduce_together([self], reduce, total)

    def step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
             lora_b_lr_ratio=1.0):
        """Clip by the global norm, then AdamW on every trainable tensor (the LoRA B matrices at lr times
        lora_b_lr_ratio: LoRA+); returns (grad_norm, applied)."""
        return self.apply_update(grad_norm(list(self.grads.values())), lr, beta1, beta2, eps, weight_decay,
                                 max_grad_norm, step, lora_b_lr_ratio)

    def apply_update(self, norm, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                     lora_b_lr_ratio=1.0):
        """step with the gradients' global norm given (a pipeline stage's: every stage's together); a non-finite
        norm skips the update. (norm, applied)."""
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

    def state(self) -> dict:
        return {k: (m.copy(), v.copy()) for k, (m, v) in self.moments.items()}

    def load_state(self, state: dict):
        self.moments = {k: (m.astype(self.dtype), v.astype(self.dtype)) for k, (m, v) in state.items()}
