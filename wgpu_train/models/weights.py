"""Hugging Face files: safetensors reading (sharded, f32/f16/bf16), weight-name checks, PEFT adapter
files, and writing complete model folders."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .config import ATTENTION_MODULES, KNOWN_LINEAR_MODULES, ModelConfig
from .errors import AdapterError, ConfigError, ModelFileError
from .layer_plan import layer_plan
from .multimodal import (PROCESSOR_FILES, adapter_key_out, carried_tensors, file_name, language_keys,
                         language_names, live_patterns, target_regex)

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _as_array(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A tensor's stored values (a view of the file) as float32 (floats) or their own integer type (a copy)."""
    if dtype == "BF16":
        return _bf16_to_f32(raw)
    if raw.dtype.kind == "f":
        return raw.astype(np.float32)
    return np.array(raw)


class LazyWeights(Mapping):
    """name -> array of a model's tensors, each converted from its memory-mapped file bytes when it is read
    (and not kept), so that an engine that stores tensors one at a time (the WebGPU one, quantising them
    as it goes) never holds the whole model as float32 in host memory."""

    def __init__(self, raw: dict):
        self._raw = raw                  # name -> (view of the file's bytes, safetensors dtype)

    def __getitem__(self, name: str) -> np.ndarray:
        return _as_array(*self._raw[name])

    def __iter__(self):
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def shape(self, name: str) -> tuple:
        return tuple(self._raw[name][0].shape)


def read_safetensors(path, names=None) -> dict:
    """Tensors of one .safetensors file as float32 (floats) or their own integer type.

    Checks the header and every tensor's byte range against the file, so a file cut short
    or with a bad header gives a ModelFileError instead of garbage.
    """
    return {k: _as_array(*v) for k, v in _read_raw(path, names).items()}


