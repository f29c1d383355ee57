"""Model: the backend-agnostic facade users hold (logits, loss and gradients, generation, LoRA, adapters, merge);
engines/loading.py loads one onto an engine."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from wgpu_train.adapters.config import LoraConfig
from wgpu_train.models.config import ModelConfig
from wgpu_train.adapters.dora import MAGNITUDE, magnitude_key, merged, weight_norm
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.models.weights import load_weights, module_name, save_model_folder
from wgpu_train.formats.safetensors import TensorMap
from wgpu_train.adapters.experts import check_expert_count, from_peft, is_expert_path, peft_shape, to_peft
from wgpu_train.adapters.files import peft_key, read_adapter, write_adapter
from wgpu_train.adapters.inits import changes_base, converted, converted_config, decompose, fresh_pair
from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.engines.shared.labels import shift_labels
from wgpu_train.adapters.saved_modules import HEAD, adapter_keys, peft_key as copy_key, trained_weights

log = logging.getLogger("wgpu_train")


def _as_batch(input_ids, attention_mask=None):
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ConfigError(f"input_ids must be an integer array of shape (B, T), got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int32)
    if attention_mask is None:
        seg = np.ones_like(ids)
    else:
        mask = np.asarray(attention_mask)
        if mask.size != ids.size:
            raise ConfigError(f"attention_mask must have the shape of input_ids {ids.shape}, got {mask.shape}")
        seg = (mask.reshape(ids.shape) != 0).astype(np.int32)
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape).copy()
    return ids, seg, pos


@dataclasses.dataclass(frozen=True)
class PreparedAdapter:
    """A LoRA adapter read and checked against a model (Model.prepare_adapter), ready to attach (use_adapter)."""

    config: LoraConfig
    modules: dict       # module path -> (A (r, in), B (out, r)), with DoRA's magnitude (out,) third
    copies: dict        # modules_to_save: base weight name -> its trained copy (V, C)
    residual: dict      # PiSSA / OLoRA saved unconverted: base weight name -> the residual replacing it
    init_pairs: dict    # ... and module path -> the (A0, B0) that residual subtracted


class Model:
    """A Llama-family causal LM on one engine ('numpy' or 'wgpu'), with optional LoRA."""

    def __init__(self, config: ModelConfig, engine, path=None):
        self.config = config
        self.engine = engine
        self.path = Path(path) if path is not None else None
        # what a saved adapter names as its base (base_model_name_or_path): the folder, or the hub id it came from
        self.name_or_path = str(self.path) if self.path else ""
        self.lora_config: LoraConfig | None = None
        self.method = "lora"
        self._scales: dict = {}       # module path -> its LoRA scale
        self._init_pairs: dict = {}   # PiSSA / OLoRA: module path -> (A0, B0) the residual base subtracts
        self._kept: dict = {}         # a model without a folder: original weights a residual or a copy replaced
        self._copies: tuple = ()      # modules_to_save: the base weights the adapter trains (saved_modules)

    @property
    def backend(self) -> str:
        return self.engine.name

    @property
    def backend_reason(self) -> str:
        """Why this engine: "as given", or backend auto's reason (engines/backend_choice.py)."""
        return self.engine.backend_reason

    # ---- inference and gradients --------------------------------------------------------------
    def logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """float32 logits (B, T, V) for integer input_ids (B, T); attention_mask marks real tokens (right padding)."""
        ids, seg, pos = _as_batch(input_ids, attention_mask)
        self._check_ids(ids)
        return self.engine.logits(ids, seg, pos)

    def loss_and_grads(self, input_ids, labels, attention_mask=None):
        """(mean loss over counted tokens, gradients by PEFT key or, for full fine-tuning, by weight name).

        labels (B, T) follow Hugging Face: logits at t predict labels[t + 1]; -100 is ignored.
        """
        ids, seg, pos = _as_batch(input_ids, attention_mask)
        self._check_ids(ids)
        labels = np.asarray(labels, dtype=np.int64)
        if labels.size != ids.size:
            raise ConfigError(f"labels must have the shape of input_ids {ids.shape}, got {labels.shape}")
        targets = shift_labels(labels.reshape(ids.shape))
        # -1 would silently index the last vocabulary row, >= vocab_size would raise IndexError deep inside.
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= self.config.vocab_size))
        if bad.any():
            raise ConfigError(f"labels must be -100 or lie in [0, {self.config.vocab_size}), got {int(targets[bad][0])}")
        count = int((targets != IGNORE_INDEX).sum())
        if count == 0:
            raise ConfigError("labels hold no token to train on (all -100)")
        self.engine.zero_grads()
        loss_sum, _ = self.engine.forward_backward(ids, targets, seg, pos, 1.0 / count)
        grads = self.engine.gradients()
        self.engine.zero_grads()
        return loss_sum / count, self._public_grad_names(grads)

    def _public_grad_names(self, grads: dict) -> dict:
        if self.method == "full":
            return grads
        out = {}
        adapted = {k.rsplit(".lora_", 1)[0] for k in grads if ".lora_" in k}
        for k, g in grads.items():
            if ".lora_" not in k:             # a trained copy (modules_to_save)
                out[copy_key(k)] = g
                continue
            path, which = k.rsplit(".lora_", 1)
            if k.endswith(MAGNITUDE):
                out[magnitude_key(path)] = g
            else:
                out[peft_key(path, which, adapted)] = to_peft(which, g) if is_expert_path(path) else g
        return out

    def _check_ids(self, ids):
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ConfigError(f"token ids must lie in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed=None, stop_token_ids=(), on_token=None) -> list[int]:
        """New token ids after one prompt (ids (T,), or (1, T)), greedy at temperature 0, seeded sampling
        otherwise. Several prompts are refused (generate_batch answers them), and so is a prompt whose length
        plus max_new_tokens exceeds the model's max_position_embeddings."""
        from wgpu_train.engines.generate import generate, one_prompt

        ids = one_prompt(input_ids)
        self._check_ids(ids)
        return generate(self.engine, ids, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                        on_token)

    def generate_batch(self, prompts, max_new_tokens=64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed=None, stop_token_ids=(), max_len=None,
                       on_token=None, images=None) -> list[list[int]]:
        """New token ids after each prompt (a list of 1-D id arrays of any lengths), generated together:
        one KV cache row per prompt, one engine call per decoding step. max_new_tokens and seed may be
        lists with one value per prompt; see generate.generate_batch for what row i shares with generate(),
        and for `on_token(i, id)` (streaming; True ends row i), and `images` (each prompt's ImageTokens or None).
        A prompt whose length plus its max_new_tokens exceeds the model's max_position_embeddings is refused."""
        from wgpu_train.engines.generate import generate_batch

        ids = [np.asarray(p) for p in prompts]
        for p in ids:
            self._check_ids(p)
        return generate_batch(self.engine, ids, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
                              max_len, on_token, images)

    # ---- LoRA ---------------------------------------------------------------------------------
    def add_lora(self, config: LoraConfig, seed: int = 0):
        """Attach fresh LoRA modules (config.modules: which layers and modules, with their ranks) initialised
        as config.init says, from `seed`: "default" (PEFT's: A kaiming-uniform, B zeros) or "gaussian" (A normal
        with std 1/r) leave the model unchanged; "pissa" / "pissa_niter_K" / "olora" take A, B from the SVD /
        QR of the original base weights (before any float16 / NF4 rounding) and replace those by the residual
        W - scale * B A, which the engine then stores as it stores the base. With config.use_dora every
        module's magnitude starts at ||W + scale * B A|| (= ||W||: B is zero), W as the engine stores it."""
        rng = np.random.default_rng(seed)
        config = config.as_saved(self.config)
        settings = config.modules(self.config)
        scales = config.module_scales(self.config)
        if changes_base(config.init):
            modules, residual = self._decomposed(config, settings, scales, rng)
        else:
            modules, residual = {}, {}
            for path, (r, _) in settings.items():
                shape = self._lora_shape(path)
                if is_expert_path(path):       # a pair per expert
                    pairs = [fresh_pair(rng, config.init, r, *shape[1:]) for _ in range(shape[0])]
                    modules[path] = tuple(np.stack(side) for side in zip(*pairs))
                else:
                    modules[path] = fresh_pair(rng, config.init, r, *shape)
        if config.use_dora:
            weights = self.engine.weights()
            modules = {p: (a, b, weight_norm(weights[p + ".weight"], a, b, scales[p]).astype(np.float32))
                       for p, (a, b) in modules.items()}
        self._set_lora(config, modules, seed, residual, modules if residual else None)

    def _lora_shape(self, path: str) -> tuple:
        """(out, in) of a LoRA path's linear module, (E, out, in) of an expert tensor's."""
        if is_expert_path(path):
            return self.config.expert_shape(path.rsplit(".", 1)[1])
        return self.config.linear_shape(module_name(path))

    def _decomposed(self, config: LoraConfig, settings: dict, scales: dict, rng) -> tuple:
        """PiSSA / OLoRA of every module: ({path: (A0, B0)}, {weight name: residual})."""
        if any(is_expert_path(p) for p in settings):
            raise ConfigError(f"LoRA init {config.init} on the experts is not supported (PEFT's expert wrapper "
                              f"has no PiSSA / OLoRA): use init default or gaussian, or leave the experts out")
        originals = self._original_weights([p + ".weight" for p in settings])
        modules, residual = {}, {}
        for path, (r, _) in settings.items():
            a, b, residual[path + ".weight"] = decompose(originals[path + ".weight"], r, scales[path], config.init, rng)
            modules[path] = (a, b)
        return modules, residual

    def _original_weights(self, names: list) -> dict:
        """The base weights as in the model's files (float32), whatever the engine stores now."""
        if self.path is not None:
            weights = load_weights(self.path, self.config)
            return {n: weights[n] for n in names}
        rest = [n for n in names if n not in self._kept]
        if rest and self.engine.base_dtype.rounds:
            raise ConfigError(f"PiSSA / OLoRA need the base weights before their {self.engine.base_dtype} rounding: "
                              f"load the model from its folder")
        stored = self.engine.weights() if rest else {}
        return {n: self._kept[n] if n in self._kept else stored[n] for n in names}

    def _set_lora(self, config: LoraConfig, modules: dict, seed: int = 0, residual: dict | None = None,
                  init_pairs: dict | None = None, copies: dict | None = None):
        """Attach `modules` ({path: (A, B)}, or (A, B, magnitude) with DoRA) with config's scales. PiSSA / OLoRA:
        `residual` ({weight name: array}) replaces base weights and `init_pairs` ({path: (A0, B0)}) is what it subtracted; base weights
        that an earlier residual replaced get their original values back. config.modules_to_save: see
        _attach_copies (`copies`: a loaded adapter's)."""
        config = config.as_saved(self.config)
        scales = config.module_scales(self.config)
        residual = residual or {}
        restore = [p + ".weight" for p in self._init_pairs if p + ".weight" not in residual]
        if self.path is None:      # no files to read the originals from again: keep them
            self._kept.update(self._original_weights([n for n in residual if n not in self._kept]))
        if restore or residual:
            self.engine.set_base_weights({**self._original_weights(restore), **residual})
        for n in restore:
            self._kept.pop(n, None)
        self.lora_config = config
        self.method = "lora"
        self._scales = scales
        self._init_pairs = {p: (a.copy(), b.copy()) for p, (a, b) in (init_pairs or {}).items()}
        self.engine.set_full_finetune(False)
        self.engine.seed_dropout(seed)
        self.engine.set_lora({p: (t[0], t[1], scales[p], config.dropout, *t[2:]) for p, t in modules.items()})
        self._attach_copies(config, copies)

    def _attach_copies(self, config: LoraConfig, copies: dict | None):
        """Train the base weights that config.modules_to_save copies (saved_modules.trained_weights; a tied
        model's head untied where PEFT unties it), starting from `copies` ({weight name: array}) or from the
        weights as the engine holds them (float16 ones as rounded there, then trained in float32). Copies an
        earlier adapter trained are first replaced by the original weights."""
        # _set_lora's set_full_finetune(False) froze them and tied a tied model's head again
        stale = [n for n in self._copies if n != HEAD or not self.config.tie_word_embeddings]
        if stale:
            self.engine.set_base_weights(self._original_weights(stale))
        for n in stale:
            self._kept.pop(n, None)
        names, untie = trained_weights(self.config.tie_word_embeddings, config.modules_to_save,
                                       config.ensure_weight_tying)
        if self.path is None and names:     # no files to read the originals from again: keep them
            stored = self.engine.weights()
            self._kept.update({n: np.array(stored[n]) for n in names if n in stored and n not in self._kept})
        self.engine.set_trained_base(names, untie)
        if copies:
            self.engine.set_trainable(copies)
        self._copies = names

    def set_full_finetune(self):
        """Train every weight instead of LoRA (gradients keyed by Hugging Face tensor names)."""
        if self.lora_config is not None:
            raise ConfigError("full fine-tuning of a model with a LoRA adapter is not supported; merge it first")
        stored = (self.engine.base_dtype, self.engine.embed_dtype)
        if any(dtype.rounds for dtype in stored):
            raise ConfigError(f"full fine-tuning needs float32 weights, but this model stores them as base_dtype "
                              f"{stored[0]}, embed_dtype {stored[1]} (frozen); use LoRA or load it with float32")
        self.method = "full"
        self.engine.set_full_finetune(True)

    def set_gradient_checkpointing(self, enabled: bool = True):
        """Recompute each layer's activations in the backward instead of keeping them (HF's
        gradient_checkpointing): less GPU memory for about one more forward per step, the same gradients.
        The NumPy engine keeps everything and only records the setting."""
        self.engine.set_gradient_checkpointing(enabled)

    def lora_state_dict(self) -> dict:
        """LoRA tensors by PEFT key: lora_A (r, in) and lora_B (out, r), DoRA's lora_magnitude_vector (out,), and the
        modules_to_save copies (V, C),
        float32."""
        out = {}
        tensors = self.engine.lora_tensors()
        for path, (a, b) in tensors.items():
            for which, x in (("A", a.astype(np.float32)), ("B", b.astype(np.float32))):
                out[peft_key(path, which, tensors)] = to_peft(which, x) if is_expert_path(path) else x
        out.update({magnitude_key(path): m for path, m in self._magnitudes().items()})
        if self._copies:        # modules_to_save, keyed as PEFT saves them
            trained = self.engine.trainable()
            for key, name in self._copy_keys(self.lora_config).items():
                out[key] = np.asarray(trained[name], np.float32)
        return out

    def _magnitudes(self) -> dict:
        """{module path: DoRA magnitude (out,) float32} ({} without DoRA)."""
        if self.lora_config is None or not self.lora_config.use_dora:
            return {}
        suffix = "." + MAGNITUDE
        return {k[:-len(suffix)]: v.astype(np.float32) for k, v in self.engine.trainable().items()
                if k.endswith(suffix)}

    def _copy_keys(self, config: LoraConfig) -> dict:
        return adapter_keys(self.config.tie_word_embeddings, config.modules_to_save, config.ensure_weight_tying)

    def save_adapter(self, directory, convert: bool = True):
        """Write the adapter in PEFT's format (adapter_config.json, adapter_model.safetensors). A PiSSA / OLoRA
        adapter is written as PEFT's save_pretrained(path_initial_model_for_weight_conversion=...) writes it:
        converted to a plain LoRA of rank 2r on the original base (inits.converted), which loads on the
        untouched base model anywhere. convert=False writes it as trained, over the residual base, with its
        init recorded (PEFT's save_pretrained without conversion; loading it rebuilds the residual)."""
        if self.lora_config is None:
            raise AdapterError("the model has no LoRA adapter to save (call add_lora first)")
        config, tensors = self.lora_config, self.lora_state_dict()
        if convert and self._init_pairs:
            config = converted_config(config)
            for path, (a0, b0) in self._init_pairs.items():
                ka, kb = peft_key(path, "A"), peft_key(path, "B")
                tensors[ka], tensors[kb] = converted(tensors[ka], tensors[kb], a0, b0)
            if self.engine.base_dtype.rounds:
                log.warning("wgpu-train: the %s adapter was trained over the %s-rounded residual base; converted "
                            "to a LoRA on the original base, it adds to the unrounded weights (as in PEFT, "
                            "Quant(W_res) + BA differs slightly from W + dW)", self.lora_config.init,
                            self.engine.base_dtype)
        write_adapter(directory, config, tensors, base_model=self.name_or_path, model=self.config)

    def load_adapter(self, directory, dropout: float | None = None, seed: int = 0):
        """Load a PEFT LoRA adapter; names or shapes that do not match the model are refused, listed. An
        adapter saved unconverted from a PiSSA / OLoRA init (init_lora_weights "pissa" / "olora") gets its
        residual base rebuilt from this model's weights, as PEFT does when loading it. To train it further:
        `dropout` replaces the adapter's lora_dropout, `seed` seeds the dropout masks."""
        self.use_adapter(self.prepare_adapter(directory, dropout), seed)

    def prepare_adapter(self, directory, dropout: float | None = None) -> PreparedAdapter:
        """A PEFT LoRA adapter read from its folder and checked against this model (as load_adapter does),
        held in memory to attach with use_adapter as often as wanted (a server switching adapters) without
        reading its files again."""
        config, tensors = read_adapter(directory, self.config)
        try:
            settings = config.modules(self.config)
        except ConfigError as e:
            raise AdapterError(f"adapter {directory}: {e}") from None
        expected = {}
        for path, (r, _) in settings.items():
            shape = self._lora_shape(path)
            if is_expert_path(path):
                expected[peft_key(path, "A", settings)] = peft_shape("A", (shape[0], r, shape[2]))
                expected[peft_key(path, "B", settings)] = peft_shape("B", (shape[0], shape[1], r))
                continue
            out_f, in_f = shape
            expected[peft_key(path, "A")] = (r, in_f)
            expected[peft_key(path, "B")] = (out_f, r)
            if config.use_dora:
                expected[magnitude_key(path)] = (out_f,)
        copy_keys = self._copy_keys(config)
        expected.update({k: (self.config.vocab_size, self.config.hidden_size) for k in copy_keys})
        # PEFT files may carry the adapter name (".lora_A.default.weight"); accept that spelling too.
        tensors = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}
        for path, (r, _) in settings.items():
            if is_expert_path(path) and peft_key(path, "A", settings) in tensors:
                check_expert_count(tensors[peft_key(path, "A", settings)], path, r, self._lora_shape(path)[0],
                                   directory)
        problems = [f"missing {k}" for k in expected if k not in tensors]
        problems += [f"unexpected {k}" for k in tensors if k not in expected]
        problems += [f"{k} has shape {tuple(tensors[k].shape)}, expected {s}"
                     for k, s in expected.items() if k in tensors and tuple(tensors[k].shape) != s]
        if problems:
            more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
            raise AdapterError(f"adapter {directory} does not match the model: {'; '.join(problems[:4])}{more}")
        if config.init.startswith("pissa_niter_"):
            raise AdapterError(f"adapter {directory}: not supported: init_lora_weights={config.init} saved "
                               f"unconverted (its residual base comes from a random SVD that cannot be repeated); "
                               f"save it with path_initial_model_for_weight_conversion")
        def pair(path):
            if is_expert_path(path):
                e = self._lora_shape(path)[0]
                return tuple(from_peft(w, tensors[peft_key(path, w, settings)], e) for w in ("A", "B"))
            return tensors[peft_key(path, "A")], tensors[peft_key(path, "B")]

        modules = {path: (*pair(path), *([tensors[magnitude_key(path)]] if config.use_dora else []))
                   for path in settings}
        copies = {name: tensors[key] for key, name in copy_keys.items()}   # a tied copy: the embedding's key last
        if dropout is not None:
            config = dataclasses.replace(config, dropout=float(dropout))
        scales = config.module_scales(self.config)
        init_pairs, residual = ({}, {}) if not changes_base(config.init) else self._decomposed(config, settings,
                                                                                              scales, None)
        return PreparedAdapter(config, modules, copies, residual, init_pairs)

    def use_adapter(self, adapter: PreparedAdapter, seed: int = 0):
        """Attach a prepared adapter (prepare_adapter), replacing any other; `seed` seeds the dropout masks."""
        self._set_lora(adapter.config, adapter.modules, seed, adapter.residual, adapter.init_pairs, adapter.copies)

    def remove_adapter(self):
        """Detach the LoRA adapter, if any: the base model alone, the base weights an adapter replaced (a PiSSA /
        OLoRA residual, modules_to_save copies) back as they were."""
        if self.lora_config is None:
            return
        self._set_lora(dataclasses.replace(self.lora_config, modules_to_save=()), {})
        self.lora_config, self._scales = None, {}

    def merged_weights(self) -> TensorMap:
        """Base weights with every LoRA delta folded in: W + scale * B @ A (float32; W the residual base of a
        PiSSA / OLoRA adapter, so the sum is the original base plus the trained change); with DoRA PEFT's
        (m / ||W + scale * B A||) * (W + scale * B A) (dora.merged); the modules_to_save copies in place of their
        weights (a tied model whose head was untied gets its own lm_head.weight). Each weight is merged when it
        is read, and not kept: a save writes them one at a time, so a model whose weights lie in pipeline
        stages is never whole in one process."""
        base = self.engine.weights()
        magnitudes = self._magnitudes()
        pairs = {(path if is_expert_path(path) else path + ".weight"): (path, a, b)
                 for path, (a, b) in self.engine.lora_tensors().items()}

        def merge(name: str) -> np.ndarray:
            weight = np.array(base[name], dtype=np.float32)
            if name not in pairs:
                return weight
            path, a, b = pairs[name]
            if path in magnitudes:
                return merged(weight, a, b, self._scales[path], magnitudes[path])
            weight += (self._scales[path] * (b.astype(np.float64) @ a)).astype(np.float32)   # (E,) out x in
            return weight

        return TensorMap(base, merge)

    def merge_and_save(self, directory, dtype: str = "float32") -> dict:
        """Write a complete Hugging Face model folder with the adapter merged (tokenizer files copied), its weights
        merged in float32 and stored in `dtype` (float32, bfloat16 or float16); returns the merged weights
        (merged_weights' float32 mapping, which merges each again when read)."""
        weights = self.merged_weights()
        save_model_folder(directory, self.config, weights, source_folder=self.path, dtype=dtype)
        return weights

    def save_pretrained(self, directory):
        """Write the (possibly fully fine-tuned) model as a Hugging Face folder."""
        save_model_folder(directory, self.config, self.merged_weights(), source_folder=self.path)
