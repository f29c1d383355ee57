"""PEFT adapter folders: adapter_config.json and adapter_model.safetensors written and read (every field
checked, what this library cannot apply refused), an adapter's folder and its base model."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from wgpu_train.errors import AdapterError, ConfigError, ModelFileError
from wgpu_train.formats.safetensors import read_safetensors, write_safetensors
from wgpu_train.adapters.experts import (convert_per_expert, expert_key, has_per_expert_keys, is_expert_path,
                                         parse_target_parameters, saved_parameters)
from wgpu_train.models.config import KNOWN_LINEAR_MODULES, ROUTERS, ModelConfig
from wgpu_train.models.multimodal import adapter_key_out, language_keys, live_layout, live_patterns, target_regex


def peft_key(path: str, which: str, adapted=()) -> str:
    """The PEFT tensor name of lora_A / lora_B for a module path; an expert tensor's depends on which of its
    layer's expert tensors are `adapted` (every LoRA path of the adapter; experts.expert_key)."""
    if is_expert_path(path):
        return expert_key(path, which, adapted)
    return f"base_model.model.{path}.lora_{which}.weight"


def write_adapter(out, lora_cfg, tensors: dict, base_model: str = "", model: ModelConfig | None = None):
    """Write adapter_config.json and adapter_model.safetensors in PEFT's format (its per-layer fields,
    init_lora_weights and modules_to_save included). For a multimodal checkpoint's language model (`model`'s
    wrapper) the keys are PEFT's on the multimodal model and target_modules a regular expression selecting
    the language model's modules and layers alone."""
    from wgpu_train.adapters.inits import peft_value

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers, pattern = lora_cfg.layers_to_transform, lora_cfg.layers_pattern
    targets = list(lora_cfg.target_modules)
    if model is not None and model.wrapper:
        outer = live_layout(model.wrapper)      # an MoE's routers are PEFT's target_parameters (below)
        modules = [t for t in lora_cfg.targets_in(model) if model.moe is None or t not in ROUTERS]
        targets, layers, pattern = target_regex(modules, layers, outer) if modules else [], None, None
        tensors = {adapter_key_out(k, outer): v for k, v in tensors.items()}
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
    if model is not None and model.moe is not None:      # PEFT adapts the router and the experts as parameters
        config["target_modules"] = targets if isinstance(targets, str) else [t for t in targets if t not in ROUTERS]
        config["target_parameters"] = saved_parameters(lora_cfg.target_parameters if lora_cfg.experts_in(model)
                                                       else (), tuple(lora_cfg.targets_in(model)), model.moe.block)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(out / "adapter_model.safetensors", {k: v.astype(np.float32) for k, v in tensors.items()},
                      metadata={"format": "pt"})


# adapter_config.json fields for what this library does not compute (extra trained modules, ...): an
# adapter that sets one (to anything but null, false or empty) is refused by name. init_lora_weights is read
# by inits.from_peft; the other init-only settings (loftq_config, eva_config, ...) do not matter here.
UNSUPPORTED_ADAPTER_FIELDS = (
    "fan_in_fan_out", "lora_bias", "exclude_modules",
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
    from wgpu_train.formats import hub

    name = adapter_base_name(adapter_path)
    if hub.is_hub_id(name):
        return hub.resolve(name, "model")
    base = Path(name)
    return base if name not in ("", ".") and (base / "config.json").is_file() else None


def adapter_folder(adapter_path) -> Path | None:
    """The adapter folder of --adapter-path (a checkpoint folder gives its adapter/), checked to be one."""
    from wgpu_train.formats import hub

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
    from wgpu_train.adapters.config import LoraConfig
    from wgpu_train.adapters.layout import adapter_layout, adapter_targets

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
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"no adapter_model.safetensors in {folder}")
    try:
        tensors = read_safetensors(weights)
    except ModelFileError as e:
        raise AdapterError(str(e)) from None
    if model is not None and model.moe is not None and has_per_expert_keys(tensors):   # transformers 4's names
        raw, tensors = convert_per_expert(raw, tensors, model, cfg_path)
    spec = raw.get("target_modules")
    experts_only = spec in (None, []) and bool(raw.get("target_parameters"))    # LoRA on parameters alone
    if not (experts_only or isinstance(spec, str) and spec or
            isinstance(spec, list) and spec and all(isinstance(t, str) and t for t in spec)):
        got = "missing" if "target_modules" not in raw else f"got {json.dumps(spec)}"
        raise AdapterError(f"{cfg_path}: key 'target_modules' must be a list of module names or a regular "
                           f"expression, {got}")
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
    modules, layers = ((), layout["layers_to_transform"]) if experts_only else adapter_targets(
        spec, num_hidden_layers, cfg_path, layout["layers_to_transform"], layout["layers_pattern"], linear_modules,
        outer)
    try:
        experts, routers = parse_target_parameters(raw.get("target_parameters") or ())
    except ConfigError as e:
        raise AdapterError(f"{cfg_path}: {e}") from None
    modules = (*modules, *routers)
    try:
        cfg = LoraConfig(r=r, alpha=alpha, dropout=float(dropout), target_modules=modules, use_rslora=rslora,
                         use_dora=dora, **{**layout, "layers_to_transform": layers}, modules_to_save=saved,
                         target_parameters=experts,
                         ensure_weight_tying=tying)
    except ConfigError as e:
        raise AdapterError(f"{cfg_path}: {e}") from None
    return cfg, tensors