def _read_raw(path, names=None) -> dict:
    """name -> (view of the tensor's bytes in a memory map of the file, safetensors dtype), checked."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ModelFileError(f"{path}: safetensors header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ModelFileError(f"weights file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelFileError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    out = {}
    for name, meta in header.items():
        if names is not None and name not in names:
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{path}: malformed header entry for tensor {name}") from None
        if dtype not in _DTYPES:
            raise ModelFileError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        np_dtype = np.dtype(_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        if end > data.shape[0] or end - start != count * np_dtype.itemsize:
            raise ModelFileError(f"{path}: tensor {name} lies outside the file (file cut short?)")
        out[name] = (np.frombuffer(data[start:end], dtype=np_dtype).reshape(shape), dtype)
    return out


def write_safetensors(path, tensors: dict, metadata: dict | None = None):
    """Write float32 / integer NumPy arrays as a .safetensors file (atomically: temp file, then rename)."""
    header, chunks, offset = {}, [], 0
    rev = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        raw = arr.tobytes()
        header[name] = {"dtype": rev[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelFileError(f"{index}: not a valid safetensors index (needs 'weight_map')") from None
        return [folder / f for f in sorted(set(weight_map.values()))]
    if single.is_file():
        return [single]
    raise ModelFileError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def expected_shapes(cfg: ModelConfig) -> dict:
    """Every tensor name the model needs mapped to its shape (biases and lm_head handled by the caller); a
    layer's norms are its layer plan's."""
    c, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, c), "model.norm.weight": (c,)}
    norms = {op.param: (d if op.heads else c,) for op in layer_plan(cfg).ops if op.kind == "rmsnorm"}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in norms.items()})
        for m in cfg.linear_modules:
            shapes[module_path(i, m) + ".weight"] = cfg.linear_shape(m)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, c)
    return shapes


def module_path(layer: int, module: str) -> str:
    """The Hugging Face path of one linear module, e.g. model.layers.0.self_attn.q_proj."""
    group = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


def _folder_tensors(folder: Path) -> dict:
    tensors = {}
    for f in weight_files(folder):
        tensors.update(_read_raw(f))
    return tensors


def load_weights(folder, cfg: ModelConfig) -> LazyWeights:
    """All weights of a model folder, checked for presence and shape, as a LazyWeights (float32 on reading);
    of a multimodal checkpoint, its language model's (multimodal.language_names)."""
    folder = Path(folder)
    tensors = _folder_tensors(folder)
    if cfg.wrapper:
        tensors = {ours: tensors[name] for ours, name in language_names(tensors, folder).items()}
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    # Biases: q/k/v (Qwen2, Llama attention_bias) and o_proj (Llama attention_bias).
    for i in range(cfg.num_hidden_layers):
        for m in cfg.linear_modules:
            name = module_path(i, m) + ".bias"
            if name in tensors:
                shapes[name] = (cfg.linear_shape(m)[0],)
            elif cfg.attention_bias and m in ("q_proj", "k_proj", "v_proj"):
                shapes[name] = (cfg.linear_shape(m)[0],)
    missing = [k for k in shapes if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelFileError(f"{folder}: missing tensors {', '.join(missing[:3])}{more}")
    for k, shape in shapes.items():
        if tuple(tensors[k][0].shape) != tuple(shape):
            raise ModelFileError(f"{folder}: tensor {k} has shape {tuple(tensors[k][0].shape)}, expected {tuple(shape)}")
    return LazyWeights({k: tensors[k] for k in shapes})


def save_model_folder(out, cfg: ModelConfig, weights: dict, source_folder=None):
    """A complete Hugging Face model folder: config.json, model.safetensors, tokenizer files copied. A
    multimodal checkpoint's folder gets its language model's weights under the source's names beside the
    source's other tensors (vision tower, projector: multimodal.carried_tensors), all in float32, and its
    processor's files."""
    out = Path(out)
    companions = TOKENIZER_FILES
    if cfg.wrapper:
        if source_folder is None:
            raise ConfigError(f"saving a {cfg.wrapper} model needs the folder it was loaded from (its vision tower)")
        source = _folder_tensors(Path(source_folder))
        names = language_names(source, source_folder)
        carried = carried_tensors(source, names, source_folder)
        weights = {**{k: _as_array(*v) for k, v in carried.items()},
                   **{file_name(k, names): v for k, v in weights.items()}}
        companions += PROCESSOR_FILES
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(cfg.raw)
    raw["torch_dtype"] = raw["dtype"] = "float32"
    if cfg.tie_word_embeddings and any(k.endswith("lm_head.weight") for k in weights):   # a head trained apart
        raw["tie_word_embeddings"] = False                                                # (modules_to_save)
        if cfg.wrapper:
            raw["text_config"] = {**raw["text_config"], "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    write_safetensors(out / "model.safetensors", {k: v.astype(np.float32) for k, v in weights.items()},
                      metadata={"format": "pt"})
    if source_folder is not None:
        for name in companions:
            src = Path(source_folder) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)


# ---- PEFT adapters ---------------------------------------------------------------------------

def peft_key(path: str, which: str) -> str:
    """The PEFT tensor name of lora_A / lora_B for a module path."""
    return f"base_model.model.{path}.lora_{which}.weight"


