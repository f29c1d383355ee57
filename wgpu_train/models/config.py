"""Model configuration read from a Hugging Face config.json: the architecture, its sizes and variants."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError, ModelFileError, positive_field
from wgpu_train.models import lfm2, lfm3, qwen3_5
from wgpu_train.models.gemma import gemma_fields, gemma_layer_types
from wgpu_train.models.moe import MoeConfig, moe_settings
from wgpu_train.models.multimodal import WRAPPERS, from_wrapper
from wgpu_train.models.rope import inv_freq, rope_settings

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "SmolLM3ForCausalLM": "smollm3",
    "GptOssForCausalLM": "gpt_oss",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "Lfm3ForCausalLM": "lfm3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEAR_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")     # Phi-3 / Phi-4
# every family's, for LoRA targets: each family's modules in its order (an MoE layer's router "gate", gpt-oss's
# "router", and Qwen2-MoE's shared expert's gate; its projections are matched by their last name, as PEFT matches them)
KNOWN_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                        "down_proj", "gate", "router", "shared_expert_gate", "in_proj", "out_proj", "w1", "w3", "w2",
                        "g_proj",
                        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "out_proj", "g_proj")
# LFM2's modules outside self_attn are named by their path under the layer (conv.in_proj, feed_forward.w1): its
# short convolution's out_proj shares the attention's last name, as PEFT's targets do
LAYER_GROUPS = ("conv", "feed_forward", "linear_attn")     # linear_attn: Qwen3.5's Gated DeltaNet
LFM2_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
LFM2_CONV = ("conv.in_proj", "conv.out_proj")
LFM2_MLP = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")     # gate, up, down
ROUTER = "gate"              # an MoE layer's router (mlp.gate: E x hidden), a linear module of its own
ROUTERS = (ROUTER, "router")   # every family's router module (gpt-oss's is mlp.router, with a bias)
SHARED_EXPERT_MODULES = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                         "shared_expert_gate")   # Qwen2-MoE's shared expert and its sigmoid gate (1 x hidden)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")   # an MoE layer's experts: 3-D tensors under mlp.experts


def _layer_windows(raw: dict, family: str, layers: int, max_pos: int, source: str) -> tuple:
    """Each layer's sliding window as transformers applies it (0: full attention): Mistral's and Phi-3's
    `sliding_window` on every layer; Qwen2 / Qwen3's when `use_sliding_window`, on the layers from `max_window_layers` on
    (or as `layer_types` says); Gemma 3's on its sliding layers. A window of at least the context is no window."""
    window = raw.get("sliding_window")
    use_window = raw.get("use_sliding_window", family in ("mistral", "gemma2", "gemma3", "phi3", "gpt_oss"))
    if window is None or not use_window:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer, got {window!r}")
    if window >= max_pos:
        return ()
    types = gemma_layer_types(raw, layers, family) if family.startswith("gemma") else raw.get("layer_types")
    if types is None and family == "gpt_oss":     # transformers' gpt-oss: sliding and full layers alternate
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if types is not None:
        if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ConfigError(f"{source}: field 'layer_types' must list 'sliding_attention' or 'full_attention' "
                              f"for each of the {layers} layers")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    first = int(raw.get("max_window_layers", 0)) if family not in ("mistral", "phi3") else 0
    return tuple(window if i >= first else 0 for i in range(layers))


