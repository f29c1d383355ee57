"""The NumPy engine: model forward and backward composed from engines/numpy/ops.py, gradients of LoRA and of
trained base weights (full fine-tuning, modules_to_save), AdamW. The oracle that the GPU engine is tested against.
It owns its parts as objects, each given the state it reads: its mode (walk.Mode), the optimizer (optim.py), the
layer walk's ops (layers.py), DoRA's linear (dora_linear.py), the steps (steps.py) and KV-cache generation
(kv_cache.py). (Over 450 lines: the Engine protocol's whole surface in one class, most methods one-line
delegations to the part that owns them.)"""
from __future__ import annotations

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.adapters.dora import MAGNITUDE, split_entry
from wgpu_train.engines.protocol import EngineState, LossScaler
from wgpu_train.models.weights import is_buffer, module_path
from wgpu_train.models.layer_plan import OUTPUT, layer_plans
from wgpu_train.adapters.saved_modules import EMBED, HEAD
from wgpu_train.engines.numpy import ops
from wgpu_train.engines.numpy.dora_linear import DoraLinear
from wgpu_train.engines.numpy.kv_cache import KvCacheGeneration
from wgpu_train.engines.numpy.layers import LayerOps
from wgpu_train.engines.numpy.optim import Optimizer
from wgpu_train.engines.numpy.walk import Mode, Walk
from wgpu_train.engines.numpy.precision import Rounding
from wgpu_train.engines.numpy.steps import StepRunner
from wgpu_train.engines.numpy.tower_step import TowerStep
from wgpu_train.engines.shared.image_tokens import TowerImages
from wgpu_train.engines.shared.kv_dtype import KvDtype, check_kv_dtype
from wgpu_train.engines.shared.kv_rows import forward_cached
from wgpu_train.engines.shared.mixed_lora import mixed_lora_forward
from wgpu_train.engines.shared.moe import RouterLoss, check_router_aux_loss
from wgpu_train.engines.shared.parts import part_field
from wgpu_train.engines.shared.quant import check_dtypes, round_weights


class LoraModule:
    """One LoRA pair on a linear module: A (r, in), B (out, r), its dropout, and with DoRA its magnitude m (out,)
    (None: plain LoRA)."""

    def __init__(self, a, b, scale, dropout, m=None):
        self.a, self.b, self.scale, self.dropout, self.m = a, b, scale, dropout, m


