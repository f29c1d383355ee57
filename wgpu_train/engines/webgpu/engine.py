"""The WebGPU engine: persistent weights, activations per (batch, length) bucket, and a whole
optimizer step (forward, loss, backward, clipping, AdamW) recorded into one command encoder. It owns its parts
as objects, each told the state it reads: the buckets (buffers.py), the layer recording (layers.py), DoRA's
norms (dora.py), the dropout seeds (dropout_seeds.py), the optimizer (optimizer.py), the steps (steps.py),
KV-cache generation (kv_cache.py) and Gemma 3's images (images.py). (Over 450 lines: the engine protocol's methods,
each a few lines handing its work to a part.)"""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import EXPERT_PARAMETERS, ModelConfig
from wgpu_train.engines.protocol import EngineState, LossScaler, OptimizerParams, Precision, check_precision_widths
from wgpu_train.engines.shared.moe import check_router_aux_loss
from wgpu_train.errors import ConfigError
from wgpu_train.models.weights import is_buffer, module_path
from wgpu_train.models.layer_plan import layer_plans
from wgpu_train.models.weights import module_name
from wgpu_train.adapters.experts import is_expert_path
from wgpu_train.engines.webgpu.device import storage
from wgpu_train.engines.webgpu.memory import layer_ranks, lora_groups
from wgpu_train.engines.shared.kv_dtype import KvDtype, check_kv_dtype
from wgpu_train.engines.shared.image_tokens import TowerImages
from wgpu_train.engines.shared.kv_rows import forward_cached
from wgpu_train.engines.shared.parts import part_field
from wgpu_train.engines.shared.quant import check_dtypes, kept_packed
from wgpu_train.adapters.saved_modules import EMBED, HEAD
from wgpu_train.engines.webgpu.tuned.quant import QuantMatrix
from wgpu_train.engines.webgpu.tuned.moe_packed import packed_format, packed_read
from wgpu_train.engines.webgpu.device.recorder import count_submissions, submit
from wgpu_train.engines.webgpu.device.runtime import Runtime
from wgpu_train.engines.webgpu.tensors import Packed, read_tensor, store_weight, weight_buffers, write_tensor
from wgpu_train.engines.webgpu.buffers import Activations, BucketCache, GpuExpertLora, GpuLora
from wgpu_train.engines.webgpu.dora import DoraNorms
from wgpu_train.engines.webgpu.dropout_seeds import DropoutSeeds
from wgpu_train.engines.webgpu.images import ImageInputs
from wgpu_train.engines.webgpu.kv_cache import KvCacheGeneration
from wgpu_train.engines.webgpu.layers import LayerRecorder
from wgpu_train.engines.webgpu.optimizer import Optimizer
from wgpu_train.engines.webgpu.support import unsupported_reason
from wgpu_train.engines.webgpu.steps import StepRunner
from wgpu_train.adapters.dora import MAGNITUDE, split_entry


