"""LFM2-VL's SigLIP2 NaFlex tower and projector on the WebGPU engine over the NumPy one (engines/numpy/siglip2_tower,
the oracle, passed in by engines/vision_model.py: its weights, LoRA and the position grid resized on the host per tile
shape): every tile's real patches in one batch, the patch GEMM, encoder layers (LayerNorm, attention within each tile,
gelu_tanh MLP), the post-layernorm, the pixel unshuffle as a row gather, the projector (LayerNorm, Linear, erf GELU,
Linear); frozen, or with the NumPy tower's LoRA on the encoder's linears, whose backward recomputes each layer from its
kept input."""
from __future__ import annotations

import numpy as np

from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.attention import attention_backward, attention_forward, attention_scratch_size
from wgpu_train.engines.webgpu.device.operands import at
from wgpu_train.engines.webgpu.lora import lora_backward, lora_forward
from wgpu_train.engines.webgpu.device_tower import DeviceTower
from wgpu_train.engines.webgpu.tensors import Matrix, linear_backward, linear_forward
from wgpu_train.engines.webgpu.tuned.attention_kernels import extents, supported_head_dim
from wgpu_train.engines.webgpu.vision_tower_ops import (gelu_backward, gelu_forward, layernorm_backward,
                                                         layernorm_forward)
from wgpu_train.models.lfm2_vl import PROJ, TOWER

PROJECTOR_EPS = 1e-5        # the projector's LayerNorm (transformers' nn.LayerNorm default)


