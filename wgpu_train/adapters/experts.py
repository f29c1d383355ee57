"""LoRA on an MoE layer's experts in PEFT's format (its ParamWrapper over transformers 5's 3-D expert tensors): the
names that target_parameters takes, where the pairs sit in the saved file (a layer's gate_up_proj nested under
base_layer when its down_proj is adapted too), and their layout there (lora_A (E*r, in) with expert-major rows,
lora_B (out, r*E) with rank-major columns) against ours (A (E, r, in), B (E, out, r)). gpt-oss's expert tensors
are transposed in transformers ((E, in, out)), which PEFT's wrapper reads as such (it swaps nothing there), so its
pairs are laid out as everyone's, and our experts keep its gate_up rows interleaved as PEFT's lora_B rows are.
Adapters written on transformers 4, one pair per expert and projection, are converted as PEFT 0.21 converts them."""
from __future__ import annotations

import re

import numpy as np

from wgpu_train.errors import AdapterError, ConfigError
from wgpu_train.models.config import EXPERT_PARAMETERS, ModelConfig

# transformers 4's per-expert LoRA keys (Mixtral's block_sparse_moe.experts.N.w1, the Qwen MoE family's and OLMoE's
# mlp.experts.N.gate_proj), and the families PEFT 0.21 converts them on (its _MOE_TARGET_MODULE_MAPPING through
# transformers' conversion patterns: Qwen3-MoE and OLMoE take Qwen2-MoE's, which Qwen2-MoE itself does not get)
_PER_EXPERT = re.compile(r"(?P<layer>.*\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
                         r"(?P<proj>\w+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
_OLD_NAMES = {"mixtral": ("w1", "w3", "w2", "gate"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj", "gate"),
              "olmoe": ("gate_proj", "up_proj", "down_proj", "gate"),
              "qwen3_next": ("gate_proj", "up_proj", "down_proj", "gate")}
# PEFT's target_parameters name of each family's router module: mlp.gate's (all-linear writes it so), gpt-oss's
# mlp.router's
ROUTER_PARAMETERS = {"gate": "gate.weight", "router": "mlp.router.weight"}


def all_linear_takes_experts(model: ModelConfig) -> bool:
    """Whether all-linear takes the router and the experts of `model`, as PEFT 0.21's all-linear on transformers 5
    does on Mixtral, Qwen3-MoE and OLMoE; on gpt-oss and LFM2-MoE, whose routers and experts are no nn.Linear, it
    takes their other nn.Linear modules alone (measured). On Qwen2-MoE PEFT's all-linear takes neither router nor
    experts (it converts no names there: peft_converts_expert_names); ours takes them, so that nothing is skipped,
    and the saved adapter names them in target_parameters, which PEFT loads as trained."""
    return model.family not in ("gpt_oss", "lfm2_moe")


def peft_converts_expert_names(model: ModelConfig) -> bool:
    """Whether PEFT 0.21 on transformers 5 reads transformers 4's expert names (gate_proj / up_proj / down_proj,
    Mixtral's w1 / w3 / w2) as the experts' fused tensors on `model` (its _MOE_TARGET_MODULE_MAPPING through
    transformers' conversion patterns: Mixtral, Qwen3-MoE, OLMoE, Qwen3-Next); elsewhere (Qwen2-MoE, Qwen3.5-MoE,
    measured) gate_proj / up_proj / down_proj name the dense layers' MLPs and the shared expert."""
    return model.family in _OLD_NAMES


def parse_target_parameters(values) -> tuple[tuple, tuple]:
    """PEFT's target_parameters -> (the expert tensors they name, in EXPERT_PARAMETERS' order; the router modules
    they name: "gate" for gate.weight, "router" for router.weight). An entry names a tensor by its path's end
    (down_proj, experts.down_proj, mlp.experts.down_proj, LFM2-MoE's feed_forward.experts.down_proj); ConfigError
    for one that names none of them."""
    if isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()]
    experts, routers = set(), set()
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"LoRA target_parameters entries must be names, got {value!r}")
        full = {f"{block}.experts.{p}": p for p in EXPERT_PARAMETERS for block in ("mlp", "feed_forward")}
        match = [p for path, p in full.items() if path == value or path.endswith("." + value)]
        if match:
            experts.add(match[0])
        elif value.removeprefix("mlp.") in (f"{m}.weight" for m in ROUTER_PARAMETERS):
            routers.add(value.removeprefix("mlp.").split(".")[0])
        else:
            raise ConfigError(f"LoRA target_parameters entry {value!r} is not an MoE layer's expert tensor "
                              f"({', '.join(f'mlp.experts.{p}' for p in EXPERT_PARAMETERS)}) or its router "
                              f"({' or '.join(ROUTER_PARAMETERS.values())})")
    return tuple(p for p in EXPERT_PARAMETERS if p in experts), tuple(m for m in ROUTER_PARAMETERS if m in routers)


