"""Images in a batch's token stream (Gemma 3): the embeddings that replace the image placeholders' and the
bidirectional blocks they form, as an engine's forward takes them (engine.set_images)."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """blocks (B, T) int32: each image token's block number (models/vision.image_blocks), -1 for text; embeds
    (n, C): the image tokens' embeddings in the batch's row-major order, n the count of blocks >= 0. They
    replace the embedding rows there (unscaled: the projector's output is the text stream's), and each block's
    tokens see each other both ways in the attention (SmolVLM's: each token a block of its own, plainly causal)."""

    blocks: np.ndarray
    embeds: np.ndarray

    def __post_init__(self):
        n = int((self.blocks >= 0).sum())
        if self.embeds.shape[0] != n:
            raise ValueError(f"{self.embeds.shape[0]} image embeddings for {n} image tokens")

    def rounded(self, rounding) -> ImageTokens:
        """The same tokens with their embeddings through `rounding` (an engine's storage of activations)."""
        return dataclasses.replace(self, embeds=rounding(self.embeds))

    @property
    def flat(self) -> np.ndarray:
        """(B*T,) bool: the image tokens."""
        return self.blocks.reshape(-1) >= 0
