"""Qwen3-VL's and Qwen3.5's vision tower on the NumPy engine (frozen, or with LoRA on its blocks' and mergers' linears
and their backward): the Conv3d patch embedding as a
GEMM, the learned position grid bilinearly resampled to each image, blocks with the 2-D vision rotary and full
attention within each image (each frame group of a video), the patch merger and Qwen3-VL's DeepStack mergers (transformers' Qwen3VLVisionModel;
Qwen3_5VisionModel is the same without them)."""
from __future__ import annotations

import math

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.vision_tower import (LoraLinears, bidirectional_attention_backward,
                                                   bidirectional_attention_forward, gelu_backward, gelu_forward,
                                                   layernorm_backward, layernorm_forward)
from wgpu_train.models.qwen3_vl import LAYER_NORM_EPS, VISUAL, Qwen3VLVision, frame_grids

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


def gelu_erf_backward(dy, x):
    """dx of gelu_erf_forward: dy * (Phi(x) + x phi(x))."""
    x64 = x.astype(np.float64)
    d = 0.5 * (1.0 + erf(x64 / math.sqrt(2.0))) + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    return (dy * d).astype(dy.dtype)


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


# the linear modules of a block and of a merger, the LoRA targets the tower offers (their paths under visual.)
BLOCK_MODULES = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
MERGER_MODULES = ("linear_fc1", "linear_fc2")