def write_adapter(out, lora_cfg, tensors: dict, base_model: str = "", model: ModelConfig | None = None):
    """Write adapter_config.json and adapter_model.safetensors in PEFT's format (its per-layer fields,
    init_lora_weights and modules_to_save included). For a multimodal checkpoint's language model (`model`'s
    wrapper) the keys are PEFT's on the multimodal model and target_modules a regular expression selecting
    the language model's modules and layers alone."""
    from .lora_init import peft_value

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers, pattern = lora_cfg.layers_to_transform, lora_cfg.layers_pattern
    targets = list(lora_cfg.target_modules)
    if model is not None and model.wrapper:
        targets, layers, pattern = target_regex(lora_cfg.targets_in(model), layers), None, None
        tensors = {adapter_key_out(k): v for k, v in tensors.items()}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora_cfg.r), "lora_alpha": lora_cfg.alpha,
        "lora_dropout": float(lora_cfg.dropout), "target_modules": targets,
        "use_rslora": bool(lora_cfg.use_rslora), "use_dora": bool(lora_cfg.use_dora), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
        "modules_to_save": list(lora_cfg.modules_to_save) or None,
        "ensure_weight_tying": bool(lora_cfg.ensure_weight_tying),
        "init_lora_weights": peft_value(lora_cfg.init),
        "layers_to_transform": list(layers) if layers is not None else None,
        "layers_pattern": (pattern[0] if len(pattern) == 1 else list(pattern)) if pattern else None,
        "rank_pattern": dict(lora_cfg.rank_pattern), "alpha_pattern": dict(lora_cfg.alpha_pattern),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(out / "adapter_model.safetensors", {k: v.astype(np.float32) for k, v in tensors.items()},
                      metadata={"format": "pt"})


# adapter_config.json fields for what this library does not compute (extra trained modules, ...): an
# adapter that sets one (to anything but null, false or empty) is refused by name. init_lora_weights is read
# by lora_init.from_peft; the other init-only settings (loftq_config, eva_config, ...) do not matter here.
UNSUPPORTED_ADAPTER_FIELDS = (
    "fan_in_fan_out", "lora_bias", "exclude_modules", "target_parameters",
    "trainable_token_indices", "layer_replication", "alora_invocation_tokens", "use_qalora", "arrow_config",
    "kasa_config", "monteclora_config", "use_bdlora")


def _adapter_field(raw: dict, key: str, kind: str, default, cfg_path):
    """raw[key] (default when absent) checked against kind: "int" (>= 1), "number", "bool" or "str"."""
    value = raw.get(key, default)
    ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": lambda v: isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}[kind](value)
    if not ok:
        want = {"int": "a whole number >= 1", "number": "a number", "bool": "true or false", "str": "a string"}[kind]
        got = "missing" if key not in raw else f"got {json.dumps(value)}"
        raise AdapterError(f"{cfg_path}: key '{key}' must be {want}, {got}")
    return value


def adapter_base_name(adapter_path) -> str:
    """The adapter's base_model_name_or_path as written ("" when it has none or it cannot be read)."""
    try:
        raw = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
        return str(raw.get("base_model_name_or_path") or "")
    except (OSError, ValueError, TypeError, AttributeError):
        return ""


def adapter_base_model(adapter_path) -> Path | None:
    """The adapter's base_model_name_or_path when it is a model folder on this machine or a hub id (from the
    cache, else downloaded)."""
    from . import hub

    name = adapter_base_name(adapter_path)
    if hub.is_hub_id(name):
        return hub.resolve(name, "model")
    base = Path(name)
    return base if name not in ("", ".") and (base / "config.json").is_file() else None


def adapter_folder(adapter_path) -> Path | None:
    """The adapter folder of --adapter-path (a checkpoint folder gives its adapter/), checked to be one."""
    from . import hub

    if adapter_path is None:
        return None
    adapter = hub.resolve(adapter_path, "adapter")
    if not adapter.is_dir():
        raise AdapterError(f"adapter folder not found: {adapter}")
    if not (adapter / "adapter_config.json").is_file() and (adapter / "config.json").is_file():
        raise AdapterError(f"{adapter} is a model folder, not an adapter: pass it as --model")
    if not (adapter / "adapter_config.json").is_file() and (adapter / "adapter" / "adapter_config.json").is_file():
        return adapter / "adapter"                      # a checkpoint folder: its adapter
    return adapter