def _rope_layers(raw: dict, layers: int, source: str) -> tuple:
    """SmolLM3's no_rope_layers (1: the layer uses RoPE), or from no_rope_layer_interval (default 4: every fourth
    layer without), as transformers' SmolLM3Config makes them."""
    given = raw.get("no_rope_layers")
    if given is None:
        interval = positive_field({"no_rope_layer_interval": 4, **raw}, "no_rope_layer_interval", source)
        return tuple((i + 1) % int(interval) != 0 for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(v not in (0, 1) for v in given):
        raise ConfigError(f"{source}: field 'no_rope_layers' must list 0 or 1 for each of the {layers} layers")
    return tuple(bool(v) for v in given)


# what transformers' Gemma and Phi-3 configs default where config.json lacks a field (the Llama-family
# defaults differ; the hub's multimodal Gemma 3 checkpoints leave most of their text_config to these)
_GEMMA_SIZES = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4}
FAMILY_DEFAULTS = {
    "lfm2": lfm2.DEFAULTS,
    "lfm2_moe": lfm2.MOE_DEFAULTS,
    "lfm3": lfm3.DEFAULTS,
    "qwen3_5": qwen3_5.DEFAULTS,
    "qwen3_next": qwen3_5.DEFAULTS,
    "qwen3_5_moe": qwen3_5.DEFAULTS,
    "smollm3": {"tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "phi3": {"rms_norm_eps": 1e-5, "pad_token_id": 32000, "bos_token_id": 1, "eos_token_id": 32000,
             "max_position_embeddings": 4096},
    "gemma2": {**_GEMMA_SIZES, "head_dim": 256, "max_position_embeddings": 8192, "pad_token_id": 0,
               "sliding_window": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "gemma3": {**_GEMMA_SIZES, "vocab_size": 262208, "head_dim": 256, "max_position_embeddings": 131072,
               "pad_token_id": 0, "sliding_window": 4096, "rms_norm_eps": 1e-6},
    "gpt_oss": {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
                "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}},
}


def _pad_row(pad, vocab: int) -> int | None:
    """The embedding row transformers builds with padding_idx (no gradient), if config.json names one."""
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else None


def _check_gpt_oss(raw: dict, source: str):
    """Refuse what gpt-oss's config.json may ask for beyond what is implemented: dropout inside attention, a
    quantisation other than MXFP4 (its experts: packed_experts)."""
    if raw.get("attention_dropout"):
        raise ConfigError(f"{source}: field 'attention_dropout' is {raw['attention_dropout']!r}; only 0 is supported")
    quant = raw.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(f"{source}: field 'quantization_config' has quant_method {method!r}; only 'mxfp4' (the "
                          f"experts' blocks and scales) is supported")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters that the math needs, normalised across model families."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    pad_token_id: int | None = None   # transformers' embedding padding_idx: that row's gradient is zero
    eos_token_id: int | list | None = None
    layer_windows: tuple = ()    # per layer: the sliding window (query i sees keys j with i - j < it), 0 for none
    hidden_act: str = "silu"     # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    norm_offset: float = 0.0     # every RMSNorm scales by (norm_offset + weight): Gemma's 1 + w
    embed_scale: float = 1.0     # the embedding's rows times this (Gemma: sqrt(hidden_size), rounded to float32)
    query_scale: float = 1.0     # queries times this after RoPE: scores scale by query_scale / sqrt(head_dim)
    sandwich_norms: bool = False   # Gemma: RMSNorms on the attention's and the MLP's outputs before the residual adds
    local_rope: tuple = ()       # per layer: whether it uses local_rope_theta, unscaled (Gemma's sliding layers)
    local_rope_theta: float = 10000.0
    attn_softcap: float = 0.0    # Gemma 2: scaled attention scores become cap * tanh(s / cap); 0 for none
    logit_softcap: float = 0.0   # Gemma 2: logits likewise (final_logit_softcapping)
    rotary_dim: int = 0          # the leading dims of each head that RoPE rotates (Phi-4-mini's partial rotary); 0: all
    moe: MoeConfig | None = None   # the experts of a mixture-of-experts model (moe.py); None for a dense one
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each attention softmax's denominator
    qk_norm_per_head: bool = True  # q / k norms over each head (Qwen3, Gemma 3) or the whole projection (OLMoE)
    rope_layers: tuple = ()      # per layer: whether it rotates q and k (SmolLM3's no_rope_layers); (): every layer
    conv_kernel: int = 0         # LFM2: its short convolutions' kernel (conv_L_cache)
    conv_layers: tuple = ()      # per layer: whether it is a short convolution (LFM2's "conv"); (): none is
    linear_layers: tuple = ()    # per layer: whether it is Gated DeltaNet linear attention (Qwen3.5); (): none is
    linear_attention: qwen3_5.LinearAttention | None = None   # those layers' heads and sizes
    attn_output_gate: bool = False   # Qwen3.5: attention's output times sigmoid of a gate q_proj also writes
    head_gate: bool = False      # LFM3: each attention head's output times sigmoid of its g_proj output (Hq x hidden)
    wrapper: str = ""            # the multimodal class whose language model this is (multimodal.py); "" for a text model
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE (SmolLM3's NoPE layers do not)."""
        return bool(self.rope_layers[layer]) if self.rope_layers else True

    def is_conv(self, layer: int) -> bool:
        """Whether layer `layer` is a double-gated short convolution (LFM2) in place of attention."""
        return bool(self.conv_layers[layer]) if self.conv_layers else False

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) in place of attention."""
        return bool(self.linear_layers[layer]) if self.linear_layers else False

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a per-row recurrent state in generation (a short convolution's window, a linear
        attention's state)."""
        return any(self.conv_layers) or any(self.linear_layers)

    @property
    def recurrent_kind(self) -> str:
        """The recurrent layers' kind in words, for the WebGPU engine's refusal."""
        return "linear-attention (Gated DeltaNet)" if any(self.linear_layers) else "short-convolution"

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding attention window in tokens, 0 for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def label(self) -> str:
        """The architecture as the user's checkpoint names it (a multimodal one: its language model)."""
        return f"{self.wrapper}'s language model" if self.wrapper else self.architecture

    @property
    def fused_projections(self) -> bool:
        """Phi-3: one qkv_proj for q / k / v and one gate_up_proj for gate / up."""
        return self.family == "phi3"

    @property
    def linear_modules(self) -> tuple:
        """Every layer kind's linear modules, each once: the attention's, the other token mixers', the dense
        MLP's, then a mixture of experts' router and shared expert (layer_modules: one layer's)."""
        parts = [self._layer_parts(i) for i in range(self.num_hidden_layers)]
        attention = self._attention_modules()
        mixers = sorted({mixer for mixer, _ in parts}, key=lambda m: m != attention)
        mlps = sorted({mlp for _, mlp in parts}, key=lambda m: m[0] == self.moe.router if self.moe else False)
        return tuple(dict.fromkeys(m for group in mixers + mlps for m in group))

    def modules_by_layer_kind(self) -> dict:
        """Each kind of layer part's linear modules ({"conv layers": (...), "attention layers": (...), "MLPs":
        (...)}), for a refusal that says which kind of layer has a module."""
        groups: dict = {}
        for layer in range(self.num_hidden_layers):
            mixer, mlp = self._layer_parts(layer)
            kind = ("conv" if self.is_conv(layer) else
                    "linear_attention" if self.linear_attention is not None and self.is_linear(layer) else
                    "attention")
            groups.setdefault(f"{kind} layers", mixer)
            groups.setdefault("mixture-of-experts MLPs" if self.is_sparse(layer) else "MLPs", mlp)
        return groups

    def layer_modules(self, layer: int) -> tuple:
        """Layer `layer`'s linear modules in order: its token mixer's (attention's: Llama's four, Phi-3's fused
        two, LFM2's; LFM2's convolution; Qwen3.5's linear attention), then its channel mixer's (the dense MLP; a
        mixture of experts' router and its shared expert, the experts themselves being 3-D tensors)."""
        mixer, mlp = self._layer_parts(layer)
        return mixer + mlp

    def _attention_modules(self) -> tuple:
        if self.family in lfm2.FAMILIES:
            return LFM2_ATTENTION
        if self.head_gate:
            return LINEAR_MODULES[:4] + ("g_proj",)
        return FUSED_LINEAR_MODULES[:2] if self.fused_projections else LINEAR_MODULES[:4]

    def _layer_parts(self, layer: int) -> tuple[tuple, tuple]:
        """(the token mixer's linear modules, the channel mixer's) of layer `layer`."""
        liquid = self.family in (*lfm2.FAMILIES, "lfm3")
        if liquid and self.is_conv(layer):
            mixer = LFM2_CONV
        elif self.linear_attention is not None and self.is_linear(layer):
            mixer = self.linear_attention.modules
        else:
            mixer = self._attention_modules()
        if self.is_sparse(layer):
            mlp = (self.moe.router,) + (SHARED_EXPERT_MODULES if self.moe.shared_expert_size else ())
        else:
            mlp = LFM2_MLP if liquid else FUSED_LINEAR_MODULES[2:] if self.fused_projections else LINEAR_MODULES[4:]
        return mixer, mlp

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def expert_shape(self, param: str) -> tuple[int, int, int]:
        """(experts, out_features, in_features) of an MoE layer's expert tensor (EXPERT_PARAMETERS): gate_up_proj
        (E, 2I, hidden) with the gate's rows first, down_proj (E, hidden, I), as transformers 5 fuses them."""
        e, f, c = self.moe.num_experts, self.moe.expert_size, self.hidden_size
        return {"gate_up_proj": (e, 2 * f, c), "down_proj": (e, c, f)}[param]

    def module_id(self, layer: int, module: str) -> int:
        """A linear module's index over the whole model (its LoRA dropout seed)."""
        return layer * len(self.linear_modules) + self.linear_modules.index(module)

    def linear_shape(self, module: str) -> tuple[int, int]:
        """(out_features, in_features) of one of a layer's linear modules (fused ones included)."""
        c, f = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size * (2 if self.attn_output_gate else 1), c), "k_proj": (self.kv_size, c), "v_proj": (self.kv_size, c),
            "o_proj": (c, self.q_size), "gate_proj": (f, c), "up_proj": (f, c), "down_proj": (c, f),
            "qkv_proj": (self.q_size + 2 * self.kv_size, c), "gate_up_proj": (2 * f, c),
            "out_proj": (c, self.q_size), "g_proj": (self.num_attention_heads, c), "conv.in_proj": (3 * c, c), "conv.out_proj": (c, c),
            "feed_forward.w1": (f, c), "feed_forward.w3": (f, c), "feed_forward.w2": (c, f),
            **self._moe_shapes(), **(self.linear_attention.shapes(c) if self.linear_attention else {}),
        }[module]

    def _moe_shapes(self) -> dict:
        """The MoE modules' (out_features, in_features): the router and the shared expert."""
        if self.moe is None:
            return {}
        s, c = self.moe.shared_expert_size, self.hidden_size
        return {self.moe.router: (self.moe.num_experts, c), "shared_expert.gate_proj": (s, c), "shared_expert.up_proj": (s, c),
                "shared_expert.down_proj": (c, s), "shared_expert_gate": (1, c)}

    @property
    def rope_scale(self) -> float:
        """What RoPE multiplies the rotated dims by (longrope's and YaRN's attention factor; 1 otherwise)."""
        s = self.rope_scaling
        return float(s["attention_factor"]) if s and s["rope_type"] in ("longrope", "yarn") else 1.0

    def rope_long(self, max_position: int) -> bool:
        """Whether a forward whose largest position is max_position takes longrope's long factors: as
        transformers does, when max_position + 1 exceeds original_max_position_embeddings."""
        s = self.rope_scaling
        return bool(s) and s["rope_type"] == "longrope" and max_position + 1 > s["original_max_position_embeddings"]

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype config.json gives the checkpoint's weights (torch_dtype, or transformers 5's dtype; a
        multimodal checkpoint's text_config when the top level has none); "" when it gives none."""
        for raw in (self.raw, self.raw.get("text_config") or {}):
            value = raw.get("torch_dtype") or raw.get("dtype")
            if isinstance(value, str) and value:
                return value.removeprefix("torch.")
        return ""

    packed_experts = property(lambda self: self.moe.packed if self.moe else "", doc="MoeConfig.packed, or \"\"")

    def inv_freq(self, layer: int = 0, long: bool = False) -> np.ndarray:
        """Layer `layer`'s RoPE inverse frequencies (rotary_dim/2,), float64 (rope.inv_freq)."""
        return inv_freq(self, layer, long)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Normalise a Hugging Face config dict; refuse what the math here does not implement."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in WRAPPERS:      # text-only fine-tuning of a multimodal checkpoint: its language model
            return from_wrapper(cls, raw, source)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: field 'architectures' is {archs!r}; supported: "
                              f"{', '.join([*SUPPORTED_ARCHITECTURES, *WRAPPERS])}")
        family = SUPPORTED_ARCHITECTURES[arch]
        given, raw = raw, {**FAMILY_DEFAULTS.get(family, {}), **raw}
        if family in (*lfm2.FAMILIES, "lfm3"):
            raw = lfm2.lfm2_raw(raw)

        def need(key):
            if key not in raw:
                raise ConfigError(f"{source}: required field '{key}' is missing")
            return raw[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = raw.get("head_dim") or hidden // heads
        layers = int(need("num_hidden_layers"))
        gemma = gemma_fields(raw, source, family, layers, hidden, int(head_dim)) if family.startswith("gemma") else {}
        liquid = lfm2.lfm2_fields(raw, family, layers, source) if family in lfm2.FAMILIES else \
            lfm3.lfm3_fields(raw, layers, int(raw.get("max_position_embeddings", 4096)), source) if family == "lfm3" else \
            qwen3_5.qwen3_5_fields(raw, family, layers, source) if family in qwen3_5.FAMILIES else {}
        ff_size = liquid.pop("intermediate_size", None)
        act = raw.get("hidden_act", "silu")
        if not gemma and act not in ("silu", "swish"):   # Gemma's is its hidden_activation (_gemma_fields)
            raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")
        max_pos = int(raw.get("max_position_embeddings", 4096))
        params = gemma.pop("rope_parameters", liquid.pop("rope_parameters", None))    # Gemma's / LFM3's full layers'
        theta, scaling, rotary_dim = rope_settings(raw, params, family, int(head_dim), max_pos, source)
        rope_layers = _rope_layers(raw, layers, source) if family == "smollm3" else ()
        if family == "smollm3" and raw.get("layer_types") is None:      # transformers' SmolLM3: NoPE layers slide
            raw = {**raw, "layer_types": ["sliding_attention" if raw.get("use_sliding_window") and
                                          raw.get("sliding_window") and not r else "full_attention"
                                          for r in rope_layers]}
        windows = liquid.pop("layer_windows") if family == "lfm3" else _layer_windows(raw, family, layers, max_pos, source)
        moe = lfm2.lfm2_moe_settings(raw, layers, source) if family == "lfm2_moe" else \
            moe_settings(raw, family, layers, source)
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: field 'mlp_bias' is true; not supported")
        if family == "gpt_oss":
            _check_gpt_oss(raw, source)
        attention_bias = bool(raw.get("attention_bias", family == "qwen2")) and family != "phi3"
        if family == "qwen2":
            attention_bias = True
        if family == "qwen2_moe":
            attention_bias = bool(raw.get("qkv_bias", True))
        if family == "gpt_oss":
            attention_bias = bool(raw.get("attention_bias", True))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            # Mixtral's and OLMoE's intermediate_size is their experts' (moe.expert_size), Qwen3.5-MoE has none:
            # no layer is dense
            # (LFM2's MLP width is derived from it: lfm2.feed_forward_size)
            intermediate_size=ff_size if ff_size is not None else
            0 if family in ("mixtral", "olmoe", "gpt_oss", "qwen3_5_moe") else int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.startswith("gemma"))),
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe", "olmoe", *lfm2.FAMILIES, "lfm3", *qwen3_5.FAMILIES),
            qk_norm_per_head=family != "olmoe",
            rope_layers=rope_layers,
            moe=moe,
            attention_sinks=family == "gpt_oss",
            max_position_embeddings=max_pos,
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=_pad_row(raw.get("pad_token_id"), int(need("vocab_size"))),
            eos_token_id=raw.get("eos_token_id"),
            layer_windows=windows,
            rotary_dim=rotary_dim,
            **{"hidden_act": "silu", **gemma, **liquid},
            raw=given,
        )

    @classmethod
    def from_folder(cls, path) -> "ModelConfig":
        path = Path(path)
        cfg = path / "config.json"
        if not path.is_dir():
            raise ModelFileError(f"model folder not found: {path}")
        if not cfg.is_file():
            raise ModelFileError(f"no config.json in model folder {path}")
        try:
            raw = json.loads(cfg.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{cfg}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelFileError(f"{cfg}: expected a JSON object")
        return cls.from_dict(raw, str(cfg))
