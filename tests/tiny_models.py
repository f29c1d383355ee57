"""Tiny randomly initialised transformers models (odd sizes), saved as Hugging Face folders for the tests."""
from __future__ import annotations

import json
import re

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")

# Sizes avoid multiples of 4, 16 and 64 where the architecture allows (head_dim must be even for RoPE).
BASE = dict(vocab_size=83, hidden_size=30, intermediate_size=43, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=1, max_position_embeddings=128, rms_norm_eps=1e-5)


def hf_config(arch: str, **overrides):
    import transformers as tf

    kw = dict(BASE)
    if arch == "llama":
        kw.update(rope_theta=5000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        cls = tf.LlamaConfig
    elif arch == "mistral":
        kw.update(sliding_window=None, tie_word_embeddings=False, head_dim=10)
        cls = tf.MistralConfig
    elif arch == "qwen2":
        kw.update(tie_word_embeddings=True, use_sliding_window=False)
        cls = tf.Qwen2Config
    elif arch == "qwen3":
        kw.update(head_dim=14, tie_word_embeddings=True, use_sliding_window=False, num_key_value_heads=3)
        cls = tf.Qwen3Config
    elif arch == "gemma2":
        # soft-caps low enough to bend these tiny models' scores and logits
        kw.update(head_dim=14, tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=20,
                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        cls = tf.Gemma2Config
    elif arch == "gemma3":
        # a sliding layer (local RoPE base, a 5-token window) and a global one (linear RoPE scaling), a query
        # scale that is not 1 / sqrt(head_dim)
        kw.update(head_dim=14, tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=20,
                  layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}})
        cls = tf.Gemma3TextConfig
    elif arch == "phi3":
        # Phi-4-mini's shape of RoPE: a partial rotary (6 of 10 dims) under longrope, whose long factors (and
        # attention factor) take over past original_max_position_embeddings; a sliding window; a padding row
        kw.update(tie_word_embeddings=True, sliding_window=9, pad_token_id=3, bos_token_id=1, eos_token_id=2,
                  original_max_position_embeddings=8,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.6,
                                   "short_factor": [1.0, 1.3, 2.1], "long_factor": [1.7, 3.9, 11.0]})
        cls = tf.Phi3Config
    elif arch == "gemma3_mm":
        # a multimodal Gemma 3 (gemma-3-4b's class): the gemma3 text model beside a one-layer SigLIP tower
        vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        tie = overrides.pop("tie_word_embeddings", True)     # the class ties by its own (top-level) field
        return tf.Gemma3Config(text_config=hf_config("gemma3", tie_word_embeddings=tie, **overrides).to_dict(),
                               vision_config=vision.to_dict(), mm_tokens_per_image=4, tie_word_embeddings=tie)
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def in_arch(arch: str, names):
    """Module names, paths or target regexes written for Llama's seven modules, as `arch` names them: Phi-3
    fuses q / k / v into qkv_proj and gate / up into gate_up_proj (a list or tuple keeps one of each)."""
    if isinstance(names, (list, tuple)):
        out = [in_arch(arch, n) for n in names]
        return type(names)(dict.fromkeys(out))
    if arch != "phi3":
        return names
    names = re.sub(r"\b[qkv]_proj\b", "qkv_proj", names)
    names = re.sub(r"\b(gate|up)_proj\b", "gate_up_proj", names)
    return names.replace("(qkv_proj|qkv_proj|qkv_proj)", "qkv_proj")


def build_model(arch: str, seed: int = 0, **overrides):
    """A transformers CausalLM with random weights (norm weights randomised too, so they matter)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:     # Gemma's norms scale by 1 + w
                p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


def save_model(model, folder, dtype=None):
    """save_pretrained into folder (optionally converted to float16 / bfloat16)."""
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


# Mixtures of experts (tests/test_moe_models.py): odd sizes, a dense layer among the sparse ones where the family
# has them, k > 1
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
_MOE = dict(vocab_size=61, hidden_size=30, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1,
            max_position_embeddings=64, rms_norm_eps=1e-5)


def moe_config(arch: str, **overrides):
    """A transformers config of a tiny mixture of experts (5 experts, 2 or 3 per token)."""
    import transformers as tf

    kw = dict(_MOE)
    if arch == "mixtral":
        kw.update(intermediate_size=19, num_local_experts=5, num_experts_per_tok=2, head_dim=6)
        cls = tf.MixtralConfig
    elif arch == "qwen3_moe":
        kw.update(head_dim=6, intermediate_size=23, moe_intermediate_size=19, num_experts=5, num_experts_per_tok=2,
                  norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True)
        cls = tf.Qwen3MoeConfig
    elif arch == "qwen2_moe":
        kw.update(intermediate_size=23, moe_intermediate_size=19, shared_expert_intermediate_size=13, num_experts=5,
                  num_experts_per_tok=2, decoder_sparse_step=2)
        cls = tf.Qwen2MoeConfig
    elif arch == "olmoe":
        kw.update(intermediate_size=19, num_experts=5, num_experts_per_tok=3, num_key_value_heads=5, pad_token_id=0,
                  eos_token_id=1)
        cls = tf.OlmoeConfig
    else:
        raise ValueError(arch)
    kw.update(overrides)
    return cls(**kw)


def build_moe(arch: str, seed: int = 0, **overrides):
    """A tiny random mixture-of-experts CausalLM (eager attention, float32, norms randomised)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    # the experts' eager loop: torch's grouped GEMM needs 16-byte strides, which these odd sizes do not have
    model = tf.AutoModelForCausalLM.from_config(moe_config(arch, **overrides), dtype=torch.float32,
                                                attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + (0.3 if "norm" in name or "gate" in name else 0.15)
                    * torch.randn_like(p))
    return model.eval()
