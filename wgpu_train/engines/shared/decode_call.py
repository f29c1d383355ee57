"""The tokens of one forward_rows call of a DecodeBatch (engines/generate.py): ids, cache rows, positions and
adapters, the logits each row wants, and the images as the engine's set_images takes them (Qwen3-VL's M-RoPE
positions per rotated pair and DeepStack features too)."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.image_tokens import ImageTokens


class DecodeCall:
    """The tokens of one forward_rows call: ids, cache rows, positions and adapters, and which logits each row
    wants."""

    def __init__(self):
        self.ids, self.rows, self.positions, self.adapters = [], [], [], []
        self.wants, self.last = [], []         # (slot, position) and its token's index in the call
        self.blocks, self.embeds = [], []      # each token's image block (-1: text), the image tokens' embeddings
        self.deepstack = []                    # each image prompt's DeepStack features (Qwen3-VL's)
        self.pairs = []                        # each token's M-RoPE positions (n, R/2), or its position (n,)
        self.mrope = False                     # whether any token's are M-RoPE's
        self.n = 0

    def add(self, slot: int, ids: np.ndarray, start: int, wants, adapter: int, images: ImageTokens | None = None,
            shift: int | None = None):
        """shift: a Qwen3-VL row's decoded token's M-RoPE position less its cache position (None: none)."""
        pos = np.arange(start, start + ids.size)
        self.pairs.append(pos if shift is None else pos[:, None] + shift)       # (n,), or (n, 1) broadcast
        self.mrope |= shift is not None
        if images is None:
            self.blocks.append(np.full(ids.size, -1, np.int32))
        else:                                   # a whole prompt (start 0): its blocks and embeddings
            self.blocks.append(images.blocks[0])
            self.embeds.append(images.embeds)
            if images.positions is not None:
                self.pairs[-1], self.mrope = images.positions[0], True
                self.deepstack.append(images.deepstack)
        self.ids.append(ids)
        self.rows.append(np.full(ids.size, slot))
        self.adapters.append(np.full(ids.size, adapter))
        self.positions.append(pos)
        for pos in wants:
            self.wants.append((slot, pos))
            self.last.append(self.n + pos - start)
        self.n += ids.size

    def images(self, hidden: int, half: int) -> ImageTokens | None:
        """The call's images as the engine's set_images takes them (its tokens as one row), or None; with M-RoPE
        rows (Qwen3-VL's), every token's positions per rotated pair (half of them; a text token's its position on
        each) and the image prompts' DeepStack features joined layer by layer."""
        if not self.embeds and not self.mrope:
            return None
        embeds = np.concatenate(self.embeds) if self.embeds else np.zeros((0, hidden), np.float32)
        if not self.mrope:
            return ImageTokens(np.concatenate(self.blocks)[None], embeds)
        pairs = np.concatenate([np.broadcast_to(p.reshape(p.shape[0], -1), (p.shape[0], half)) for p in self.pairs])
        deepstack = tuple(np.concatenate(layer) for layer in zip(*self.deepstack)) if self.deepstack else ()
        return ImageTokens(np.concatenate(self.blocks)[None], embeds, pairs[None].astype(np.int32), deepstack)
