"""GGUF export of the hybrid families as llama.cpp's converter writes them: SmolLM3 (llama.cpp's smollm3: its NoPE
layers fixed at every fourth), LFM2 (shortconv tensors, per-layer KV head counts, shortconv.l_cache) and LFM2-MoE
(lfm2moe: the same with sigmoid-routed experts after its leading dense layers, the expert bias as exp_probs_b), Qwen3.5 (qwen35,
and qwen35moe with its experts) and Qwen3-Next (qwen3next) with their Gated DeltaNet ssm_* tensors and
full_attention_interval."""

from __future__ import annotations

import numpy as np

from wgpu_train.errors import ConfigError
from wgpu_train.models.config import ModelConfig

HYBRID_ARCHES = {"SmolLM3ForCausalLM": "smollm3", "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2moe",
                 "Qwen3NextForCausalLM": "qwen3next", "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe"}
LIQUID = ("lfm2", "lfm2moe")                        # llama.cpp's short-convolution architectures
DELTANET = ("qwen3next", "qwen35", "qwen35moe")     # llama.cpp's Gated DeltaNet architectures
TILED_V = ("qwen35", "qwen35moe")                   # those whose converter tiles the value heads
SMOLLM3_NOPE_STEP = 4            # llama.cpp's smollm3 graph: layer i has no RoPE when (i + 1) % 4 == 0
# llama.cpp tensors its converter keeps in float32 whatever the file type (the convolutions, the routers)
F32_SUFFIXES = ("ssm_conv1d.weight", "shortconv.conv.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def attention_interval(config: ModelConfig) -> int:
    """Qwen3.5 / Qwen3-Next: the n with every n-th layer full attention and the others linear, as llama.cpp's
    full_attention_interval says; one line (ConfigError) for a pattern it cannot say."""
    linear = [config.is_linear(i) for i in range(config.num_hidden_layers)]
    interval = (linear.index(False) + 1) if False in linear else 0
    if not interval or linear != [(i + 1) % interval != 0 for i in range(len(linear))]:
        raise ConfigError("--gguf: llama.cpp's full_attention_interval makes every n-th layer full attention; this "
                          f"model's layer_types {['linear' if x else 'full' for x in linear]} are not such a pattern")
    return interval


def check_hybrid(config: ModelConfig, arch: str):
    """One line (ConfigError) for what llama.cpp's graph of `arch` cannot run as this model does."""
    if arch == "smollm3":
        want = tuple((i + 1) % SMOLLM3_NOPE_STEP != 0 for i in range(config.num_hidden_layers))
        if config.rope_layers and tuple(bool(x) for x in config.rope_layers) != want:
            raise ConfigError("--gguf: llama.cpp's smollm3 leaves RoPE out of every fourth layer; this model's "
                              f"no_rope_layers are {[int(x) for x in config.rope_layers]}")
    if arch in ("smollm3", *LIQUID) and any(config.layer_windows):
        raise ConfigError(f"--gguf: llama.cpp's {arch} has no sliding window; this model uses one")
    if arch in DELTANET:
        attention_interval(config)
    if arch in ("qwen3next", "qwen35moe") and (config.moe is None or not config.moe.shared_expert_size):
        raise ConfigError(f"--gguf: llama.cpp's {arch} has routed experts and a shared expert in every layer; this "
                          "model has " + ("no experts" if config.moe is None else "no shared expert"))
    if arch in DELTANET:
        spec = config.linear_attention       # llama.cpp sizes the value heads by ssm.state_size (the key head dim)
        if spec.value_dim != spec.key_dim:
            raise ConfigError(f"--gguf: llama.cpp's {arch} takes the linear attention's value heads as wide as its key "
                              f"heads; this model's are {spec.value_dim} and {spec.key_dim} (linear_value_head_dim, "
                              "linear_key_head_dim)")
    if arch == "lfm2moe" and config.moe.scaling != 1.0:      # its graph reads no expert_weights_scale
        raise ConfigError("--gguf: llama.cpp's lfm2moe does not scale the experts' weights; this model's "
                          f"routed_scaling_factor is {config.moe.scaling:g}")


def head_count_kv(config: ModelConfig, arch: str):
    """attention.head_count_kv: LFM2's per layer (0 on its convolutions: llama.cpp finds its attention layers so),
    every other model's one number."""
    if arch in LIQUID:
        return [0 if config.is_conv(i) else config.num_key_value_heads for i in range(config.num_hidden_layers)]
    return config.num_key_value_heads


def rope_dimension_count(config: ModelConfig) -> int:
    """rope.dimension_count: the dims of each head that RoPE rotates (Qwen3.5 / Qwen3-Next's partial rotary)."""
    return config.rotary_dim or config.head_dim


def default_sections(rotary_dims: int) -> list:
    """rope.dimension_sections for a config without mrope_section: the rotated pairs split t, h, w as the
    converter's default [11, 11, 10] splits Qwen3.5's 32 (64 rotary dims). llama.cpp's M-RoPE rotates a pair beyond
    the sections by the fourth position, 0 for text, and asserts that they fit the head; text gives t, h and w the
    same position, so any split of all the pairs rotates as transformers does."""
    pairs = rotary_dims // 2
    third = -(-pairs // 3)
    return [third, third, pairs - 2 * third]


def add_hybrid_fields(writer, config: ModelConfig, arch: str):
    """The metadata llama.cpp's converter adds for `arch` beyond a dense model's."""
    if arch in LIQUID:
        writer.add_shortconv_l_cache(config.conv_kernel)
    if arch == "lfm2moe":
        from gguf import ExpertGatingFuncType    # the writer's package: present wherever a writer is

        writer.add_leading_dense_block_count(config.moe.sparse.index(True) if any(config.moe.sparse) else
                                             config.num_hidden_layers)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch in DELTANET:
        spec = config.linear_attention
        writer.add_ssm_conv_kernel(spec.conv_kernel)
        writer.add_ssm_state_size(spec.key_dim)
        writer.add_ssm_group_count(spec.key_heads)
        writer.add_ssm_time_step_rank(spec.value_heads)
        writer.add_ssm_inner_size(spec.values)
        writer.add_full_attention_interval(attention_interval(config))
    if arch in TILED_V:
        rope = config.raw.get("rope_parameters") or config.raw.get("rope_scaling") or {}
        sections = list(rope.get("mrope_section") or default_sections(rope_dimension_count(config)))
        writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))


