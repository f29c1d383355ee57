"""Qwen3-VL's and Qwen3.5's vision tower on the NumPy engine (frozen, forward only): the Conv3d patch embedding as a
GEMM, the learned position grid bilinearly resampled to each image, blocks with the 2-D vision rotary and full
attention within each image, the patch merger and Qwen3-VL's DeepStack mergers (transformers' Qwen3VLVisionModel;
Qwen3_5VisionModel is the same without them)."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.vision_tower import bidirectional_attention_forward, gelu_forward, layernorm_forward
from wgpu_train.models.qwen3_vl import LAYER_NORM_EPS, VISUAL, Qwen3VLVision

# Abramowitz & Stegun 7.1.26: erf to 1.5e-7 absolute, below float32's rounding of the GELU's output
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(x: np.ndarray) -> np.ndarray:
    """erf of a float64 array, vectorised (NumPy has none; math.erf element by element is slow on a tower's
    activations)."""
    t = 1.0 / (1.0 + _ERF_P * np.abs(x))
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def gelu_erf_forward(x):
    """The erf GELU (torch's nn.GELU(): x * Phi(x)), the mergers' activation."""
    return (0.5 * x * (1.0 + erf(x.astype(np.float64) / math.sqrt(2.0)))).astype(x.dtype)


def block_order(grid, merge: int) -> tuple:
    """An image's (t, rows, cols) of patches -> (row (P,), col (P,)) of each patch in pixel_values' order: merge
    blocks row-major, the patches of a block row-major inside it, repeated over t."""
    t, h, w = grid
    i = np.arange(h * w)
    block_cols = w // merge
    row = (i // (merge * merge * block_cols)) * merge + (i // merge) % merge
    col = ((i // (merge * merge)) % block_cols) * merge + i % merge
    return np.tile(row, t), np.tile(col, t)


def _taps(index, size: int, side: int) -> tuple:
    """Bilinear taps (P, 2) into a side-long table and their weights (P, 2), align_corners (endpoints to 0 and
    side - 1), as F.interpolate resamples the position grid."""
    src = index * (side - 1) / max(size - 1, 1)
    floor = np.floor(src)
    taps = floor[:, None].astype(np.int64) + np.arange(2)
    weights = np.clip(1.0 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0.0, None)
    return np.clip(taps, 0, side - 1), weights


class Qwen3VLTower:
    """The tower over its weights ({our name (models/qwen3_vl.tensor_shapes): array}) in `dtype`. __call__:
    pixel_values (P, patch dim) and image_grid_thw (N, 3) -> (the image tokens' embeddings (P / 4, text C),
    the DeepStack features [(P / 4, text C)] in the order of the blocks they come from; Qwen3.5's: none). Its encoder
    takes no LoRA."""

    lora: dict = {}

    def __init__(self, vc: Qwen3VLVision, weights: dict, dtype=np.float32):
        self.vc, self.dtype = vc, np.dtype(dtype)
        self.w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}

    def modules(self) -> list[str]:
        """The LoRA targets the tower offers: none yet."""
        return []

    def position_embeddings(self, grid) -> np.ndarray:
        """The learned position grid resampled to one image's patches (P, C), in pixel_values' order."""
        side = int(round(self.vc.num_position_embeddings ** 0.5))
        row, col = block_order(grid, self.vc.spatial_merge_size)
        (hi, hw), (wi, ww) = _taps(row.astype(np.float64), grid[1], side), _taps(col.astype(np.float64), grid[2], side)
        index = (hi[:, :, None] * side + wi[:, None, :]).reshape(-1, 4)
        weight = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4).astype(np.float32)
        return (self.w[VISUAL + "pos_embed.weight"][index] * weight[:, :, None]).sum(axis=1)

    def rotary_positions(self, grid) -> tuple:
        """The 2-D vision rotary of one image's patches as per-pair positions (1, P, D/2) over frequencies
        (D/2,): the first D/4 pairs turn with the patch's row, the rest with its column."""
        d = self.vc.head_dim
        inv = 1.0 / (self.vc.theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2)))   # (D/4,)
        row, col = block_order(grid, self.vc.spatial_merge_size)
        pos = np.concatenate([np.repeat(row[:, None], d // 4, 1), np.repeat(col[:, None], d // 4, 1)], axis=1)
        return pos[None], np.concatenate([inv, inv]).astype(np.float64)

    def _merge(self, x, prefix: str, post_norm: bool):
        """A patch merger: x (P, C) -> (P / 4, text C): LayerNorm (before the 4 patches of a block are joined, or
        after: DeepStack's), fc1, the exact GELU, fc2."""
        w, width = self.w, self.vc.hidden_size * self.vc.merge_unit
        if post_norm:
            x = x.reshape(-1, width)
        x, _ = layernorm_forward(x, w[prefix + "norm.weight"], w[prefix + "norm.bias"], LAYER_NORM_EPS)
        x = ops.linear_forward(x.reshape(-1, width), w[prefix + "linear_fc1.weight"], w[prefix + "linear_fc1.bias"])
        return ops.linear_forward(gelu_erf_forward(x), w[prefix + "linear_fc2.weight"], w[prefix + "linear_fc2.bias"])

    def _block(self, x, i: int, grids, rotary):
        """Block i over all images' patches x (P, C): attention within each image, then the MLP."""
        vc, w, p = self.vc, self.w, f"{VISUAL}blocks.{i}."
        h, _ = layernorm_forward(x, w[p + "norm1.weight"], w[p + "norm1.bias"], LAYER_NORM_EPS)
        qkv = ops.linear_forward(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).reshape(-1, 3, vc.num_heads,
                                                                                              vc.head_dim)
        out, start = [], 0
        for grid, (pos, inv) in zip(grids, rotary):
            n = int(np.prod(grid))
            q, k, v = (qkv[None, start:start + n, j] for j in range(3))                    # (1, n, H, D)
            q, k = (ops.rope_forward(a, pos, inv) for a in (q, k))
            out.append(bidirectional_attention_forward(q, k, v)[0][0].reshape(n, -1))
            start += n
        x = x + ops.linear_forward(np.concatenate(out), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h, _ = layernorm_forward(x, w[p + "norm2.weight"], w[p + "norm2.bias"], LAYER_NORM_EPS)
        h = ops.linear_forward(h, w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"])
        return x + ops.linear_forward(gelu_forward(h), w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])

    def __call__(self, pixels, grids) -> tuple:
        vc, w = self.vc, self.w
        grids = [tuple(int(v) for v in g) for g in np.asarray(grids).reshape(-1, 3)]
        if pixels.shape != (sum(int(np.prod(g)) for g in grids), vc.patch_dim):
            raise ValueError(f"pixel_values of shape {pixels.shape} for grids {grids} of {vc.patch_dim}-value patches")
        kernel = w[VISUAL + "patch_embed.proj.weight"].reshape(vc.hidden_size, -1)              # (C, patch dim)
        x = ops.linear_forward(np.asarray(pixels, self.dtype), kernel, w[VISUAL + "patch_embed.proj.bias"])
        x = x + np.concatenate([self.position_embeddings(g) for g in grids]).astype(self.dtype)   # (P, C)
        rotary = [self.rotary_positions(g) for g in grids]
        deepstack = []          # in the blocks' order, as transformers collects them
        for i in range(vc.depth):
            x = self._block(x, i, grids, rotary)
            if i in vc.deepstack_indexes:
                j = vc.deepstack_indexes.index(i)
                deepstack.append(self._merge(x, f"{VISUAL}deepstack_merger_list.{j}.", True))
        return self._merge(x, VISUAL + "merger.", False), deepstack
