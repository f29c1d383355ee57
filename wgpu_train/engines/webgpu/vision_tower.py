"""The SigLIP vision tower and projector on the WebGPU engine (engines/numpy/vision_tower.VisionTower, the oracle):
the patch embedding as a GEMM over patches unfolded on the host, position embeddings, the bidirectional encoder
layers (LayerNorm with bias, the attention family's image blocks, gelu_tanh MLP), the post-layernorm, then Gemma 3's
projector (average pool as a batched GEMM, the soft-embedding RMSNorm, the projection) or SmolVLM's connector (pixel
shuffle as a row gather, the projection): frozen, or with LoRA on the encoder's linears and SmolVLM's connector
projection, whose backward recomputes each layer from its input (kept) and reads the LoRA gradients back once."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import DeviceError
from wgpu_train.engines.shared.patches import unfold_patches
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_backward, attention_forward, attention_scratch_size
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.lora import lora_backward, lora_forward
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


class GpuVisionTower:
    """The tower and projector on runtime rt over their weights ({our name (models/vision.tensor_shapes): array}),
    uploaded once as float32. __call__: the frozen forward, pixel_values (N, C, H, W) -> the image tokens'
    embeddings (N, mm_tokens_per_image, text hidden) float32; forward / backward: the same with LoRA on the
    encoder's linears (the NumPy tower's `lora` dict), its gradients from the embeddings' gradient."""

    def __init__(self, rt, vc: VisionConfig, weights: dict):
        self.rt, self.vc = rt, vc
        self._scratch: dict = {}        # name -> (buffer, capacity in elements), grown as batches need
        self._lora: dict = {}           # path -> (A's offset, B's offset, r, scale, out, in) in the packed buffers
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

    def _buffer(self, name: str, elems: int):
        have = self._scratch.get(name)
        if have is None or have[1] < elems:
            if have is not None:
                self.rt.release(have[0])
            have = self._scratch[name] = (self.rt.buffer(max(elems, 1) * 4, "tower " + name), elems)
        return have[0]

    def _buffers(self, n: int, t: int, keep: bool) -> dict:
        """The forward's buffers for n images of t patches; keep: the backward's too (each layer's input, the LoRA
        parameters, their h and gradients)."""
        vc, rows = self.vc, n * t
        c, f, r = vc.hidden_size, vc.intermediate_size, max((v[2] for v in self._lora.values()), default=0)
        sizes = {"patches": rows * vc.num_channels * vc.patch_size ** 2, "x": rows * c, "h": rows * c,
                 "h2": rows * c, "q": rows * c, "k": rows * c, "v": rows * c, "att": rows * c,
                 "lse": n * vc.num_heads * t, "f1": rows * f, "g": rows * f, "spans": 3 * rows}
        if keep:
            total = sum(rr * (o + i) for _, _, rr, _, o, i in self._lora.values())
            sizes.update({"saved": (vc.num_layers + 1) * rows * c, "x2": rows * c, "lora_params": total,
                          "lora_grads": total, "ldh": rows * r, **{"lh_" + m.rsplit(".", 1)[1]: rows * r
                                                                   for m in (*LINEARS, CONNECTOR)}})
        return {name: self._buffer(name, size) for name, size in sizes.items()}

    def _set_lora(self, lora: dict):
        """Pack and upload lora ({module path: (A (r, in), B (out, r), scale)}), A then B of each module."""
        self._lora, parts, off = {}, [], 0
        for path, (a, b, scale) in sorted(lora.items()):
            r, in_f = a.shape
            self._lora[path] = (off, off + a.size, r, float(scale), b.shape[0], in_f)
            parts += [np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)]
            off += a.size + b.size
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _linear(self, rec, buf, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path], self.vec[path + ".bias"], rows, accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params = buf["lora_params"]
            lora_forward(rec, y, buf["lh_" + path.rsplit(".", 1)[1]], x, at(params, a), at(params, b), scale, rows,
                         in_f, out_f, r)

    def _linear_backward(self, rec, buf, dx, dy, x, path, rows, accumulate=False):
        """dx (+)= dy @ W (the base frozen) and the module's LoRA gradients from its input x and its h."""
        linear_backward(rec, dx, None, None, dy, None, self.mat[path], rows, accumulate_dx=accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params, grads = buf["lora_params"], buf["lora_grads"]
            lora_backward(rec, dx, at(grads, a), at(grads, b), dy, x, buf["lh_" + path.rsplit(".", 1)[1]],
                          at(params, a), at(params, b), scale, rows, in_f, out_f, r, buf["ldh"])

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

    def __call__(self, pixels) -> np.ndarray:
        """The frozen forward: the images in chunks whose widest activation fits one storage binding and whose
        activations SCRATCH_BYTES hold, a submission and a readback each (the buffers kept for the next call)."""
        vc, pixels = self.vc, self._check(pixels)
        self._lora = {}
        chunk = max(1, min(self.rt.max_binding // image_elements(vc), SCRATCH_BYTES // scratch_elements(vc)) // 4)
        return np.concatenate([self._forward(pixels[i:i + chunk])[0] for i in range(0, len(pixels), chunk)])

    def forward(self, pixels, lora: dict) -> tuple:
        """pixels (N, C, H, W) with LoRA (the NumPy tower's dict: {module path: (A, B, scale)}) -> (the embeddings
        (N, M, text C), the backward's cache): all N images at once, each layer's input kept on the device until
        backward (no other call of this tower in between)."""
        pixels = self._check(pixels)
        need = 4 * len(pixels) * image_elements(self.vc)
        if need > self.rt.max_binding:
            raise DeviceError(f"LoRA on the vision tower runs a micro-batch's {len(pixels)} images at once: their "
                              f"activations need {need / 2**20:.0f} MiB, over the device's max storage binding of "
                              f"{self.rt.max_binding / 2**20:.0f} MiB (fewer images per micro-batch)")
        packed = self._set_lora(lora)
        return self._forward(pixels, packed)

    def _forward(self, pixels, packed=None) -> tuple:
        """pixels (N, C, H, W) -> (their embeddings, cache), one submission; packed: the LoRA parameters (forward's),
        kept for the backward, or None (frozen)."""
        vc, rt, keep = self.vc, self.rt, packed is not None
        n, c = len(pixels), vc.hidden_size
        patches = unfold_patches(pixels, vc.patch_size)                                      # (N, T, C_in*p*p)
        t = patches.shape[1]
        rows = n * t
        buf = self._buffers(n, t, keep)
        rt.write(buf["patches"], patches.reshape(-1))
        if keep and packed.size:
            rt.write(buf["lora_params"], packed)
        # every patch of an image sees every other: one segment, one image block a row (attention's blocks)
        rt.write(buf["spans"], extents(np.ones((n, t), np.int32), np.zeros((n, t), np.int32)).reshape(-1))
        rec = rt.recorder()
        e = TOWER + "embeddings."
        x = buf["x"]
        for i in range(n):      # x = patches @ kernel.T + bias + position embeddings
            K.copy(rec, at(x, i * t * c), self.vec[e + "position_embedding.weight"], t * c)
        linear_forward(rec, x, buf["patches"], self.mat[e + "patch_embedding"], self.vec[e + "patch_embedding.bias"],
                       rows, accumulate=True)
        for layer in range(vc.num_layers):
            if keep:
                K.copy(rec, at(buf["saved"], layer * rows * c), x, rows * c)
            self._layer(rec, buf, layer, n, t)
        if keep:
            K.copy(rec, at(buf["saved"], vc.num_layers * rows * c), x, rows * c)
        self._layernorm(rec, buf["h"], x, TOWER + "post_layernorm", rows)
        out = self._project(rec, buf, buf["h"], n, t)
        rec.read_back(out, np.float32, (n, vc.mm_tokens_per_image, vc.text_hidden_size))
        rec.submit()
        self._calls += 1
        return rec.result(), {"n": n, "t": t, "device": True, "call": self._calls}

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
        LoRA forward set, after forward's cache: the projector's backward, then each layer's, recomputed from its
        kept input first; one submission, one readback."""
        vc, rt = self.vc, self.rt
        if cache.get("call") != self._calls or not self._lora:
            raise ValueError("GpuVisionTower.backward takes the cache of its last forward with LoRA only")
        n, t = cache["n"], cache["t"]
        rows, c, f, h = n * t, vc.hidden_size, vc.intermediate_size, vc.num_heads
        buf = self._buffers(n, t, True)
        sizes = {"dout": dout.size, "dx": rows * c, "dh": rows * c, "dhid": rows * c, "datt": rows * c,
                 "dq": rows * c, "dk": rows * c, "dv": rows * c, "dg": rows * f, "df1": rows * f,
                 "att_scratch": attention_scratch_size(n, t, h)}
        buf.update({name: self._buffer(name, size) for name, size in sizes.items()})
        rt.write(buf["dout"], np.ascontiguousarray(dout, np.float32).reshape(-1))
        grads = buf["lora_grads"]
        rec = rt.recorder()
        K.fill(rec, grads, 0.0, sum(rr * (o + i) for _, _, rr, _, o, i in self._lora.values()))
        self._project_backward(rec, buf, buf["dhid"], buf["dout"], n, t)
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
        total = sum(rr * (o + i) for _, _, rr, _, o, i in self._lora.values())
        rec.read_back(grads, np.float32, (total,))
        rec.submit()
        flat = rec.result()
        out = {}
        for path, (a, b, r, _, out_f, in_f) in self._lora.items():
            out[path + ".lora_A"] = flat[a:a + r * in_f].reshape(r, in_f)
            out[path + ".lora_B"] = flat[b:b + out_f * r].reshape(out_f, r)
        return out

    def _project(self, rec, buf, hidden, n, t):
        """The projector over hidden (N*T, C) -> its output buffer (N*M, text C); LoRA on SmolVLM's connector
        projection when set (its h in buf)."""
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
            if CONNECTOR in self._lora:
                a, b, r, scale, out_f, in_f = self._lora[CONNECTOR]
                params = buf["lora_params"]
                lora_forward(rec, out, buf["lh_proj"], shuffled, at(params, a), at(params, b), scale, n * m, in_f,
                             out_f, r)
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

    def _project_backward(self, rec, buf, dhidden, dout, n, t):
        """The projector's backward: dout (N*M, text C) -> dhidden (N*T, C), from _project's buffers; the
        connector projection's LoRA gradients into buf's."""
        vc, c, m = self.vc, self.vc.hidden_size, self.vc.mm_tokens_per_image
        if vc.scale_factor:
            dshuffled = self._buffer("dshuffled", n * t * c)
            linear_backward(rec, dshuffled, None, None, dout, None, self.mat["proj"], n * m)
            if CONNECTOR in self._lora:
                a, b, r, scale, out_f, in_f = self._lora[CONNECTOR]
                params, grads = buf["lora_params"], buf["lora_grads"]
                lora_backward(rec, dshuffled, at(grads, a), at(grads, b), dout, self._buffer("shuffled", n * t * c),
                              buf["lh_proj"], at(params, a), at(params, b), scale, n * m, in_f, out_f, r, buf["ldh"])
            K.row_gather_backward(rec, dhidden, dshuffled, self._buffer("shuffle_rows", n * t), n * t, c, n * t)
            return
        k = vc.patches_per_side // int(round(m ** 0.5))
        dnormed, dpooled = self._buffer("dnormed", n * m * c), self._buffer("dpooled", n * m * c)
        linear_backward(rec, dnormed, None, None, dout, None, self.mat["proj"], n * m)
        K.rmsnorm_backward(rec, dpooled, None, dnormed, self._buffer("pooled", n * m * c),
                           self.vec[PROJ + "mm_soft_emb_norm.weight"], self._buffer("rstd", n * m), n * m, c, None,
                           offset=1.0)
        gemm(rec, dhidden, self._buffer("pool", m * t), dpooled, t, c, m, "tn", alpha=1.0 / (k * k), batch=n,
             stride_a=0, stride_b=m * c, stride_c=t * c)