class WgpuEngine(EngineState):
    """The engine protocol of numpy.engine.NumpyEngine, on a WebGPU device."""

    name = "wgpu"
    backend_reason = "as given"
    precision_reason = "as given"

    def __init__(self, cfg: ModelConfig, weights: dict, rt: Runtime, base_dtype: str = "float32",
                 embed_dtype: str = "auto", kv_dtype: KvDtype | str = KvDtype.FLOAT32, precision: Precision | str = Precision.FP32,
                 span: range | None = None, first: bool = True, last: bool = True):
        """precision (protocol.PRECISIONS): fp32, or bf16 / f16 where the activations and their gradients are
        16-bit buffers (memory.activation_format) and the kernels round where they store them, as
        engines/numpy/precision.py does; f16 adds dynamic loss scaling. span, first, last: a pipeline stage's
        layers, and whether it holds the embedding and the final norm and head (webgpu/stage.py); by default
        the whole model, whose weights are every one of `weights`."""
        reason = unsupported_reason(cfg)
        if reason:
            raise ConfigError(f"{cfg.label}: {reason}; use --backend numpy")
        kv_dtype = check_kv_dtype(kv_dtype, cfg)
        precision = Precision.parse(precision)
        if not precision.resolved:
            raise ValueError("WgpuEngine takes a resolved precision (engines/loading.py resolves auto)")
        check_precision_widths(precision, cfg)
        self.precision = precision
        self.loss_scaler = LossScaler() if precision.loss_scaling else None
        self.cfg, self.rt = cfg, rt
        self.dtype = np.dtype(np.float32)
        self.kv_dtype = kv_dtype      # generation's KV cache storage (new_kv_cache)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype,
                                                                                   cfg.checkpoint_dtype)
        self.w: dict = {}          # HF name -> Matrix or QuantMatrix (2-D) or buffer (1-D)
        self.shapes: dict = {}
        for name in weights:       # one tensor at a time: `weights` may convert each as it is read
            packed = kept_packed(weights, name, base_dtype)     # a checkpoint's MXFP4 experts, uploaded as stored
            arr = weights[name] if packed is None else packed
            self.shapes[name] = tuple(arr.shape)
            self.w[name] = store_weight(rt, name, arr, base_dtype, embed_dtype)
        # GPU bytes of the base weights as allocated (memory.base_weight_bytes predicts the same)
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))
        # [long][layer] (R/2,): RoPE's frequencies (longrope: its short and long sets), one buffer per
        # distinct set (Gemma: local and global layers)
        uploaded: dict = {}
        inv_freqs = []
        for long in (False, True):
            freqs = [cfg.inv_freq(i, long).astype(np.float32) for i in range(cfg.num_hidden_layers)]
            for f in freqs:
                if f.tobytes() not in uploaded:
                    uploaded[f.tobytes()] = rt.upload(f, "inv_freq")
            inv_freqs.append([uploaded[f.tobytes()] for f in freqs])
        self.lora: dict[str, GpuLora] = {}
        self.expert_lora: dict[str, GpuExpertLora] = {}    # LoRA pairs on MoE experts (set_lora)
        self._group_of: dict = {}  # module name -> its LoRA group (set_lora)
        self.trained: tuple = ()   # base weights trained (full fine-tuning: all; modules_to_save: some)
        self._lora_packed = None
        self.gradient_checkpointing = False
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0,
                         "buckets_allocated": 0, "policy_forwards": 0, "reference_forwards": 0}
        step_buf = rt.buffer(64, "step_scalars")       # [grad_scale]
        # the parts
        self.buckets = BucketCache(rt, cfg, precision, self.counters, span, first, last)
        self.dora = DoraNorms(rt, self.w)
        self.dropout = DropoutSeeds(rt, cfg.num_hidden_layers * len(cfg.linear_modules))
        self.optimizer = Optimizer(rt)
        self.layers = LayerRecorder(cfg, layer_plans(cfg), self.w, inv_freqs, self.dora, self.dropout, step_buf,
                                    self.counters, span, first, last)
        self.steps = StepRunner(rt, cfg, precision, self.buckets, self.layers, self.dropout, self.optimizer,
                                self.dora, step_buf, self.counters)
        self.kv = KvCacheGeneration(rt, cfg, kv_dtype, self.buckets, self.layers, self.counters)
        self.buckets.images = self.image_inputs = ImageInputs(rt, cfg.hidden_size)

    # ---- what the parts keep, as the protocol names it ----------------------------------------
    dropout_seed = part_field("dropout", "seed", "The run's dropout seed (seed_dropout).")
    dropout_calls = part_field("dropout", "calls", "Micro-batches trained so far: the next one's dropout masks.")
    plan = part_field("layers", "plan", "The layer plan the layers walk (a test may give the engine a variant).")

    @property
    def step_logps(self) -> list:
        """The last train_step's log-probabilities of its TokenObjective micro-batches."""
        return self.steps.step_logps

    @property
    def step_entropies(self) -> list:
        """And the entropies of its policy's distributions there."""
        return self.steps.step_entropies

    @property
    def last_step(self) -> dict:
        return self.steps.last_step

    @property
    def last_profile(self) -> dict:
        return self.steps.last_profile

    @property
    def last_timing(self) -> dict:
        return self.steps.last_timing

    @property
    def adapter_enabled(self) -> bool:
        return self.layers.adapter_enabled

    @property
    def loss_temperature(self) -> float:
        return self.layers.loss_temperature

    def _activations(self, b, t, train=True, keep=()) -> Activations:
        """A bucket of the engine's BucketCache set to b x t tokens (BucketCache.activations)."""
        return self.buckets.activations(b, t, train, keep)

    # ---- parameters ---------------------------------------------------------------------------
    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout[, DoRA magnitude]) (dora.split_entry); replaces every LoRA
        module and resets the optimizer.

        All LoRA tensors live in one packed buffer (their gradients and AdamW moments in three more),
        so zeroing, the gradient norm and AdamW take a dispatch per buffer rather than per tensor: every A,
        then every B, then DoRA's magnitudes (with B's learning rate under LoRA+, as PEFT groups them)."""
        self._release_acts()
        if self._lora_packed:
            self.rt.release(self._lora_packed[0].buf, self._lora_packed[1].buf)
        self.lora, self.expert_lora, self._lora_packed = self._upload_lora(modules)
        self.dora.setup(self.lora)
        self._group_of = self._lora_groups(self.lora)
        self.buckets.set_adapter(self.lora, self._group_of, self.expert_lora)
        self.layers.set_adapter(self.lora, self._group_of, self.expert_lora)
        self._reset_training_state()

    def _upload_lora(self, modules: dict) -> tuple:
        """set_lora's modules packed and uploaded: (path -> GpuLora, expert tensor path -> GpuExpertLora (A
        (E, r, in), B (E, out, r)), (packed parameters, packed gradients))."""
        modules = {p: split_entry(e) for p, e in modules.items()}
        # every A first, layer by layer in module order (a layer's experts last), so that the A matrices of a
        # group lie back to back
        order = sorted(modules, key=self._packing_order)
        shapes = {p + ".lora_A": modules[p][0].shape for p in order}
        shapes.update({p + ".lora_B": modules[p][1].shape for p in order})
        shapes.update({f"{p}.{MAGNITUDE}": (modules[p][1].shape[0],) for p in order if modules[p][4] is not None})
        lora, experts = {}, {}
        params, grads = Packed(self.rt, shapes, "lora_params"), Packed(self.rt, shapes, "lora_grads")
        for path, (a, b, s, d, mag) in modules.items():
            layer, module = int(path.split(".")[2]), module_name(path)
            na, nb, nm = path + ".lora_A", path + ".lora_B", f"{path}.{MAGNITUDE}"
            self._write(params.view(na), a)
            self._write(params.view(nb), b)
            if is_expert_path(path):       # adapters/config.py refuses dropout and DoRA on experts
                experts[path] = GpuExpertLora(path, params.view(na), params.view(nb), grads.view(na), grads.view(nb),
                                              a.shape, b.shape, s)
                continue
            lora[path] = GpuLora(path, params.view(na), params.view(nb), grads.view(na), grads.view(nb),
                                 a.shape, b.shape, s, d, self.cfg.module_id(layer, module))
            if mag is not None:
                self._write(params.view(nm), mag)
                lora[path].m, lora[path].gm = params.view(nm), grads.view(nm)
        return lora, experts, (params, grads)

    def _packing_order(self, path: str) -> tuple:
        """(layer, the module's place among the layer's modules, its experts after them) of a LoRA path."""
        layer = int(path.split(".")[2])
        if is_expert_path(path):
            return layer, len(self.cfg.linear_modules) + EXPERT_PARAMETERS.index(path.rsplit(".", 1)[1])
        return layer, self.cfg.linear_modules.index(module_name(path))

    def _lora_groups(self, lora: dict) -> dict:
        """module name -> the modules of `lora` (path -> GpuLora) that run their LoRA as one (memory.lora_groups'
        rule: the same for the memory estimate), each group's A matrices back to back in every layer with LoRA
        on it."""
        ranks = layer_ranks({p: m.r for p, m in lora.items()})
        # DoRA scales each module's dy by its own c: no shared LoRA backward
        alone = any(m.dropout > 0 or m.m is not None for m in lora.values()) or self.precision.sixteen_bit
        out = {}
        for module, members in lora_groups(self.cfg, ranks, alone).items():
            # lora_groups: every member has LoRA in the same layers
            mods = [[lora[module_path(i, m)] for m in members] for i in sorted(ranks[module])]
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
        frozen = sorted(k for k in self.w if self._stored_as(k) != "float32")
        if enabled and frozen:
            raise ConfigError(f"full fine-tuning needs float32 weights, but {frozen[0]} is stored as "
                              f"{self._stored_as(frozen[0])}; use LoRA or load the model with float32")
        self.set_trained_base(tuple(n for n in self.w if not is_buffer(n)) if enabled else ())   # expert_bias

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
            if self._stored_as(name) != "float32":
                arr = self._weight(name)
                self.rt.release(*weight_buffers(self.w[name]))
                self.w[name] = store_weight(self.rt, name, arr, "float32", "float32")
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))
        self.trained = tuple(names)
        self._release_acts()
        self._reset_training_state()

    def set_adapter_enabled(self, enabled: bool = True):
        """Switch every LoRA module off (False: forwards are the base model's, PEFT's disable_adapter) or on."""
        self.layers.adapter_enabled = bool(enabled)

    last_aux_loss = part_field("steps", "last_aux_loss", "The last train_step's router aux loss (the mean over its "
                               "micro-batches; None when off).")

    def set_router_aux_loss(self, coef: float = 0.0):
        """A mixture of experts' router auxiliary loss (transformers' load_balancing_loss_func over each training
        forward's real tokens) added at weight `coef` to training steps, its gradient reaching the routers' logits,
        all on the device within the step's submission (webgpu/moe.load_balancing_counts); 0 turns it off."""
        self.steps.router_aux_loss_coef = check_router_aux_loss(self.cfg, coef)

    def set_loss_temperature(self, temperature: float = 1.0):
        """The loss head of training steps and token_losses scores logits / temperature (GRPO's log-probabilities
        at its sampling temperature, as TRL takes them); loss() and generation keep the model's own."""
        self.layers.loss_temperature = float(temperature)

    def set_gradient_checkpointing(self, on: bool = True):
        """Gradient (activation) checkpointing of training steps: each layer keeps only its input, and the
        backward recomputes the layer's forward (the same kernels on the same inputs, LoRA dropout masks
        included, so the gradients are bit-identical) before its backward. Activation memory drops from
        every layer's buffers to one layer's plus every layer's input, for about one more forward per step.
        Evaluation and generation are unaffected."""
        if bool(on) != self.gradient_checkpointing:
            self.gradient_checkpointing = bool(on)
            self.buckets.set_checkpointing(self.gradient_checkpointing)

    def _reset_training_state(self):
        """Gradients and zeroed AdamW moments of the trainable tensors (the optimizer's reset), told to the layers."""
        self.optimizer.reset(self._lora_packed, self.trained, self.w)
        self.layers.set_grads(self.optimizer.grads)

    def _release_acts(self):
        self.buckets.release()

    def _read(self, t, shape):
        return read_tensor(self.rt, t, shape)

    def _write(self, t, arr):
        write_tensor(self.rt, t, arr)

    def _shape_of(self, name):
        return self.shapes[name] if name in self.trained else self._lora_packed[0].shapes[name]

    def trainable(self) -> dict:
        """Trainable arrays by name ('path.lora_A' / 'path.lora_B', or weight names), read back (copies)."""
        return {k: self._read(t, self._shape_of(k)) for k, t in self.optimizer.params.items()}

    def set_trainable(self, arrays: dict):
        for k, arr in arrays.items():
            self._write(self.optimizer.params[k], arr)
        self.dora.stale = True

    def lora_tensors(self) -> dict:
        out = {p: (self._read(m.a, (m.r, m.in_f)), self._read(m.b, (m.out_f, m.r))) for p, m in self.lora.items()}
        out.update({p: (self._read(m.a, (m.experts, m.rank, m.in_f)), self._read(m.b, (m.experts, m.out_f, m.rank)))
                    for p, m in self.expert_lora.items()})
        return out

    def weights(self) -> dict:
        """Base weights as float32 (float16 / NF4 ones dequantised)."""
        return {k: self._weight(k) for k in self.w}

    def _weight(self, name) -> np.ndarray:
        """One base weight as float32 (dequantised)."""
        t = self.w[name]
        if isinstance(t, QuantMatrix):
            return t.read(self.rt)
        if len(self.shapes[name]) == 3:      # an MoE layer's experts, in their storage format or packed
            if packed_format(t) is not None:
                return packed_read(self.rt, t, self.shapes[name])
            return storage.read(self.rt, t, int(np.prod(self.shapes[name]))).reshape(self.shapes[name])
        return self._read(t, self.shapes[name])

    def _stored_as(self, name) -> str:
        """The storage dtype of base weight `name`: a QuantMatrix's, an expert tensor's format, else float32."""
        t = self.w[name]
        if isinstance(t, QuantMatrix):
            return str(t.dtype)
        if len(self.shapes[name]) == 3:
            packed = packed_format(t)     # NF4 (the base dtype's, nf4 or nf4-dq) or MXFP4 (as the checkpoint's)
            if packed is not None:
                return "mxfp4" if packed[0] == "mxfp4" else str(self.base_dtype)
            return {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[storage.format_of(t)]
        return "float32"

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
        self.dora.weight_norms()
        self.base_weight_bytes = sum(b.size for t in self.w.values() for b in weight_buffers(t))

    def zero_grads(self):
        rec = self.rt.recorder()
        self.optimizer.record_zero_grads(rec)
        submit(self.rt, self.counters, rec)

    def gradients(self) -> dict:
        return self.optimizer.gradients(self._shape_of)

    def apply_update(self, norm, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                     lora_b_lr_ratio=1.0):
        """train_step's clipping and AdamW kernels on the gradients accumulated so far, their global norm given (a
        pipeline stage's: every stage's; the vision tower's LoRA step: the language model's and the tower's), in a
        submission of their own; a non-finite norm skips the update. (norm, applied)."""
        applied = bool(np.isfinite(norm))
        if applied:
            rec, hp = self.rt.recorder(), OptimizerParams(lr, beta1, beta2, eps, weight_decay, max_grad_norm,
                                                          lora_b_lr_ratio)
            self.optimizer.record_given_norm(rec, norm, hp, step, (self.steps.results, 0))
            submit(self.rt, self.counters, rec)
            self.dora.stale = True          # A and B moved: the next forward recomputes DoRA's norms
        else:
            self.counters["nonfinite_skipped"] += 1
        return norm, applied

    def reduce_gradients(self, reduce, total: int):
        """The gradients so far through a data-parallel `reduce` (train_step's), its result kept
        (StepRunner.reduce_gradients): the vision tower's LoRA step reduces the language model's with it."""
        before = dict(self.rt.counters)
        self.steps.reduce_gradients(self.rt.recorder(), reduce, total, False)
        count_submissions(self.rt, self.counters, before)

    def optimizer_state(self) -> dict:
        return self.optimizer.state(self._shape_of)

    def load_optimizer_state(self, state: dict):
        self.optimizer.load_state(state)

    # ---- the steps (steps.StepRunner) ---------------------------------------------------------
    def logits(self, ids, segment_ids, position_ids):
        """(B, T, V) float32 logits of a batch, the adapter as it is."""
        return self.steps.logits(ids, segment_ids, position_ids)

    def loss(self, ids, targets, segment_ids, position_ids):
        """(loss_sum, trained tokens) of a batch, no gradient."""
        return self.steps.loss(ids, targets, segment_ids, position_ids)

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """Each position's loss (B, T) (StepRunner.token_losses); with reference, (the policy's, the reference's)."""
        return self.steps.token_losses(ids, targets, segment_ids, position_ids, reference)

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch (StepRunner.forward_backward); (loss_sum, count)."""
        return self.steps.forward_backward(ids, targets, segment_ids, position_ids, grad_scale)

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """One optimizer step over micro-batches in one submission (StepRunner.train_step);
        (loss_sum, token_count, grad_norm, applied)."""
        return self.steps.train_step(micro_batches, hp, step, profile, reduce, self.loss_scaler)

    # ---- images (images.ImageInputs) -----------------------------------------------------------
    def set_images(self, images):
        """The forwards that follow take these images (a shared/image_tokens.ImageTokens; TowerImages: their
        host(), the vision tower's embeddings computed now), or none (None): each batch uploads their embeddings
        and blocks (a train_step's micro-batch may end with its own instead)."""
        if isinstance(images, TowerImages):
            images = images.host()
        self.image_inputs.tokens = images

    def set_vision_tower(self, tower):
        """The vision tower (webgpu/vision_tower.GpuVisionTower, or None) that runs micro-batches ending with
        TowerImages inside train_step's recording, its LoRA (when set) trained by the engine's optimizer with the
        engine's own: call again after the tower's set_lora."""
        self.steps.tower = tower
        self.optimizer.set_tower(*((tower.params, tower.grads) if tower is not None else (None, None)))

    def tower_optimizer_state(self) -> dict:
        """The vision tower's LoRA AdamW moments by name: (m, v)."""
        return self.optimizer.tower_state()

    def load_tower_optimizer_state(self, state: dict):
        self.optimizer.load_tower_state(state)

    @property
    def image_grad(self):
        """The image rows' gradient (n, C) float32 of the last backward with images (for the vision tower's
        backward), read back from the device now; None before one."""
        before = dict(self.rt.counters)
        grad = self.image_inputs.read_grad(self.layers.image_grad_source)
        count_submissions(self.rt, self.counters, before)
        return grad

    @property
    def deepstack_grad(self) -> dict:
        """{layer k: the gradient (n, C) float32 of the DeepStack features added to layer k's output} of the last
        backward with images (Qwen3-VL's, for the tower's LoRA), read back now; {} before one."""
        before = dict(self.rt.counters)
        grads = self.image_inputs.read_deepstack_grad(self.layers.image_grad_source)
        count_submissions(self.rt, self.counters, before)
        return grads

    # ---- generation (kv_cache.KvCacheGeneration) ----------------------------------------------
    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows of up to max_len positions (KvCacheGeneration.new_kv_cache)."""
        return self.kv.new_kv_cache(batch, max_len)

    def free_kv_cache(self, kv: dict):
        self.kv.free_kv_cache(kv)

    def forward_cached(self, ids, kv: dict) -> np.ndarray:
        """New tokens ids (B, Tq) of every row after the kv["len"] cached ones -> logits (B, V) of each row's last."""
        return forward_cached(self, ids, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """n new tokens, each with its own cache row and position (and adapter out of the bank: adapters, or
        None) -> logits (m, V) of the tokens at indices last (KvCacheGeneration.forward_rows)."""
        return self.kv.forward_rows(ids, rows, positions, kv, last, long_rope, adapters)

    def set_adapter_bank(self, bank: dict | None):
        """The adapters forward_rows(adapters=) picks per row (KvCacheGeneration.set_adapter_bank)."""
        self.kv.set_adapter_bank(bank)
