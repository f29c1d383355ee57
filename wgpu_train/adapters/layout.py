"""Where LoRA goes and with which rank: PEFT's target_modules, layers_to_transform / layers_pattern (which
layers) and rank_pattern / alpha_pattern (per-module r and alpha), checked and matched on module paths exactly
as PEFT matches them (peft.tuners.tuners_utils.check_target_module_exists, peft.utils.other.get_pattern_key);
read from adapter_config.json and from the command line (--lora-layers, --lora-rank-pattern, ...)."""
from __future__ import annotations

import json
import math
import re

from wgpu_train.models.config import KNOWN_LINEAR_MODULES
from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.models.weights import expert_path, module_path
from wgpu_train.models.multimodal import live_layout, outer_path


DEFAULT_TARGETS = "q_proj,v_proj"      # the command line's --lora-targets default


def model_targets(spec: str, model) -> str:
    """--lora-targets for `model`: the default (Llama's q_proj,v_proj) means the fused qkv_proj that holds them
    on a model with fused projections (Phi-3; mlx-lm's default there too)."""
    return "qkv_proj" if spec == DEFAULT_TARGETS and model.fused_projections else spec


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _regex(key: str, what: str):
    try:
        re.compile(key)
    except re.error as e:
        raise ConfigError(f"LoRA {what} key {key!r} is not a valid regular expression ({e})") from None


def check_layout(cfg) -> dict:
    """The per-layer fields of a LoraConfig, checked and normalised: layers_to_transform a sorted tuple of
    distinct indices >= 0 (PEFT also takes one int), layers_pattern a tuple of names, the patterns plain dicts
    (their order kept: the first matching key wins) of valid regular expressions to r >= 1 / finite alpha > 0.
    As in PEFT, layers_pattern needs layers_to_transform, and rsLoRA with a pattern cannot take PiSSA / OLoRA
    (its conversion to a plain LoRA of rank 2r, which every save here makes, is refused by PEFT)."""
    out = {}
    layers = cfg.layers_to_transform
    if layers is not None:
        layers = [layers] if _whole(layers) else layers
        if isinstance(layers, str) or not all(_whole(i) and i >= 0 for i in layers):
            raise ConfigError(f"LoRA layers_to_transform must be layer indices >= 0, got {cfg.layers_to_transform!r}")
        layers = tuple(sorted(set(layers)))
        if not layers:
            layers = None         # PEFT: an empty list transforms every layer
    out["layers_to_transform"] = layers
    pattern = cfg.layers_pattern
    if pattern is not None:
        pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
        if not all(isinstance(p, str) for p in pattern):
            raise ConfigError(f"LoRA layers_pattern must be a name or a list of names, got {cfg.layers_pattern!r}")
        for p in pattern:
            _regex(p, "layers_pattern")
        pattern = pattern or None
        if pattern and layers is None:
            raise ConfigError("LoRA layers_pattern needs layers_to_transform (as in PEFT)")
    out["layers_pattern"] = pattern
    for name, ok, want in (("rank_pattern", lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
                           ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                            and math.isfinite(v) and v > 0, "a finite number > 0")):
        value = getattr(cfg, name)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"LoRA {name} must map module-path patterns to values, got {value!r}")
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ConfigError(f"LoRA {name} keys must be module-path patterns, got {k!r}")
            _regex(k, name)
            if not ok(v):
                raise ConfigError(f"LoRA {name}[{k!r}] must be {want}, got {v!r}")
        out[name] = dict(value)
    return out


def layer_index(path: str, layers_pattern) -> int | None:
    """The layer index PEFT reads from a module path: the first number after `<pattern>.` for one of
    layers_pattern's names, or without a pattern the first number segment that follows a named segment."""
    if not layers_pattern:
        # lazy: the first numbered segment (model.layers.3.), not a nested one
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        match = None
        for pattern in layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if match is not None:
                break
    return int(match.group("idx")) if match else None


