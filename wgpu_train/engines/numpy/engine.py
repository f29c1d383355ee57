"""The NumPy engine: model forward and backward composed from engines/numpy/ops.py, gradients of LoRA and of
trained base weights (full fine-tuning, modules_to_save), AdamW. The oracle that the GPU engine is tested against."""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.adapters.dora import MAGNITUDE, split_entry
from wgpu_train.engines.protocol import EngineState, LossScaler, check_kv_dtype
from wgpu_train.models.weights import module_path
from wgpu_train.models.layer_plan import CARRY, INPUT, OUTPUT, layer_plan
from wgpu_train.adapters.saved_modules import EMBED, HEAD
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.dora_linear import DoraLinear
from wgpu_train.engines.numpy.kv_cache import NumpyKvCache
from wgpu_train.engines.numpy.walk import Walk
from wgpu_train.engines.numpy.precision import Rounding
from wgpu_train.engines.numpy.steps import NumpySteps
from wgpu_train.engines.shared.mixed_lora import mixed_lora_forward
from wgpu_train.engines.shared.quant import check_dtypes, round_to, round_weights


class LoraModule:
    """One LoRA pair on a linear module: A (r, in), B (out, r), its dropout, and with DoRA its magnitude m (out,)
    (None: plain LoRA)."""

    def __init__(self, a, b, scale, dropout, m=None):
        self.a, self.b, self.scale, self.dropout, self.m = a, b, scale, dropout, m


