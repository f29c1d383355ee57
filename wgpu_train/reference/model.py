"""The NumPy engine: model forward and backward composed from reference/ops.py, LoRA and full
fine-tuning gradients, AdamW. The oracle that the GPU engine is tested against."""
from __future__ import annotations

import time

import numpy as np

from ..config import ModelConfig
from ..engine_protocol import DropoutState
from ..hf import module_path
from . import ops
from .quant import check_dtypes, round_weights
from .optim import adamw_update, clip_scale, grad_norm


class LoraModule:
    """One LoRA pair on a linear module: A (r, in), B (out, r), and its dropout."""

    def __init__(self, a, b, scale, dropout):
        self.a, self.b, self.scale, self.dropout = a, b, scale, dropout


def check_rows(ids, rows, positions, last, kv: dict, vocab_size: int) -> tuple:
    """The arguments of an engine's forward_rows as int arrays, after checking that they fit the cache and
    the vocabulary, and that no two tokens of the call write the same cache slot (row, position)."""
    ids, rows, positions, last = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (ids, rows, positions, last))
    n = ids.shape[0]
    if rows.shape[0] != n or positions.shape[0] != n:
        raise ValueError(f"forward_rows: {n} ids but {rows.shape[0]} rows and {positions.shape[0]} positions")
    if n and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"forward_rows: token ids must lie in [0, {vocab_size})")
    if np.unique(rows * kv["max_len"] + positions).size < n:
        raise ValueError("forward_rows: two tokens of one call write the same cache row and position")
    if n and (rows.min() < 0 or rows.max() >= kv["batch"] or positions.min() < 0 or positions.max() >= kv["max_len"]):
        raise ValueError(f"forward_rows: rows must lie in [0, {kv['batch']}) and positions in [0, {kv['max_len']})")
    if last.size and (last.min() < 0 or last.max() >= n or last.size > n):
        raise ValueError(f"forward_rows: need at most {n} indices `last` in [0, {n})")
    return ids, rows, positions, last


def forward_cached(engine, ids, kv: dict) -> np.ndarray:
    """Every row b of the cache takes tokens ids[b] (B, Tq) after its kv["len"] cached ones (forward_rows with
    all rows at the same length); returns logits (B, V) of each row's last token."""
    b, tq = ids.shape
    start = kv["len"]
    if b > kv["batch"] or start + tq > kv["max_len"]:
        raise ValueError("KV cache is full")
    rows = np.repeat(np.arange(b), tq)
    positions = np.tile(np.arange(start, start + tq), b)
    logits = engine.forward_rows(ids.reshape(-1), rows, positions, kv, np.arange(1, b + 1) * tq - 1)
    kv["len"] = start + tq
    return logits


