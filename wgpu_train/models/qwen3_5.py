"""Qwen3.5 (dense and MoE) and Qwen3-Next in config.json (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
Qwen3NextForCausalLM): which layers are Gated DeltaNet linear attention and which gated full attention (layer_types,
or every full_attention_interval-th layer), the linear attention's heads and sizes (LinearAttention), and their
module names: Qwen3.5's separate in-projections, or Qwen3-Next's two fused ones whose rows interleave per key head.
The variants not implemented are refused by field."""
from __future__ import annotations

from dataclasses import dataclass

from wgpu_train.errors import ConfigError, positive_field
from wgpu_train.models.layer_types import checked_layer_types

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LAYER_KINDS = ("linear_attention", "full_attention")
# transformers 5's Qwen3_5TextConfig / Qwen3NextConfig defaults, for fields a config.json leaves out
DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "partial_rotary_factor": 0.25}
# the linear-attention layer's modules, by their path under the layer (config.LAYER_GROUPS: "linear_attn")
SEPARATE_MODULES = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                    "linear_attn.in_proj_a", "linear_attn.out_proj")
FUSED_MODULES = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj")


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's sizes: key_heads Hk of key_dim Dk (q and k), value_heads Hv of value_dim Dv (v, z, the
    decay g and beta; a multiple of Hk), the causal conv1d's kernel over q, k and v side by side, and whether the
    in-projections are fused per key head (Qwen3-Next) or separate (Qwen3.5)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    fused: bool

    @property
    def keys(self) -> int:
        """Hk Dk: the width of q, and of k."""
        return self.key_heads * self.key_dim

    @property
    def values(self) -> int:
        """Hv Dv: the width of v, z and the rule's output."""
        return self.value_heads * self.value_dim

    @property
    def conv_width(self) -> int:
        """The conv1d's channels: q, k and v side by side."""
        return 2 * self.keys + self.values

    @property
    def modules(self) -> tuple:
        return FUSED_MODULES if self.fused else SEPARATE_MODULES

    @property
    def even_widths(self) -> dict:
        """The config fields whose values 16-bit activations on the WebGPU engine need even (a row's pairs its own):
        the value heads (Qwen3.5's in_proj_b / in_proj_a rows) and their dim (the gated norm's rows)."""
        return {"linear_num_value_heads": self.value_heads, "linear_value_head_dim": self.value_dim}

    def shapes(self, hidden: int) -> dict:
        """(out_features, in_features) of each of its linear modules."""
        hv = self.value_heads
        return {"linear_attn.in_proj_qkv": (self.conv_width, hidden), "linear_attn.in_proj_z": (self.values, hidden),
                "linear_attn.in_proj_b": (hv, hidden), "linear_attn.in_proj_a": (hv, hidden),
                "linear_attn.in_proj_qkvz": (self.conv_width + self.values, hidden),
                "linear_attn.in_proj_ba": (2 * hv, hidden), "linear_attn.out_proj": (hidden, self.values)}


def linear_layers(raw: dict, layers: int, source: str) -> tuple:
    """Per layer, whether it is linear attention: layer_types, or every full_attention_interval-th layer (default 4)
    full attention, as transformers' configs make them."""
    types = raw.get("layer_types")
    if types is None:
        interval = int(positive_field({"full_attention_interval": 4, **raw}, "full_attention_interval", source))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    return tuple(t == "linear_attention" for t in checked_layer_types(types, layers, LAYER_KINDS, source))


def qwen3_5_fields(raw: dict, family: str, layers: int, source: str) -> dict:
    """The ModelConfig fields of a Qwen3.5 / Qwen3-Next config beyond Llama's: the layer kinds, the linear attention,
    the full-attention layers' output gate, their q / k norms and every RMSNorm's 1 + weight."""
    for key in ("attention_bias", "attention_dropout"):
        if raw.get(key):
            raise ConfigError(f"{source}: field '{key}' is {raw[key]!r}; only false / 0 is supported")
    sizes = {key: int(positive_field(raw, key, source)) for key in
             ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")}
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ConfigError(f"{source}: field 'linear_num_value_heads' ({sizes['linear_num_value_heads']}) must be a "
                          f"multiple of 'linear_num_key_heads' ({sizes['linear_num_key_heads']})")
    spec = LinearAttention(sizes["linear_num_key_heads"], sizes["linear_num_value_heads"],
                           sizes["linear_key_head_dim"], sizes["linear_value_head_dim"],
                           sizes["linear_conv_kernel_dim"], fused=family == "qwen3_next")
    return {"linear_layers": linear_layers(raw, layers, source), "linear_attention": spec, "attn_output_gate": True,
            "norm_offset": 1.0}