def saved_parameters(target_parameters: tuple, target_modules: tuple, block: str = "mlp") -> list:
    """adapter_config.json's target_parameters, as PEFT writes them: the experts' (under `block`, MoeConfig's) and,
    when the router is a target, its weight (PEFT adapts the router, which is no nn.Linear, as a parameter)."""
    return [f"{block}.experts.{p}" for p in target_parameters] + [v for m, v in ROUTER_PARAMETERS.items()
                                                                if m in target_modules]


def is_expert_path(path: str) -> bool:
    """Whether a LoRA path is an MoE layer's expert tensor (model.layers.N.mlp.experts.gate_up_proj; LFM2-MoE's
    under feed_forward)."""
    return ".experts." in path


def expert_key(path: str, which: str, adapted) -> str:
    """The PEFT key of lora_A / lora_B of expert tensor `path`: PEFT nests one wrapper per adapted tensor of a
    layer, the first of EXPERT_PARAMETERS innermost (under base_layer) when the next one is adapted too."""
    block, param = path.rsplit(".", 1)
    later = EXPERT_PARAMETERS[EXPERT_PARAMETERS.index(param) + 1:]
    nesting = sum(f"{block}.{p}" in adapted for p in later)
    return f"base_model.model.{block}.{'base_layer.' * nesting}lora_{which}.weight"


def to_peft(which: str, x: np.ndarray) -> np.ndarray:
    """Our A (E, r, in) / B (E, out, r) (or their gradients) as PEFT stores them: (E*r, in) / (out, r*E)."""
    if which == "A":
        return x.reshape(-1, x.shape[-1])
    return x.transpose(1, 2, 0).reshape(x.shape[1], -1)


def from_peft(which: str, x: np.ndarray, num_experts: int) -> np.ndarray:
    """PEFT's lora_A (E*r, in) / lora_B (out, r*E) as ours: (E, r, in) / (E, out, r)."""
    if which == "A":
        return x.reshape(num_experts, -1, x.shape[-1])
    return x.reshape(x.shape[0], -1, num_experts).transpose(2, 0, 1)


def check_expert_count(lora_a, path: str, r: int, experts: int, source):
    """AdapterError when PEFT's lora_A (E'*r, in) of expert tensor `path` holds pairs for E' experts, not the
    model's `experts`."""
    rows = lora_a.shape[0] if getattr(lora_a, "ndim", 0) == 2 else None
    if rows is not None and rows != r * experts and rows % r == 0:
        raise AdapterError(f"adapter {source}: it has LoRA for {rows // r} experts in {path}; the model has {experts}")


def peft_shape(which: str, shape: tuple) -> tuple:
    """The PEFT shape of our A / B of `shape`."""
    e = shape[0]
    return (e * shape[1], shape[2]) if which == "A" else (shape[1], shape[2] * e)


def has_per_expert_keys(tensors) -> bool:
    """Whether an adapter's tensors hold transformers 4's one LoRA pair per expert and projection."""
    return any(_PER_EXPERT.fullmatch(k) for k in tensors)


def _converted_targets(raw: dict, model: ModelConfig, source) -> dict:
    """adapter_config.json as PEFT 0.21 converts it for transformers 5 (_convert_peft_config_moe): the experts'
    and router's old names move from target_modules to target_parameters (w1 / w3 or gate_proj / up_proj to
    gate_up_proj, w2 / down_proj to down_proj, gate to gate.weight); both halves of gate_up_proj give it rank 2r
    and alpha 2 alpha (rank / alpha patterns), one half alone is refused."""
    gate, up, down, router = _OLD_NAMES[model.family]
    new = {gate: "gate_up_proj", up: "gate_up_proj", down: "down_proj", router: "gate.weight"}
    spec = raw.get("target_modules")
    if spec == "all-linear":
        spec = list(model.linear_modules) + list(new)
    if not isinstance(spec, list) or not all(isinstance(t, str) for t in spec):
        raise AdapterError(f"{source}: an adapter with per-expert LoRA (transformers 4's names) needs target_modules "
                           f"as a list or all-linear to be converted, got {spec!r}")
    kept, params, halves = [], list(raw.get("target_parameters") or []), set()
    for target in spec:
        old = next((o for o in new if target == o or target.endswith("." + o)), None)
        if old is None:
            kept.append(target)
            continue
        params.append(new[old])
        halves |= {old} & {gate, up}
    if len(halves) == 1:
        (present,), (missing,) = halves, {gate, up} - halves
        raise AdapterError(f"{source}: per-expert target {present} cannot be converted without {missing}: both are "
                           f"fused into gate_up_proj (as PEFT refuses it)")
    out = {**raw, "target_modules": kept, "target_parameters": sorted(set(params))}
    if halves and isinstance(raw.get("r"), int):        # else read_adapter refuses r
        fused = r".*\.gate_up_proj"
        out["rank_pattern"] = {**(raw.get("rank_pattern") or {}), fused: 2 * raw["r"]}
        out["alpha_pattern"] = {**(raw.get("alpha_pattern") or {}), fused: 2 * raw.get("lora_alpha", 8)}
    return out


