"""The WebGPU engine: persistent weights, activations per (batch, length) bucket, and a whole
optimizer step (forward, loss, backward, clipping, AdamW) recorded into one command encoder. Its buckets are
buffers.py's, its layer recording layers.py's, its KV-cache generation kv_cache.py's."""
from __future__ import annotations

import os

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.engines.protocol import (PRECISIONS, EngineState, LossScaler, check_kv_dtype,
                                         check_precision_widths)
from wgpu_train.errors import ConfigError
from wgpu_train.models.weights import module_path
from wgpu_train.models.layer_plan import layer_plan
from wgpu_train.engines.webgpu.memory import layer_ranks, lora_groups
from wgpu_train.engines.shared.quant import check_dtypes
from wgpu_train.adapters.saved_modules import EMBED, HEAD
from wgpu_train.engines.webgpu.tuned import attention_kernels
from wgpu_train.engines.webgpu import kernels as K
from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import F32, Matrix, Packed, store_weight, weight_buffers
from wgpu_train.engines.webgpu.buffers import BucketCache, GpuLora
from wgpu_train.engines.webgpu.kv_cache import KvCacheGeneration
from wgpu_train.engines.webgpu.layers import LayerRecorder
from wgpu_train.engines.webgpu.dora import DoraRecorder
from wgpu_train.engines.webgpu.steps import StepRecording
from wgpu_train.adapters.dora import MAGNITUDE, split_entry


