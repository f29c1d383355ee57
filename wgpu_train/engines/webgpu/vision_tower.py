"""The frozen SigLIP vision tower and projector on the WebGPU engine (engines/numpy/vision_tower.VisionTower's
forward, the oracle): the patch embedding as a GEMM over patches unfolded on the host, position embeddings, the
bidirectional encoder layers (LayerNorm with bias, the attention family's image blocks, gelu_tanh MLP), the
post-layernorm, then Gemma 3's projector (average pool as a batched GEMM, the soft-embedding RMSNorm, the
projection) or SmolVLM's connector (pixel shuffle as a row gather, the projection); one submission and one readback
a call. LoRA on the tower's encoder stays on the NumPy tower."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.shared.patches import unfold_patches
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_forward
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.tensors import Matrix, linear_forward
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents, supported_head_dim
from wgpu_train.engines.webgpu.tuned.gemm import gemm
from wgpu_train.engines.webgpu.vision_tower_ops import gelu_forward, layernorm_forward
from wgpu_train.models.vision import PROJ, TOWER, VisionConfig

SCRATCH_BYTES = 1 << 30      # the activations a chunk of images may hold at once (at least one image's)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


def image_elements(vc: VisionConfig) -> int:
    """Elements of one image's widest activation (its patches by the MLP's or the hidden width)."""
    return vc.patches_per_side ** 2 * max(vc.intermediate_size, vc.hidden_size,
                                          vc.num_channels * vc.patch_size ** 2)


def scratch_elements(vc: VisionConfig) -> int:
    """Elements of one image's activations the forward holds at once: the patches, x, the norm's output, q, k, v and
    the attention's output, the MLP's two."""
    t = vc.patches_per_side ** 2
    return t * (vc.num_channels * vc.patch_size ** 2 + 6 * vc.hidden_size + 2 * vc.intermediate_size)


def runs_on_device(rt, vc: VisionConfig) -> bool:
    """Whether this tower runs on rt's device: the attention kernels take its head dim and one image's widest
    activation fits one storage binding (else the tower stays on the NumPy engine)."""
    return supported_head_dim(vc.head_dim) and image_elements(vc) * 4 <= rt.max_binding


class GpuVisionTower:
    """The frozen tower and projector on runtime rt over their weights ({our name (models/vision.tensor_shapes):
    array}), uploaded once as float32. __call__: pixel_values (N, C, H, W) -> the image tokens' embeddings
    (N, mm_tokens_per_image, text hidden) float32: the images in chunks whose widest activation fits one storage
    binding and whose activations SCRATCH_BYTES hold, a submission and a readback each (the buffers kept for the
    next call)."""

    def __init__(self, rt, vc: VisionConfig, weights: dict):
        self.rt, self.vc = rt, vc
        self._scratch: dict = {}        # name -> (buffer, capacity in elements), grown as batches need
        w = {k: np.asarray(v, np.float32) for k, v in weights.items()}
        e = TOWER + "embeddings."
        kernel = w[e + "patch_embedding.weight"].reshape(vc.hidden_size, -1)                # (C, C_in*p*p)
        self.mat = {e + "patch_embedding": Matrix(rt, *kernel.shape, "tower patch_embedding", kernel)}
        self.vec = {}
        for name, arr in w.items():
            if arr.ndim == 1 or name == e + "position_embedding.weight":
                self.vec[name] = rt.upload(arr.reshape(-1), name)
            elif name.endswith(".weight") and name.rsplit(".", 1)[0].endswith(LINEARS):
                self.mat[name.rsplit(".", 1)[0]] = Matrix(rt, *arr.shape, name, arr)
        if vc.scale_factor:     # SmolVLM: (text C, C*s*s)
            proj = w[PROJ + "modality_projection.proj.weight"]
        else:                   # Gemma 3: stored (C, text C), used as x @ it
            proj = np.ascontiguousarray(w[PROJ + "mm_input_projection_weight"].T)
        self.mat["proj"] = Matrix(rt, *proj.shape, "tower projection", proj)

    def _buffer(self, name: str, elems: int, dtype=np.float32):
        have = self._scratch.get(name)
        if have is None or have[1] < elems:
            if have is not None:
                self.rt.release(have[0])
            have = self._scratch[name] = (self.rt.buffer(max(elems, 1) * 4, "tower " + name), elems)
        return have[0]

    def _linear(self, rec, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path], self.vec[path + ".bias"], rows, accumulate)

    def _layernorm(self, rec, y, x, path, rows):
        layernorm_forward(rec, y, x, self.vec[path + ".weight"], self.vec[path + ".bias"], rows,
                          self.vc.hidden_size, self.vc.layer_norm_eps)

    def __call__(self, pixels) -> np.ndarray:
        vc = self.vc
        pixels = np.asarray(pixels, np.float32)
        if pixels.shape[1:] != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(f"pixel_values of shape {pixels.shape[1:]}, the tower takes "
                             f"{(vc.num_channels, vc.image_size, vc.image_size)}")
        chunk = max(1, min(self.rt.max_binding // image_elements(vc), SCRATCH_BYTES // scratch_elements(vc)) // 4)
        return np.concatenate([self._forward(pixels[i:i + chunk]) for i in range(0, len(pixels), chunk)])

    def _forward(self, pixels) -> np.ndarray:
        """pixels (N, C, H, W), N images whose activations fit a binding -> their embeddings, one submission."""
        vc, rt = self.vc, self.rt
        n, c, f, h, d = len(pixels), vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.head_dim
        patches = unfold_patches(pixels, vc.patch_size)                                      # (N, T, C_in*p*p)
        t = patches.shape[1]
        rows = n * t
        buf = {name: self._buffer(name, size) for name, size in (
            ("patches", patches.size), ("x", rows * c), ("h", rows * c), ("q", rows * c), ("k", rows * c),
            ("v", rows * c), ("att", rows * c), ("lse", n * h * t), ("f1", rows * f), ("g", rows * f),
            ("spans", 3 * rows))}
        rt.write(buf["patches"], patches.reshape(-1))
        # every patch of an image sees every other: one segment, one image block a row (attention's blocks)
        rt.write(buf["spans"], extents(np.ones((n, t), np.int32), np.zeros((n, t), np.int32)).reshape(-1))
        rec = rt.recorder()
        e = TOWER + "embeddings."
        x = buf["x"]
        for i in range(n):      # x = patches @ kernel.T + bias + position embeddings
            K.copy(rec, at(x, i * t * c), self.vec[e + "position_embedding.weight"], t * c)
        self._linear(rec, x, buf["patches"], e + "patch_embedding", rows, accumulate=True)
        for layer in range(vc.num_layers):
            p = f"{TOWER}encoder.layers.{layer}."
            self._layernorm(rec, buf["h"], x, p + "layer_norm1", rows)
            for m in ("q", "k", "v"):
                self._linear(rec, buf[m], buf["h"], p + f"self_attn.{m}_proj", rows)
            attention_forward(rec, buf["att"], buf["lse"], buf["q"], buf["k"], buf["v"], buf["spans"], n, t, h, h,
                              d, blocks=True)
            self._linear(rec, x, buf["att"], p + "self_attn.out_proj", rows, accumulate=True)
            self._layernorm(rec, buf["h"], x, p + "layer_norm2", rows)
            self._linear(rec, buf["f1"], buf["h"], p + "mlp.fc1", rows)
            gelu_forward(rec, buf["g"], buf["f1"], rows * f)
            self._linear(rec, x, buf["g"], p + "mlp.fc2", rows, accumulate=True)
        self._layernorm(rec, buf["h"], x, TOWER + "post_layernorm", rows)
        out = self._project(rec, buf["h"], n, t)
        m, text = vc.mm_tokens_per_image, vc.text_hidden_size
        rec.read_back(out, np.float32, (n, m, text))
        rec.submit()
        return rec.result()

    def _project(self, rec, hidden, n, t):
        """The projector over hidden (N*T, C) -> its output buffer (N*M, text C)."""
        vc, c, m = self.vc, self.vc.hidden_size, self.vc.mm_tokens_per_image
        out = self._buffer("out", n * m * vc.text_hidden_size)
        if vc.scale_factor:     # SmolVLM: each output token the scale x scale block of patches beside each other
            s = vc.scale_factor
            side = int(round(t ** 0.5))
            order = np.arange(n * t, dtype=np.int32).reshape(n, side // s, s, side // s, s)   # (N, rb, dy, cb, dx)
            order = order.transpose(0, 1, 3, 2, 4).reshape(-1)
            rows = self._buffer("shuffle_rows", n * t)
            self.rt.write(rows, np.ascontiguousarray(order, np.int32))
            shuffled = self._buffer("shuffled", n * t * c)
            K.row_gather_forward(rec, shuffled, hidden, rows, n * t, c, n * t)
            linear_forward(rec, out, shuffled, self.mat["proj"], None, n * m)
            return out
        # Gemma 3: the average over each pool window, a GEMM per image with a 0/1 pooling matrix (M, T)
        side, s = vc.patches_per_side, int(round(m ** 0.5))
        k = side // s
        cell = (np.arange(side)[:, None] // k * s + np.arange(side)[None, :] // k).reshape(-1)    # (T,) pooled token
        pool = self._buffer("pool", m * t)
        self.rt.write(pool, (cell[None, :] == np.arange(m)[:, None]).astype(np.float32).reshape(-1))
        pooled, normed, rstd = (self._buffer(name, size) for name, size in
                                (("pooled", n * m * c), ("normed", n * m * c), ("rstd", n * m)))
        gemm(rec, pooled, pool, hidden, m, c, t, "nn", alpha=1.0 / (k * k), batch=n, stride_a=0)
        K.rmsnorm_forward(rec, normed, rstd, pooled, self.vec[PROJ + "mm_soft_emb_norm.weight"], n * m, c,
                          vc.layer_norm_eps, 1.0)
        linear_forward(rec, out, normed, self.mat["proj"], None, n * m)
        return out
