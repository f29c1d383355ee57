"""The SigLIP vision tower and projector on the NumPy engine: the patch embedding as a GEMM over unfolded
patches, position embeddings, bidirectional encoder layers, the post-layernorm, then Gemma 3's projector (average
pool to mm_tokens_per_image, the soft-embedding RMSNorm, the projection) or SmolVLM's connector (pixel shuffle, the
projection); frozen, or with LoRA on the encoder's linear modules and SmolVLM's connector projection, whose
gradients the backward from the image embeddings' gradient gives."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.numpy import ops
from wgpu_train.engines.shared.patches import unfold_patches
from wgpu_train.models.vision import CONNECTOR, ENCODER_MODULES, PROJ, TOWER, VisionConfig


def layernorm_forward(x, weight, bias, eps):
    """LayerNorm over the last axis: x (N, C) -> y (N, C), rstd (N, 1)."""
    mu = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
    return (x - mu) * rstd * weight + bias, rstd


def layernorm_backward(dy, x, weight, rstd):
    """dx (N, C) of layernorm_forward (its weight and bias are frozen)."""
    xhat = (x - x.mean(axis=-1, keepdims=True)) * rstd
    g = dy * weight
    return rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))


def gelu_forward(x):
    """gelu's tanh approximation (gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(ops.GELU_C * (x + 0.044715 * (x * x * x))))


def gelu_backward(dy, x):
    t = np.tanh(ops.GELU_C * (x + 0.044715 * (x * x * x)))
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * ops.GELU_C * (1.0 + 3 * 0.044715 * x * x))


def pixel_shuffle(x, scale: int):
    """SmolVLM's connector's shuffle: x (N, P, C) over a square grid of P patches -> (N, P / scale^2, C * scale^2),
    each output token the scale x scale block of patches beside each other (transformers' pixel_shuffle)."""
    n, p, c = x.shape
    side = int(round(p ** 0.5))
    x = x.reshape(n, side // scale, scale, side // scale, scale, c)        # (N, row block, dy, col block, dx, C)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, p // scale ** 2, scale * scale * c)


def pixel_unshuffle(x, scale: int):
    """pixel_shuffle's inverse (its backward): x (N, P / scale^2, C * scale^2) -> (N, P, C)."""
    n, m, cs = x.shape
    side, c = int(round(m ** 0.5)), cs // (scale * scale)
    x = x.reshape(n, side, side, scale, scale, c)                          # (N, row block, col block, dy, dx, C)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, m * scale * scale, c)


def bidirectional_attention_forward(q, k, v):
    """Full (non-causal) multi-head attention as batched GEMMs: q, k, v (N, T, H, D) -> out (N, T, H, D),
    lse (N, H, T, 1) (the backward recomputes the probabilities from it: a real tower's are a GiB an image)."""
    qh, kh, vh = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))  # (N, H, T, D): BLAS
    s = (qh * q.dtype.type(1.0 / np.sqrt(q.shape[-1]))) @ kh.transpose(0, 1, 3, 2)   # (N, H, T, T)
    m = s.max(axis=-1, keepdims=True)
    np.exp(s - m, out=s)
    denom = s.sum(axis=-1, keepdims=True)
    out = (s @ vh) / denom                                                          # (N, H, T, D)
    return out.transpose(0, 2, 1, 3), m + np.log(denom)


def bidirectional_attention_backward(dout, q, k, v, out, lse):
    """dq, dk, dv (N, T, H, D) of bidirectional_attention_forward."""
    qh, kh, vh, oh, dh = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, out, dout))
    scale = q.dtype.type(1.0 / np.sqrt(q.shape[-1]))
    p = np.exp((qh * scale) @ kh.transpose(0, 1, 3, 2) - lse)                       # (N, H, T, T)
    dv = p.transpose(0, 1, 3, 2) @ dh
    ds = dh @ vh.transpose(0, 1, 3, 2)
    ds -= (dh * oh).sum(axis=-1, keepdims=True)
    ds *= p * scale
    dq, dk = ds @ kh, ds.transpose(0, 1, 3, 2) @ qh
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