class Qwen3VLTower(LoraLinears):
    """The tower over its weights ({our name (models/qwen3_vl.tensor_shapes): array}) in `dtype`; lora: {module
    path (visual.blocks.N.attn.qkv, visual.merger.linear_fc1, ...): (A (r, in), B (out, r), scale)}. __call__:
    pixel_values (P, patch dim) and image_grid_thw (N, 3) -> (the image tokens' embeddings (P / 4, text C),
    the DeepStack features [(P / 4, text C)] in the order of the blocks they come from; Qwen3.5's: none); forward
    keeps what backward needs, which takes both's gradients to the LoRA gradients."""

    def __init__(self, vc: Qwen3VLVision, weights: dict, dtype=np.float32):
        self.vc, self.dtype = vc, np.dtype(dtype)
        self.w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}
        self.lora: dict = {}

    def mergers(self) -> list:
        """(prefix, post_norm) of the merger and of each DeepStack merger."""
        return [(VISUAL + "merger.", False), *((f"{VISUAL}deepstack_merger_list.{j}.", True)
                                                for j in range(len(self.vc.deepstack_indexes)))]

    def modules(self) -> list[str]:
        """Every block's and merger's linear module path, the LoRA targets the tower offers."""
        return [*(f"{VISUAL}blocks.{i}.{m}" for i in range(self.vc.depth) for m in BLOCK_MODULES),
                *(p + m for p, _ in self.mergers() for m in MERGER_MODULES)]
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

    def _merge(self, x, prefix: str, post_norm: bool, c: dict):
        """A patch merger: x (P, C) -> (P / 4, text C): LayerNorm (before the 4 patches of a block are joined, or
        after: DeepStack's), fc1, the exact GELU, fc2; c keeps what _merge_backward needs."""
        w, width = self.w, self.vc.hidden_size * self.vc.merge_unit
        if post_norm:
            x = x.reshape(-1, width)
        c["x"] = x
        x, c["rstd"] = layernorm_forward(x, w[prefix + "norm.weight"], w[prefix + "norm.bias"], LAYER_NORM_EPS)
        c["f1"] = self._linear(x.reshape(-1, width), prefix + "linear_fc1", c)
        return self._linear(gelu_erf_forward(c["f1"]), prefix + "linear_fc2", c)

    def _merge_backward(self, dout, prefix: str, post_norm: bool, c: dict, grads: dict):
        """The merger's input gradient (P, C) from its output's dout (P / 4, text C)."""
        dg = self._linear_backward(dout, prefix + "linear_fc2", c, grads)
        dh = self._linear_backward(gelu_erf_backward(dg, c["f1"]), prefix + "linear_fc1", c, grads)
        if not post_norm:
            dh = dh.reshape(-1, self.vc.hidden_size)
        dx = layernorm_backward(dh, c["x"], self.w[prefix + "norm.weight"], c["rstd"])
        return dx.reshape(-1, self.vc.hidden_size)

    def _block(self, x, i: int, grids, rotary, c: dict):
        """Block i over all images' patches x (P, C): attention within each image, then the MLP; c keeps what
        _block_backward needs."""
        vc, w, p = self.vc, self.w, f"{VISUAL}blocks.{i}."
        c["x"] = x
        h, c["rstd1"] = layernorm_forward(x, w[p + "norm1.weight"], w[p + "norm1.bias"], LAYER_NORM_EPS)
        qkv = self._linear(h, p + "attn.qkv", c).reshape(-1, 3, vc.num_heads, vc.head_dim)
        out, start, c["att"] = [], 0, []
        for grid, (pos, inv) in zip(grids, rotary):
            n = int(np.prod(grid))
            q, k, v = (qkv[None, start:start + n, j] for j in range(3))                    # (1, n, H, D)
            q, k = (ops.rope_forward(a, pos, inv) for a in (q, k))
            att, lse = bidirectional_attention_forward(q, k, v)
            c["att"].append((q, k, v, att, lse))
            out.append(att[0].reshape(n, -1))
            start += n
        x = x + self._linear(np.concatenate(out), p + "attn.proj", c)
        c["x2"] = x
        h, c["rstd2"] = layernorm_forward(x, w[p + "norm2.weight"], w[p + "norm2.bias"], LAYER_NORM_EPS)
        c["f1"] = self._linear(h, p + "mlp.linear_fc1", c)
        return x + self._linear(gelu_forward(c["f1"]), p + "mlp.linear_fc2", c)

    def _block_backward(self, dx, i: int, rotary, c: dict, grads: dict):
        """Block i's input gradient (P, C) from its output's dx (P, C)."""
        w, p = self.w, f"{VISUAL}blocks.{i}."
        dg = self._linear_backward(dx, p + "mlp.linear_fc2", c, grads)
        dh = self._linear_backward(gelu_backward(dg, c["f1"]), p + "mlp.linear_fc1", c, grads)
        dx = dx + layernorm_backward(dh, c["x2"], w[p + "norm2.weight"], c["rstd2"])
        datt = self._linear_backward(dx, p + "attn.proj", c, grads)                      # (P, H*D)
        dqkv, start = [], 0
        for (q, k, v, att, lse), (pos, inv) in zip(c["att"], rotary):
            n = q.shape[1]
            dq, dk, dv = bidirectional_attention_backward(datt[None, start:start + n].reshape(att.shape), q, k, v,
                                                          att, lse)
            dq, dk = (ops.rope_backward(d, pos, inv) for d in (dq, dk))
            dqkv.append(np.stack([dq[0], dk[0], dv[0]], axis=1))                          # (n, 3, H, D)
            start += n
        dh = self._linear_backward(np.concatenate(dqkv).reshape(dx.shape[0], -1), p + "attn.qkv", c, grads)
        return dx + layernorm_backward(dh, c["x"], w[p + "norm1.weight"], c["rstd1"])

    def forward(self, pixels, grids, keep: bool = True) -> tuple:
        """pixel_values (P, patch dim), image_grid_thw (N, 3) -> (the image tokens' embeddings (P / 4, text C), the
        DeepStack features [(P / 4, text C)], the backward's cache: its activations only with `keep`)."""
        vc, w = self.vc, self.w
        grids = frame_grids(grids)          # a video's frames each attend within themselves
        if pixels.shape != (sum(int(np.prod(g)) for g in grids), vc.patch_dim):
            raise ValueError(f"pixel_values of shape {pixels.shape} for grids {grids} of {vc.patch_dim}-value patches")
        kernel = w[VISUAL + "patch_embed.proj.weight"].reshape(vc.hidden_size, -1)              # (C, patch dim)
        x = ops.linear_forward(np.asarray(pixels, self.dtype), kernel, w[VISUAL + "patch_embed.proj.bias"])
        x = x + np.concatenate([self.position_embeddings(g) for g in grids]).astype(self.dtype)   # (P, C)
        rotary = [self.rotary_positions(g) for g in grids]
        mergers = self.mergers()
        cache = {"rotary": rotary, "blocks": [], "mergers": [None] * len(mergers)}    # in mergers()' order
        deepstack = []          # in the blocks' order, as transformers collects them
        for i in range(vc.depth):
            c: dict = {}
            x = self._block(x, i, grids, rotary, c)
            cache["blocks"].append(c if keep else None)
            if i in vc.deepstack_indexes:
                j, c = 1 + vc.deepstack_indexes.index(i), {}
                deepstack.append(self._merge(x, *mergers[j], c))
                cache["mergers"][j] = c if keep else None
        c = {}
        out = self._merge(x, *mergers[0], c)
        cache["mergers"][0] = c if keep else None
        return out, deepstack, cache

    def __call__(self, pixels, grids) -> tuple:
        """The frozen forward: (the image tokens' embeddings, the DeepStack features)."""
        return self.forward(pixels, grids, keep=False)[:2]

    def backward(self, dout, ddeepstack, cache) -> dict:
        """The image embeddings' gradient dout (P / 4, text C) and the DeepStack features' [(P / 4, text C)] (in
        forward's order, the blocks') ->
        {module path.lora_A / .lora_B: gradient} of the tower's LoRA; the ops in reverse order of forward's."""
        grads: dict = {}
        mergers = self.mergers()
        dx = self._merge_backward(dout, *mergers[0], cache["mergers"][0], grads)
        for i in reversed(range(self.vc.depth)):
            if i in self.vc.deepstack_indexes:
                j, k = self.vc.deepstack_indexes.index(i), sorted(self.vc.deepstack_indexes).index(i)
                dx = dx + self._merge_backward(ddeepstack[k], *mergers[1 + j], cache["mergers"][1 + j], grads)
            dx = self._block_backward(dx, i, cache["rotary"], cache["blocks"][i], grads)
        return grads