def convert_per_expert(raw: dict, tensors: dict, model: ModelConfig, source) -> tuple[dict, dict]:
    """(adapter_config.json, tensors) of an adapter written on transformers 4 with one LoRA pair per expert and
    projection, converted as PEFT 0.21 converts it: per layer, the experts' pairs stacked; gate and up fused into
    one pair of rank 2r (A's rank rows concatenated, gate's first; B block-diagonal over the two); laid out as
    PEFT's ParamWrapper keeps them (to_peft); Mixtral's block_sparse_moe renamed mlp. AdapterError for a family
    PEFT does not convert, and for an expert count other than the model's."""
    if model.family not in _OLD_NAMES:
        raise AdapterError(f"{source}: per-expert LoRA keys (transformers 4's names) on {model.architecture}: PEFT "
                           f"0.21 does not convert them for this family, so neither does this library; save the "
                           f"adapter with target_parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj)")
    converted = _converted_targets(raw, model, source)
    gate, up, down, _ = _OLD_NAMES[model.family]
    grouped, out = {}, {}
    for key, value in tensors.items():
        m = _PER_EXPERT.fullmatch(key)
        if m is None:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = value
            continue
        grouped.setdefault(m["layer"], {}).setdefault((m["proj"], m["which"]), {})[int(m["expert"])] = value
    experts = model.moe.num_experts
    fused = {}
    for layer, pairs in grouped.items():
        for (proj, which), by_expert in pairs.items():
            if (proj, "AB".replace(which, "")) not in pairs:
                raise AdapterError(f"{source}: {layer}'s per-expert {proj} has lora_{which} but no "
                                   f"lora_{'AB'.replace(which, '')}")
            if proj not in (gate, up, down):
                raise AdapterError(f"{source}: per-expert LoRA on {layer}...experts.N.{proj}: not an expert "
                                   f"projection of {model.architecture} ({gate}, {up}, {down})")
            if sorted(by_expert) != list(range(experts)):
                raise AdapterError(f"{source}: the adapter has LoRA for {len(by_expert)} experts in {layer} "
                                   f"(indices {min(by_expert)}..{max(by_expert)}); the model has {experts}")
        try:
            stacked = {k: np.stack([v[e] for e in range(experts)]) for k, v in pairs.items()}   # A (E, r, in),
        except ValueError:                                                                     # B (E, out, r)
            raise AdapterError(f"{source}: the per-expert LoRA pairs of {layer} differ in shape") from None
        if (gate, "A") in stacked and (up, "A") in stacked:
            a = np.concatenate([stacked[gate, "A"], stacked[up, "A"]], axis=1)
            bg, bu = stacked[gate, "B"], stacked[up, "B"]
            b = np.zeros((experts, bg.shape[1] + bu.shape[1], bg.shape[2] + bu.shape[2]), np.float32)
            b[:, :bg.shape[1], :bg.shape[2]], b[:, bg.shape[1]:, bg.shape[2]:] = bg, bu
            fused[f"{layer}.mlp.experts.gate_up_proj"] = (a, b)
        elif (gate, "A") in stacked or (up, "A") in stacked:
            raise AdapterError(f"{source}: {layer} has per-expert LoRA on one of {gate} / {up} alone, which "
                               f"target_modules does not say; both are fused into gate_up_proj")
        if (down, "A") in stacked:
            fused[f"{layer}.mlp.experts.down_proj"] = (stacked[down, "A"], stacked[down, "B"])
    layer_paths = {p.removeprefix("base_model.model.") for p in fused}
    for path, (a, b) in fused.items():
        inner = path.removeprefix("base_model.model.")
        out[expert_key(inner, "A", layer_paths)] = to_peft("A", a)
        out[expert_key(inner, "B", layer_paths)] = to_peft("B", b)
    return converted, out