class NumpyEngine(EngineState):
    """Forward and backward of a Llama-family model on the CPU in float32 (or float64).

    base_dtype / embed_dtype (quant.BASE_DTYPES / quant.EMBED_DTYPES): the base weights are rounded through that
    storage at load (engines/shared/quant.py) and kept dequantised (MXFP4 experts packed: quant.kept_packed), so
    the math equals the GPU engine's, which stores them in that format, up to summation order.

    precision (protocol.PRECISIONS): fp32, or bf16 / f16, where activations, saved tensors and activation
    gradients are rounded where the GPU stores them (precision.Rounding); f16 adds dynamic loss scaling
    (protocol.LossScaler) to train_step. kv_dtype (shared/kv_dtype.KvDtype): generation's KV cache rounds its
    keys and values to it where the GPU's cache stores them."""

    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=np.float32, base_dtype: str = "float32",
                 embed_dtype: str = "auto", precision: str = "fp32", kv_dtype: KvDtype | str = KvDtype.FLOAT32):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.base_dtype, self.embed_dtype = base_dtype, embed_dtype = check_dtypes(base_dtype, embed_dtype,
                                                                                   cfg.checkpoint_dtype)
        self.w = round_weights(weights, base_dtype, embed_dtype, self.dtype)
        # [long][layer] (R/2,): RoPE's frequencies, longrope's short and long sets (the same without longrope)
        inv_freqs = [[cfg.inv_freq(i, long) for i in range(cfg.num_hidden_layers)] for long in (False, True)]
        plans = layer_plans(cfg)
        self.rounding = Rounding(precision, set().union(*(plan.statistics for plan in plans)))
        self.precision, self.precision_reason = self.rounding.precision, "as given"
        self.backend_reason = "as given"
        self.kv_dtype = kv_dtype = check_kv_dtype(kv_dtype, cfg)   # generation's KV cache storage (new_kv_cache)
        self.lora: dict[str, LoraModule] = {}
        self.trained: tuple = ()     # base weights trained (full fine-tuning: all; modules_to_save: some)
        self.gradient_checkpointing = False
        self.images = self.image_grad = None     # set_images; the image rows' gradient of the last backward
        self.deepstack_grad: dict = {}            # {layer: its DeepStack features' gradient} of the last backward
        self.counters = {"submits": 0, "readbacks": 0, "bytes_uploaded": 0, "bytes_read": 0, "nonfinite_skipped": 0,
                         "policy_forwards": 0, "reference_forwards": 0}
        self.base_weight_bytes = 0   # no device copy
        self.max_binding = None
        self.device_description = "cpu (NumPy)"
        # the parts
        self.mode = Mode()
        self.optimizer = Optimizer(self.trainable, self.dtype, self.counters)
        self.steps = StepRunner(cfg, self.mode, self.optimizer, LossScaler() if self.precision.loss_scaling else None,
                                self.counters, self.forward, self.backward, self.set_images)
        self.steps.image_grad = lambda: (self.image_grad, self.deepstack_grad)
        self.dora = DoraLinear(self.w, self.dtype)
        self.layer_ops = LayerOps(cfg, plans, self.w, self.dtype, inv_freqs, self.rounding, self._linear,
                                  self._linear_backward, self.optimizer.add, lambda name: name in self.grads,
                                  lambda path: self.lora.get(path) if self.adapter_enabled else None)
        self.kv = KvCacheGeneration(cfg, self.dtype, kv_dtype, self.mode, self._embed, self.layer_ops.forward,
                                    self._generation_head, lambda: self.images)

    # ---- what the parts keep, as the protocol names it ----------------------------------------
    plan = part_field("layer_ops", "plan", "The layer plan the layers walk (a test may give the engine a variant).")
    training = part_field("mode", "training", "Whether the forward runs dropout on the LoRA inputs (a training "
                                               "micro-batch's).")
    dropout_seed = part_field("mode", "dropout_seed", "The run's dropout seed (seed_dropout).")
    dropout_calls = part_field("mode", "dropout_calls", "Micro-batches trained so far: the next one's dropout masks.")
    loss_scaler = part_field("steps", "loss_scaler", "f16's dynamic loss scaling (the steps'), or None.")
    last_aux_loss = part_field("steps", "last_aux_loss", "The last train_step's router aux loss (the mean over its "
                                                         "micro-batches), or None without one.")

    @property
    def adapter_enabled(self) -> bool:
        """False: forwards skip every LoRA module (a preference objective's reference)."""
        return self.mode.adapter_enabled

    @property
    def loss_temperature(self) -> float:
        """set_loss_temperature's."""
        return self.mode.loss_temperature

    @property
    def grads(self) -> dict:
        """The trainable tensors' gradients by name (the optimizer's)."""
        return self.optimizer.grads

    @property
    def step_logps(self) -> list:
        """The last train_step's log-probabilities of its TokenObjective micro-batches."""
        return self.steps.step_logps

    @property
    def step_entropies(self) -> list:
        """And the entropies of its policy's distributions there."""
        return self.steps.step_entropies

    @property
    def last_profile(self) -> dict:
        return self.steps.last_profile

    # ---- parameters ---------------------------------------------------------------------------
    def lm_head(self):
        return self.w[self._head_name()]

    def _head_name(self) -> str:
        """The head's weight: lm_head's, or a tied model's embedding unless set_trained_base untied them."""
        return HEAD if HEAD in self.w else EMBED

    def set_lora(self, modules: dict):
        """modules: path -> (A, B, scale, dropout[, magnitude]) (dora.split_entry). Replaces every LoRA module
        and resets the optimizer."""
        self.lora = self._lora_modules(modules)
        self.optimizer.reset()

    def _lora_modules(self, modules: dict) -> dict:
        """set_lora's modules as LoraModules in this engine's dtype."""
        out = {}
        for p, entry in modules.items():
            a, b, s, d, m = split_entry(entry)
            out[p] = LoraModule(a.astype(self.dtype), b.astype(self.dtype), s, d,
                                None if m is None else np.array(m, dtype=self.dtype))
        return out

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
        self.set_trained_base(tuple(n for n in self.w if not is_buffer(n)) if enabled else ())

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
        self.optimizer.reset()

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
        self.optimizer.zero_grads()

    def weights(self) -> dict:
        return self.w

    # ---- forward ------------------------------------------------------------------------------
    def set_adapter_enabled(self, enabled: bool = True):
        """Switch every LoRA module off (False: forwards are the base model's, PEFT's disable_adapter) or on."""
        self.mode.adapter_enabled = bool(enabled)

    def _linear(self, x, layer, module, cache, residual=None):
        """Base linear plus LoRA (with dropout on the LoRA input while training), added to residual (N, out) if
        given; x (N, in) -> (N, out). In 16 bits the base output (with the residual) is stored before the LoRA term
        is added, as the GPU does (then the op's output is rounded again), as PEFT under autocast rounds it."""
        path = module_path(layer, module)
        lora = self.lora.get(path) if self.adapter_enabled else None
        if lora is not None and lora.m is not None:
            y, cache[module] = self.dora.forward(x, path, lora, *self._dropout_input(x, layer, module, lora))
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
            bank = self.kv.adapter_bank
            if self.kv.bank_rows is not None and path in bank:     # a server's rows of mixed adapters
                y = self.rounding.activation(y, f"layer {layer} ({module})") + \
                    mixed_lora_forward(x, bank[path], self.kv.bank_rows)
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
            dx, da, db, dm = self.dora.backward(dy, path, lora, cache[module])
            self.grads[path + ".lora_A"] += da
            self.grads[path + ".lora_B"] += db
            self.grads[f"{path}.{MAGNITUDE}"] += dm
            return dx, None
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

    def set_images(self, images):
        """The forwards that follow take these images (a shared/image_tokens.ImageTokens; TowerImages: the vision
        tower's embeddings of them, computed now: their host()), or none (None)."""
        if isinstance(images, TowerImages):
            images = images.host()
        self.images = images and images.rounded(lambda x: self.rounding.activation(x.astype(self.dtype), "images"))

    def set_vision_tower(self, tower):
        """The vision tower (engines/numpy/vision_tower.VisionTower or qwen3_vl_tower.Qwen3VLTower, or None) that
        runs micro-batches ending with TowerImages inside train_step, its LoRA (its `lora` arrays) trained with the
        engine's LoRA (tower_step.TowerStep): a new optimizer state, zeroed moments."""
        self.steps.tower = TowerStep(tower, self.dtype) if tower is not None else None

    def tower_optimizer_state(self) -> dict:
        """The vision tower's LoRA AdamW moments by name: (m, v)."""
        return self.steps.tower.optimizer.state()

    def load_tower_optimizer_state(self, state: dict):
        self.steps.tower.optimizer.load_state(state)

    def forward(self, ids, segment_ids, position_ids):
        """ids (B, T) -> logits (B, T, V) and the cache the backward needs."""
        b, t = ids.shape
        cache = {"ids": ids.reshape(-1), "walk": self._walk(segment_ids, position_ids)}
        x = self._embed(cache["ids"])
        if self.images is not None:         # the projector's embeddings in place of the placeholders'
            x[self.images.flat] = self.images.embeds
        x = self._layers_forward(x, range(self.cfg.num_hidden_layers), cache)
        return self._head_forward(x, cache).reshape(b, t, -1), cache

    def _walk(self, segment_ids, position_ids) -> Walk:
        b, t = segment_ids.shape
        weight, im = self.mode.router_loss_weight if self.mode.training else 0.0, self.images    # im: ImageTokens
        return Walk(b, t, position_ids, segment_ids, long_rope=self.cfg.rope_long(int(np.max(position_ids))),
                    router_loss=RouterLoss(self.cfg.moe.num_experts, weight) if weight else None,
                    blocks=im and im.blocks, rope_positions=im and im.positions)

    def _layers_forward(self, x, layers: range, cache: dict):
        """The layers' forward from the first one's input x (N, C) to the last one's output (N, C); each layer's
        activations are kept for the backward in cache["layers"], in the range's order."""
        cache["layers"] = []
        for i in layers:
            a = self.layer_ops.forward(i, x, cache["walk"])
            x = a.pop(OUTPUT) if self.images is None else self.images.add_deepstack(a.pop(OUTPUT), i)   # Qwen3-VL's
            cache["layers"].append(a)
        return x

    def _head_forward(self, x, cache: dict):
        """The final norm and the head from the last layer's output x (N, C): logits (N, V) (soft-capped)."""
        xf, rstd_f = ops.rmsnorm_forward(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps, self.cfg.norm_offset)
        xf = self.rounding.activation(xf, "the final norm")                      # the loss head's input
        cache.update(x_final=x, rstd_f=rstd_f, xf=xf)
        return ops.softcap_forward(ops.linear_forward(xf, self.lm_head()), self.cfg.logit_softcap)   # (N, V)

    def _generation_head(self, x):
        """The final norm and the head of generation's last tokens x (m, C): logits (m, V) float32."""
        xf, _ = ops.rmsnorm_forward(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps, self.cfg.norm_offset)
        xf = self.rounding.activation(xf, "the final norm")
        return ops.softcap_forward(ops.linear_forward(xf, self.lm_head()), self.cfg.logit_softcap).astype(np.float32)

    def _embed(self, ids):
        """The embedding rows of ids (N,), times the model's embed_scale (Gemma)."""
        x = ops.embedding_forward(ids, self.w["model.embed_tokens.weight"])        # (N, C)
        if self.cfg.embed_scale != 1.0:     # the rows are stored, then scaled where they lie (as on the GPU)
            x = self.rounding.activation(x, "the embedding") * self.dtype.type(self.cfg.embed_scale)
        return self.rounding.activation(x, "the embedding")

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
        self.optimizer.add(head_name, dhead)
        dx, dnorm = ops.rmsnorm_backward(self.rounding.gradient(dxf), cache["x_final"], self.w["model.norm.weight"],
                                         cache["rstd_f"], self.cfg.norm_offset)
        self.optimizer.add("model.norm.weight", dnorm)
        return self.rounding.gradient(dx)

    def _layers_backward(self, dx, layers: range, cache: dict):
        """The layers' backward, last first, from the last one's output gradient dx (N, C): the first one's input
        gradient (N, C)."""
        self.deepstack_grad = {}
        for i in reversed(layers):
            if self.images is not None and i < len(self.images.deepstack):    # Qwen3-VL's DeepStack features' rows
                self.deepstack_grad[i] = dx[self.images.flat]
            dx = self.layer_ops.backward(i, cache["layers"][i - layers.start], dx, cache["walk"])
        return dx

    def _embed_backward(self, dx, ids):
        """The embedding's gradient from its output's dx (N, C), where the embedding trains."""
        cfg = self.cfg
        if self.images is not None:     # the image rows' gradient goes to the vision tower, none to an embedding row
            self.image_grad, dx = dx[self.images.flat], np.where(self.images.flat[:, None], 0, dx)
        if EMBED in self.grads:
            dx = dx * self.dtype.type(cfg.embed_scale) if cfg.embed_scale != 1.0 else dx
            demb = ops.embedding_backward(dx, ids, cfg.vocab_size)       # (V, C)
            if cfg.pad_token_id is not None:      # torch's padding_idx: the padding row gets no gradient
                demb[cfg.pad_token_id] = 0
            self.grads[EMBED] += demb

    # ---- the protocol's steps (steps.StepRunner, optim.Optimizer) ----------------------------
    def logits(self, ids, segment_ids, position_ids):
        return self.steps.logits(ids, segment_ids, position_ids)

    def forward_backward(self, ids, targets, segment_ids, position_ids, grad_scale):
        """Forward, loss and backward of one micro-batch; grads accumulate scaled by grad_scale per token (one
        number, or a weight per token (B, T)). Returns (loss_sum, token_count) (the loss unweighted)."""
        return self.steps.forward_backward(ids, targets, segment_ids, position_ids, grad_scale)

    def loss(self, ids, targets, segment_ids, position_ids):
        return self.steps.loss(ids, targets, segment_ids, position_ids)

    def token_losses(self, ids, targets, segment_ids, position_ids, reference=False):
        """(B, T) float32: each position's loss, minus the log-probability of its target (0 where ignored); with
        reference, (the policy's, the reference's): a second forward with the adapter switched off."""
        return self.steps.token_losses(ids, targets, segment_ids, position_ids, reference)

    def set_router_aux_loss(self, coef: float = 0.0):
        """A mixture of experts' training steps add coef times transformers' load-balancing loss of each
        micro-batch (divided among a step's micro-batches, as TRL divides it among accumulation steps); 0 turns
        it off. last_aux_loss: the last train_step's loss, the mean over its micro-batches (None when off)."""
        self.steps.router_aux_loss_coef = check_router_aux_loss(self.cfg, coef)

    def set_loss_temperature(self, temperature: float = 1.0):
        """The loss head of training steps and token_losses scores logits / temperature (GRPO's log-probabilities
        at its sampling temperature, as TRL takes them); loss() and generation keep the model's own."""
        self.mode.loss_temperature = float(temperature)

    def train_step(self, micro_batches, hp, step: int, profile: bool = False, reduce=None):
        """See StepRunner.train_step: (loss_sum, token_count, grad_norm, applied)."""
        return self.steps.train_step(micro_batches, hp, step, profile, reduce)

    def gradients(self) -> dict:
        return self.optimizer.gradients()

    def optimizer_step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                       lora_b_lr_ratio=1.0):
        """Clip by the global norm, then AdamW on every trainable tensor (the LoRA B matrices at lr times
        lora_b_lr_ratio: LoRA+); returns (grad_norm, applied)."""
        return self.optimizer.step(lr, beta1, beta2, eps, weight_decay, max_grad_norm, step, lora_b_lr_ratio)

    def apply_update(self, norm, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=None, step=1,
                     lora_b_lr_ratio=1.0):
        """optimizer_step with the gradients' global norm given (a pipeline stage's: every stage's together);
        a non-finite norm skips the update. (norm, applied)."""
        return self.optimizer.apply_update(norm, lr, beta1, beta2, eps, weight_decay, max_grad_norm, step,
                                           lora_b_lr_ratio)

    def reduce_gradients(self, reduce, total: int):
        """The gradients through a data-parallel `reduce` (train_step's), its result kept: the vision tower's LoRA
        step (engines/vision_model.py) reduces the language model's with it."""
        self.optimizer.reduce(reduce, total)

    def optimizer_state(self) -> dict:
        return self.optimizer.state()

    def load_optimizer_state(self, state: dict):
        self.optimizer.load_state(state)

    # ---- generation (kv_cache.KvCacheGeneration) ------------------------------------------------
    def set_adapter_bank(self, bank: dict | None):
        """The adapters that forward_rows(adapters=) picks per row ({module path: BankModule}), or None."""
        self.kv.set_adapter_bank(bank)

    def new_kv_cache(self, batch: int, max_len: int) -> dict:
        """A KV cache of `batch` rows (sequences) of up to max_len positions each; its keys and values are
        rounded to self.kv_dtype where they are written (held in arrays of self.dtype)."""
        return self.kv.new_kv_cache(batch, max_len)

    def free_kv_cache(self, kv: dict):
        """Drop a KV cache's arrays (the engine protocol: the GPU engine frees its buffers)."""
        kv["k"] = kv["v"] = None

    def forward_cached(self, ids, kv: dict) -> np.ndarray:
        """New tokens ids (B, Tq) of every row after the kv["len"] cached ones -> logits (B, V) of each row's last."""
        return forward_cached(self, ids, kv)

    def forward_rows(self, ids, rows, positions, kv: dict, last, long_rope=None, adapters=None) -> np.ndarray:
        """n new tokens, each with its own cache row and position: ids, rows, positions (n,) int.

        Every token's key and value is written into kv first; then token i attends to keys 0..positions[i]
        of row rows[i], so one call prefills several ragged prompts packed together, or advances every row
        by one token. Returns logits (m, V) float32 of the tokens at indices last (m,): only those go
        through the final norm and lm_head. long_rope: whether RoPE takes longrope's long factors (None: as
        the call's largest position says, ModelConfig.rope_long). adapters: (n,) each token's adapter in the bank
        (set_adapter_bank; negative: none), or None.
        """
        return self.kv.forward_rows(ids, rows, positions, kv, last, long_rope, adapters)
