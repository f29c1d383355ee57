"""Gemma 3's SigLIP vision tower and projector on the NumPy engine, forward only (the tower is frozen): the patch
embedding as a GEMM over unfolded patches, position embeddings, bidirectional encoder layers, the post-layernorm,
then the projector (average pool to mm_tokens_per_image, the soft-embedding RMSNorm, the projection)."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.models.vision import PROJ, TOWER, VisionConfig


def layernorm(x, weight, bias, eps):
    """LayerNorm over the last axis, (N, C) -> (N, C)."""
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * weight + bias


def gelu_tanh(x):
    """gelu's tanh approximation (gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(ops.GELU_C * (x + 0.044715 * x ** 3)))


def unfold_patches(pixels, patch: int):
    """pixels (N, C, H, W) -> (N, P, C*patch*patch): the non-overlapping patches, row-major over the grid, each
    flattened as the convolution's weight (out, C, kh, kw) is; a border that does not fill a patch is dropped
    (a 'valid' convolution)."""
    n, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels[:, :, :gh * patch, :gw * patch].reshape(n, c, gh, patch, gw, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * patch * patch)


def bidirectional_attention(q, k, v):
    """Full (non-causal) multi-head attention: q, k, v (N, T, H, D) -> (N, T, H, D)."""
    scores = np.einsum("nihd,njhd->nhij", q, k) / np.sqrt(q.shape[-1])
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("nhij,njhd->nihd", p, v)


class VisionTower:
    """The tower and the projector over their weights ({our name (models/vision.tensor_shapes): array}) in
    `dtype`; __call__: pixel_values (N, C, H, W) -> the image tokens' embeddings (N, mm_tokens_per_image,
    text hidden)."""

    def __init__(self, vc: VisionConfig, weights: dict, dtype=np.float32):
        self.vc, self.dtype = vc, np.dtype(dtype)
        self.w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}

    def _linear(self, x, name):
        return ops.linear_forward(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def hidden_states(self, pixels):
        """pixels (N, C, H, W) -> the tower's last hidden state, post-layernormed (N, P, C)."""
        vc, w = self.vc, self.w
        n = pixels.shape[0]
        if pixels.shape[1:] != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(f"pixel_values of shape {pixels.shape[1:]}, the tower takes "
                             f"{(vc.num_channels, vc.image_size, vc.image_size)}")
        e = TOWER + "embeddings."
        patches = unfold_patches(np.asarray(pixels, self.dtype), vc.patch_size)             # (N, P, C*p*p)
        kernel = w[e + "patch_embedding.weight"].reshape(vc.hidden_size, -1)                # (C, C*p*p)
        x = ops.linear_forward(patches.reshape(-1, kernel.shape[1]), kernel, w[e + "patch_embedding.bias"])
        x = (x.reshape(n, -1, vc.hidden_size) + w[e + "position_embedding.weight"]).reshape(-1, vc.hidden_size)
        t = x.shape[0] // n
        for i in range(vc.num_layers):
            p = f"{TOWER}encoder.layers.{i}."
            h = layernorm(x, w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"], vc.layer_norm_eps)
            q, k, v = (self._linear(h, p + f"self_attn.{m}").reshape(n, t, vc.num_heads, vc.head_dim)
                       for m in ("q_proj", "k_proj", "v_proj"))
            x = x + self._linear(bidirectional_attention(q, k, v).reshape(n * t, -1), p + "self_attn.out_proj")
            h = layernorm(x, w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"], vc.layer_norm_eps)
            x = x + self._linear(gelu_tanh(self._linear(h, p + "mlp.fc1")), p + "mlp.fc2")
        x = layernorm(x, w[TOWER + "post_layernorm.weight"], w[TOWER + "post_layernorm.bias"], vc.layer_norm_eps)
        return x.reshape(n, t, vc.hidden_size)

    def project(self, hidden):
        """The projector: hidden (N, P, C) -> (N, mm_tokens_per_image, text hidden)."""
        vc = self.vc
        n, side = hidden.shape[0], vc.patches_per_side
        tokens_side = int(round(vc.mm_tokens_per_image ** 0.5))
        k = side // tokens_side
        grid = hidden.reshape(n, side, side, vc.hidden_size)[:, :tokens_side * k, :tokens_side * k]
        pooled = grid.reshape(n, tokens_side, k, tokens_side, k, -1).mean(axis=(2, 4))     # (N, s, s, C)
        pooled = pooled.reshape(n * vc.mm_tokens_per_image, vc.hidden_size)
        normed, _ = ops.rmsnorm_forward(pooled, self.w[PROJ + "mm_soft_emb_norm.weight"], vc.layer_norm_eps, 1.0)
        out = normed @ self.w[PROJ + "mm_input_projection_weight"]                          # (N*M, text C)
        return out.reshape(n, vc.mm_tokens_per_image, -1)

    def __call__(self, pixels):
        return self.project(self.hidden_states(pixels))
