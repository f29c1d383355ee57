"""LFM2-VL's SigLIP2 NaFlex tower and projector on the NumPy engine, frozen: each tile's patches through the Linear
patch embedding, the learned position grid resized to the tile's patches (antialiased bilinear, as transformers'
Siglip2VisionEmbeddings), SigLIP's encoder over the tile's own patches (the padding is never attended), then the
projector: pixel unshuffle by downsample_factor, LayerNorm, Linear, GELU, Linear."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.qwen3_vl_tower import gelu_erf_forward
from wgpu_train.engines.numpy.vision_tower import VisionTower, layernorm_forward
from wgpu_train.errors import ConfigError
from wgpu_train.models.lfm2_vl import PROJ, TOWER, Lfm2VlVision


def resize_weights(size: int, grid: int) -> np.ndarray:
    """(size, grid) weights of F.interpolate(mode="bilinear", align_corners=False, antialias=True) along one axis
    from `grid` positions to `size`: a triangle as wide as the scale where it shrinks, normalised per output."""
    scale = grid / size
    center = (np.arange(size) + 0.5) * scale - 0.5
    w = np.clip(1.0 - np.abs(np.arange(grid)[None, :] - center[:, None]) / max(scale, 1.0), 0.0, None)
    return w / w.sum(axis=1, keepdims=True)


def unshuffle(x, rows: int, cols: int, f: int):
    """x (rows * cols, C) patches row-major -> (rows / f * cols / f, f * f * C): each token the f x f block of
    patches, row offset then column offset (transformers' Lfm2VlMultiModalProjector.pixel_unshuffle)."""
    c = x.shape[-1]
    x = x.reshape(rows // f, f, cols // f, f, c).transpose(0, 2, 1, 3, 4)          # (block r, block c, dr, dc, C)
    return x.reshape(-1, f * f * c)


class Siglip2Tower(VisionTower):
    """The tower and the projector over their weights ({our name (models/lfm2_vl.tensor_shapes): array}) in
    `dtype`. __call__: a processor's (pixel_values (N, P, p * p * C), pixel_attention_mask (N, P), spatial_shapes
    (N, 2)) -> the image tokens' embeddings (tokens of all N tiles, text hidden). Frozen: its LoRA is refused."""

    def __init__(self, vc: Lfm2VlVision, weights: dict, dtype=np.float32):
        super().__init__(vc, weights, dtype)

    def modules(self) -> list[str]:
        """No LoRA target: the tower's LoRA (set_tower_lora, --lora-targets' tower entries) refused in one line."""
        raise ConfigError("LoRA on LFM2-VL's vision tower is not supported yet (its language model's is)")

    def positions(self, rows: int, cols: int) -> np.ndarray:
        """The position grid resized to rows x cols patches: (rows * cols, C)."""
        g, c = self.vc.grid_side, self.vc.hidden_size
        table = self.w[TOWER + "embeddings.position_embedding.weight"].astype(np.float64).reshape(g, g, c)
        out = np.einsum("hi,wj,ijc->hwc", resize_weights(rows, g), resize_weights(cols, g), table)
        return out.reshape(rows * cols, c).astype(self.dtype)

    def tile(self, patches, rows: int, cols: int) -> np.ndarray:
        """One tile's patches (rows * cols, p * p * C) -> its tokens' embeddings (rows / f * cols / f, text C)."""
        vc, w, e = self.vc, self.w, TOWER + "embeddings."
        f = vc.downsample_factor
        if rows % f or cols % f:
            raise ValueError(f"a tile of {rows} x {cols} patches is not whole {f} x {f} blocks")
        x = ops.linear_forward(np.asarray(patches, self.dtype), w[e + "patch_embedding.weight"],
                               w[e + "patch_embedding.bias"]) + self.positions(rows, cols)
        y, _ = self.encode(x, 1, keep=False)
        u = unshuffle(y, rows, cols, f)
        if vc.projector_use_layernorm:
            u, _ = layernorm_forward(u, w[PROJ + "layer_norm.weight"], w[PROJ + "layer_norm.bias"], 1e-5)
        h = gelu_erf_forward(ops.linear_forward(u, w[PROJ + "linear_1.weight"], w.get(PROJ + "linear_1.bias")))
        return ops.linear_forward(h, w[PROJ + "linear_2.weight"], w.get(PROJ + "linear_2.bias"))

    def __call__(self, pixels) -> np.ndarray:
        values, _, shapes = pixels
        out = [self.tile(values[i, :r * c], r, c) for i, (r, c) in enumerate(np.asarray(shapes).tolist())]
        return np.concatenate(out) if out else np.zeros((0, self.vc.text_hidden_size), self.dtype)

    def tokens(self, shapes) -> int:
        """The image tokens of tiles of `shapes` (N, 2) patches."""
        f = self.vc.downsample_factor
        return int(sum((r // f) * (c // f) for r, c in np.asarray(shapes).tolist()))