class NumpyEngine(NumpySteps, EngineState, DoraLinear, NumpyKvCache):
    """Forward and backward of a Llama-family model on the CPU in float32 (or float64).

    base_dtype / embed_dtype (quant.BASE_DTYPES / quant.EMBED_DTYPES): the base weights are
    rounded through that storage at load (engines/shared/quant.py) and kept dequantised, so the math equals
    the GPU engine's, which stores them in that format, up to summation order.

    precision (protocol.PRECISIONS): fp32, or bf16 / f16, where activations, saved tensors and activation
    gradients are rounded where the GPU stores them (precision.Rounding); f16 adds dynamic loss scaling
    (protocol.LossScaler) to train_step. kv_dtype (protocol.KV_DTYPES): generation's KV cache rounds its keys and
    values to it where the GPU's cache stores them."""

    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=np.float32, base_dtype: str = "float32",
                 embed_dtype: str = "auto", precision: str = "fp32", kv_dtype: str = "float32"):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype,
                                                                                   cfg.checkpoint_dtype)
        self.w = {k: v.astype(self.dtype) for k, v in round_weights(weights, base_dtype, embed_dtype).items()}
        # [long][layer] (R/2,): RoPE's frequencies, longrope's short and long sets (the same without longrope)
        self.inv_freqs = [[cfg.inv_freq(i, long) for i in range(cfg.num_hidden_layers)] for long in (False, True)]
        self.plan = layer_plan(cfg)
        self.rounding = Rounding(precision, self.plan.statistics)
        self.precision, self.precision_reason = self.rounding.precision, "as given"
        self.backend_reason = "as given"
        self.loss_temperature = 1.0     # set_loss_temperature
        check_kv_dtype(kv_dtype, cfg)
        self.kv_dtype = kv_dtype      # generation's KV cache storage (new_kv_cache)
        self.loss_scaler = LossScaler() if self.precision.loss_scaling else None
        self.lora: dict[str, LoraModule] = {}
        self.trained: tuple = ()     # base weights trained (full fine-tuning: all; modules_to_save: some)
        self.grads: dict = {}
        self.moments: dict = {}
        self.training = False
        self.adapter_enabled = True     # False: forwards skip every LoRA module (a preference objective's reference)
        self.gradient_checkpointing = False
        self.last_profile: dict = {}
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0,
                         "policy_forwards": 0, "reference_forwards": 0}
        self.step_logps: list = []      # the last train_step's log-probabilities of its TokenObjective micro-batches
        self.step_entropies: list = []  # and the entropies of its policy's distributions there
        self.base_weight_bytes = 0   # no device copy
        self.max_binding = None
        self.device_description = "cpu (NumPy)"

    # ---- parameters ---------------------------------------------------------------------------
    def lm_head(self):
        return self.w[self._head_name()]

    def _head_name(self) -> str:
        """The head's weight: lm_head's, or a tied model's embedding unless set_trained_base untied them."""
        return HEAD if HEAD in self.w else EMBED

    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout[, magnitude]) (dora.split_entry). Replaces every LoRA module
        and resets the optimizer."""
        self.lora = {}
        for p, entry in modules.items():
            a, b, s, d, m = split_entry(entry)
            self.lora[p] = LoraModule(a.astype(self.dtype), b.astype(self.dtype), s, d,
                                      None if m is None else np.array(m, dtype=self.dtype))
        self.moments = {}
        self.zero_grads()

    def lora_tensors(self) -> dict:
        return {p: (m.a.copy(), m.b.copy()) for p, m in self.lora.items()}

    def set_base_weights(self, weights: dict):
        """Replace base weights by name, rounded through the storage dtypes as at load."""
        for k, v in weights.items():
            v = np.asarray(v, np.float32) if k in self.trained else round_weights({k: v}, self.base_dtype,
                                                                                    self.embed_dtype)[k]
            if self.w[k].shape != v.shape:
                raise ValueError(f"set_base_weights: {k} has shape {v.shape}, expected {self.w[k].shape}")
            self.w[k] = v.astype(self.dtype)

    def set_full_finetune(self, enabled: bool = True):
        self.set_trained_base(tuple(self.w) if enabled else ())

    def set_trained_base(self, names, untie: bool = False):
        """Train base weights `names` beside any LoRA (float32, as they are now); the others are frozen.
        untie (a tied model): lm_head gets its own tensor, a copy of the embedding as it is now, so that
        the two train or stay frozen apart; False ties them again. Resets the optimizer."""
        if self.cfg.tie_word_embeddings:
            if untie and HEAD not in self.w:
                self.w[HEAD] = self.w[EMBED].copy()
            elif not untie:
                self.w.pop(HEAD, None)
        unknown = [n for n in names if n not in self.w]
        if unknown:
            raise ValueError(f"set_trained_base: no base weight {unknown[0]}")
        self.trained = tuple(names)
        self.moments = {}
        self.zero_grads()

    def set_gradient_checkpointing(self, on: bool = True):
        """Only stores the flag: the CPU reference keeps every activation (memory is not its concern), and
        recomputing them would give the same numbers, so it stays the oracle either way."""
        self.gradient_checkpointing = bool(on)

    def trainable(self) -> dict:
        """Trainable arrays by name: 'path.lora_A' / 'path.lora_B' (and 'path.lora_magnitude_vector' with DoRA),
        and trained base weights by their Hugging Face names."""
        out = {}
        for p, m in self.lora.items():
            out[p + ".lora_A"] = m.a
            out[p + ".lora_B"] = m.b
        out.update({f"{p}.{MAGNITUDE}": m.m for p, m in self.lora.items() if m.m is not None})
        out.update((k, self.w[k]) for k in self.trained)
        return out

    def set_trainable(self, tensors: dict):
        """Overwrite trainable tensors in place by name (names and shapes as trainable()); the optimizer
        moments and the dropout counter are left alone. Unknown names or wrong shapes raise ValueError."""
        current = self.trainable()
        for k, v in tensors.items():
            if k not in current:
                raise ValueError(f"set_trainable: unknown tensor {k}")
            if tuple(np.shape(v)) != current[k].shape:
                raise ValueError(f"set_trainable: {k} has shape {tuple(np.shape(v))}, expected {current[k].shape}")
            current[k][...] = v

    def zero_grads(self):
        self.grads = {k: np.zeros_like(v) for k, v in self.trainable().items()}

    def weights(self) -> dict:
        return self.w

    # ---- forward ------------------------------------------------------------------------------
    def set_adapter_enabled(self, enabled: bool = True):
        """Switch every LoRA module off (False: forwards are the base model's, PEFT's disable_adapter) or on."""
        self.adapter_enabled = bool(enabled)

    def _linear(self, x, layer, module, cache, residual=None):
        """Base linear plus LoRA (with dropout on the LoRA input while training), added to residual (N, out) if
        given; x (N, in) -> (N, out). In 16 bits the base output (with the residual) is stored before the LoRA term
        is added, as the GPU does (then the op's output is rounded again), as PEFT under autocast rounds it."""
        path = module_path(layer, module)
        lora = self.lora.get(path) if self.adapter_enabled else None
        if lora is not None and lora.m is not None:
            y = self._dora_linear(x, layer, module, lora, cache)
            return residual + y if residual is not None else y
        y = ops.linear_forward(x, self.w[path + ".weight"], self.w.get(path + ".bias"))
        y = residual + y if residual is not None else y
        if lora is not None:
            xl, mask = self._dropout_input(x, layer, module, lora)
            yl, h = ops.lora_forward(xl, lora.a, lora.b, lora.scale)
            y = self.rounding.activation(y, f"layer {layer} ({module})") + yl
            cache[module] = (x, xl, h, mask)
        else:
            cache[module] = (x, None, None, None)
            if self.bank_rows is not None and path in self.adapter_bank:     # a server's rows of mixed adapters
                y = self.rounding.activation(y, f"layer {layer} ({module})") + \
                    mixed_lora_forward(x, self.adapter_bank[path], self.bank_rows)
        return y

    def _dropout_input(self, x, layer, module, lora):
        """(the LoRA input, its dropout mask or None)."""
        if self.training and lora.dropout > 0:
            mask = ops.dropout_mask(self.dropout_module_seed(layer, module), x.shape, lora.dropout, x.dtype)
            return x * mask, mask
        return x, None

    def dropout_module_seed(self, layer, module) -> int:
        """The dropout seed of one LoRA module in the current micro-batch (shared with the GPU engine)."""
        module_id = self.cfg.module_id(layer, module)
        return int(ops.pcg_hash(ops.pcg_hash(np.uint32(self.dropout_seed) ^ np.uint32(self.dropout_calls)) ^ np.uint32(module_id)))

    def _linear_backward(self, dy, layer, module, cache) -> tuple:
        """The gradient of the module's input in parts, (base, LoRA's or None), which the layer's backward adds
        into the input's gradient one at a time (in 16 bits each sum is stored, as on the GPU)."""
        path = module_path(layer, module)
        lora = self.lora.get(path) if self.adapter_enabled else None
        if lora is not None and lora.m is not None:
            return self._dora_linear_backward(dy, layer, module, lora, cache), None
        x, xl, h, mask = cache[module]
        w = self.w[path + ".weight"]
        dx, dw, db = ops.linear_backward(dy, x, w, need_weight_grad=path + ".weight" in self.grads)
        if path + ".weight" in self.grads:
            self.grads[path + ".weight"] += dw
            if path + ".bias" in self.grads:
                self.grads[path + ".bias"] += db
        if lora is None:
            return dx, None
        dxl, da, db_ = ops.lora_backward(dy, xl, h, lora.a, lora.b, lora.scale)
        self.grads[path + ".lora_A"] += da
        self.grads[path + ".lora_B"] += db_
        return dx, (dxl * mask if mask is not None else dxl)

    def forward(self, ids, segment_ids, position_ids):
        """ids (B, T) -> logits (B, T, V) and the cache the backward needs."""
        b, t = ids.shape
        cache = {"ids": ids.reshape(-1), "walk": self._walk(segment_ids, position_ids)}
        x = self._layers_forward(self._embed(cache["ids"]), range(self.cfg.num_hidden_layers), cache)
        return self._head_forward(x, cache).reshape(b, t, -1), cache

    def _walk(self, segment_ids, position_ids) -> Walk:
        b, t = segment_ids.shape
        return Walk(b, t, position_ids, segment_ids, long_rope=self.cfg.rope_long(int(np.max(position_ids))))

    def _layers_forward(self, x, layers: range, cache: dict):
        """The layers' forward from the first one's input x (N, C) to the last one's output (N, C); each layer's
        activations are kept for the backward in cache["layers"], in the range's order."""
        cache["layers"] = []
        for i in layers:
            a = self._layer_forward(i, x, cache["walk"])
            x = a.pop(OUTPUT)
            cache["layers"].append(a)
        return x

    def _head_forward(self, x, cache: dict):
        """The final norm and the head from the last layer's output x (N, C): logits (N, V) (soft-capped)."""
        xf, rstd_f = ops.rmsnorm_forward(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps, self.cfg.norm_offset)
        xf = self.rounding.activation(xf, "the final norm")                      # the loss head's input
        cache.update(x_final=x, rstd_f=rstd_f, xf=xf)
        return ops.softcap_forward(ops.linear_forward(xf, self.lm_head()), self.cfg.logit_softcap)   # (N, V)

    def _embed(self, ids):
        """The embedding rows of ids (N,), times the model's embed_scale (Gemma)."""
        x = ops.embedding_forward(ids, self.w["model.embed_tokens.weight"])        # (N, C)
        if self.cfg.embed_scale != 1.0:     # the rows are stored, then scaled where they lie (as on the GPU)
            x = self.rounding.activation(x, "the embedding") * self.dtype.type(self.cfg.embed_scale)
        return self.rounding.activation(x, "the embedding")

    def _layer_forward(self, i: int, x, walk: "Walk") -> dict:
        """Layer i's ops in the plan's order from its input x (N, C): every activation by name, (N, width)."""
        a = {INPUT: x}
        for op in self.plan.ops:
            getattr(self, "_forward_" + op.kind)(op, i, a, walk)
            self.rounding.op_outputs(op, a, i)
        return a

    def _norm_weight(self, layer, op):
        return f"model.layers.{layer}.{op.param}"

    def _forward_rmsnorm(self, op, i, a, walk):
        x = a[op.inputs[0]]
        w = self.w[self._norm_weight(i, op)]
        y, rstd = ops.rmsnorm_forward(x.reshape(-1, w.shape[0]), w, self.cfg.rms_norm_eps, self.cfg.norm_offset)
        a[op.outputs[0]], a[op.outputs[1]] = y.reshape(x.shape), rstd

    def _forward_linear(self, op, i, a, walk):
        a[op.outputs[0]] = self._linear(a[op.inputs[0]], i, op.param, a, a[op.residual] if op.residual else None)

    def _inv_freq(self, i, walk):
        """Layer i's frequencies for this forward (longrope: its short or long set)."""
        return self.inv_freqs[walk.long_rope][i]

    def _forward_rope(self, op, i, a, walk):
        x = a[op.inputs[0]]
        a[op.outputs[0]] = ops.rope_forward(walk.heads(x, self.cfg), walk.positions, self._inv_freq(i, walk),
                                            self.cfg.rope_scale).reshape(x.shape)

    def _forward_attention(self, op, i, a, walk):
        q, k, v = (walk.heads(a[name], self.cfg) for name in op.inputs)         # (B, T, H, D)
        window = self.cfg.window(i)
        if walk.kv is None:
            att, lse = ops.attention_forward(q, k, v, walk.segments, window, self.cfg.attn_softcap)      # (B, T, Hq, D), (B, Hq, T)
        else:   # generation: one row of n tokens, each with its own cache row and position
            kv = walk.kv
            k_new, v_new = k[0], v[0]                                           # (n, Hkv, D)
            if kv["dtype"] != "float32":      # rounded as the GPU's cache stores them
                k_new, v_new = (round_to(x, kv["dtype"]).astype(x.dtype) for x in (k_new, v_new))
            ops.kv_cache_write(kv["k"][i], kv["v"][i], k_new, v_new, walk.rows, walk.positions[0])
            att = ops.attention_cached_forward(q[0], kv["k"][i], kv["v"][i], walk.rows, walk.positions[0], window,
                                               self.cfg.attn_softcap)
            lse = None
        a[op.outputs[0]], a[op.outputs[1]] = att.reshape(a[op.inputs[0]].shape), lse

    def _forward_glu(self, op, i, a, walk):
        """A gated activation, swiglu or geglu (the op's kind names the op pair)."""
        a[op.outputs[0]] = getattr(ops, op.kind + "_forward")(a[op.inputs[0]], a[op.inputs[1]])

    _forward_swiglu = _forward_geglu = _forward_glu

    def _forward_add(self, op, i, a, walk):
        a[op.outputs[0]] = a[op.residual] + a[op.inputs[0]]

    def _forward_scale(self, op, i, a, walk):
        a[op.outputs[0]] = a[op.inputs[0]] * self.dtype.type(op.factor)

    def _forward_split(self, op, i, a, walk):
        parts = ops.split_forward(a[op.inputs[0]], [self.plan.widths[y] for y in op.outputs])
        a.update(zip(op.outputs, parts))

    # ---- backward -----------------------------------------------------------------------------
    def backward(self, dlogits, cache):
        """Accumulate gradients of every trainable tensor from dlogits (N, V) (with respect to the uncapped
        logits); ops in reverse order."""
        dx = self._layers_backward(self._head_backward(dlogits, cache), range(self.cfg.num_hidden_layers), cache)
        self._embed_backward(dx, cache["ids"])

    def _head_backward(self, dlogits, cache: dict):
        """The head's and the final norm's backward from dlogits (N, V): the last layer's output gradient (N, C)."""
        head_name = self._head_name()
        dxf, dhead, _ = ops.linear_backward(dlogits, cache["xf"], self.lm_head(),
                                            need_weight_grad=head_name in self.grads)
        self._add_trained(head_name, dhead)
        dx, dnorm = ops.rmsnorm_backward(self.rounding.gradient(dxf), cache["x_final"], self.w["model.norm.weight"],
                                         cache["rstd_f"], self.cfg.norm_offset)
        self._add_trained("model.norm.weight", dnorm)
        return self.rounding.gradient(dx)

    def _layers_backward(self, dx, layers: range, cache: dict):
        """The layers' backward, last first, from the last one's output gradient dx (N, C): the first one's input
        gradient (N, C)."""
        for i in reversed(layers):
            dx = self._layer_backward(i, cache["layers"][i - layers.start], dx, cache["walk"])
        return dx

    def _embed_backward(self, dx, ids):
        """The embedding's gradient from its output's dx (N, C), where the embedding trains."""
        cfg = self.cfg
        if EMBED in self.grads:
            dx = dx * self.dtype.type(cfg.embed_scale) if cfg.embed_scale != 1.0 else dx
            demb = ops.embedding_backward(dx, ids, cfg.vocab_size)       # (V, C)
            if cfg.pad_token_id is not None:      # torch's padding_idx: the padding row gets no gradient
                demb[cfg.pad_token_id] = 0
            self.grads[EMBED] += demb

    def _layer_backward(self, i: int, a: dict, dx, walk: "Walk"):
        """The gradient (N, C) of layer i's input from that of its output dx: the plan's ops in reverse, each
        reading its outputs' gradients and writing (or adding into) its inputs'."""
        g = {CARRY: dx}
        for op, accumulate in self.plan.backward_steps():
            dys = [g[name] for name in op.grads_out]
            for name in op.grads_out[1:] if op.residual else op.grads_out:
                del g[name]
            dxs = getattr(self, "_backward_" + op.kind)(op, i, a, dys, walk)
            for name, d, add in zip(op.grads_in, dxs, accumulate):
                for j, part in enumerate(d if isinstance(d, tuple) else (d,)):     # a linear's: base, LoRA
                    if part is not None:
                        g[name] = self.rounding.gradient(g[name] + part if add or j else part)
        return g[CARRY]

    def _backward_rmsnorm(self, op, i, a, dys, walk):
        name = self._norm_weight(i, op)
        x, width = a[op.inputs[0]], self.w[name].shape[0]
        dx, dw = ops.rmsnorm_backward(dys[0].reshape(-1, width), x.reshape(-1, width), self.w[name], a[op.outputs[1]],
                                      self.cfg.norm_offset)
        self._add_trained(name, dw)
        return [dx.reshape(x.shape)]

    def _backward_linear(self, op, i, a, dys, walk):
        return [self._linear_backward(dys[0], i, op.param, a)]

    def _backward_rope(self, op, i, a, dys, walk):
        dy = dys[0]
        return [ops.rope_backward(walk.heads(dy, self.cfg), walk.positions, self._inv_freq(i, walk),
                                  self.cfg.rope_scale).reshape(dy.shape)]

    def _backward_attention(self, op, i, a, dys, walk):
        q, k, v = (walk.heads(a[name], self.cfg) for name in op.inputs)
        att, lse = walk.heads(a[op.outputs[0]], self.cfg), a[op.outputs[1]]
        grads = ops.attention_backward(walk.heads(dys[0], self.cfg), q, k, v, att, lse, walk.segments,
                                       self.cfg.window(i), self.cfg.attn_softcap)
        return [g.reshape(a[name].shape) for g, name in zip(grads, op.inputs)]

    def _backward_glu(self, op, i, a, dys, walk):
        return list(getattr(ops, op.kind + "_backward")(dys[0], a[op.inputs[0]], a[op.inputs[1]]))

    _backward_swiglu = _backward_geglu = _backward_glu

    def _backward_add(self, op, i, a, dys, walk):
        return [dys[0]]

    def _backward_scale(self, op, i, a, dys, walk):
        return [dys[0] * self.dtype.type(op.factor)]

    def _backward_split(self, op, i, a, dys, walk):
        return [ops.split_backward(dys)]

    def _add_trained(self, name, g):
        if name in self.grads:
            self.grads[name] += g