def read_adapter(folder, model: ModelConfig | None = None):
    """(LoraConfig, tensors by PEFT key) from a PEFT adapter folder; refuses what this library cannot apply.

    Every value of adapter_config.json that matters is checked for its type; a wrong one, or a setting this
    library does not compute (UNSUPPORTED_ADAPTER_FIELDS, a bias other than "none"), raises AdapterError
    naming the key. target_modules is resolved with adapter_targets against the layers and linear modules
    of `model` (by default: the layers the adapter's tensors cover, any family's module names)."""
    from .config import LoraConfig
    from .lora_layout import adapter_layout, adapter_targets

    folder = Path(folder)
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"no adapter_config.json in {folder}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{cfg_path}: must hold a JSON object, got {type(raw).__name__}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {json.dumps(raw.get('peft_type'))} is not LORA")
    for field in UNSUPPORTED_ADAPTER_FIELDS:
        if raw.get(field) not in (None, False, [], {}, ""):
            raise AdapterError(f"{cfg_path}: not supported: {field}={json.dumps(raw[field])}")
    bias = _adapter_field(raw, "bias", "str", "none", cfg_path)
    if bias != "none":
        raise AdapterError(f"{cfg_path}: not supported: bias={json.dumps(bias)} (only \"none\")")
    r = _adapter_field(raw, "r", "int", None, cfg_path)
    alpha = _adapter_field(raw, "lora_alpha", "number", 8, cfg_path)
    dropout = _adapter_field(raw, "lora_dropout", "number", 0.0, cfg_path)
    rslora = _adapter_field(raw, "use_rslora", "bool", False, cfg_path)
    dora = raw.get("use_dora") is not None and _adapter_field(raw, "use_dora", "bool", False, cfg_path)
    spec = raw.get("target_modules")
    if not (isinstance(spec, str) and spec or
            isinstance(spec, list) and spec and all(isinstance(t, str) and t for t in spec)):
        got = "missing" if "target_modules" not in raw else f"got {json.dumps(spec)}"
        raise AdapterError(f"{cfg_path}: key 'target_modules' must be a list of module names or a regular "
                           f"expression, {got}")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"no adapter_model.safetensors in {folder}")
    try:
        tensors = read_safetensors(weights)
    except ModelFileError as e:
        raise AdapterError(str(e)) from None
    if model is None:
        layers = [int(m.group(1)) for k in tensors if (m := re.search(r"\.layers\.(\d+)\.", k))]
        num_hidden_layers, linear_modules = max(layers, default=0) + 1, KNOWN_LINEAR_MODULES
    else:
        num_hidden_layers, linear_modules = model.num_hidden_layers, model.linear_modules
    layout = adapter_layout(raw, spec, cfg_path)
    saved = raw.get("modules_to_save")
    if saved is not None and not (isinstance(saved, list) and all(isinstance(m, str) for m in saved)):
        raise AdapterError(f"{cfg_path}: key 'modules_to_save' must be a list of module names or null, "
                           f"got {json.dumps(saved)}")
    tying = _adapter_field(raw, "ensure_weight_tying", "bool", False, cfg_path)
    found = language_keys(tensors, cfg_path)       # an adapter of a multimodal checkpoint's language model
    tensors, outer = found if found is not None else (tensors, None)
    if outer is not None:      # patterns are matched on the multimodal model's current paths (module_settings)
        layout.update({k: live_patterns(layout[k], outer) for k in ("rank_pattern", "alpha_pattern")})
    modules, layers = adapter_targets(spec, num_hidden_layers, cfg_path, layout["layers_to_transform"],
                                      layout["layers_pattern"], linear_modules, outer)
    try:
        cfg = LoraConfig(r=r, alpha=alpha, dropout=float(dropout), target_modules=modules, use_rslora=rslora,
                         use_dora=dora, **{**layout, "layers_to_transform": layers}, modules_to_save=saved,
                         ensure_weight_tying=tying)
    except ConfigError as e:
        raise AdapterError(f"{cfg_path}: {e}") from None
    return cfg, tensors

