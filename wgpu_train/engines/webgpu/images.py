"""Images on the WebGPU engine (engine.set_images): each micro-batch slot's image inputs uploaded with its batch,
which the layer recording scatters over the embedding rows, the attention takes as bidirectional blocks (Gemma
3's), RoPE takes each pair's positions from and the layers add DeepStack features from (Qwen3-VL's), and the
backward gathers the image rows' gradient and the DeepStack features' from (read back only when asked: image_grad,
deepstack_grad); a train_step's micro-batch with TowerImages gets its buffers only, the vision tower's forward
recorded into its embeds (steps.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wgpu_train.engines.shared.image_tokens import TowerImages
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents
from wgpu_train.engines.webgpu.tuned.decode_kernels import with_reaches


@dataclass
class BatchImages:
    """One uploaded batch's images: index (count,) i32, the image tokens' rows in the batch; embeds (count, C) in
    the layers' input format; spans, the attention's operand: a training forward's segment ids with the blocks'
    extents (attention_kernels.extents, (3, B, T)), or generation's positions with each query's reach
    (decode_kernels.with_reaches, (2, n)); grad (count, C) float32, the image rows' gradient a backward gathers
    (embeds and grad None on a pipeline stage after the first);
    deepstack: Qwen3-VL's features (count, C) each, in the layers' input format, the k-th added to layer k's
    output at the image tokens (frozen: their gradient is the residual stream's, which passes through; None for a
    layer a pipeline stage does not hold); deepstack_grad (count, C) float32 each: the k-th's gradient, layer k's
    output gradient at the image rows, which a backward gathers (for the tower's LoRA; None as deepstack's);
    pixels: TowerImages' tower_input (SigLIP's pixels (N, C, H, W), Qwen's (patches, grids)), which the vision
    tower writes embeds (and the DeepStack features) from inside the step, or None; outputs / output_grads: what
    the tower writes and the gradients its backward reads, the embeddings' then the DeepStack features'."""

    index: object
    embeds: object
    spans: object
    grad: object
    count: int
    deepstack: tuple = ()
    deepstack_grad: tuple = ()
    pixels: object = None

    @property
    def outputs(self) -> tuple:
        return (self.embeds, *self.deepstack)

    @property
    def output_grads(self) -> tuple:
        return (self.grad, *self.deepstack_grad)


class ImageInputs:
    """The images the following forwards take (tokens: a shared/image_tokens.ImageTokens, or None), and the
    device buffers of each micro-batch slot, grown as needed and reused."""

    def __init__(self, rt: Runtime, hidden: int):
        self.rt, self.c = rt, hidden
        self.tokens = None
        self._slots: dict = {}      # slot -> {name: (buffer, capacity in elements)}

    def _buffer(self, slot, name: str, elems: int, fmt: str = "f32"):
        have = self._slots.setdefault(slot, {}).get(name)
        if have is None or have[1] < elems or storage.format_of(have[0]) != fmt:
            if have is not None:
                self.rt.release(have[0])
            cap = 1 << max(4, (elems - 1).bit_length())
            buf = storage.set_format(self.rt.buffer(storage.nbytes(cap, fmt), "image " + name), fmt)
            have = self._slots[slot][name] = (buf, cap)
        return have[0]

    def attach(self, acts, slot, ids, segment_ids, position_ids, x_in, generation: bool, layers: range):
        """After upload_batch wrote a batch into acts: the tokens' images (when set) written to the slot's buffers
        and acts.images pointed at them (None without images). ids, segment_ids, position_ids (B, T): the batch
        as uploaded (generation: (1, n) padded tokens, their cache rows and positions); the ids are rewritten
        with -1 at the image tokens (the embedding looks none up for them and gives them no gradient); ids None
        (a pipeline stage after the first, which has no embedding): neither the ids nor the embeddings written
        (images.embeds and grad None), the blocks, M-RoPE positions and DeepStack features only; x_in: the
        layers' input buffer (its format is the embeddings'); layers: the layers recorded over acts (a pipeline
        stage's), whose DeepStack features alone are uploaded (None in images.deepstack for the others). The
        tokens' M-RoPE positions (Qwen3-VL's, a decoded token's too, which has no image) go to acts.rope_pairs,
        padded with 0."""
        acts.images = acts.rope_pairs = None
        if self.tokens is None:
            return
        b, t = np.shape(segment_ids)
        if self.tokens.positions is not None:
            pairs = np.asarray(self.tokens.positions, np.int32)                    # (B, T', R/2)
            if pairs.shape[:2] != self.tokens.blocks.shape:
                raise ValueError(f"M-RoPE positions of {pairs.shape} for images of {self.tokens.blocks.shape}")
            pairs = np.pad(pairs, [(0, 0), (0, t - pairs.shape[1]), (0, 0)])
            acts.rope_pairs = self._buffer(slot, "rope_pairs", pairs.size)
            self.rt.write(acts.rope_pairs, pairs.reshape(-1))
        if not (self.tokens.blocks >= 0).any():
            return
        blocks = self.tokens.blocks
        if blocks.shape[0] != b or blocks.shape[1] > t:
            raise ValueError(f"images of {blocks.shape} tokens for a batch of {ids.shape}")
        blocks = np.pad(blocks, [(0, 0), (0, t - blocks.shape[1])], constant_values=-1)   # generation's padding
        flat = blocks.reshape(-1) >= 0
        index = np.flatnonzero(flat).astype(np.int32)
        n, c, fmt = index.size, self.c, storage.format_of(x_in)
        rt = self.rt
        first = ids is not None
        if first:
            rt.write(acts.ids, np.where(flat, -1, np.asarray(ids).reshape(-1)).astype(np.int32))
        embeds, grad = (self._buffer(slot, "embeds", n * c, fmt), self._buffer(slot, "grad", n * c)) if first else \
            (None, None)
        towered = isinstance(self.tokens, TowerImages)
        n_deep = self.tokens.deepstack_layers if towered else len(self.tokens.deepstack)
        held = [k in layers for k in range(n_deep)]
        images = BatchImages(self._buffer(slot, "index", n), embeds, self._buffer(slot, "spans", 3 * b * t), grad,
                             n, tuple(self._buffer(slot, f"deepstack {k}", n * c, fmt) if h else None
                                      for k, h in enumerate(held)),
                             tuple(self._buffer(slot, f"deepstack grad {k}", n * c) if h else None
                                   for k, h in enumerate(held)))
        rt.write(images.index, index)
        if towered:
            images.pixels = self.tokens.tower_input
        else:
            features = ((images.embeds, self.tokens.embeds),) if first else ()
            for buf, values in (*features, *zip(images.deepstack, self.tokens.deepstack)):
                if buf is not None:
                    rt.write(buf, storage.to_words(np.asarray(values, np.float32), fmt))
        spans = (with_reaches(np.asarray(position_ids).reshape(-1), blocks.reshape(-1),
                              np.asarray(segment_ids).reshape(-1)) if generation else extents(segment_ids, blocks))
        rt.write(images.spans, spans.reshape(-1).astype(np.int32))
        acts.images = images

    def read_grad(self, images: BatchImages | None):
        """The image rows' gradient (count, C) float32 a backward gathered into images.grad, or None."""
        if images is None:
            return None
        return self.rt.read(images.grad, np.float32, (images.count, self.c))

    def read_deepstack_grad(self, images: BatchImages | None) -> dict:
        """{layer k: the k-th DeepStack features' gradient (count, C) float32} a backward gathered ({} without)."""
        if images is None:
            return {}
        return {k: self.rt.read(buf, np.float32, (images.count, self.c)) for k, buf in enumerate(images.deepstack_grad)
                if buf is not None}