class WgpuEngine(EngineState, BucketCache, LayerRecorder, DoraRecorder, StepRecording, KvCacheGeneration):
    """The engine protocol of numpy.engine.NumpyEngine, on a WebGPU device."""

    name = "wgpu"
    backend_reason = "as given"
    loss_temperature = 1.0      # set_loss_temperature
    precision_reason = "as given"
    MAX_BUCKETS = 4             # training activation buckets kept allocated at once
    MAX_FORWARD_BUCKETS = 8     # forward-only ones (one set of layer buffers each): generation uses several

    def __init__(self, cfg: ModelConfig, weights: dict, rt: Runtime, base_dtype: str = "float32",
                 embed_dtype: str = "auto", kv_dtype: str = "float32", precision: str = "fp32"):
        """precision (protocol.PRECISIONS): fp32, or bf16 / f16 where the activations and their gradients are
        16-bit buffers (memory.activation_format) and the kernels round where they store them, as
        engines/numpy/precision.py does; f16 adds dynamic loss scaling."""
        if not attention_kernels.supported_head_dim(cfg.head_dim):
            raise ConfigError(f"config.json: field 'head_dim' ({cfg.head_dim}) is not one the WebGPU attention "
                              f"kernels support (up to {attention_kernels.MAX_HEAD_DIM}, a multiple of 4 above "
                              f"{attention_kernels.ROWS_DMAX}); use backend='numpy'")
        check_kv_dtype(kv_dtype, cfg)
        if precision not in PRECISIONS:
            raise ValueError(f"WgpuEngine takes one of {PRECISIONS} ('auto' is resolved by engines/model.py), got "
                             f"{precision!r}")
        check_precision_widths(precision, cfg)
        self.precision = precision
        self.loss_scaler = LossScaler() if precision == "f16" else None
        self.cfg, self.rt = cfg, rt
        self.dtype = np.dtype(np.float32)
        self.kv_dtype = kv_dtype      # generation's KV cache storage (new_kv_cache)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype,
                                                                                   cfg.checkpoint_dtype)
        self.w: dict = {}          # HF name -> Matrix or QuantMatrix (2-D) or buffer (1-D)
        self.shapes: dict = {}
        for name in weights:       # one tensor at a time: `weights` may convert each as it is read
            arr = weights[name]
            self.shapes[name] = tuple(arr.shape)
            self.w[name] = store_weight(rt, name, arr, base_dtype, embed_dtype)
        # GPU bytes of the base weights as allocated (memory.base_weight_bytes predicts the same)
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))
        # [long][layer] (R/2,): RoPE's frequencies (longrope: its short and long sets), one buffer per
        # distinct set (Gemma: local and global layers)
        uploaded: dict = {}
        self.inv_freqs = []
        for long in (False, True):
            freqs = [cfg.inv_freq(i, long).astype(np.float32) for i in range(cfg.num_hidden_layers)]
            for f in freqs:
                if f.tobytes() not in uploaded:
                    uploaded[f.tobytes()] = rt.upload(f, "inv_freq")
            self.inv_freqs.append([uploaded[f.tobytes()] for f in freqs])
        self.plan = layer_plan(cfg)
        self.lora: dict[str, GpuLora] = {}
        self.adapter_enabled = True   # False: forwards skip every LoRA module (a preference objective's reference)
        self._group_of: dict = {}  # module name -> its LoRA group (set_lora)
        self._pending: dict = {}   # member -> dy of a group whose LoRA backward waits for the others
        self.trained: tuple = ()   # base weights trained (full fine-tuning: all; modules_to_save: some)
        self.params: dict = {}     # trainable name -> tensor: Matrix, buffer or (buffer, offset) view
        self.grads: dict = {}      # trainable name -> its gradient, the same kind
        self.moments: dict = {}    # trainable name -> (m, v), the same kind
        self._groups: list = []    # optimizer pieces: (param, grad, m, v, n elements)
        self._b_groups: list = []  # per piece: whether it holds LoRA B matrices (their lr: LoRA+)
        self._state_buffers: list = []
        self._lora_packed = None
        self.gradient_checkpointing = False
        self._acts: dict = {}      # (capacity in tokens, train, checkpointed) -> Activations
        self._inputs: dict = {}    # (bucket capacity, micro-batch slot) -> Inputs
        self._micro = 0            # micro-batch slot being recorded (selects dropout seeds)
        self.step_buf = rt.buffer(64, "step_scalars")       # [grad_scale]
        self.results = rt.buffer(4 * F32, "results")       # loss_sum, count, (norm, clip, finite)
        self.partials = None
        self.n_modules = cfg.num_hidden_layers * len(cfg.linear_modules)
        self.seeds = rt.buffer(F32 * self.n_modules, "dropout_seeds")   # (micro-batch slot, module) -> u32
        self.scored_rows = rt.buffer(F32, "scored_rows")     # token_losses(reference=True): both passes' loss rows
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0,
                         "buckets_allocated": 0, "policy_forwards": 0, "reference_forwards": 0}
        self.step_logps: list = []      # the last train_step's log-probabilities of its TokenObjective micro-batches
        self.step_entropies: list = []  # and the entropies of its policy's distributions there
        self.last_step: dict = {}
        # GPU seconds one submission may hold (WGPU_TRAIN_MAX_SUBMIT_S), and the dispatches per submission
        # that keep a step under it (0: the whole step in one), measured from the previous step
        self.max_submit_s = float(os.environ.get("WGPU_TRAIN_MAX_SUBMIT_S", "1.0"))
        self._dispatch_budget = 0
        self.last_profile: dict = {}
        self.last_timing: dict = {}

    # ---- parameters ---------------------------------------------------------------------------
    def _head(self) -> Matrix:
        return self.w[self._head_name()]

    def _head_name(self) -> str:
        """The head's weight: lm_head's, or a tied model's embedding unless set_trained_base untied them."""
        return HEAD if HEAD in self.w else EMBED

    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout[, DoRA magnitude]) (dora.split_entry); replaces every LoRA
        module and resets the optimizer.

        All LoRA tensors live in one packed buffer (their gradients and AdamW moments in three more),
        so zeroing, the gradient norm and AdamW take a dispatch per buffer rather than per tensor: every A,
        then every B, then DoRA's magnitudes (with B's learning rate under LoRA+, as PEFT groups them)."""
        self._release_acts()
        modules = {p: split_entry(e) for p, e in modules.items()}
        if self._lora_packed:
            self.rt.release(self._lora_packed[0].buf, self._lora_packed[1].buf)
        # every A first, layer by layer in module order, so that the A matrices of a group lie back to back
        order = sorted(modules, key=lambda p: (int(p.split(".")[2]), self.cfg.linear_modules.index(p.rsplit(".", 1)[1])))
        shapes = {p + ".lora_A": modules[p][0].shape for p in order}
        shapes.update({p + ".lora_B": modules[p][1].shape for p in order})
        shapes.update({f"{p}.{MAGNITUDE}": (modules[p][1].shape[0],) for p in order if modules[p][4] is not None})
        self.lora = {}
        self._lora_packed = Packed(self.rt, shapes, "lora_params"), Packed(self.rt, shapes, "lora_grads")
        params, grads = self._lora_packed
        for path, (a, b, s, d, mag) in modules.items():
            layer, module = int(path.split(".")[2]), path.rsplit(".", 1)[1]
            na, nb, nm = path + ".lora_A", path + ".lora_B", f"{path}.{MAGNITUDE}"
            self._write(params.view(na), a)
            self._write(params.view(nb), b)
            self.lora[path] = GpuLora(path, params.view(na), params.view(nb), grads.view(na), grads.view(nb),
                                      a.shape, b.shape, s, d, self.cfg.module_id(layer, module))
            if mag is not None:
                self._write(params.view(nm), mag)
                self.lora[path].m, self.lora[path].gm = params.view(nm), grads.view(nm)
        self._setup_dora()
        self._group_of = self._lora_groups()
        self._reset_training_state()

    def _lora_groups(self) -> dict:
        """module name -> the modules that run their LoRA as one (memory.lora_groups' rule: the same for
        the memory estimate), each group's A matrices back to back in every layer with LoRA on it."""
        ranks = layer_ranks({p: m.r for p, m in self.lora.items()})
        # DoRA scales each module's dy by its own c: no shared LoRA backward
        alone = any(m.dropout > 0 or m.m is not None for m in self.lora.values()) or self.precision != "fp32"
        out = {}
        for module, members in lora_groups(self.cfg, ranks, alone).items():
            # lora_groups: every member has LoRA in the same layers
            mods = [[self.lora[module_path(i, m)] for m in members] for i in sorted(ranks[module])]
            if any(row[j + 1].a[1] != row[j].a[1] + row[j].r * row[j].in_f for row in mods for j in range(len(row) - 1)):
                continue     # not back to back (set_lora's packing order puts them so)
            out[module] = members
        return out

    @property
    def max_binding(self) -> int:
        return self.rt.max_binding

    @property
    def device_description(self) -> str:
        return self.rt.info.describe()

    def set_full_finetune(self, enabled: bool = True):
        frozen = sorted(k for k, t in self.w.items() if isinstance(t, QuantMatrix))
        if enabled and frozen:
            raise ConfigError(f"full fine-tuning needs float32 weights, but {frozen[0]} is stored as "
                              f"{self.w[frozen[0]].dtype}; use LoRA or load the model with float32")
        self.set_trained_base(tuple(self.w) if enabled else ())

    def set_trained_base(self, names, untie: bool = False):
        """Train base weights `names` beside any LoRA, each stored as a float32 Matrix (or buffer) from its value
        now (a float16 embedding is converted); the others are frozen. untie (a tied model): lm_head gets its
        own tensor, a copy of the embedding as it is now, so that the two train or stay frozen apart; False
        ties them again. Resets the optimizer."""
        if self.cfg.tie_word_embeddings:
            if untie and HEAD not in self.w:
                self.w[HEAD] = store_weight(self.rt, HEAD, self._weight(EMBED), self.base_dtype, self.embed_dtype)
                self.shapes[HEAD] = self.shapes[EMBED]
            elif not untie and HEAD in self.w:
                self.rt.release(*weight_buffers(self.w.pop(HEAD)))
                self.shapes.pop(HEAD)
        unknown = [n for n in names if n not in self.w]
        if unknown:
            raise ValueError(f"set_trained_base: no base weight {unknown[0]}")
        for name in names:
            if isinstance(self.w[name], QuantMatrix):
                arr = self._weight(name)
                self.rt.release(*weight_buffers(self.w[name]))
                self.w[name] = store_weight(self.rt, name, arr, "float32", "float32")
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))
        self.trained = tuple(names)
        self._release_acts()
        self._reset_training_state()

    def set_adapter_enabled(self, enabled: bool = True):
        """Switch every LoRA module off (False: forwards are the base model's, PEFT's disable_adapter) or on."""
        self.adapter_enabled = bool(enabled)

    def set_loss_temperature(self, temperature: float = 1.0):
        """The loss head of training steps and token_losses scores logits / temperature (GRPO's log-probabilities
        at its sampling temperature, as TRL takes them); loss() and generation keep the model's own."""
        self.loss_temperature = float(temperature)

    def set_gradient_checkpointing(self, on: bool = True):
        """Gradient (activation) checkpointing of training steps: each layer keeps only its input, and the
        backward recomputes the layer's forward (the same kernels on the same inputs, LoRA dropout masks
        included, so the gradients are bit-identical) before its backward. Activation memory drops from
        every layer's buffers to one layer's plus every layer's input, for about one more forward per step.
        Evaluation and generation are unaffected."""
        if bool(on) != self.gradient_checkpointing:
            self.gradient_checkpointing = bool(on)
            self._release_acts()

    def _reset_training_state(self):
        """Gradients and zeroed AdamW moments of the trainable tensors, and the optimizer's groups:
        (param, grad, m, v, n) pieces that each fit one binding, one norm slot each."""
        rt = self.rt
        if self._state_buffers:
            rt.release(*self._state_buffers)
        self.params, self.grads, self.moments = {}, {}, {}
        self._groups, self._b_groups, self._state_buffers = [], [], []
        if self._lora_packed:                  # the LoRA tensors: packed, a few pieces (set_lora owns params, grads)
            params, grads = self._lora_packed
            m, v = Packed(rt, params.shapes, "lora_m"), Packed(rt, params.shapes, "lora_v")
            self.params = {k: params.view(k) for k in params.shapes}
            self.grads = {k: grads.view(k) for k in params.shapes}
            self.moments = {k: (m.view(k), v.view(k)) for k in params.shapes}
            step = max(1, (rt.max_binding - 256) // F32)
            # every A lies before every B (set_lora): pieces end at that boundary, so B's may take another lr
            b0 = min((params.view(k)[1] for k in params.shapes if k.endswith(".lora_B")), default=params.n)
            spans = [(o, min(step, end - o), start == b0) for start, end in ((0, b0), (b0, params.n))
                     for o in range(start, end, step)]
            self._groups = [((params.buf, o), (grads.buf, o), (m.buf, o), (v.buf, o), n) for o, n, _ in spans]
            self._b_groups = [is_b for _, _, is_b in spans]
            self._state_buffers = [m.buf, v.buf]
        for k in self.trained:                 # trained base weights: a piece per row chunk, at lr (PEFT's LoRA+ too)
            p = self.params[k] = self.w[k]
            self.grads[k] = self._like(p, k + ".grad")
            self.moments[k] = (self._like(p, k + ".m"), self._like(p, k + ".v"))
            parts = [self._parts(t) for t in (p, self.grads[k], *self.moments[k])]
            self._groups += [(pp[0], gp[0], mp[0], vp[0], pp[1]) for pp, gp, mp, vp in zip(*parts)]
            self._b_groups += [False] * len(parts[0])
            self._state_buffers += [t for g in (self.grads[k], *self.moments[k]) for t, _ in self._parts(g)]
        self._norm_slots = [K.grad_norm_slots(g[4]) for g in self._groups]
        self.partials = rt.buffer(F32 * max(1, sum(self._norm_slots)), "partials")
        self._state_buffers.append(self.partials)

    def _like(self, t, label):
        if isinstance(t, Matrix):
            return Matrix(self.rt, t.rows, t.cols, label)
        return self.rt.buffer(t.size, label)

    @staticmethod
    def _parts(t):
        """(buffer, elements) pieces of a weight or its gradient."""
        if isinstance(t, Matrix):
            return [(b, n * t.cols) for b, _, n in t.chunks]
        return [(t, t.size // F32)]

    def _read(self, t, shape):
        """A tensor (Matrix, buffer, or (buffer, element offset) view) back as an array of `shape`."""
        if isinstance(t, Matrix):
            return t.read(self.rt)
        if isinstance(t, tuple):
            return self.rt.read(t[0], np.float32, shape, offset=t[1] * F32)
        return self.rt.read(t, np.float32, shape)

    def _write(self, t, arr):
        if isinstance(t, Matrix):
            t.write(self.rt, arr)
        elif isinstance(t, tuple):
            self.rt.write(t[0], np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), t[1] * F32)
        else:
            self.rt.write(t, np.ascontiguousarray(arr, dtype=np.float32))

    def _shape_of(self, name):
        return self.shapes[name] if name in self.trained else self._lora_packed[0].shapes[name]

    def trainable(self) -> dict:
        """Trainable arrays by name ('path.lora_A' / 'path.lora_B', or weight names), read back (copies)."""
        return {k: self._read(t, self._shape_of(k)) for k, t in self.params.items()}

    def set_trainable(self, arrays: dict):
        for k, arr in arrays.items():
            self._write(self.params[k], arr)
        self._dora_stale = True

    def lora_tensors(self) -> dict:
        return {p: (self._read(m.a, (m.r, m.in_f)), self._read(m.b, (m.out_f, m.r))) for p, m in self.lora.items()}

    def weights(self) -> dict:
        """Base weights as float32 (float16 / NF4 ones dequantised)."""
        return {k: self._weight(k) for k in self.w}

    def _weight(self, name) -> np.ndarray:
        """One base weight as float32 (dequantised)."""
        t = self.w[name]
        return t.read(self.rt) if isinstance(t, QuantMatrix) else self._read(t, self.shapes[name])

    def set_base_weights(self, weights: dict):
        """Replace base weights by name: each stored anew as at load (its old buffers released)."""
        for name, arr in weights.items():
            if self.shapes[name] != tuple(arr.shape):
                raise ValueError(f"set_base_weights: {name} has shape {arr.shape}, expected {self.shapes[name]}")
            if name in self.trained:      # stays the float32 tensor the optimizer updates
                self._write(self.w[name], arr)
                continue
            self.rt.release(*weight_buffers(self.w[name]))
            self.w[name] = store_weight(self.rt, name, np.asarray(arr, np.float32), self.base_dtype, self.embed_dtype)
        self._dora_weight_norms()
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))

    def zero_grads(self):
        rec = self.rt.recorder()
        self._record_zero_grads(rec)
        self._submit(rec)

    def _record_zero_grads(self, rec):
        for _, grad, _, _, n in self._groups:
            buf, off = grad if isinstance(grad, tuple) else (grad, 0)
            rec.clear(buf, off * F32, n * F32)

    def gradients(self) -> dict:
        return {k: self._read(g, self._shape_of(k)) for k, g in self.grads.items()}

    def optimizer_state(self) -> dict:
        return {k: (self._read(m, self._shape_of(k)), self._read(v, self._shape_of(k)))
                for k, (m, v) in self.moments.items()}

    def load_optimizer_state(self, state: dict):
        for k, (m, v) in state.items():
            self._write(self.moments[k][0], m)
            self._write(self.moments[k][1], v)

    def _record_optimizer(self, rec, hp, step, norm_at):
        rec.section("optimizer (grad norm, AdamW)")
        slot = 0
        for (_, grad, _, _, n), slots in zip(self._groups, self._norm_slots):
            K.grad_norm_partial(rec, self.partials, slot, grad, n)
            slot += slots
        K.grad_norm_finalize(rec, norm_at, self.partials, slot, hp.max_grad_norm or 0.0)
        for (param, grad, m, v, n), is_b in zip(self._groups, self._b_groups):
            lr = hp.lr * hp.lora_b_lr_ratio if is_b else hp.lr
            K.adamw_update(rec, param, grad, m, v, n, lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step,
                           scale_buf=norm_at)

