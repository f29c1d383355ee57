"""LFM2-VL's SigLIP2 NaFlex tower and projector on the NumPy engine, frozen or with LoRA on the encoder's linear
modules (their backward from the image tokens' gradient): each tile's patches through the Linear patch embedding,
the learned position grid resized to the tile's patches (antialiased bilinear, as transformers'
Siglip2VisionEmbeddings), SigLIP's encoder over the tile's own patches (the padding is never attended), then the
projector: pixel unshuffle by downsample_factor, LayerNorm, Linear, GELU, Linear."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.qwen3_vl_tower import gelu_erf_backward, gelu_erf_forward
from wgpu_train.engines.numpy.vision_tower import VisionTower, layernorm_backward, layernorm_forward
from wgpu_train.models.lfm2_vl import PROJ, TOWER
from wgpu_train.models.vision import ENCODER_MODULES


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


def shuffle(x, rows: int, cols: int, f: int):
    """unshuffle's inverse (its backward): x (rows / f * cols / f, f * f * C) -> (rows * cols, C)."""
    c = x.shape[-1] // (f * f)
    x = x.reshape(rows // f, cols // f, f, f, c).transpose(0, 2, 1, 3, 4)          # (block r, dr, block c, dc, C)
    return x.reshape(rows * cols, c)


class Siglip2Tower(VisionTower):
    """The tower and the projector over their weights ({our name (models/lfm2_vl.tensor_shapes): array}) in
    `dtype`; lora: {encoder module path: (A (r, in), B (out, r), scale)}. __call__: a processor's (pixel_values (N,
    P, p * p * C), pixel_attention_mask (N, P), spatial_shapes (N, 2)) -> the image tokens' embeddings (tokens of
    all N tiles, text hidden); forward keeps what backward needs, which takes their gradient to the LoRA's."""

    def modules(self) -> list[str]:
        """The encoder's linear modules, the LoRA targets the tower offers (not the projector's)."""
        return [f"{TOWER}encoder.layers.{i}.{m}" for i in range(self.vc.num_layers) for m in ENCODER_MODULES]

    def positions(self, rows: int, cols: int) -> np.ndarray:
        """The position grid resized to rows x cols patches: (rows * cols, C)."""
        g, c = self.vc.grid_side, self.vc.hidden_size
        table = self.w[TOWER + "embeddings.position_embedding.weight"].astype(np.float64).reshape(g, g, c)
        out = np.einsum("hi,wj,ijc->hwc", resize_weights(rows, g), resize_weights(cols, g), table)
        return out.reshape(rows * cols, c).astype(self.dtype)

    def tile(self, patches, rows: int, cols: int, keep: bool = False) -> tuple:
        """One tile's patches (rows * cols, p * p * C) -> (its tokens' embeddings (rows / f * cols / f, text C),
        the backward's cache: its activations with `keep`)."""
        vc, w, e = self.vc, self.w, TOWER + "embeddings."
        f = vc.downsample_factor
        if rows % f or cols % f:
            raise ValueError(f"a tile of {rows} x {cols} patches is not whole {f} x {f} blocks")
        x = ops.linear_forward(np.asarray(patches, self.dtype), w[e + "patch_embedding.weight"],
                               w[e + "patch_embedding.bias"]) + self.positions(rows, cols)
        y, cache = self.encode(x, 1, keep)
        u = unshuffle(y, rows, cols, f)
        cache.update(rows=rows, cols=cols, u=u)
        if vc.projector_use_layernorm:
            u, cache["rstd_proj"] = layernorm_forward(u, w[PROJ + "layer_norm.weight"], w[PROJ + "layer_norm.bias"],
                                                      1e-5)
        cache["h"] = ops.linear_forward(u, w[PROJ + "linear_1.weight"], w.get(PROJ + "linear_1.bias"))
        out = ops.linear_forward(gelu_erf_forward(cache["h"]), w[PROJ + "linear_2.weight"],
                                 w.get(PROJ + "linear_2.bias"))
        return out, cache

    def forward(self, pixels) -> tuple:
        """pixels as __call__ takes them -> (the image tokens' embeddings, the backward's cache: each tile's)."""
        values, _, shapes = pixels
        tiles = [self.tile(values[i, :r * c], r, c, keep=True) for i, (r, c) in enumerate(np.asarray(shapes).tolist())]
        return self._joined([t for t, _ in tiles]), {"tiles": [c for _, c in tiles]}

    def __call__(self, pixels) -> np.ndarray:
        """The frozen forward, a tile at a time."""
        values, _, shapes = pixels
        return self._joined([self.tile(values[i, :r * c], r, c)[0]
                             for i, (r, c) in enumerate(np.asarray(shapes).tolist())])

    def _joined(self, tiles) -> np.ndarray:
        return np.concatenate(tiles) if tiles else np.zeros((0, self.vc.text_hidden_size), self.dtype)

    def backward(self, dout, cache) -> dict:
        """The image tokens' gradient dout (tokens, text C) -> {module path.lora_A / .lora_B: gradient} of the
        tower's LoRA, summed over the tiles: back through the projector, the unshuffle and the encoder."""
        w, f, grads, at = self.w, self.vc.downsample_factor, {}, 0
        for c in cache["tiles"]:
            n = c["u"].shape[0]
            dh = ops.linear_backward(dout[at:at + n], None, w[PROJ + "linear_2.weight"], False)[0]
            du = ops.linear_backward(gelu_erf_backward(dh, c["h"]), None, w[PROJ + "linear_1.weight"], False)[0]
            if self.vc.projector_use_layernorm:
                du = layernorm_backward(du, c["u"], w[PROJ + "layer_norm.weight"], c["rstd_proj"])
            tile: dict = {}
            self.encode_backward(shuffle(du, c["rows"], c["cols"], f), c, tile)
            for k, g in tile.items():
                grads[k] = grads[k] + g if k in grads else g
            at += n
        return grads

    def tokens(self, shapes) -> int:
        """The image tokens of tiles of `shapes` (N, 2) patches."""
        f = self.vc.downsample_factor
        return int(sum((r // f) * (c // f) for r, c in np.asarray(shapes).tolist()))