class LoraLinears:
    """A tower's linear modules over its weights w ({name: array}) with LoRA on those in lora ({module path: (A
    (r, in), B (out, r), scale)}): the forward keeping each LoRA module's input and rank activations, the backward
    adding their gradients (shared by the SigLIP and Qwen towers)."""

    w: dict
    lora: dict

    def _linear(self, x, path, cache):
        y = ops.linear_forward(x, self.w[path + ".weight"], self.w.get(path + ".bias"))
        if path in self.lora:
            a, b, scale = self.lora[path]
            dy, h = ops.lora_forward(x, a, b, scale)
            y = y + dy
            cache[path] = (x, h)
        return y

    def _linear_backward(self, dy, path, cache, grads):
        dx, _, _ = ops.linear_backward(dy, cache.get(path, (None,))[0], self.w[path + ".weight"], False)
        if path in self.lora:
            a, b, scale = self.lora[path]
            x, h = cache[path]
            dxl, da, db = ops.lora_backward(dy, x, h, a, b, scale)
            grads[path + ".lora_A"], grads[path + ".lora_B"] = da, db
            dx = dx + dxl
        return dx


class VisionTower(LoraLinears):
    """The tower and the projector over their weights ({our name (models/vision.tensor_shapes): array}) in
    `dtype`; lora: {module path (vision_tower.encoder.layers.N.self_attn.q_proj, ...): (A (r, in), B (out, r),
    scale)}. __call__: pixel_values (N, C, H, W) -> the image tokens' embeddings (N, mm_tokens_per_image, text
    hidden); forward keeps what backward needs, which takes the embeddings' gradient to the LoRA gradients."""

    def __init__(self, vc: VisionConfig, weights: dict, dtype=np.float32):
        self.vc, self.dtype = vc, np.dtype(dtype)
        self.w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}
        self.lora: dict = {}

    def modules(self) -> list[str]:
        """Every encoder linear module's path and SmolVLM's connector projection's, the LoRA targets the tower
        offers."""
        encoder = [f"{TOWER}encoder.layers.{i}.{m}" for i in range(self.vc.num_layers) for m in ENCODER_MODULES]
        return encoder + ([CONNECTOR] if self.vc.scale_factor else [])

    def forward(self, pixels, keep: bool = True):
        """pixels (N, C, H, W) -> (the image tokens' embeddings (N, M, text C), the backward's cache: its
        activations only with `keep`, which the frozen tower's forward leaves out)."""
        vc, w = self.vc, self.w
        n = pixels.shape[0]
        if pixels.shape[1:] != (vc.num_channels, vc.image_size, vc.image_size):
            raise ValueError(f"pixel_values of shape {pixels.shape[1:]}, the tower takes "
                             f"{(vc.num_channels, vc.image_size, vc.image_size)}")
        e = TOWER + "embeddings."
        patches = unfold_patches(np.asarray(pixels, self.dtype), vc.patch_size)             # (N, P, C*p*p)
        kernel = w[e + "patch_embedding.weight"].reshape(vc.hidden_size, -1)                # (C, C*p*p)
        x = ops.linear_forward(patches.reshape(-1, kernel.shape[1]), kernel, w[e + "patch_embedding.bias"])
        x = (x.reshape(n, -1, vc.hidden_size) + w[e + "position_embedding.weight"]).reshape(-1, vc.hidden_size)
        y, cache = self.encode(x, n, keep)
        return self.project(y.reshape(n, cache["t"], vc.hidden_size), cache), cache

    def encode(self, x, n: int, keep: bool = True) -> tuple:
        """The encoder layers and the post-layernorm over n images' embedded patches x (n * t, C), each image's
        t patches attending to each other -> (y (n * t, C), the backward's cache: its activations with `keep`)."""
        vc, w = self.vc, self.w
        t = x.shape[0] // n
        cache = {"n": n, "t": t, "layers": []}
        for i in range(vc.num_layers):
            p, c = f"{TOWER}encoder.layers.{i}.", {"x": x}
            h, c["rstd1"] = layernorm_forward(x, w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"],
                                              vc.layer_norm_eps)
            q, k, v = (self._linear(h, p + f"self_attn.{m}", c).reshape(n, t, vc.num_heads, vc.head_dim)
                       for m in ("q_proj", "k_proj", "v_proj"))
            att, lse = bidirectional_attention_forward(q, k, v)
            c.update(q=q, k=k, v=v, att=att, lse=lse)
            x = x + self._linear(att.reshape(n * t, -1), p + "self_attn.out_proj", c)
            c["x2"] = x
            h, c["rstd2"] = layernorm_forward(x, w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"],
                                              vc.layer_norm_eps)
            c["f1"] = self._linear(h, p + "mlp.fc1", c)
            x = x + self._linear(gelu_forward(c["f1"]), p + "mlp.fc2", c)
            cache["layers"].append(c if keep else None)
        cache["x_last"] = x
        y, cache["rstd_post"] = layernorm_forward(x, w[TOWER + "post_layernorm.weight"],
                                                  w[TOWER + "post_layernorm.bias"], vc.layer_norm_eps)
        return y, cache

    def project(self, hidden, cache=None):
        """The projector: hidden (N, P, C) -> (N, mm_tokens_per_image, text hidden)."""
        vc = self.vc
        if vc.scale_factor:     # SmolVLM's connector, LoRA on its projection when set
            shuffled = pixel_shuffle(hidden, vc.scale_factor)                               # (N, M, C*s*s)
            out = self._linear(shuffled.reshape(-1, shuffled.shape[-1]), CONNECTOR, {} if cache is None else cache)
            return out.reshape(hidden.shape[0], shuffled.shape[1], -1)
        n, side = hidden.shape[0], vc.patches_per_side
        s = int(round(vc.mm_tokens_per_image ** 0.5))
        pooled = hidden.reshape(n, s, side // s, s, side // s, -1).mean(axis=(2, 4))        # (N, s, s, C)
        pooled = pooled.reshape(n * vc.mm_tokens_per_image, vc.hidden_size)
        normed, rstd = ops.rmsnorm_forward(pooled, self.w[PROJ + "mm_soft_emb_norm.weight"], vc.layer_norm_eps, 1.0)
        if cache is not None:
            cache.update(pooled=pooled, rstd_soft=rstd, normed=normed)
        out = normed @ self.w[PROJ + "mm_input_projection_weight"]                          # (N*M, text C)
        return out.reshape(n, vc.mm_tokens_per_image, -1)

    def __call__(self, pixels):
        """The frozen forward, one image at a time (a real tower's attention scores take a GiB an image)."""
        return np.concatenate([self.forward(pixels[i:i + 1], keep=False)[0] for i in range(len(pixels))])

    def backward(self, dout, cache) -> dict:
        """The image embeddings' gradient dout (N, M, text C) -> {module path.lora_A / .lora_B: gradient} of
        the tower's LoRA; the ops in reverse order of forward's."""
        grads: dict = {}
        self.encode_backward(self._project_backward(dout, cache, grads), cache, grads)
        return grads

    def encode_backward(self, dy, cache, grads: dict):
        """encode's backward: the post-layernorm output's gradient dy (n * t, C) -> the encoder's LoRA gradients
        into grads."""
        vc, w, n, t = self.vc, self.w, cache["n"], cache["t"]
        dx = layernorm_backward(dy, cache["x_last"], w[TOWER + "post_layernorm.weight"], cache["rstd_post"])
        for i in reversed(range(vc.num_layers)):
            p, c = f"{TOWER}encoder.layers.{i}.", cache["layers"][i]
            dg = self._linear_backward(dx, p + "mlp.fc2", c, grads)
            dh = self._linear_backward(gelu_backward(dg, c["f1"]), p + "mlp.fc1", c, grads)
            dx = dx + layernorm_backward(dh, c["x2"], w[p + "layer_norm2.weight"], c["rstd2"])
            datt = self._linear_backward(dx, p + "self_attn.out_proj", c, grads).reshape(c["att"].shape)
            dq, dk, dv = bidirectional_attention_backward(datt, c["q"], c["k"], c["v"], c["att"], c["lse"])
            dh = sum(self._linear_backward(d.reshape(n * t, -1), p + f"self_attn.{m}", c, grads)
                     for d, m in ((dq, "q_proj"), (dk, "k_proj"), (dv, "v_proj")))
            dx = dx + layernorm_backward(dh, c["x"], w[p + "layer_norm1.weight"], c["rstd1"])

    def _project_backward(self, dout, cache, grads):
        """The projector's backward: the image embeddings' gradient (N, M, text C) -> the post-layernorm
        output's (N*P, C); the connector projection's LoRA gradients into grads."""
        vc, w, n = self.vc, self.w, cache["n"]
        if vc.scale_factor:
            d = self._linear_backward(dout.reshape(-1, dout.shape[-1]), CONNECTOR, cache, grads)  # (N*M, C*s*s)
            return pixel_unshuffle(d.reshape(n, dout.shape[1], -1), vc.scale_factor).reshape(-1, vc.hidden_size)
        dn = dout.reshape(-1, dout.shape[-1]) @ w[PROJ + "mm_input_projection_weight"].T      # (N*M, C)
        dpooled, _ = ops.rmsnorm_backward(dn, cache["pooled"], w[PROJ + "mm_soft_emb_norm.weight"],
                                          cache["rstd_soft"], 1.0)
        s, side = int(round(vc.mm_tokens_per_image ** 0.5)), vc.patches_per_side
        k = side // s
        dy = np.broadcast_to((dpooled / (k * k)).reshape(n, s, 1, s, 1, -1), (n, s, k, s, k, vc.hidden_size))
        return dy.reshape(n * cache["t"], -1)
