"""Qwen3-VL's and Qwen3.5's vision tower, frozen, on the WebGPU engine over the NumPy one (engines/numpy/qwen3_vl_tower,
the oracle, passed in by engines/vision_model.py: this engine imports nothing of NumPy's; its weights, host-side
position grid and rotary positions): the patch GEMM, blocks with LayerNorm, the 2-D rotary (per-pair positions),
attention within each image, gelu_tanh MLP, the patch and DeepStack mergers (erf GELU). Its LoRA runs on the CPU."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_forward
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.tensors import Matrix, linear_forward
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents, supported_head_dim
from wgpu_train.engines.webgpu.vision_tower_ops import gelu_forward, layernorm_forward
from wgpu_train.models.qwen3_vl import LAYER_NORM_EPS, VISUAL


def row_width(tower) -> int:
    """Elements a patch holds in the widest activation (the patches, qkv or the MLP's)."""
    vc = tower.vc
    return max(vc.patch_dim, 3 * vc.hidden_size, vc.intermediate_size)


def runs_on_device(rt, tower) -> bool:
    """Whether this tower runs on rt's device: the attention kernels take its head dim (else the NumPy tower runs)."""
    return supported_head_dim(tower.vc.head_dim)


class GpuQwenTower:
    """The NumPy tower `tower`'s (a Qwen3VLTower) weights uploaded once as float32 to runtime rt; __call__(pixels (P, patch dim),
    grids (N, 3)) -> (the merged features (P / 4, text C), the DeepStack features [(P / 4, text C)] in block order)
    as the NumPy tower's. `calls` counts the forwards run on the device."""

    def __init__(self, rt, tower):
        self.rt, self.tower, self.vc = rt, tower, tower.vc
        self.calls = 0
        self.mat, self.vec = {}, {}
        for name, arr in tower.w.items():
            arr = np.asarray(arr, np.float32)
            if name == VISUAL + "patch_embed.proj.weight":
                self.mat[name] = Matrix(rt, arr.shape[0], arr[0].size, name, arr.reshape(arr.shape[0], -1))
            elif arr.ndim == 2 and name != VISUAL + "pos_embed.weight":
                self.mat[name] = Matrix(rt, *arr.shape, name, arr)
            elif arr.ndim == 1:
                self.vec[name] = rt.upload(arr, name)

    def __call__(self, pixels, grids) -> tuple:
        """The frozen forward in chunks of whole images whose widest activation fits one storage binding (an image
        alone over it runs on the NumPy tower), a submission and a readback each."""
        grids = np.asarray(grids).reshape(-1, 3)
        sizes = [int(np.prod(g)) for g in grids]
        limit = self.rt.max_binding // (4 * row_width(self.tower))      # patches a chunk may hold
        parts, start, i = [], 0, 0
        while i < len(sizes):
            j = i + 1           # images i..j-1: at least one, more while they fit
            while j < len(sizes) and sum(sizes[i:j + 1]) <= limit:
                j += 1
            rows = sum(sizes[i:j])
            chunk = (np.asarray(pixels[start:start + rows], np.float32), grids[i:j])
            parts.append(self._forward(*chunk) if rows <= limit else self.tower(*chunk))
            start, i = start + rows, j
        return (np.concatenate([p[0] for p in parts]),
                [np.concatenate([p[1][k] for p in parts]) for k in range(len(self.vc.deepstack_indexes))])

    def _forward(self, pixels, grids) -> tuple:
        """One chunk's images, one submission: (merged features, [DeepStack features])."""
        vc, rt, tower = self.vc, self.rt, self.tower
        rows, c, f, d, h = len(pixels), vc.hidden_size, vc.intermediate_size, vc.head_dim, vc.num_heads
        grids = [tuple(int(v) for v in g) for g in grids]
        if pixels.shape != (rows, vc.patch_dim) or rows != sum(int(np.prod(g)) for g in grids):
            raise ValueError(f"pixel_values of shape {pixels.shape} for grids {grids} of {vc.patch_dim}-value patches")
        merged, n_out = rows // vc.merge_unit, 1 + len(vc.deepstack_indexes)
        pos = np.concatenate([tower.position_embeddings(g) for g in grids]).astype(np.float32)     # (P, C)
        rotary = [tower.rotary_positions(g) for g in grids]
        pairs = np.concatenate([p[0][0] for p in rotary]).astype(np.int32)                        # (P, D/2)
        image = np.repeat(np.arange(len(grids), dtype=np.int32), [int(np.prod(g)) for g in grids])[None]
        sizes = {"patches": rows * vc.patch_dim, "x": rows * c, "h": rows * c, "qkv": rows * 3 * c, "q": rows * c,
                 "k": rows * c, "v": rows * c, "att": rows * c, "lse": h * rows, "f1": rows * f, "g": rows * f,
                 "m1": rows * c, "mg": rows * c, "out": n_out * merged * vc.text_hidden_size}
        buf = {name: rt.buffer(max(n, 1) * 4, "qwen tower " + name) for name, n in sizes.items()}
        consts = [rt.upload(pixels.reshape(-1), "qwen tower patches"), rt.upload(pos.reshape(-1), "qwen tower pos"),
                  rt.upload(pairs.reshape(-1), "qwen tower rotary positions"),
                  rt.upload(rotary[0][1].astype(np.float32), "qwen tower inv_freq"),
                  rt.upload(extents(image + 1, image).reshape(-1), "qwen tower spans")]
        patches, positions, pair_pos, inv_freq, spans = consts
        rec = rt.recorder()
        x = buf["x"]
        K.copy(rec, x, positions, rows * c)
        linear_forward(rec, x, patches, self.mat[VISUAL + "patch_embed.proj.weight"],
                       self.vec[VISUAL + "patch_embed.proj.bias"], rows, accumulate=True)
        mergers = tower.mergers()
        for i in range(vc.depth):
            p = f"{VISUAL}blocks.{i}."
            self._layernorm(rec, buf["h"], x, p + "norm1", rows, c)
            self._linear(rec, buf["qkv"], buf["h"], p + "attn.qkv", rows)
            K.split_forward(rec, [buf["q"], buf["k"], buf["v"]], buf["qkv"], rows, (c, c, c))
            for m in ("q", "k"):
                K.rope_forward(rec, buf[m], buf[m], pair_pos, inv_freq, rows, h, d, per_pair=True)
            attention_forward(rec, buf["att"], buf["lse"], buf["q"], buf["k"], buf["v"], spans, 1, rows, h, h, d,
                              blocks=True)
            self._linear(rec, x, buf["att"], p + "attn.proj", rows, accumulate=True)
            self._layernorm(rec, buf["h"], x, p + "norm2", rows, c)
            self._linear(rec, buf["f1"], buf["h"], p + "mlp.linear_fc1", rows)
            gelu_forward(rec, buf["g"], buf["f1"], rows * f)
            self._linear(rec, x, buf["g"], p + "mlp.linear_fc2", rows, accumulate=True)
            if i in vc.deepstack_indexes:
                j = 1 + vc.deepstack_indexes.index(i)
                slot = 1 + sorted(vc.deepstack_indexes).index(i)      # the features go out in block order
                self._merge(rec, buf, at(buf["out"], slot * merged * vc.text_hidden_size), *mergers[j], rows)
        self._merge(rec, buf, buf["out"], *mergers[0], rows)
        rec.read_back(buf["out"], np.float32, (n_out, merged, vc.text_hidden_size))
        rec.submit()
        out = rec.result()
        for b in [*buf.values(), *consts]:
            rt.release(b)
        self.calls += 1
        return out[0], list(out[1:])

    def _merge(self, rec, buf, y, prefix, post_norm, rows):
        """A merger over buf["x"] (P, C) into y (P / 4, text C): LayerNorm per patch (or per merged row: post_norm),
        fc1, the erf GELU, fc2."""
        c, unit = self.vc.hidden_size, self.vc.merge_unit
        n, width = (rows // unit, c * unit) if post_norm else (rows, c)
        self._layernorm(rec, buf["m1"], buf["x"], prefix + "norm", n, width)
        self._linear(rec, buf["mg"], buf["m1"], prefix + "linear_fc1", rows // unit)
        gelu_forward(rec, buf["m1"], buf["mg"], rows * c, erf=True)
        self._linear(rec, y, buf["m1"], prefix + "linear_fc2", rows // unit)

    def _linear(self, rec, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path + ".weight"], self.vec[path + ".bias"], rows, accumulate)

    def _layernorm(self, rec, y, x, path, rows, width):
        layernorm_forward(rec, y, x, self.vec[path + ".weight"], self.vec[path + ".bias"], rows, width,
                          LAYER_NORM_EPS)