def pattern_key(keys, path: str) -> str | None:
    """The first key (in order) that PEFT's get_pattern_key matches to a module path: the key as a regular
    expression matching the path's end after a dot, or the whole path; None when none does."""
    for key in keys:
        if re.match(rf"(.*\.)?({key})$", path):
            return key
    return None


def module_settings(cfg, model) -> dict:
    """{module path: (r, alpha)} of every LoRA module of `cfg` (a LoraConfig) in `model` (a ModelConfig), layer
    by layer in the order of its linear modules. Targets the model lacks, a layers_to_transform index it
    lacks, or a selection that leaves no module, are refused naming them."""
    num_hidden_layers, targets = model.num_hidden_layers, cfg.targets_in(model)
    layers = cfg.layers_to_transform
    missing = [i for i in layers or () if i >= num_hidden_layers]
    if missing:
        raise ConfigError(f"LoRA layers_to_transform {', '.join(map(str, missing))}: the model has layers 0 to "
                          f"{num_hidden_layers - 1}")
    experts = cfg.experts_in(model)
    out = {}
    for i in range(num_hidden_layers):
        here = model.layer_modules(i)
        paths = [module_path(i, m) for m in targets if m in here]
        paths += [expert_path(i, p, model.moe.block) for p in experts if model.is_sparse(i)]
        for path in paths:
            seen = outer_path(path, live_layout(model.wrapper)) if model.wrapper else path   # PEFT matches on it
            if layers is not None and layer_index(seen, cfg.layers_pattern) not in layers:
                continue
            r_key, a_key = pattern_key(cfg.rank_pattern, seen), pattern_key(cfg.alpha_pattern, seen)
            out[path] = (int(cfg.rank_pattern[r_key]) if r_key is not None else int(cfg.r),
                         cfg.alpha_pattern[a_key] if a_key is not None else cfg.alpha)
    if not out:     # every index is a layer of the model: only a layers_pattern can miss them all
        raise ConfigError(f"LoRA layers_pattern {list(cfg.layers_pattern)!r} names no layer of the model's module "
                          f"paths (model.layers.N...)")
    return out


# ---- adapter_config.json ---------------------------------------------------------------------------------

def adapter_targets(spec, num_hidden_layers: int, where="adapter_config.json", layers_to_transform=None,
                    layers_pattern=None, linear_modules=KNOWN_LINEAR_MODULES, outer=None) -> tuple[tuple, tuple | None]:
    """(module names, layer indices or None for every layer) that PEFT's target_modules `spec` selects in a
    model of num_hidden_layers layers with the linear modules `linear_modules` (by default any family's),
    matched as PEFT matches (check_target_module_exists) on module paths (model.layers.0.self_attn.q_proj;
    with `outer`, a multimodal.LAYOUTS entry, as that layout of a multimodal model spells them): "all-linear";
    a string is a regular expression that must match a path with re.fullmatch; a list entry matches a path
    that equals it or, in the layers_to_transform (as read by layout.layer_index with layers_pattern),
    ends with "." + entry. The modules are returned by the last name of their path (LoraConfig's target names). LoRA
    on the embedding or lm_head, a selection whose modules lie in different layers, one of some modules of a name
    but not all, or one of no linear module is refused naming it."""
    if spec == "all-linear":
        spec = list(linear_modules)
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise AdapterError(f"{where}: target_modules {spec!r} is not a valid regular expression ({e})") from None
    layers = layers_to_transform

    def selects(path: str) -> bool:
        if isinstance(spec, str):
            return pattern.fullmatch(path) is not None
        if path in spec:
            return True
        found = any(path.endswith("." + t) for t in spec)
        return found and (layers is None or layer_index(path, layers_pattern) in layers)

    def spelled(path):     # as PEFT saw it: in the multimodal model's layout `outer`
        return outer_path(path, outer) if outer else path

    for other in (spelled("model.embed_tokens"), spelled("lm_head")):
        if selects(other):
            raise AdapterError(f"{where}: not supported: target_modules {spec!r} selects {other} (LoRA on the "
                               f"linear layers {', '.join(linear_modules)} only)")
    chosen = {m: tuple(i for i in range(num_hidden_layers) if selects(spelled(module_path(i, m))))
              for m in linear_modules}
    chosen = {m: found for m, found in chosen.items() if found}
    if not chosen:
        where_layers = f" in layers_to_transform {list(layers)}" if layers else ""
        raise AdapterError(f"{where}: target_modules {spec!r} selects none of the linear layers "
                           f"({', '.join(linear_modules)}){where_layers}")
    if len(set(chosen.values())) > 1:
        shown = "; ".join(f"{m} in layers {','.join(map(str, found))}" for m, found in chosen.items())
        raise AdapterError(f"{where}: not supported: target_modules {spec!r} selects {shown} (LoRA on the same "
                           f"layers for every module only)")
    found = next(iter(chosen.values()))
    # as LoraConfig names targets: by the last name of a module's path (LFM2's conv.in_proj -> in_proj), which
    # selects every module of that name (PEFT's suffix match), so a selection of only some of them is refused
    names = tuple(dict.fromkeys(m.rsplit(".", 1)[-1] for m in chosen))
    partial = [m for m in linear_modules if m.rsplit(".", 1)[-1] in names and m not in chosen]
    if partial:
        raise AdapterError(f"{where}: not supported: target_modules {spec!r} selects {', '.join(chosen)} but not "
                           f"{', '.join(partial)} (LoRA on every module of a name only)")
    return names, (None if len(found) == num_hidden_layers and layers is None else found)


