"""Mixtures of experts in config.json: how many experts, how many a token takes and how they are weighted, which
layers are sparse, the shared expert, the router's auxiliary loss, and gpt-oss's router bias, expert biases and
clamped SwiGLU (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss as transformers 5 defines them; LFM2-MoE's sigmoid
router in lfm2.py); what else an MoE config asks for is refused naming the field."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.errors import ConfigError

# the families with experts, and the config fields that name their expert count and size (transformers 5
# writes either name of the count: its configs map num_experts and num_local_experts onto each other)
MOE_FAMILIES = {"mixtral": ("num_local_experts", "intermediate_size"),
                "qwen2_moe": ("num_experts", "moe_intermediate_size"),
                "qwen3_moe": ("num_experts", "moe_intermediate_size"),
                "olmoe": ("num_experts", "intermediate_size"),
                "qwen3_next": ("num_experts", "moe_intermediate_size"),
                "qwen3_5_moe": ("num_experts", "moe_intermediate_size"),
                "gpt_oss": ("num_local_experts", "intermediate_size")}
_COUNT_ALIASES = ("num_experts", "num_local_experts")
# MoE variants of other families, refused by the field that asks for them: (what it asks for, the values that
# ask for nothing)
_UNSUPPORTED = {"topk_group": ("grouped top-k routing", (None, 1)), "n_group": ("grouped top-k routing", (None, 1)),
                "kv_lora_rank": ("multi-head latent attention (DeepSeek's MLA)", (None,)),
                "scoring_func": ("a router score other than softmax", (None, "softmax")),
                "topk_method": ("a top-k other than the greedy one", (None, "greedy"))}


@dataclass(frozen=True)
class MoeConfig:
    """num_experts E, top_k k, expert_size I (each expert's gate / up width); normalize: the k weights divided by
    their sum (norm_topk_prob; always for Mixtral); sparse: per layer, whether its MLP is the experts (else the
    dense MLP of intermediate_size); shared_expert_size: Qwen2-MoE's shared expert beside the routed ones, behind
    a sigmoid gate (0: none); aux_loss_coef and aux_loss (output_router_logits: the load-balancing loss added to
    the training loss). gpt-oss: router, the router's module name ("router"; "gate" elsewhere); biases, on the
    router and on each expert's projections; swiglu (alpha, limit): its experts' clamped SwiGLU over gate_up rows
    that alternate gate and up, () for the plain SwiGLU over gate rows then up rows; packed, how the checkpoint
    packs the experts ("mxfp4": its quantization_config, formats/mxfp4.py; "": plain tensors). LFM2-MoE: block,
    the module the router and experts sit under ("feed_forward"; "mlp" elsewhere); scoring, the router's score of each
    expert ("softmax", or "sigmoid": normalised over the chosen ones plus 1e-6); expert_bias, a per-expert bias
    (block.expert_bias) added to the scores to choose the k, not to weigh them; scaling, the weights' factor
    (routed_scaling_factor)."""

    num_experts: int
    top_k: int
    expert_size: int
    normalize: bool
    sparse: tuple
    shared_expert_size: int = 0
    aux_loss_coef: float = 0.0
    aux_loss: bool = False
    router: str = "gate"
    biases: bool = False
    swiglu: tuple = ()
    block: str = "mlp"
    scoring: str = "softmax"
    expert_bias: bool = False
    scaling: float = 1.0
    packed: str = ""

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse[layer])

    def widths(self) -> dict:
        """The widths its layers add, by config field: the router's logits (E) and top-k weights (k), an expert's
        gate / up (I) and the shared expert's (0: none)."""
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.expert_size, "shared_expert_intermediate_size": self.shared_expert_size}


def positive_count(raw: dict, key: str, source: str) -> int:
    """raw[key] checked a positive integer (ConfigError naming the field)."""
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
    return value