class NumpyEngine(DropoutState):
    """Forward and backward of a Llama-family model on the CPU in float32 (or float64).

    base_dtype / embed_dtype ("float32", "float16", "nf4", "nf4-dq" / "float32", "float16"): the base weights are
    rounded through that storage at load (reference/quant.py) and kept dequantised, so the math equals
    the GPU engine's, which stores them in that format, up to summation order."""

    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=np.float32, base_dtype: str = "float32",
                 embed_dtype: str = "auto"):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype)
        self.w = {k: v.astype(self.dtype) for k, v in round_weights(weights, base_dtype, embed_dtype).items()}
        self.inv_freq = cfg.inv_freq()
        self.lora: dict[str, LoraModule] = {}
        self.full = False            # full fine-tuning: every weight trainable
        self.grads: dict = {}
        self.moments: dict = {}
        self.training = False
        self.gradient_checkpointing = False
        self.last_profile: dict = {}
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0}
        self.base_weight_bytes = 0   # no device copy
        self.max_binding = None
        self.device_description = "cpu (NumPy)"

    # ---- parameters ---------------------------------------------------------------------------
    def lm_head(self):
        return self.w["model.embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]

    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout). Replaces every LoRA module and resets the optimizer."""
        self.lora = {p: LoraModule(a.astype(self.dtype), b.astype(self.dtype), s, d) for p, (a, b, s, d) in modules.items()}
        self.moments = {}
        self.zero_grads()

    def lora_tensors(self) -> dict:
        return {p: (m.a.copy(), m.b.copy()) for p, m in self.lora.items()}

    def set_full_finetune(self, enabled: bool = True):
        self.full = enabled
        self.moments = {}
        self.zero_grads()

    def set_gradient_checkpointing(self, on: bool = True):
        """Only stores the flag: the CPU reference keeps every activation (memory is not its concern), and
        recomputing them would give the same numbers, so it stays the oracle either way."""
        self.gradient_checkpointing = bool(on)

    def trainable(self) -> dict:
        """Trainable arrays by name: 'path.lora_A' / 'path.lora_B', or Hugging Face weight names."""
        if self.full:
            return dict(self.w)
        out = {}
        for p, m in self.lora.items():
            out[p + ".lora_A"] = m.a
            out[p + ".lora_B"] = m.b
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
    def _linear(self, x, layer, module, cache):
        """Base linear plus LoRA (with dropout on the LoRA input while training); x (N, in) -> (N, out)."""
        path = module_path(layer, module)
        y = ops.linear_forward(x, self.w[path + ".weight"], self.w.get(path + ".bias"))
        lora = self.lora.get(path)
        if lora is not None:
            xl, mask = x, None
            if self.training and lora.dropout > 0:
                mask = ops.dropout_mask(self.dropout_module_seed(layer, module), x.shape, lora.dropout, x.dtype)
                xl = x * mask
            yl, h = ops.lora_forward(xl, lora.a, lora.b, lora.scale)
            y = y + yl
            cache[module] = (x, xl, h, mask)
        else:
            cache[module] = (x, None, None, None)
        return y

    def dropout_module_seed(self, layer, module) -> int:
        """The dropout seed of one LoRA module in the current micro-batch (shared with the GPU engine)."""
        from ..config import LINEAR_MODULES

        module_id = layer * len(LINEAR_MODULES) + LINEAR_MODULES.index(module)
        return int(ops.pcg_hash(ops.pcg_hash(np.uint32(self.dropout_seed) ^ np.uint32(self.dropout_calls)) ^ np.uint32(module_id)))

    def _linear_backward(self, dy, layer, module, cache):
        path = module_path(layer, module)
        x, xl, h, mask = cache[module]
        w = self.w[path + ".weight"]
        dx, dw, db = ops.linear_backward(dy, x, w, need_weight_grad=self.full)
        if self.full:
            self.grads[path + ".weight"] += dw
            if path + ".bias" in self.grads:
                self.grads[path + ".bias"] += db
        lora = self.lora.get(path)
        if lora is not None:
            dxl, da, db_ = ops.lora_backward(dy, xl, h, lora.a, lora.b, lora.scale)
            if not self.full:
                self.grads[path + ".lora_A"] += da
                self.grads[path + ".lora_B"] += db_
            dx = dx + (dxl * mask if mask is not None else dxl)
        return dx

    def forward(self, ids, segment_ids, position_ids):
        """ids (B, T) -> logits (B, T, V) and the cache the backward needs."""
        cfg = self.cfg
        b, t = ids.shape
        n = b * t
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        flat_ids = ids.reshape(-1)
        x = ops.embedding_forward(flat_ids, self.w["model.embed_tokens.weight"])   # (N, C)
        layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            c = {"x_in": x}
            h, c["rstd1"] = ops.rmsnorm_forward(x, self.w[p + "input_layernorm.weight"], eps)
            q = self._linear(h, i, "q_proj", c).reshape(b, t, hq, d)
            k = self._linear(h, i, "k_proj", c).reshape(b, t, hkv, d)
            v = self._linear(h, i, "v_proj", c).reshape(b, t, hkv, d)
            if cfg.qk_norm:
                c["q_pre"], c["k_pre"] = q, k
                q, c["rstd_q"] = ops.rmsnorm_forward(q.reshape(-1, d), self.w[p + "self_attn.q_norm.weight"], eps)
                k, c["rstd_k"] = ops.rmsnorm_forward(k.reshape(-1, d), self.w[p + "self_attn.k_norm.weight"], eps)
                q, k = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d)
            q = ops.rope_forward(q, position_ids, self.inv_freq)
            k = ops.rope_forward(k, position_ids, self.inv_freq)
            att, lse = ops.attention_forward(q, k, v, segment_ids, cfg.window(i))   # (B, T, Hq, D)
            c.update(q=q, k=k, v=v, att=att, lse=lse)
            x = x + self._linear(att.reshape(n, hq * d), i, "o_proj", c)
            c["x_mid"] = x
            h2, c["rstd2"] = ops.rmsnorm_forward(x, self.w[p + "post_attention_layernorm.weight"], eps)
            gate = self._linear(h2, i, "gate_proj", c)
            up = self._linear(h2, i, "up_proj", c)
            c["gate"], c["up"] = gate, up
            x = x + self._linear(ops.swiglu_forward(gate, up), i, "down_proj", c)
            layers.append(c)
        xf, rstd_f = ops.rmsnorm_forward(x, self.w["model.norm.weight"], eps)
        logits = ops.linear_forward(xf, self.lm_head())                         # (N, V)
        cache = {"ids": flat_ids, "segment_ids": segment_ids, "position_ids": position_ids, "layers": layers,
                 "x_final": x, "rstd_f": rstd_f, "xf": xf, "shape": (b, t)}
        return logits.reshape(b, t, -1), cache

    # ---- backward -----------------------------------------------------------------------------
    def backward(self, dlogits, cache):
        """Accumulate gradients of every trainable tensor from dlogits (N, V); ops in reverse order."""
        cfg = self.cfg
        b, t = cache["shape"]
        n = b * t
        hq, d = cfg.num_attention_heads, cfg.head_dim
        tied = cfg.tie_word_embeddings
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        dxf, dhead, _ = ops.linear_backward(dlogits, cache["xf"], self.lm_head(), need_weight_grad=self.full)
        if self.full:
            self.grads[head_name] += dhead
        dx, dnorm = ops.rmsnorm_backward(dxf, cache["x_final"], self.w["model.norm.weight"], cache["rstd_f"])
        if self.full:
            self.grads["model.norm.weight"] += dnorm
        for i in reversed(range(cfg.num_hidden_layers)):
            p = f"model.layers.{i}."
            c = cache["layers"][i]
            dm = self._linear_backward(dx, i, "down_proj", c)
            dgate, dup = ops.swiglu_backward(dm, c["gate"], c["up"])
            dh2 = self._linear_backward(dup, i, "up_proj", c) + self._linear_backward(dgate, i, "gate_proj", c)
            dmid, dw = ops.rmsnorm_backward(dh2, c["x_mid"], self.w[p + "post_attention_layernorm.weight"], c["rstd2"])
            self._add_full(p + "post_attention_layernorm.weight", dw)
            dx = dx + dmid
            datt = self._linear_backward(dx, i, "o_proj", c).reshape(b, t, hq, d)
            dq, dk, dv = ops.attention_backward(datt, c["q"], c["k"], c["v"], c["att"], c["lse"], cache["segment_ids"],
                                                cfg.window(i))
            dq = ops.rope_backward(dq, cache["position_ids"], self.inv_freq)
            dk = ops.rope_backward(dk, cache["position_ids"], self.inv_freq)
            if cfg.qk_norm:
                dq, dwq = ops.rmsnorm_backward(dq.reshape(-1, d), c["q_pre"].reshape(-1, d),
                                               self.w[p + "self_attn.q_norm.weight"], c["rstd_q"])
                dk, dwk = ops.rmsnorm_backward(dk.reshape(-1, d), c["k_pre"].reshape(-1, d),
                                               self.w[p + "self_attn.k_norm.weight"], c["rstd_k"])
                self._add_full(p + "self_attn.q_norm.weight", dwq)
                self._add_full(p + "self_attn.k_norm.weight", dwk)
            dh = (self._linear_backward(dv.reshape(n, -1), i, "v_proj", c)
                  + self._linear_backward(dk.reshape(n, -1), i, "k_proj", c)
                  + self._linear_backward(dq.reshape(n, -1), i, "q_proj", c))
            din, dw = ops.rmsnorm_backward(dh, c["x_in"], self.w[p + "input_layernorm.weight"], c["rstd1"])
            self._add_full(p + "input_layernorm.weight", dw)
            dx = dx + din
        if self.full:
            self.grads["model.embed_tokens.weight"] += ops.embedding_backward(dx, cache["ids"], cfg.vocab_size)

    def _add_full(self, name, g):
        if self.full:
            self.grads[name] += g

    # ---- generation with a KV cache ------------------------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions each."""
        cfg = self.cfg
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return {"k": np.zeros(shape, self.dtype), "v": np.zeros(shape, self.dtype), "len": 0,
                "batch": batch, "max_len": max_len}

    def free_kv_cache(self, kv: dict):
        """Drop a KV cache's arrays (the engine protocol: the GPU engine frees its buffers)."""
        kv["k"] = kv["v"] = None

    def forward_cached(self, ids, kv: dict) -> np.ndarray:
        """New tokens ids (B, Tq) of every row after the kv["len"] cached ones -> logits (B, V) of each row's last."""
        return forward_cached(self, ids, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last) -> np.ndarray:
        """n new tokens, each with its own cache row and position: ids, rows, positions (n,) int.

        Every token's key and value is written into kv first; then token i attends to keys 0..positions[i]
        of row rows[i], so one call prefills several ragged prompts packed together, or advances every row
        by one token. Returns logits (m, V) float32 of the tokens at indices last (m,): only those go
        through the final norm and lm_head.
        """
        ids, rows, positions, last = check_rows(ids, rows, positions, last, kv, self.cfg.vocab_size)
        cfg = self.cfg
        n = ids.shape[0]
        hq, hkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        x = ops.embedding_forward(ids, self.w["model.embed_tokens.weight"])       # (n, C)
        self.training = False
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            c: dict = {}
            h, _ = ops.rmsnorm_forward(x, self.w[p + "input_layernorm.weight"], eps)
            q = self._linear(h, i, "q_proj", c).reshape(n, hq, d)
            k = self._linear(h, i, "k_proj", c).reshape(n, hkv, d)
            v = self._linear(h, i, "v_proj", c).reshape(n, hkv, d)
            if cfg.qk_norm:
                q = ops.rmsnorm_forward(q.reshape(-1, d), self.w[p + "self_attn.q_norm.weight"], eps)[0].reshape(q.shape)
                k = ops.rmsnorm_forward(k.reshape(-1, d), self.w[p + "self_attn.k_norm.weight"], eps)[0].reshape(k.shape)
            q = ops.rope_forward(q[None], positions[None], self.inv_freq)[0]
            k = ops.rope_forward(k[None], positions[None], self.inv_freq)[0]
            ops.kv_cache_write(kv["k"][i], kv["v"][i], k, v, rows, positions)
            att = ops.attention_cached_forward(q, kv["k"][i], kv["v"][i], rows, positions, cfg.window(i))  # (n, Hq, D)
            x = x + self._linear(att.reshape(n, hq * d), i, "o_proj", c)
            h2, _ = ops.rmsnorm_forward(x, self.w[p + "post_attention_layernorm.weight"], eps)
            m = ops.swiglu_forward(self._linear(h2, i, "gate_proj", c), self._linear(h2, i, "up_proj", c))
            x = x + self._linear(m, i, "down_proj", c)
        xf, _ = ops.rmsnorm_forward(x[last], self.w["model.norm.weight"], eps)    # (m, C)
        return ops.linear_forward(xf, self.lm_head()).astype(np.float32)

    # ---- the engine protocol ------------------------------------------------------------------
    def logits(self, ids, segment_ids, position_ids):
        self.training = False
        return self.forward(ids, segment_ids, position_ids)[0].astype(np.float32)

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch; grads accumulate scaled by grad_scale per token.

        Returns (loss_sum, token_count) of the micro-batch.
        """
        self.training = True
        self.dropout_calls += 1
        logits, cache = self.forward(ids, segment_ids, position_ids)
        flat = logits.reshape(-1, logits.shape[-1])
        loss_sum, count, lse = ops.cross_entropy_forward(flat, targets.reshape(-1))
        if count:
            self.backward(ops.cross_entropy_backward(flat, targets.reshape(-1), lse, grad_scale), cache)
        self.training = False
        return loss_sum, count

    def loss(self, ids, targets, segment_ids, position_ids):
        logits = self.forward(ids, segment_ids, position_ids)[0]
        loss_sum, count, _ = ops.cross_entropy_forward(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss_sum, count

    def gradients(self) -> dict:
        return {k: v.astype(np.float32) for k, v in self.grads.items()}

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """One optimizer step over micro-batches [(ids, targets, segment_ids, position_ids), ...].

        Gradients are normalised by the total number of counted tokens of all micro-batches, so the
        step equals the full-batch step; `reduce` (the engine protocol's) may replace them before the
        update. Returns (loss_sum, token_count, grad_norm, applied).
        """
        started = time.perf_counter()
        total = sum(int((t != ops.IGNORE_INDEX).sum()) for _, t, _, _ in micro_batches)
        self.zero_grads()
        loss_sum = 0.0
        for ids, targets, seg, pos in micro_batches:
            loss_sum += self.forward_backward(ids, targets, seg, pos, 1.0 / max(total, 1))[0]
        if reduce is not None:
            self._reduce_grads(reduce, total)
        norm, applied = self.optimizer_step(hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay,
                                            hp.max_grad_norm, step, hp.lora_b_lr_ratio)
        if profile:
            self.last_profile = {"whole step (NumPy engine, wall clock)": time.perf_counter() - started}
        return loss_sum, total, norm, applied

    def _reduce_grads(self, reduce, total: int):
        """Pass the gradients through `reduce` as one flat float32 array (self.grads' order) and take its result."""
        names = list(self.grads)
        flat = np.concatenate([self.grads[k].astype(np.float32).reshape(-1) for k in names]) if names else \
            np.zeros(0, np.float32)
        out = np.asarray(reduce(flat, int(total)), dtype=np.float32)
        if out.shape != flat.shape:
            raise ValueError(f"train_step: reduce returned {out.shape[0]} gradients for {flat.shape[0]}")
        at = 0
        for k in names:
            g = self.grads[k]
            g[...] = out[at:at + g.size].reshape(g.shape)
            at += g.size

    def optimizer_step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                       lora_b_lr_ratio=1.0):
        """Clip by the global norm, then AdamW on every trainable tensor (the LoRA B matrices at lr times
        lora_b_lr_ratio: LoRA+); returns (grad_norm, applied)."""
        params = self.trainable()
        norm = grad_norm(list(self.grads.values()))
        if not np.isfinite(norm):
            self.counters["nonfinite_skipped"] += 1
            self.zero_grads()
            return norm, False
        scale = clip_scale(norm, max_grad_norm)
        for k, p in params.items():
            if k not in self.moments:
                self.moments[k] = (np.zeros_like(p), np.zeros_like(p))
            m, v = self.moments[k]
            rate = lr * lora_b_lr_ratio if k.endswith(".lora_B") else lr
            adamw_update(p, self.grads[k], m, v, rate, beta1, beta2, eps, weight_decay, step, grad_scale=scale)
        self.zero_grads()
        return norm, True

    def optimizer_state(self) -> dict:
        return {k: (m.copy(), v.copy()) for k, (m, v) in self.moments.items()}

    def load_optimizer_state(self, state: dict):
        self.moments = {k: (m.astype(self.dtype), v.astype(self.dtype)) for k, (m, v) in state.items()}