def row_width(vc) -> int:
    """Elements a patch holds in the widest activation (the patches, the MLP's, or the projector's per patch)."""
    return max(vc.num_channels * vc.patch_size ** 2, vc.hidden_size, vc.intermediate_size,
               -(-vc.projector_hidden_size // vc.downsample_factor ** 2))


def runs_on_device(rt, tower) -> bool:
    """Whether this tower runs on rt's device: the attention kernels take its head dim (else the NumPy tower runs)."""
    return supported_head_dim(tower.vc.head_dim)


class GpuSiglip2Tower(DeviceTower):
    """The NumPy tower `tower`'s (a Siglip2Tower) weights uploaded once as float32 to runtime rt, with the LoRA its
    `lora` dict holds at each call; __call__(pixels: (pixel_values (N, P, patch dim), pixel_attention_mask,
    spatial_shapes (N, 2))) -> the image tokens' embeddings (tokens of all N tiles, text C) as the NumPy tower's;
    forward / backward: the same keeping what the backward needs, then the LoRA gradients from the tokens'
    gradient. Buffers kept between calls (grown as needed); `calls` counts the forwards run on the device."""

    label = "siglip2 tower"

    def __init__(self, rt, tower):
        super().__init__(rt)
        self.tower, self.vc = tower, tower.vc
        self.calls = 0
        self._positions: dict = {}      # (rows, cols) -> the resized position grid (rows * cols, C) float32
        self.mat, self.vec = {}, {}
        for name, arr in tower.w.items():
            arr = np.asarray(arr, np.float32)
            if arr.ndim == 2 and name != TOWER + "embeddings.position_embedding.weight":
                self.mat[name] = Matrix(rt, *arr.shape, name, arr)
            elif arr.ndim == 1:
                self.vec[name] = rt.upload(arr, name)

    def _set_lora(self):
        """The NumPy tower's LoRA ({module path: (A (r, in), B (out, r), scale)}) packed, A then B of each module,
        and uploaded."""
        self._lora, parts, off = {}, [], 0
        for path, (a, b, scale) in sorted(self.tower.lora.items()):
            r, in_f = a.shape
            self._lora[path] = (off, off + a.size, r, float(scale), b.shape[0], in_f)
            parts += [np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)]
            off += a.size + b.size
        if parts:
            self.rt.write(self._buffer("lora_params", off), np.concatenate(parts))

    def _shapes(self, pixels) -> list:
        """The tiles' (rows, cols) of patches; a tile that is not whole downsample_factor blocks refused."""
        f = self.vc.downsample_factor
        shapes = [(int(r), int(c)) for r, c in np.asarray(pixels[2]).reshape(-1, 2)]
        for r, c in shapes:
            if r % f or c % f:
                raise ValueError(f"a tile of {r} x {c} patches is not whole {f} x {f} blocks")
        return shapes

    def __call__(self, pixels) -> np.ndarray:
        """The forward (with the tower's LoRA where set), no backward after it: in chunks of whole tiles whose
        widest activation fits one storage binding (a tile alone over it runs on the NumPy tower), a submission
        and a readback each."""
        values, mask, _ = pixels
        shapes = self._shapes(pixels)
        limit = self.rt.max_binding // (4 * row_width(self.vc))      # patches a chunk may hold
        self._set_lora()
        parts, i = [], 0
        while i < len(shapes):
            j = i + 1           # tiles i..j-1: at least one, more while they fit
            while j < len(shapes) and sum(r * c for r, c in shapes[i:j + 1]) <= limit:
                j += 1
            chunk = (values[i:j], mask[i:j], np.asarray(shapes[i:j]))
            fits = sum(r * c for r, c in shapes[i:j]) <= limit
            parts.append(self._run(chunk, keep=False) if fits else self.tower(chunk))
            i = j
        return (np.concatenate(parts) if parts else
                np.zeros((0, self.vc.text_hidden_size), np.float32))

    def forward(self, pixels) -> tuple:
        """pixels as __call__ takes them, with the tower's LoRA -> (the image tokens' embeddings, the backward's
        cache): all tiles at once, each layer's input kept on the device until backward (no other call of this
        tower in between); tiles whose widest activation is over one storage binding run on the NumPy tower
        instead (its cache, without "device": its backward takes it)."""
        rows = sum(r * c for r, c in self._shapes(pixels))
        if rows * row_width(self.vc) * 4 > self.rt.max_binding:
            return self.tower.forward(pixels)
        self._set_lora()
        return self._run(pixels, keep=True), {"device": True, "call": self.calls, "rows": rows}

    def _run(self, pixels, keep: bool) -> np.ndarray:
        """One chunk's tiles, one submission: their tokens' embeddings (tokens, text C)."""
        rec = self.rt.recorder()
        out, shape = self.record_forward(rec, pixels, keep)
        rec.read_back(out, np.float32, shape)
        rec.submit()
        self.calls += 1
        return rec.result()

    def _buffers(self, rows: int, keep: bool) -> dict:
        """The forward's buffers for `rows` patches; keep: each layer's input and the last x too (saved k)."""
        vc = self.vc
        c, f, r = vc.hidden_size, vc.intermediate_size, max((v[2] for v in self._lora.values()), default=0)
        tokens = rows // vc.downsample_factor ** 2
        sizes = {"patches": rows * vc.num_channels * vc.patch_size ** 2, "spans": 3 * rows, "unshuffle": rows,
                 "pos": rows * c, "x": rows * c, "x2": rows * c, "h": rows * c, "h2": rows * c, "q": rows * c,
                 "k": rows * c, "v": rows * c, "att": rows * c, "lse": vc.num_heads * rows, "f1": rows * f,
                 "g": rows * f, "u": rows * c, "un": rows * c, "p1": tokens * vc.projector_hidden_size,
                 "p2": tokens * vc.projector_hidden_size, "out": tokens * vc.text_hidden_size,
                 **{"lh_" + m: rows * r for m in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")}}
        if keep:
            sizes.update({f"saved {k}": rows * c for k in range(vc.num_layers + 1)})
        if self._lora:
            sizes["lora_params"] = sum(rr * (o + i) for _, _, rr, _, o, i in self._lora.values())
        return {name: self._buffer(name, size) for name, size in sizes.items()}

    def _positions_of(self, rows: int, cols: int) -> np.ndarray:
        """The position grid resized to rows x cols patches (the NumPy tower's), once per tile shape."""
        if (rows, cols) not in self._positions:
            self._positions[rows, cols] = np.asarray(self.tower.positions(rows, cols), np.float32)
        return self._positions[rows, cols]

    def record_forward(self, rec, pixels, keep: bool) -> tuple:
        """Record the forward of the tiles `pixels` (as __call__ takes them) into rec (its inputs written now) ->
        (the output buffer, its shape (tokens, text C)). keep: each layer's input kept for record_backward."""
        vc, rt = self.vc, self.rt
        values, _, _ = pixels
        shapes, c, f = self._shapes(pixels), vc.hidden_size, vc.downsample_factor
        sizes = [r * cc for r, cc in shapes]
        rows = sum(sizes)
        buf = self._buffers(rows, keep)
        patches = np.concatenate([np.asarray(values[i, :n], np.float32) for i, n in enumerate(sizes)])
        tile = np.repeat(np.arange(len(shapes), dtype=np.int32), sizes)[None]
        starts = np.cumsum([0, *sizes[:-1]])
        order = np.concatenate([s + np.arange(r * cc).reshape(r // f, f, cc // f, f).transpose(0, 2, 1, 3).reshape(-1)
                                for s, (r, cc) in zip(starts, shapes)]) if shapes else np.zeros(0)
        for name, arr in (("patches", patches), ("spans", extents(tile + 1, tile)),
                          ("unshuffle", order.astype(np.int32))):
            rt.write(buf[name], np.ascontiguousarray(arr).reshape(-1))
        rt.write(buf["pos"], np.concatenate([self._positions_of(r, cc) for r, cc in shapes]).reshape(-1))
        e, x = TOWER + "embeddings.", buf["x"]
        K.copy(rec, x, buf["pos"], rows * c)
        linear_forward(rec, x, buf["patches"], self.mat[e + "patch_embedding.weight"],
                       self.vec[e + "patch_embedding.bias"], rows, accumulate=True)
        for i in range(vc.num_layers):
            if keep:
                K.copy(rec, buf[f"saved {i}"], x, rows * c)
            self._layer(rec, buf, i, rows)
        if keep:
            K.copy(rec, buf[f"saved {vc.num_layers}"], x, rows * c)
        self._project(rec, buf, x, rows)
        return buf["out"], (rows // f ** 2, vc.text_hidden_size)

    def _layer(self, rec, buf, i, rows):
        """Encoder layer i over buf["x"] in place; its residual after attention also in buf["x2"]."""
        vc = self.vc
        c, h, x = vc.hidden_size, vc.num_heads, buf["x"]
        p = f"{TOWER}encoder.layers.{i}."
        self._layernorm(rec, buf["h"], x, p + "layer_norm1", rows)
        for m in ("q", "k", "v"):
            self._linear(rec, buf, buf[m], buf["h"], p + f"self_attn.{m}_proj", rows)
        attention_forward(rec, buf["att"], buf["lse"], buf["q"], buf["k"], buf["v"], buf["spans"], 1, rows, h, h,
                          vc.head_dim, blocks=True)
        self._linear(rec, buf, x, buf["att"], p + "self_attn.out_proj", rows, accumulate=True)
        K.copy(rec, buf["x2"], x, rows * c)
        self._layernorm(rec, buf["h2"], x, p + "layer_norm2", rows)
        self._linear(rec, buf, buf["f1"], buf["h2"], p + "mlp.fc1", rows)
        gelu_forward(rec, buf["g"], buf["f1"], rows * vc.intermediate_size)
        self._linear(rec, buf, x, buf["g"], p + "mlp.fc2", rows, accumulate=True)

    def _project(self, rec, buf, x, rows):
        """The post-layernorm over x (P, C) into h, the unshuffle's gather into u (P / f^2, f^2 C), the projector
        into out: LayerNorm into un, linear_1 into p1, the erf GELU into p2, linear_2."""
        vc = self.vc
        c, tokens, width = vc.hidden_size, rows // vc.downsample_factor ** 2, vc.hidden_size * vc.downsample_factor ** 2
        self._layernorm(rec, buf["h"], x, TOWER + "post_layernorm", rows)
        K.row_gather_forward(rec, buf["u"], buf["h"], buf["unshuffle"], rows, c, rows)
        normed = buf["u"]
        if vc.projector_use_layernorm:
            layernorm_forward(rec, buf["un"], buf["u"], self.vec[PROJ + "layer_norm.weight"],
                              self.vec[PROJ + "layer_norm.bias"], tokens, width, PROJECTOR_EPS)
            normed = buf["un"]
        linear_forward(rec, buf["p1"], normed, self.mat[PROJ + "linear_1.weight"], self.vec.get(PROJ + "linear_1.bias"),
                       tokens)
        gelu_forward(rec, buf["p2"], buf["p1"], tokens * vc.projector_hidden_size, erf=True)
        linear_forward(rec, buf["out"], buf["p2"], self.mat[PROJ + "linear_2.weight"],
                       self.vec.get(PROJ + "linear_2.bias"), tokens)

    def backward(self, dout, cache) -> dict:
        """The image tokens' gradient dout (tokens, text C) after forward's cache -> {module path.lora_A / .lora_B:
        gradient}: one submission, one readback."""
        if cache.get("call") != self.calls or not self._lora:
            raise ValueError("GpuSiglip2Tower.backward takes the cache of its last forward with LoRA only")
        given = self._buffer("dout", np.asarray(dout).size)
        self.rt.write(given, np.ascontiguousarray(dout, np.float32).reshape(-1))
        rec = self.rt.recorder()
        grads, total = self.record_backward(rec, given, cache["rows"])
        rec.read_back(grads, np.float32, (total,))
        rec.submit()
        flat = rec.result()
        return {f"{path}.lora_{w}": flat[o:o + n].reshape(shape)
                for path, (a, b, r, _, out_f, in_f) in self._lora.items()
                for w, o, n, shape in (("A", a, r * in_f, (r, in_f)), ("B", b, out_f * r, (out_f, r)))}

    def record_backward(self, rec, dout, rows: int) -> tuple:
        """Record the LoRA gradients' backward into rec after record_forward(keep=True) of `rows` patches, from the
        device buffer dout (tokens, text C) float32 -> (the gradients' buffer, its elements): the projector's and
        each layer's forward again from its kept input, then its backward, last first."""
        vc = self.vc
        c, f, h = vc.hidden_size, vc.intermediate_size, vc.num_heads
        tokens, width = rows // vc.downsample_factor ** 2, c * vc.downsample_factor ** 2
        buf = self._buffers(rows, True)
        total = sum(r * (o + i) for _, _, r, _, o, i in self._lora.values())
        r = max(v[2] for v in self._lora.values())
        sizes = {"dx": rows * c, "dh": rows * c, "datt": rows * c, "dq": rows * c, "dk": rows * c, "dv": rows * c,
                 "dg": rows * f, "df1": rows * f, "dp2": tokens * vc.projector_hidden_size,
                 "dp1": tokens * vc.projector_hidden_size, "du": rows * c, "dun": rows * c,
                 "att_scratch": attention_scratch_size(1, rows, h), "ldh": rows * r, "lora_grads": total}
        buf.update({name: self._buffer(name, size) for name, size in sizes.items()})
        x_last, dx = buf[f"saved {vc.num_layers}"], buf["dx"]
        self._project(rec, buf, x_last, rows)          # the projector's activations again
        linear_backward(rec, buf["dp2"], None, None, dout, None, self.mat[PROJ + "linear_2.weight"], tokens)
        gelu_backward(rec, buf["dp1"], buf["dp2"], buf["p1"], tokens * vc.projector_hidden_size, erf=True)
        if vc.projector_use_layernorm:
            linear_backward(rec, buf["dun"], None, None, buf["dp1"], None, self.mat[PROJ + "linear_1.weight"], tokens)
            layernorm_backward(rec, buf["du"], buf["dun"], buf["u"], self.vec[PROJ + "layer_norm.weight"], tokens,
                               width, PROJECTOR_EPS)
        else:
            linear_backward(rec, buf["du"], None, None, buf["dp1"], None, self.mat[PROJ + "linear_1.weight"], tokens)
        K.row_gather_backward(rec, buf["dh"], buf["du"], buf["unshuffle"], rows, c, rows)
        self._layernorm_backward(rec, dx, buf["dh"], x_last, TOWER + "post_layernorm", rows, accumulate=False)
        for i in reversed(range(vc.num_layers)):
            p, x_in = f"{TOWER}encoder.layers.{i}.", buf[f"saved {i}"]
            K.copy(rec, buf["x"], x_in, rows * c)
            self._layer(rec, buf, i, rows)              # its activations again
            self._linear_backward(rec, buf, buf["dg"], dx, buf["g"], p + "mlp.fc2", rows)
            gelu_backward(rec, buf["df1"], buf["dg"], buf["f1"], rows * f)
            self._linear_backward(rec, buf, buf["dh"], buf["df1"], buf["h2"], p + "mlp.fc1", rows)
            self._layernorm_backward(rec, dx, buf["dh"], buf["x2"], p + "layer_norm2", rows)
            self._linear_backward(rec, buf, buf["datt"], dx, buf["att"], p + "self_attn.out_proj", rows)
            attention_backward(rec, buf["dq"], buf["dk"], buf["dv"], buf["datt"], buf["q"], buf["k"], buf["v"],
                               buf["att"], buf["lse"], buf["spans"], 1, rows, h, h, vc.head_dim, buf["att_scratch"],
                               blocks=True)
            for j, m in enumerate(("q", "k", "v")):
                self._linear_backward(rec, buf, buf["dh"], buf["d" + m], buf["h"], p + f"self_attn.{m}_proj", rows,
                                      accumulate=j > 0)
            self._layernorm_backward(rec, dx, buf["dh"], x_in, p + "layer_norm1", rows)
        return buf["lora_grads"], total

    def _linear(self, rec, buf, y, x, path, rows, accumulate=False):
        linear_forward(rec, y, x, self.mat[path + ".weight"], self.vec[path + ".bias"], rows, accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params = buf["lora_params"]
            lora_forward(rec, y, buf["lh_" + path.rsplit(".", 1)[1]], x, at(params, a), at(params, b), scale, rows,
                         in_f, out_f, r)

    def _linear_backward(self, rec, buf, dx, dy, x, path, rows, accumulate=False):
        """dx (+)= dy @ W (the base frozen) and the module's LoRA gradients from its input x and its h."""
        linear_backward(rec, dx, None, None, dy, None, self.mat[path + ".weight"], rows, accumulate_dx=accumulate)
        if path in self._lora:
            a, b, r, scale, out_f, in_f = self._lora[path]
            params, grads = buf["lora_params"], buf["lora_grads"]
            lora_backward(rec, dx, at(grads, a), at(grads, b), dy, x, buf["lh_" + path.rsplit(".", 1)[1]],
                          at(params, a), at(params, b), scale, rows, in_f, out_f, r, buf["ldh"])

    def _layernorm(self, rec, y, x, path, rows):
        layernorm_forward(rec, y, x, self.vec[path + ".weight"], self.vec[path + ".bias"], rows, self.vc.hidden_size,
                          self.vc.layer_norm_eps)

    def _layernorm_backward(self, rec, dx, dy, x, path, rows, accumulate=True):
        layernorm_backward(rec, dx, dy, x, self.vec[path + ".weight"], rows, self.vc.hidden_size,
                           self.vc.layer_norm_eps, accumulate)