def moe_settings(raw: dict, family: str, layers: int, source: str) -> MoeConfig | None:
    """The MoeConfig of a family with experts (MOE_FAMILIES), None for a dense one; ConfigError naming the field
    for what is not supported: grouped or biased routing, a score other than softmax, router jitter, OLMoE's
    clip_qkv, k > E."""
    if family not in MOE_FAMILIES or family == "qwen3_next" and raw.get("num_experts", 512) == 0:
        return None     # Qwen3-Next's dense form (transformers defaults its num_experts to 512)
    for key, (what, plain) in _UNSUPPORTED.items():
        if raw.get(key) not in plain:
            raise ConfigError(f"{source}: field '{key}' asks for {what}; not supported")
    if raw.get("router_jitter_noise"):
        raise ConfigError(f"{source}: field 'router_jitter_noise' is {raw['router_jitter_noise']!r}; only 0 is "
                          f"supported")
    if raw.get("clip_qkv") is not None:
        raise ConfigError(f"{source}: field 'clip_qkv' is {raw['clip_qkv']!r}; only null is supported")
    if family == "qwen3_next":      # transformers' Qwen3NextConfig defaults
        raw = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512, "norm_topk_prob": True, **raw}
    if family == "qwen3_5_moe":     # Qwen3_5MoeTextConfig's defaults; its router always renormalises the top k
        raw = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512, **raw, "norm_topk_prob": True}
    count_key, size_key = MOE_FAMILIES[family]
    if count_key not in raw:
        count_key = next((k for k in _COUNT_ALIASES if k in raw), count_key)
    experts, top_k = positive_count(raw, count_key, source), positive_count(raw, "num_experts_per_tok", source)
    if top_k > experts:
        raise ConfigError(f"{source}: field 'num_experts_per_tok' ({top_k}) is larger than '{count_key}' ({experts})")
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next"):     # Qwen3.5-MoE's layers are all sparse
        step = positive_count({"decoder_sparse_step": 1, **raw}, "decoder_sparse_step", source)
        dense = set(raw.get("mlp_only_layers") or [])
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < layers for i in dense):
            raise ConfigError(f"{source}: field 'mlp_only_layers' must list layer indices below {layers}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    else:
        sparse = (True,) * layers
    shared = positive_count(raw, "shared_expert_intermediate_size", source) if family in ("qwen2_moe", "qwen3_next",
                                                                                         "qwen3_5_moe") else 0
    coef = raw.get("router_aux_loss_coef", 0.001 if family != "olmoe" else 0.01)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConfigError(f"{source}: field 'router_aux_loss_coef' must be a number >= 0, got {coef!r}")
    # gpt-oss's softmax over the top-k logits is the softmax over all of them renormalised over the k (Mixtral's)
    gpt_oss = family == "gpt_oss"
    return MoeConfig(num_experts=experts, top_k=top_k, expert_size=positive_count(raw, size_key, source),
                     normalize=True if family in ("mixtral", "gpt_oss") else bool(raw.get("norm_topk_prob", False)),
                     sparse=sparse, shared_expert_size=shared, aux_loss_coef=float(coef),
                     aux_loss=bool(raw.get("output_router_logits", False)),
                     router="router" if gpt_oss else "gate", biases=gpt_oss,
                     swiglu=_clamped_swiglu(raw, source) if gpt_oss else (),
                     packed="mxfp4" if gpt_oss and raw.get("quantization_config") else "")


def router_aux_loss_coef(moe: MoeConfig | None, given: float | None) -> float:
    """The weight of the router's auxiliary loss a run trains with: `given` (--router-aux-loss-coef), else the
    config's router_aux_loss_coef where its output_router_logits asks for the loss (transformers' meaning), else
    0 (off); 0 for a dense model unless given."""
    if given is not None:
        return float(given)
    return moe.aux_loss_coef if moe is not None and moe.aux_loss else 0.0


def _clamped_swiglu(raw: dict, source: str) -> tuple:
    """gpt-oss's (swiglu_alpha, swiglu_limit), transformers' defaults 1.702 and 7.0, checked positive."""
    values = []
    for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{source}: field '{key}' must be a positive number, got {value!r}")
        values.append(float(value))
    return tuple(values)