def adapter_layout(raw: dict, spec, cfg_path) -> dict:
    """adapter_config.json's per-layer fields and init as LoraConfig arguments, each checked for its type
    (AdapterError naming the key); as PEFT, layers_to_transform / layers_pattern only with a list of targets."""
    from wgpu_train.adapters.inits import from_peft

    def bad(key, want):
        return AdapterError(f"{cfg_path}: key '{key}' must be {want}, got {json.dumps(raw[key])}")

    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    layers, pattern = raw.get("layers_to_transform"), raw.get("layers_pattern")
    if layers is not None and not (whole(layers) or isinstance(layers, list) and all(whole(i) for i in layers)):
        raise bad("layers_to_transform", "a layer index or a list of them")
    if isinstance(layers, list) and not layers:
        layers = None                 # PEFT: an empty list is every layer
    if pattern is not None and not (isinstance(pattern, str) or isinstance(pattern, list) and
                                    all(isinstance(p, str) for p in pattern)):
        raise bad("layers_pattern", "a name or a list of names")
    pattern = pattern or None
    if (layers is not None or pattern) and isinstance(spec, str):
        raise AdapterError(f"{cfg_path}: layers_to_transform / layers_pattern need target_modules as a list "
                           f"(PEFT refuses them with a string: a regular expression or all-linear)")
    if pattern and layers is None:
        raise AdapterError(f"{cfg_path}: layers_pattern needs layers_to_transform (as in PEFT)")
    out = {"layers_to_transform": (layers,) if whole(layers) else tuple(layers) if layers is not None else None,
           "layers_pattern": (pattern,) if isinstance(pattern, str) else tuple(pattern) if pattern else None}
    for key, ok, want in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                           "whole numbers >= 1"),
                          ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                           "numbers")):
        value = raw.get(key) or {}
        if not isinstance(value, dict) or not all(ok(v) for v in value.values()):
            raise bad(key, f"an object of module-path patterns to {want}")
        out[key] = value
    out["init"] = from_peft(raw.get("init_lora_weights", True), cfg_path)
    return out


# ---- the command line -------------------------------------------------------------------------------------

def parse_layers(text) -> int | tuple | None:
    """--lora-layers: "N" the last N layers (an int, for last_layers; mlx-lm's --num-layers), layer indices
    "0,2,5" with ranges "3-5" (a tuple; one layer i: "i-i" or "i,"), or "", "all", "-1": every layer (None)."""
    text = str(text if text is not None else "").strip()
    if text in ("", "all", "-1"):
        return None
    if re.fullmatch(r"\d+", text):
        if int(text) < 1:
            raise ConfigError("--lora-layers N must be at least 1 (-1 or all: every layer)")
        return int(text)
    out = set()
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if part and (not m or (m.group(2) and int(m.group(2)) < int(m.group(1)))):
            raise ConfigError(f"--lora-layers {text!r}: give N (the last N layers) or layer indices such as 0,2,5 "
                              f"or 3-5")
        if part:
            out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return tuple(sorted(out))


