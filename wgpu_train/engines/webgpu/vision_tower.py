"""The SigLIP vision tower and projector on the WebGPU engine (engines/numpy/vision_tower.VisionTower, the oracle):
the patch embedding as a GEMM over patches unfolded on the host, position embeddings, the bidirectional encoder
layers (LayerNorm with bias, the attention family's image blocks, gelu_tanh MLP), the post-layernorm, then Gemma 3's
projector (average pool as a batched GEMM, the soft-embedding RMSNorm, the projection) or SmolVLM's connector (pixel
shuffle as a row gather, the projection): frozen, or with LoRA on the encoder's linears and SmolVLM's connector
projection (its tensors on the device, packed, which the engine's optimizer updates), whose backward recomputes each
layer from its input (kept). Recorded into the engine's step (record_forward / record_backward), or a call of its own
with a readback (generation, scoring)."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.shared.patches import unfold_patches
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_backward, attention_forward, attention_scratch_size
from wgpu_train.engines.webgpu.device.operands import at, split
from wgpu_train.engines.webgpu.lora import lora_backward, lora_forward
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.device_tower import DeviceTower
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents, supported_head_dim
from wgpu_train.engines.webgpu.tuned.gemm import gemm
from wgpu_train.engines.webgpu.vision_tower_ops import (gelu_backward, gelu_forward, layernorm_backward,
                                                         layernorm_forward)
from wgpu_train.models.vision import CONNECTOR, PROJ, TOWER, VisionConfig

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


class GpuVisionTower(DeviceTower):
    """The tower and projector on runtime rt over their weights ({our name (models/vision.tensor_shapes): array}),
    uploaded once as float32; LoRA on the encoder's linears (set_lora: the NumPy tower's `lora` dict) in `params`,
    its gradients in `grads` (Packed, every A then every B). __call__: the forward, pixel_values (N, C, H, W) -> the
    image tokens' embeddings (N, mm_tokens_per_image, text hidden) float32; forward / backward: the same keeping the
    backward's cache, the LoRA gradients read back; record_forward / record_backward: both inside a recording (the
    engine's step), from and to device buffers."""

    def __init__(self, rt, vc: VisionConfig, weights: dict):
        super().__init__(rt)
        self.vc = vc
        self._calls = 0                 # forwards so far: a backward takes the last one's cache only
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

    def _buffers(self, n: int, t: int, keep: bool) -> dict:
        """The forward's buffers for n images of t patches (LoRA's h of each module where it has LoRA); keep: the
        backward's too (each layer's input, the gradients)."""
        vc, rows = self.vc, n * t
        c, f, r = vc.hidden_size, vc.intermediate_size, max((v[2] for v in self._lora.values()), default=0)
        sizes = {"x": rows * c, "h": rows * c, "h2": rows * c, "q": rows * c, "k": rows * c, "v": rows * c,
                 "att": rows * c, "lse": n * vc.num_heads * t, "f1": rows * f, "g": rows * f,
                 **{"lh_" + m.rsplit(".", 1)[1]: rows * r for m in (*LINEARS, CONNECTOR)}}
        if keep:
            sizes.update({"saved": (vc.num_layers + 1) * rows * c, "x2": rows * c, "ldh": rows * r,
                          "dx": rows * c, "dh": rows * c, "dhid": rows * c, "datt": rows * c, "dq": rows * c,
                          "dk": rows * c, "dv": rows * c, "dg": rows * f, "df1": rows * f,
                          "att_scratch": attention_scratch_size(n, t, vc.num_heads)})
        return {name: self._buffer(name, size) for name, size in sizes.items()}

    def reserve(self, n: int, keep: bool):
        """Every buffer a recording of forwards (and backwards: keep) of up to n images each needs, allocated
        before it records: a buffer grown in between would be one the recording already uses."""
        self._buffers(n, self.vc.patches_per_side ** 2, keep)
        self._project_buffers(n)

    def set_base(self, path: str, weight: np.ndarray):
        """A LoRA module's base weight (out, in) written over the device's (PiSSA's / OLoRA's residual)."""
        self.mat["proj" if path == CONNECTOR else path].write(self.rt, weight)

    def _linear(self, rec, buf, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path], self.vec[path + ".bias"], rows, accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params = self.params.buf
            lora_forward(rec, y, buf["lh_" + path.rsplit(".", 1)[1]], x, at(params, a), at(params, b), scale, rows,
                         in_f, out_f, r)

    def _linear_backward(self, rec, buf, dx, dy, x, path, rows, accumulate=False):
        """dx (+)= dy @ W (the base frozen) and the module's LoRA gradients (added to `grads`) from its input x
        and its h."""
        linear_backward(rec, dx, None, None, dy, None, self.mat[path], rows, accumulate_dx=accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params, grads = self.params.buf, self.grads.buf
            lora_backward(rec, dx, at(grads, a), at(grads, b), dy, x, buf["lh_" + path.rsplit(".", 1)[1]],
                          at(params, a), at(params, b), scale, rows, in_f, out_f, r, buf["ldh"], accumulate_grads=True)

    def _layernorm(self, rec, y, x, path, rows):
        layernorm_forward(rec, y, x, self.vec[path + ".weight"], self.vec[path + ".bias"], rows,
                          self.vc.hidden_size, self.vc.layer_norm_eps)

    def _layernorm_backward(self, rec, dx, dy, x, path, rows, accumulate=False):
        layernorm_backward(rec, dx, dy, x, self.vec[path + ".weight"], rows, self.vc.hidden_size,
                           self.vc.layer_norm_eps, accumulate)

    def _check(self, pixels):
        vc = self.vc
        pixels = np.asarray(pixels, np.float32)
        if pixels.shape[1:] != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(f"pixel_values of shape {pixels.shape[1:]}, the tower takes "
                             f"{(vc.num_channels, vc.image_size, vc.image_size)}")
        return pixels

    def check_batch(self, n: int):
        """A micro-batch's n images, whose forward with LoRA keeps all their activations at once, refused in one
        line where their widest activation does not fit one storage binding."""
        need = 4 * n * image_elements(self.vc)
        if self._lora and need > self.rt.max_binding:
            raise DeviceError(f"LoRA on the vision tower runs a micro-batch's {n} images at once: their "
                              f"activations need {need / 2**20:.0f} MiB, over the device's max storage binding of "
                              f"{self.rt.max_binding / 2**20:.0f} MiB (fewer images per micro-batch)")

    def __call__(self, pixels, lora: bool = True) -> np.ndarray:
        """The forward (with the LoRA set; lora False: without it): the images in chunks whose widest activation
        fits one storage binding and whose activations SCRATCH_BYTES hold, a submission and a readback each (the
        buffers kept)."""
        vc, pixels = self.vc, self._check(pixels)
        chunk = max(1, min(self.rt.max_binding // image_elements(vc), SCRATCH_BYTES // scratch_elements(vc)) // 4)
        modules, self._lora = self._lora, (self._lora if lora else {})
        try:
            return np.concatenate([self._submit_forward(pixels[i:i + chunk], False)[0]
                                   for i in range(0, len(pixels), chunk)])
        finally:
            self._lora = modules

    def forward(self, pixels, lora: dict | None = None) -> tuple:
        """pixels (N, C, H, W), with LoRA (set_lora's dict; None: the one set) -> (the embeddings (N, M, text C),
        the backward's cache): all N images at once, each layer's input kept on the device until backward (no
        other call of this tower in between)."""
        pixels = self._check(pixels)
        if lora is not None:
            self.set_lora(lora)
        self.check_batch(len(pixels))
        return self._submit_forward(pixels, True)

    def _submit_forward(self, pixels, keep: bool) -> tuple:
        """pixels (N, C, H, W) -> (their embeddings, cache), one submission, one readback."""
        n, vc = len(pixels), self.vc
        self.reserve(n, keep)
        out = self._buffer("embeds", n * vc.mm_tokens_per_image * vc.text_hidden_size)
        rec = self.rt.recorder()
        cache = self.record_forward(rec, pixels, (out,), keep=keep)
        rec.read_back(out, np.float32, (n, vc.mm_tokens_per_image, vc.text_hidden_size))
        rec.submit()
        return rec.result(), cache

    def record_forward(self, rec, pixels, outputs, slot=0, keep: bool = False) -> dict:
        """Record the forward of pixels (N, C, H, W) into outputs (out,): out (N*M, text C) in its storage format (the
        layers' input's: float32, bf16 or f16); the host's inputs written to slot `slot`'s buffers (a step's
        micro-batches each their own); keep: each layer's input kept for record_backward (after reserve(N, True)).
        Returns the cache backward takes."""
        vc, rt = self.vc, self.rt
        pixels, (out,) = self._check(pixels), outputs
        n, c = len(pixels), vc.hidden_size
        patches = unfold_patches(pixels, vc.patch_size)                                      # (N, T, C_in*p*p)
        t = patches.shape[1]
        rows = n * t
        buf = self._buffers(n, t, keep)
        inputs = self._buffer(f"patches {slot}", patches.size)
        rt.write(inputs, patches.reshape(-1))
        # every patch of an image sees every other: one segment, one image block a row (attention's blocks)
        buf["spans"] = self._buffer(f"spans {slot}", 3 * rows)
        rt.write(buf["spans"], extents(np.ones((n, t), np.int32), np.zeros((n, t), np.int32)).reshape(-1))
        e = TOWER + "embeddings."
        x = buf["x"]
        for i in range(n):      # x = patches @ kernel.T + bias + position embeddings
            K.copy(rec, at(x, i * t * c), self.vec[e + "position_embedding.weight"], t * c)
        linear_forward(rec, x, inputs, self.mat[e + "patch_embedding"], self.vec[e + "patch_embedding.bias"],
                       rows, accumulate=True)
        for layer in range(vc.num_layers):
            if keep:
                K.copy(rec, at(buf["saved"], layer * rows * c), x, rows * c)
            self._layer(rec, buf, layer, n, t)
        if keep:
            K.copy(rec, at(buf["saved"], vc.num_layers * rows * c), x, rows * c)
        self._layernorm(rec, buf["h"], x, TOWER + "post_layernorm", rows)
        total = n * vc.mm_tokens_per_image * vc.text_hidden_size
        f32 = storage.format_of(split(out)[0]) == "f32"
        projected = out if f32 else self._buffer("embeds", total)
        self._project(rec, buf, buf["h"], n, t, projected, slot)
        if not f32:         # rounded to the layers' 16-bit input, as the NumPy engine's set_images rounds them
            K.copy(rec, out, projected, total)
        self._calls += 1
        return {"n": n, "t": t, "device": True, "call": self._calls, "slot": slot, "spans": buf["spans"]}

    def _layer(self, rec, buf, layer, n, t):
        """One encoder layer over buf["x"] in place (its residual after attention also in buf["x2"] when kept)."""
        vc, rows = self.vc, n * t
        p, x = f"{TOWER}encoder.layers.{layer}.", buf["x"]
        self._layernorm(rec, buf["h"], x, p + "layer_norm1", rows)
        for m in ("q", "k", "v"):
            self._linear(rec, buf, buf[m], buf["h"], p + f"self_attn.{m}_proj", rows)
        attention_forward(rec, buf["att"], buf["lse"], buf["q"], buf["k"], buf["v"], buf["spans"], n, t,
                          vc.num_heads, vc.num_heads, vc.head_dim, blocks=True)
        self._linear(rec, buf, x, buf["att"], p + "self_attn.out_proj", rows, accumulate=True)
        if "x2" in buf:
            K.copy(rec, buf["x2"], x, rows * vc.hidden_size)
        self._layernorm(rec, buf["h2"], x, p + "layer_norm2", rows)
        self._linear(rec, buf, buf["f1"], buf["h2"], p + "mlp.fc1", rows)
        gelu_forward(rec, buf["g"], buf["f1"], rows * vc.intermediate_size)
        self._linear(rec, buf, x, buf["g"], p + "mlp.fc2", rows, accumulate=True)

    def backward(self, dout, cache) -> dict:
        """The image embeddings' gradient dout (N, M, text C) -> {module path.lora_A / .lora_B: gradient} of the
        LoRA set, after forward's cache: record_backward from zeroed gradients, one submission, one readback."""
        if cache.get("call") != self._calls or not self._lora:
            raise ValueError("GpuVisionTower.backward takes the cache of its last forward with LoRA only")
        d = self._buffer("dout", dout.size)
        self.rt.write(d, np.ascontiguousarray(dout, np.float32).reshape(-1))
        rec = self.rt.recorder()
        K.fill(rec, self.grads.buf, 0.0, self.grads.n)
        self.record_backward(rec, (d,), cache)
        rec.read_back(self.grads.buf, np.float32, (self.grads.n,))
        rec.submit()
        return self._unpack(rec.result())

    def record_backward(self, rec, output_grads, cache):
        """Record the backward from output_grads (dout,): the image embeddings' gradient (N*M, text C) float32 (a
        device buffer), after the record_forward (keep) whose cache this is and before the next: the projector's
        backward, then each layer's, recomputed from its kept input first; the LoRA gradients added to `grads`."""
        vc, (dout,) = self.vc, output_grads
        n, t = cache["n"], cache["t"]
        rows, c, f, h = n * t, vc.hidden_size, vc.intermediate_size, vc.num_heads
        buf = self._buffers(n, t, True)
        buf["spans"] = cache["spans"]
        self._project_backward(rec, buf, buf["dhid"], dout, n, t, cache["slot"])
        saved, dx = buf["saved"], buf["dx"]
        self._layernorm_backward(rec, dx, buf["dhid"], at(saved, vc.num_layers * rows * c), TOWER + "post_layernorm",
                                 rows)
        for layer in reversed(range(vc.num_layers)):
            p, x_in = f"{TOWER}encoder.layers.{layer}.", at(saved, layer * rows * c)
            K.copy(rec, buf["x"], x_in, rows * c)
            self._layer(rec, buf, layer, n, t)              # its activations again
            self._linear_backward(rec, buf, buf["dg"], dx, buf["g"], p + "mlp.fc2", rows)
            gelu_backward(rec, buf["df1"], buf["dg"], buf["f1"], rows * f)
            self._linear_backward(rec, buf, buf["dh"], buf["df1"], buf["h2"], p + "mlp.fc1", rows)
            self._layernorm_backward(rec, dx, buf["dh"], buf["x2"], p + "layer_norm2", rows, accumulate=True)
            self._linear_backward(rec, buf, buf["datt"], dx, buf["att"], p + "self_attn.out_proj", rows)
            attention_backward(rec, buf["dq"], buf["dk"], buf["dv"], buf["datt"], buf["q"], buf["k"], buf["v"],
                               buf["att"], buf["lse"], buf["spans"], n, t, h, h, vc.head_dim, buf["att_scratch"],
                               blocks=True)
            for i, m in enumerate(("q", "k", "v")):
                self._linear_backward(rec, buf, buf["dh"], buf["d" + m], buf["h"], p + f"self_attn.{m}_proj", rows,
                                      accumulate=i > 0)
            self._layernorm_backward(rec, dx, buf["dh"], x_in, p + "layer_norm1", rows, accumulate=True)

    def _project_buffers(self, n: int) -> dict:
        """The projector's buffers for n images (its forward's and backward's)."""
        vc, t, m = self.vc, self.vc.patches_per_side ** 2, self.vc.mm_tokens_per_image
        c = vc.hidden_size
        sizes = {"embeds": n * m * vc.text_hidden_size}
        sizes.update({"shuffled": n * t * c, "dshuffled": n * t * c} if vc.scale_factor else
                 {"pool": m * t, "pooled": n * m * c, "normed": n * m * c, "rstd": n * m, "dnormed": n * m * c,
                  "dpooled": n * m * c})
        return {name: self._buffer(name, size) for name, size in sizes.items()}

    def _project(self, rec, buf, hidden, n, t, out, slot):
        """The projector over hidden (N*T, C) -> out (N*M, text C) float32; LoRA on SmolVLM's connector
        projection when set (its h in buf); the pixel shuffle's rows written to slot `slot`'s buffer."""
        vc, c, m = self.vc, self.vc.hidden_size, self.vc.mm_tokens_per_image
        pb = self._project_buffers(n)
        if vc.scale_factor:     # SmolVLM: each output token the scale x scale block of patches beside each other
            s = vc.scale_factor
            side = int(round(t ** 0.5))
            order = np.arange(n * t, dtype=np.int32).reshape(n, side // s, s, side // s, s)   # (N, rb, dy, cb, dx)
            order = order.transpose(0, 1, 3, 2, 4).reshape(-1)
            rows = self._buffer(f"shuffle_rows {slot}", n * t)
            self.rt.write(rows, np.ascontiguousarray(order, np.int32))
            K.row_gather_forward(rec, pb["shuffled"], hidden, rows, n * t, c, n * t)
            linear_forward(rec, out, pb["shuffled"], self.mat["proj"], None, n * m)
            if CONNECTOR in self._lora:
                a, b, r, scale, out_f, in_f = self._lora[CONNECTOR]
                params = self.params.buf
                lora_forward(rec, out, buf["lh_proj"], pb["shuffled"], at(params, a), at(params, b), scale, n * m,
                             in_f, out_f, r)
            return
        # Gemma 3: the average over each pool window, a GEMM per image with a 0/1 pooling matrix (M, T)
        side, s = vc.patches_per_side, int(round(m ** 0.5))
        k = side // s
        cell = (np.arange(side)[:, None] // k * s + np.arange(side)[None, :] // k).reshape(-1)    # (T,) pooled token
        self.rt.write(pb["pool"], (cell[None, :] == np.arange(m)[:, None]).astype(np.float32).reshape(-1))
        gemm(rec, pb["pooled"], pb["pool"], hidden, m, c, t, "nn", alpha=1.0 / (k * k), batch=n, stride_a=0)
        K.rmsnorm_forward(rec, pb["normed"], pb["rstd"], pb["pooled"], self.vec[PROJ + "mm_soft_emb_norm.weight"],
                          n * m, c, vc.layer_norm_eps, 1.0)
        linear_forward(rec, out, pb["normed"], self.mat["proj"], None, n * m)

    def _project_backward(self, rec, buf, dhidden, dout, n, t, slot):
        """The projector's backward: dout (N*M, text C) -> dhidden (N*T, C), from _project's buffers; the
        connector projection's LoRA gradients added to `grads`."""
        vc, c, m = self.vc, self.vc.hidden_size, self.vc.mm_tokens_per_image
        pb = self._project_buffers(n)
        if vc.scale_factor:
            linear_backward(rec, pb["dshuffled"], None, None, dout, None, self.mat["proj"], n * m)
            if CONNECTOR in self._lora:
                a, b, r, scale, out_f, in_f = self._lora[CONNECTOR]
                params, grads = self.params.buf, self.grads.buf
                lora_backward(rec, pb["dshuffled"], at(grads, a), at(grads, b), dout, pb["shuffled"], buf["lh_proj"],
                              at(params, a), at(params, b), scale, n * m, in_f, out_f, r, buf["ldh"],
                              accumulate_grads=True)
            K.row_gather_backward(rec, dhidden, pb["dshuffled"], self._buffer(f"shuffle_rows {slot}", n * t), n * t,
                                  c, n * t)
            return
        k = vc.patches_per_side // int(round(m ** 0.5))
        linear_backward(rec, pb["dnormed"], None, None, dout, None, self.mat["proj"], n * m)
        K.rmsnorm_backward(rec, pb["dpooled"], None, pb["dnormed"], pb["pooled"],
                           self.vec[PROJ + "mm_soft_emb_norm.weight"], pb["rstd"], n * m, c, None, offset=1.0)
        gemm(rec, dhidden, pb["pool"], pb["dpooled"], t, c, m, "tn", alpha=1.0 / (k * k), batch=n,
             stride_a=0, stride_b=m * c, stride_c=t * c)
