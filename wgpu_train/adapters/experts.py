"""LoRA on an MoE layer's experts in PEFT's format (its ParamWrapper over transformers 5's 3-D expert tensors): the
names that target_parameters takes, where the pairs sit in the saved file (a layer's gate_up_proj nested under
base_layer when its down_proj is adapted too), and their layout there (lora_A (E*r, in) with expert-major rows,
lora_B (out, r*E) with rank-major columns) against ours (A (E, r, in), B (E, out, r)). gpt-oss's expert tensors
are transposed in transformers ((E, in, out)), which PEFT's wrapper reads as such (it swaps nothing there), so its
pairs are laid out as everyone's, and our experts keep its gate_up rows interleaved as PEFT's lora_B rows are."""
from __future__ import annotations

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.config import EXPERT_PARAMETERS, ModelConfig

# PEFT's target_parameters name of each family's router module: mlp.gate's (all-linear writes it so), gpt-oss's
# mlp.router's
ROUTER_PARAMETERS = {"gate": "gate.weight", "router": "mlp.router.weight"}


def all_linear_takes_experts(model: ModelConfig) -> bool:
    """Whether PEFT 0.21's all-linear on transformers 5 takes every linear module of `model` (on an MoE model: the
    router and the experts too, as on Mixtral, the Qwen MoE family and OLMoE); on gpt-oss and LFM2-MoE, whose
    routers and experts are no nn.Linear, it takes their other nn.Linear modules alone (measured)."""
    return model.family not in ("gpt_oss", "lfm2_moe")


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


def peft_shape(which: str, shape: tuple) -> tuple:
    """The PEFT shape of our A / B of `shape`."""
    e = shape[0]
    return (e * shape[1], shape[2]) if which == "A" else (shape[1], shape[2] * e)