def last_layers(n: int, num_hidden_layers: int) -> tuple:
    """The indices of the last n of num_hidden_layers layers (n larger than the model is refused)."""
    if n > num_hidden_layers:
        raise ConfigError(f"--lora-layers {n}: the model has only {num_hidden_layers} layers")
    return tuple(range(num_hidden_layers - n, num_hidden_layers))


def parse_pattern(text, what: str) -> dict:
    """--lora-rank-pattern / --lora-alpha-pattern: "PATTERN=VALUE[,...]" (e.g. q_proj=16,layers.0.mlp.down_proj=4)
    or a JSON object (for patterns that hold commas); the order is kept (the first matching key wins)."""
    if isinstance(text, dict):
        return dict(text)
    text = str(text or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what}: not a valid JSON object ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{what}: expected a JSON object")
        return value
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.rpartition("=")
        if not key.strip() or not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()):
            raise ConfigError(f"{what} {part!r}: expected PATTERN=NUMBER, e.g. q_proj=16")
        number = float(value)
        out[key.strip()] = int(number) if re.fullmatch(r"[-+]?\d+", value.strip()) else number
    return out


def format_layers(layers) -> str | None:
    """Layer indices as --lora-layers spells them ("0,2,5"; one layer "3,", since "3" means the last 3)."""
    if layers is None:
        return None
    return ",".join(map(str, layers)) + ("," if len(layers) == 1 else "")


def lora_options(lora) -> dict:
    """The TrainConfig LoRA options that describe a LoraConfig (to record the adapter a run trains)."""
    return {"lora_rank": lora.r, "lora_alpha": float(lora.alpha), "lora_targets": ",".join(lora.target_modules),
            "rslora": lora.use_rslora, "lora_dropout": lora.dropout, "lora_init": lora.init,
            "lora_layers": format_layers(lora.layers_to_transform),
            "lora_rank_pattern": json.dumps(lora.rank_pattern) if lora.rank_pattern else None,
            "lora_alpha_pattern": json.dumps(lora.alpha_pattern) if lora.alpha_pattern else None,
            "dora": lora.use_dora,
            "lora_target_parameters": ",".join(f"mlp.experts.{p}" for p in lora.target_parameters) or "",
            "modules_to_save": ",".join(lora.modules_to_save) or None, "ensure_weight_tying": lora.ensure_weight_tying}


def describe_targets(lora, model) -> str:
    """The modules a LoraConfig adapts in `model`, for the log: its linear modules, and an MoE model's expert
    tensors ("q_proj,v_proj and the experts' gate_up_proj,down_proj")."""
    experts = lora.experts_in(model)
    return ",".join(lora.as_saved(model).targets_in(model)) + (f" and the experts' {','.join(experts)}"
                                                                  if experts else "")


def describe_layout(lora) -> str:
    """The per-layer choices and init of a LoraConfig for the log ("" when they are the defaults)."""
    parts = []
    if lora.layers_to_transform is not None:
        parts.append(f"layers {format_layers(lora.layers_to_transform).rstrip(',')}")
    for name, pattern in (("ranks", lora.rank_pattern), ("alphas", lora.alpha_pattern)):
        if pattern:
            parts.append(f"{name} " + ",".join(f"{k}={v:g}" for k, v in pattern.items()))
    if lora.init != "default":
        parts.append(f"init {lora.init}")
    if lora.use_dora:
        parts.append("DoRA")
    if lora.modules_to_save:
        parts.append(f"modules_to_save {','.join(lora.modules_to_save)}" + (" (tied)" if lora.ensure_weight_tying else ""))
    return f" ({'; '.join(parts)})" if parts else ""