def tiled_v_heads(w: np.ndarray, axis: int, key_heads: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from Hugging Face's order, grouped by key head (k0's v0..v{r-1}, then k1's ...), to
    the tiled order llama.cpp's qwen35 broadcasts over (v0 of every key head, then v1 ...)."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(key_heads, -1, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _split_qkvz(w: np.ndarray, config: ModelConfig) -> tuple:
    """Qwen3-Next's fused in_proj_qkvz rows ([q, k, v, z] per key head) as llama.cpp's attn_qkv (every head's q,
    then k, then v) and attn_gate (z)."""
    spec = config.linear_attention
    per_v = spec.value_heads // spec.key_heads * spec.value_dim
    parts = np.split(w.reshape(spec.key_heads, -1, w.shape[-1]), np.cumsum([spec.key_dim, spec.key_dim, per_v]),
                     axis=1)
    q, k, v, z = (p.reshape(-1, w.shape[-1]) for p in parts)
    return np.concatenate([q, k, v]), z


def _linear_attention(w: np.ndarray, leaf: str, config: ModelConfig, arch: str) -> np.ndarray:
    """One linear-attention tensor as llama.cpp's converter changes it: qwen35(moe) with more value than key heads
    reorders the value heads (tiled_v_heads) in every tensor that has them; A_log becomes ssm_a = -exp(A_log); the
    conv1d weight (C, 1, K) loses its middle axis."""
    spec = config.linear_attention
    if arch in TILED_V and spec.value_heads != spec.key_heads:
        kh, keys = spec.key_heads, 2 * spec.keys
        if leaf == "in_proj_qkv.weight":
            w = np.concatenate([w[:keys], tiled_v_heads(w[keys:], 0, kh, spec.value_dim)])
        elif leaf == "in_proj_z.weight":
            w = tiled_v_heads(w, 0, kh, spec.value_dim)
        elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            w = tiled_v_heads(w, 0, kh, 1)
        elif leaf == "conv1d.weight":
            w = np.concatenate([w[:keys], tiled_v_heads(w[keys:], 0, kh, spec.value_dim)])
        elif leaf == "out_proj.weight":
            w = tiled_v_heads(w, 1, kh, spec.value_dim)
    if leaf == "A_log":
        w = -np.exp(w)
    elif leaf == "conv1d.weight":
        w = w.reshape(w.shape[0], w.shape[-1])
    return w


def hybrid_tensors(names, hf_name: str, w: np.ndarray, config: ModelConfig, arch: str) -> list | None:
    """[(llama.cpp's name, float32 array)] of one of our tensors where `arch` needs more than a renaming, or None:
    LFM2's conv weight squeezed to (C, K) and its final norm as token_embd_norm; Qwen3.5 / Qwen3-Next's linear
    attention (_linear_attention; dt_bias as ssm_dt.bias; Qwen3-Next's in_proj_qkvz split in two) and every
    zero-centred RMSNorm but the gated one written as 1 + weight, as llama.cpp's graph multiplies by it."""
    if arch in LIQUID:
        if hf_name == "model.norm.weight":
            return [("token_embd_norm.weight", w)]
        if hf_name == "lm_head.weight":         # gguf's lfm2moe name map has no output; llama.cpp reads one
            return [("output.weight", w)]
        if hf_name.endswith("conv.conv.weight"):
            return [(names.get_name(hf_name, try_suffixes=(".weight",)), w.reshape(w.shape[0], w.shape[-1]))]
        if hf_name.endswith(".feed_forward.expert_bias"):
            return [(names.get_name(hf_name + ".bias", try_suffixes=(".bias",)), w)]
        if arch == "lfm2moe" and hf_name.endswith(".feed_forward.gate.weight") and not config.moe.expert_bias:
            layer = int(hf_name.split(".")[2])    # llama.cpp's lfm2moe requires exp_probs_b: a zero bias chooses
            return [(names.get_name(hf_name, try_suffixes=(".weight",)), w),   # as no bias does
                    (f"blk.{layer}.exp_probs_b.bias", np.zeros(config.moe.num_experts, np.float32))]
        return None
    if arch not in DELTANET:
        return None
    if ".linear_attn." in hf_name:
        leaf = hf_name.split(".linear_attn.", 1)[1]
        w = _linear_attention(w, leaf, config, arch)
        layer = int(hf_name.split(".")[2])
        if leaf == "in_proj_qkvz.weight":
            qkv, z = _split_qkvz(w, config)
            return [(f"blk.{layer}.attn_qkv.weight", qkv), (f"blk.{layer}.attn_gate.weight", z)]
        if leaf == "dt_bias":
            hf_name = hf_name[:-len("dt_bias")] + "dt_proj.bias"
    elif hf_name.endswith("norm.weight"):
        w = w + 1.0
    else:
        return None
    gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise ConfigError(f"--gguf: no llama.cpp name for tensor {hf_name}")
    return [(gname, w)]
