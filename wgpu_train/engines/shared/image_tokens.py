"""Images in a batch's token stream (Gemma 3, SmolVLM, Qwen3-VL): the embeddings that replace the image
placeholders' and the bidirectional blocks they form, Qwen3-VL's M-RoPE positions and DeepStack features, as an
engine's forward takes them (engine.set_images)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """blocks (B, T) int32: each image token's block number (models/vision.image_blocks), -1 for text; embeds
    (n, C): the image tokens' embeddings in the batch's row-major order, n the count of blocks >= 0. They
    replace the embedding rows there (unscaled: the projector's output is the text stream's), and each block's
    tokens see each other both ways in the attention (SmolVLM's: each token a block of its own, plainly causal).
    Qwen3-VL's: positions (B, T, R/2) int32, each rotated pair's position (M-RoPE; RoPE takes them in place of
    the forward's position ids, which still place the keys in a KV cache), or None; deepstack: (n, C) arrays,
    the k-th added to the image tokens' rows of the k-th layer's output."""

    blocks: np.ndarray
    embeds: np.ndarray
    positions: np.ndarray | None = None
    deepstack: tuple = ()

    def __post_init__(self):
        n = int((self.blocks >= 0).sum())
        if self.embeds.shape[0] != n:
            raise ValueError(f"{self.embeds.shape[0]} image embeddings for {n} image tokens")

    def rounded(self, rounding) -> ImageTokens:
        """The same tokens with their embeddings through `rounding` (an engine's storage of activations)."""
        return dataclasses.replace(self, embeds=rounding(self.embeds),
                                   deepstack=tuple(rounding(d) for d in self.deepstack))

    def add_deepstack(self, x, layer: int):
        """x (B*T, C), layer `layer`'s output, with its DeepStack features added at the image tokens (a copy; x
        itself where the layer takes none)."""
        if layer >= len(self.deepstack):
            return x
        x = x.copy()
        x[self.flat] += self.deepstack[layer]
        return x

    @property
    def flat(self) -> np.ndarray:
        """(B*T,) bool: the image tokens."""
        return self.blocks.reshape(-1) >= 0

    def rows(self, r0: int, r1: int) -> ImageTokens:
        """The ImageTokens of rows r0:r1 of the batch: the embeddings and DeepStack features are in the rows'
        order, so those rows' are one run."""
        e0, e1 = _token_run(self.blocks, r0, r1)
        return ImageTokens(self.blocks[r0:r1], self.embeds[e0:e1],
                           None if self.positions is None else self.positions[r0:r1],
                           tuple(d[e0:e1] for d in self.deepstack))


def _token_run(blocks, r0: int, r1: int) -> tuple:
    """(first, end) of rows r0:r1's image tokens among the batch's, in row-major order."""
    counts = (blocks >= 0).sum(axis=1)                                           # (B,) image tokens per row
    return int(counts[:r0].sum()), int(counts[:r1].sum())


@dataclasses.dataclass(frozen=True)
class TowerImages:
    """A micro-batch's images as the pixels its engine's vision tower (engine.set_vision_tower) runs inside the
    train_step: blocks (B, T) int32 as ImageTokens'; pixels, the tower's input: SigLIP's (N, C, H, W) float32, whose
    N * mm_tokens_per_image embeddings take the image tokens' rows in order, or Qwen's patches (P, patch dim) of
    images grids (N, 3) (their P / merge_unit embeddings; the gradient goes back through the tower's LoRA, where it
    has one); host: () -> their ImageTokens, the tower's forward outside a step (what an engine's set_images takes
    them as: scoring, a reference engine's), which switch the tower's LoRA off with the engine's adapter; lora:
    whether the tower has LoRA (a reference's images differ from the policy's then). positions: Qwen's M-RoPE
    positions (B, T, R/2) as ImageTokens' (computed on the host: no tower needed), else None; deepstack_layers:
    how many DeepStack features (Qwen3-VL's) the tower gives beside the embeddings, the k-th added to layer k."""

    blocks: np.ndarray
    pixels: np.ndarray
    host: object = dataclasses.field(default=None, compare=False, repr=False)
    lora: bool = False
    grids: np.ndarray | None = None
    positions: np.ndarray | None = None
    deepstack_layers: int = 0

    def rows(self, r0: int, r1: int) -> TowerImages:
        """The TowerImages of rows r0:r1 (a data-parallel worker's share of a micro-batch): the images their
        placeholders take (images go in the rows' order), their positions; host() the whole's, cut to those rows."""
        t0, t1 = _token_run(self.blocks, r0, r1)
        n = int((self.blocks >= 0).sum())
        if self.grids is None:          # each image (tile) the same count of tokens, a pixel row each
            sizes = np.ones(len(self.pixels), np.int64)
            tokens = np.full(len(self.pixels), n // max(len(self.pixels), 1))
        else:                           # Qwen's: each image its grid's patches, a token per merge unit of them
            sizes = np.prod(np.asarray(self.grids).reshape(-1, 3), axis=1)
            tokens = sizes * n // max(int(sizes.sum()), 1)
        i0, i1 = np.searchsorted(np.cumsum(np.concatenate([[0], tokens])), [t0, t1])
        p0, p1 = np.cumsum(np.concatenate([[0], sizes]))[[i0, i1]]
        host = self.host
        return dataclasses.replace(
            self, blocks=self.blocks[r0:r1], pixels=self.pixels[p0:p1],
            host=None if host is None else lambda: host().rows(r0, r1),
            grids=None if self.grids is None else self.grids[i0:i1],
            positions=None if self.positions is None else self.positions[r0:r1])

    @property
    def tower_input(self):
        """What the tower's forward takes: the pixels, or Qwen's (patches, grids)."""
        return self.pixels if self.grids is None else (self.pixels, self.grids)
