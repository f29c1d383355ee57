"""Qwen3-VL's and Qwen3.5's vision tower on the WebGPU engine over the NumPy one (engines/numpy/qwen3_vl_tower, the
oracle, passed in by engines/vision_model.py: this engine imports nothing of NumPy's; its weights, LoRA, host-side
position grid and rotary positions): the patch GEMM, blocks with LayerNorm, the 2-D rotary (per-pair positions),
attention within each image, gelu_tanh MLP, the patch and DeepStack mergers (erf GELU); frozen, or with LoRA on the
blocks' and mergers' linears (its tensors on the device, packed, which the engine's optimizer updates), whose backward
recomputes each block and merger from its kept input. Recorded into the engine's step (record_forward /
record_backward, the embeddings and DeepStack features into the step's buffers), or a call of its own with a
readback."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_backward, attention_forward, attention_scratch_size
from wgpu_train.errors import DeviceError
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.lora import lora_backward, lora_forward
from wgpu_train.engines.webgpu.device_tower import DeviceTower
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents, supported_head_dim
from wgpu_train.engines.webgpu.vision_tower_ops import (gelu_backward, gelu_forward, layernorm_backward,
                                                         layernorm_forward)
from wgpu_train.models.qwen3_vl import LAYER_NORM_EPS, VISUAL, frame_grids


def row_width(tower) -> int:
    """Elements a patch holds in the widest activation (the patches, qkv or the MLP's)."""
    vc = tower.vc
    return max(vc.patch_dim, 3 * vc.hidden_size, vc.intermediate_size)


def runs_on_device(rt, tower) -> bool:
    """Whether this tower runs on rt's device: the attention kernels take its head dim (else the NumPy tower runs)."""
    return supported_head_dim(tower.vc.head_dim)


class GpuQwenTower(DeviceTower):
    """The NumPy tower `tower`'s (a Qwen3VLTower) weights uploaded once as float32 to runtime rt; LoRA (set_lora:
    the NumPy tower's `lora` dict) in `params`, its gradients in `grads` (Packed, every A then every B), used while
    the NumPy tower's `lora` is not empty (set_lora after each change of it); __call__(pixels (P, patch dim), grids
    (N, 3)) -> (the merged features (P / 4, text C), the DeepStack features [(P / 4, text C)] in block order) as the
    NumPy tower's; forward / backward: the same keeping what the backward needs, then the LoRA gradients from both
    features' gradients. The buffers are kept between calls (grown as needed); record_forward / record_backward
    record into a given recorder (the engine's step: its buffers in, its buffers out), the others submit. `calls`
    counts the forwards recorded."""

    label = "qwen tower"

    def __init__(self, rt, tower):
        super().__init__(rt)
        self.tower, self.vc = tower, tower.vc
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

    def _host(self, run, *args):
        """run(*args) on the NumPy tower, its LoRA arrays first given the device's (which the engine's step trains)."""
        for name, arr in self.lora_arrays().items():
            path, which = name.rsplit(".lora_", 1)
            if path in self.tower.lora:
                self.tower.lora[path][0 if which == "A" else 1][...] = arr
        return run(*args)

    def _lora_of(self, path: str):
        """The module's LoRA (offsets, r, scale, out, in) a call runs with, or None: set_lora's while the NumPy
        tower's `lora` is set (a reference's forward empties it)."""
        return self._lora.get(path) if self.tower.lora else None

    def __call__(self, pixels, grids) -> tuple:
        """The forward (with the tower's LoRA where set), no backward after it: in chunks of whole images whose
        widest activation fits one storage binding (an image alone over it runs on the NumPy tower), a submission
        and a readback each."""
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
            parts.append(self._run(*chunk, keep=False) if rows <= limit else self._host(self.tower, *chunk))
            start, i = start + rows, j
        return (np.concatenate([p[0] for p in parts]),
                [np.concatenate([p[1][k] for p in parts]) for k in range(len(self.vc.deepstack_indexes))])

    def forward(self, pixels, grids) -> tuple:
        """pixel_values (P, patch dim), image_grid_thw (N, 3) with the tower's LoRA -> (the merged features, the
        DeepStack features, the backward's cache): all images at once, each block's input kept on the device until
        backward (no other call of this tower in between); images whose widest activation is over one storage
        binding run on the NumPy tower instead (its cache, without "device": its backward takes it)."""
        rows = int(np.prod(np.asarray(grids).reshape(-1, 3), axis=1).sum())
        if rows * row_width(self.tower) * 4 > self.rt.max_binding:
            return self._host(self.tower.forward, pixels, grids)
        merged, deepstack = self._run(np.asarray(pixels, np.float32), grids, keep=True)
        return merged, deepstack, {"device": True, "call": self.calls, "rows": rows, "slot": 0}

    def _run(self, pixels, grids, keep: bool) -> tuple:
        """One chunk's images, one submission: (merged features, [DeepStack features])."""
        rec = self.rt.recorder()
        self.reserve(len(pixels), keep)
        out, shape = self._record(rec, pixels, grids, keep, 0)
        rec.read_back(out, np.float32, shape)
        rec.submit()
        out = rec.result()
        return out[0], list(out[1:])

    def _buffers(self, rows: int, keep: bool) -> dict:
        """The forward's buffers for `rows` patches; keep: each block's input and the final x too (saved k), and
        the backward's."""
        vc = self.vc
        c, f, h, r = (vc.hidden_size, vc.intermediate_size, vc.num_heads,
                      max((v[2] for v in self._lora.values()), default=0))
        n_out, merged = 1 + len(vc.deepstack_indexes), rows // vc.merge_unit
        sizes = {"x": rows * c, "x2": rows * c, "h": rows * c,
                 "h2": rows * c, "qkv": rows * 3 * c, "q": rows * c, "k": rows * c, "v": rows * c, "att": rows * c,
                 "lse": vc.num_heads * rows, "f1": rows * f, "g": rows * f, "m1": rows * c, "mg": rows * c,
                 "m2": rows * c, "out": n_out * merged * vc.text_hidden_size,
                 **{"lh_" + m: rows * r for m in ("qkv", "proj", "linear_fc1", "linear_fc2")}}
        if keep:
            sizes.update({f"saved {k}": rows * c for k in range(vc.depth + 1)})
            sizes.update({"dx": rows * c, "dh": rows * c, "datt": rows * c, "dq": rows * c, "dk": rows * c,
                          "dv": rows * c, "dqkv": 3 * rows * c, "dg": rows * f, "df1": rows * f, "dm2": rows * c,
                          "dmg": rows * c, "dm1": rows * c, "att_scratch": attention_scratch_size(1, rows, h),
                          "ldh": rows * r, "mout": merged * vc.text_hidden_size})
        return {name: self._buffer(name, size) for name, size in sizes.items()}

    def check_batch(self, rows: int):
        """A micro-batch's `rows` patches, whose forward inside the engine's step holds them all at once, refused in
        one line where their widest activation does not fit one storage binding."""
        need = 4 * rows * row_width(self.tower)
        if need > self.rt.max_binding:
            raise DeviceError(f"Qwen's vision tower runs a micro-batch's {rows} patches at once inside the step: "
                              f"their activations need {need / 2**20:.0f} MiB, over the device's max storage binding "
                              f"of {self.rt.max_binding / 2**20:.0f} MiB (fewer or smaller images per micro-batch)")

    def reserve(self, rows: int, keep: bool):
        """Every buffer a recording of forwards (and backwards: keep) of up to `rows` patches each needs, allocated
        before it records: a buffer grown in between would be one the recording already uses."""
        self._buffers(rows, keep)

    def record_forward(self, rec, images, outputs, slot=0, keep: bool = False) -> dict:
        """Record the forward of images (pixels (P, patch dim), grids (N, 3)) into outputs (the engine step's
        buffers: the merged features (P / 4, text C), then each DeepStack feature's in block order, None for one
        not held), each in its storage format (the layers' input's); the host's inputs written to slot `slot`'s
        buffers (a step's micro-batches each their own); keep: each block's input kept for record_backward (after
        reserve(P, True)). Returns the cache record_backward takes."""
        pixels, grids = images
        pixels = np.asarray(pixels, np.float32)
        out, (n_out, merged, c) = self._record(rec, pixels, grids, keep, slot)
        for k, y in enumerate(outputs[:n_out]):
            if y is not None:
                K.copy(rec, y, at(out, k * merged * c), merged * c)
        return {"device": True, "call": self.calls, "rows": len(pixels), "slot": slot}

    def _record(self, rec, pixels, grids, keep: bool, slot) -> tuple:
        """Record the forward of pixels (P, patch dim) of images grids (N, 3) into rec (its inputs written now to
        slot `slot`'s buffers) -> (the output buffer, its shape (1 + DeepStack mergers, P / 4, text C)): the merged
        features, then the DeepStack features in block order. keep: each block's input kept for record_backward."""
        vc, rt, tower = self.vc, self.rt, self.tower
        rows, c = len(pixels), vc.hidden_size
        grids = frame_grids(grids)          # a video's frame groups each attend within themselves
        if pixels.shape != (rows, vc.patch_dim) or rows != sum(int(np.prod(g)) for g in grids):
            raise ValueError(f"pixel_values of shape {pixels.shape} for grids {grids} of {vc.patch_dim}-value patches")
        buf = self._buffers(rows, keep)
        rotary = [tower.rotary_positions(g) for g in grids]
        image = np.repeat(np.arange(len(grids), dtype=np.int32), [int(np.prod(g)) for g in grids])[None]
        for name, arr in (("patches", pixels), ("pos", np.concatenate([tower.position_embeddings(g) for g in grids])),
                          ("pairs", np.concatenate([p[0][0] for p in rotary]).astype(np.int32)),     # (P, D/2)
                          ("inv_freq", rotary[0][1].astype(np.float32)), ("spans", extents(image + 1, image))):
            buf[name] = self._buffer(f"{name} {slot}", arr.size)
            rt.write(buf[name], np.ascontiguousarray(arr, np.int32 if arr.dtype.kind == "i" else np.float32)
                     .reshape(-1))
        x, merged = buf["x"], rows // vc.merge_unit
        K.copy(rec, x, buf["pos"], rows * c)
        linear_forward(rec, x, buf["patches"], self.mat[VISUAL + "patch_embed.proj.weight"],
                       self.vec[VISUAL + "patch_embed.proj.bias"], rows, accumulate=True)
        mergers = tower.mergers()
        for i in range(vc.depth):
            if keep:
                K.copy(rec, buf[f"saved {i}"], x, rows * c)
            self._block(rec, buf, i, rows)
            if i in vc.deepstack_indexes:
                j = 1 + vc.deepstack_indexes.index(i)
                slot = 1 + sorted(vc.deepstack_indexes).index(i)      # the features go out in block order
                self._merge(rec, buf, x, at(buf["out"], slot * merged * vc.text_hidden_size), *mergers[j], rows)
        if keep:
            K.copy(rec, buf[f"saved {vc.depth}"], x, rows * c)
        self._merge(rec, buf, x, buf["out"], *mergers[0], rows)
        self.calls += 1
        return buf["out"], (1 + len(vc.deepstack_indexes), merged, vc.text_hidden_size)

    def _block(self, rec, buf, i, rows):
        """Block i over buf["x"] in place; its residual after attention also in buf["x2"]."""
        vc = self.vc
        c, f, d, h, x = vc.hidden_size, vc.intermediate_size, vc.head_dim, vc.num_heads, buf["x"]
        p = f"{VISUAL}blocks.{i}."
        self._layernorm(rec, buf["h"], x, p + "norm1", rows, c)
        self._linear(rec, buf, buf["qkv"], buf["h"], p + "attn.qkv", rows)
        K.split_forward(rec, [buf["q"], buf["k"], buf["v"]], buf["qkv"], rows, (c, c, c))
        for m in ("q", "k"):
            K.rope_forward(rec, buf[m], buf[m], buf["pairs"], buf["inv_freq"], rows, h, d, per_pair=True)
        attention_forward(rec, buf["att"], buf["lse"], buf["q"], buf["k"], buf["v"], buf["spans"], 1, rows, h, h, d,
                          blocks=True)
        self._linear(rec, buf, x, buf["att"], p + "attn.proj", rows, accumulate=True)
        K.copy(rec, buf["x2"], x, rows * c)
        self._layernorm(rec, buf["h2"], x, p + "norm2", rows, c)
        self._linear(rec, buf, buf["f1"], buf["h2"], p + "mlp.linear_fc1", rows)
        gelu_forward(rec, buf["g"], buf["f1"], rows * f)
        self._linear(rec, buf, x, buf["g"], p + "mlp.linear_fc2", rows, accumulate=True)

    def _merge(self, rec, buf, x, y, prefix, post_norm, rows):
        """A merger over x (P, C) into y (P / 4, text C): LayerNorm per patch (or per merged row: post_norm) into
        m1, fc1 into mg, the erf GELU into m2, fc2."""
        c, unit = self.vc.hidden_size, self.vc.merge_unit
        n, width = (rows // unit, c * unit) if post_norm else (rows, c)
        self._layernorm(rec, buf["m1"], x, prefix + "norm", n, width)
        self._linear(rec, buf, buf["mg"], buf["m1"], prefix + "linear_fc1", rows // unit)
        gelu_forward(rec, buf["m2"], buf["mg"], rows * c, erf=True)
        self._linear(rec, buf, y, buf["m2"], prefix + "linear_fc2", rows // unit)

    def backward(self, dout, ddeepstack, cache) -> dict:
        """The merged features' gradient dout (P / 4, text C) and the DeepStack features' [(P / 4, text C)] (block
        order), after forward's cache -> {module path.lora_A / .lora_B: gradient}: one submission, one readback."""
        if cache.get("call") != self.calls or not (self._lora and self.tower.lora):
            raise ValueError("GpuQwenTower.backward takes the cache of its last forward with LoRA only")
        n = np.asarray(dout).size
        given = self._buffer("dout", (1 + len(ddeepstack)) * n)
        self.rt.write(given, np.concatenate([np.asarray(g, np.float32).reshape(-1) for g in (dout, *ddeepstack)]))
        rec = self.rt.recorder()
        K.fill(rec, self.grads.buf, 0.0, self.grads.n)
        self.record_backward(rec, [at(given, k * n) for k in range(1 + len(ddeepstack))], cache)
        rec.read_back(self.grads.buf, np.float32, (self.grads.n,))
        rec.submit()
        return self._unpack(rec.result())

    def record_backward(self, rec, output_grads, cache):
        """Record the LoRA gradients' backward into rec after the record_forward(keep=True) whose cache this is
        (and before the next), from the device buffers output_grads: the merged features' gradient (P / 4, text
        C), then the DeepStack features' (block order), float32 (the engine's image rows' and DeepStack features'
        gradients, or backward's upload of them); the gradients added to `grads`: each merger's and block's forward
        again from its kept input, then its backward, last first."""
        vc, (dout, *ddeepstack) = self.vc, output_grads
        rows, slot = cache["rows"], cache["slot"]
        c, f, h = vc.hidden_size, vc.intermediate_size, vc.num_heads
        buf = self._buffers(rows, True)
        buf.update({name: self._buffer(f"{name} {slot}", 1) for name in ("pairs", "inv_freq", "spans")})
        mergers, dx = self.tower.mergers(), buf["dx"]
        self._merge_backward(rec, buf, buf[f"saved {vc.depth}"], dout, *mergers[0], rows, False)
        for i in reversed(range(vc.depth)):
            if i in vc.deepstack_indexes:
                j, k = 1 + vc.deepstack_indexes.index(i), sorted(vc.deepstack_indexes).index(i)
                self._merge_backward(rec, buf, buf[f"saved {i + 1}"], ddeepstack[k], *mergers[j], rows, True)
            p, x_in = f"{VISUAL}blocks.{i}.", buf[f"saved {i}"]
            K.copy(rec, buf["x"], x_in, rows * c)
            self._block(rec, buf, i, rows)              # its activations again
            self._linear_backward(rec, buf, buf["dg"], dx, buf["g"], p + "mlp.linear_fc2", rows)
            gelu_backward(rec, buf["df1"], buf["dg"], buf["f1"], rows * f)
            self._linear_backward(rec, buf, buf["dh"], buf["df1"], buf["h2"], p + "mlp.linear_fc1", rows)
            self._layernorm_backward(rec, dx, buf["dh"], buf["x2"], p + "norm2", rows, c)
            self._linear_backward(rec, buf, buf["datt"], dx, buf["att"], p + "attn.proj", rows)
            attention_backward(rec, buf["dq"], buf["dk"], buf["dv"], buf["datt"], buf["q"], buf["k"], buf["v"],
                               buf["att"], buf["lse"], buf["spans"], 1, rows, h, h, vc.head_dim, buf["att_scratch"],
                               blocks=True)
            for m in ("dq", "dk"):
                K.rope_backward(rec, buf[m], buf[m], buf["pairs"], buf["inv_freq"], rows, h, vc.head_dim,
                                per_pair=True)
            K.split_backward(rec, buf["dqkv"], [buf["dq"], buf["dk"], buf["dv"]], rows, (c, c, c))
            self._linear_backward(rec, buf, buf["dh"], buf["dqkv"], buf["h"], p + "attn.qkv", rows)
            self._layernorm_backward(rec, dx, buf["dh"], x_in, p + "norm1", rows, c)

    def _merge_backward(self, rec, buf, x, dy, prefix, post_norm, rows, accumulate):
        """A merger's forward again from its input x, then its input's gradient from dy (P / 4, text C) into
        buf["dx"] (added where accumulate)."""
        c, unit = self.vc.hidden_size, self.vc.merge_unit
        self._merge(rec, buf, x, buf["mout"], prefix, post_norm, rows)
        self._linear_backward(rec, buf, buf["dm2"], dy, buf["m2"], prefix + "linear_fc2", rows // unit)
        gelu_backward(rec, buf["dmg"], buf["dm2"], buf["mg"], rows * c, erf=True)
        self._linear_backward(rec, buf, buf["dm1"], buf["dmg"], buf["m1"], prefix + "linear_fc1", rows // unit)
        n, width = (rows // unit, c * unit) if post_norm else (rows, c)
        self._layernorm_backward(rec, buf["dx"], buf["dm1"], x, prefix + "norm", n, width, accumulate)

    def _linear(self, rec, buf, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path + ".weight"], self.vec[path + ".bias"], rows, accumulate)
        if self._lora_of(path) is not None:
            a, b, r, scale, out_f, in_f = self._lora_of(path)
            params = self.params.buf
            lora_forward(rec, y, buf["lh_" + path.rsplit(".", 1)[1]], x, at(params, a), at(params, b), scale, rows,
                         in_f, out_f, r)

    def _linear_backward(self, rec, buf, dx, dy, x, path, rows):
        """dx = dy @ W (the base frozen) and the module's LoRA gradients from its input x and its h."""
        linear_backward(rec, dx, None, None, dy, None, self.mat[path + ".weight"], rows)
        if self._lora_of(path) is not None:
            a, b, r, scale, out_f, in_f = self._lora_of(path)
            params, grads = self.params.buf, self.grads.buf
            lora_backward(rec, dx, at(grads, a), at(grads, b), dy, x, buf["lh_" + path.rsplit(".", 1)[1]],
                          at(params, a), at(params, b), scale, rows, in_f, out_f, r, buf["ldh"], accumulate_grads=True)

    def _layernorm(self, rec, y, x, path, rows, width):
        layernorm_forward(rec, y, x, self.vec[path + ".weight"], self.vec[path + ".bias"], rows, width,
                          LAYER_NORM_EPS)

    def _layernorm_backward(self, rec, dx, dy, x, path, rows, width, accumulate=True):
        layernorm_backward(rec, dx, dy, x, self.vec[path + ".weight"], rows, width, LAYER_NORM_EPS, accumulate)
