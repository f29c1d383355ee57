"""A (merged) model as one GGUF file for llama.cpp and Ollama, written with the `gguf` package (the llama.cpp
project's own Python writer): llama.cpp's tensor names and layout (q / k rows of Llama and Mistral in its
rotary order), the model's hyper-parameters, its byte-level BPE tokenizer and chat template; weights in f32,
f16 or q8_0, each tensor of the type llama.cpp's converter gives it (tensor_type: its q8_0 tensors are the
converter's, byte for byte). Mixtures of experts as llama.cpp's qwen3moe, qwen2moe (its shared expert), olmoe and
Mixtral as llama: each layer's experts as stacked (E, rows, cols) tensors (ffn_gate_exps / ffn_up_exps /
ffn_down_exps), the router as ffn_gate_inp, expert_count / expert_used_count and the expert widths. The hybrid
families (SmolLM3, LFM2, LFM2-MoE, Qwen3.5, Qwen3-Next) as gguf_hybrid says. Every architecture is run by llama.cpp
itself in tests/test_gguf_llamacpp.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from wgpu_train.models.config import ModelConfig
from wgpu_train.errors import ConfigError
from wgpu_train.models.gguf_hybrid import (F32_SUFFIXES, HYBRID_ARCHES, add_hybrid_fields, check_hybrid,
                                           head_count_kv, hybrid_tensors, rope_dimension_count)

TYPES = ("f32", "f16", "q8_0")
# Hugging Face architecture -> llama.cpp's (Mistral runs as llama there)
ARCHES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
          "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe", **HYBRID_ARCHES}
# whether llama.cpp's MoE graph of each architecture divides the top-k weights by their sum (build_moe_ffn's
# norm_w in its llama, qwen3moe, qwen2moe, olmoe, qwen3next and qwen35moe graphs); every layer of these
# graphs is sparse
RENORMALISES = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False, "qwen3next": True,
                "qwen35moe": True, "lfm2moe": True}
LEADING_DENSE = ("lfm2moe",)                   # the MoE graphs whose first leading_dense_block_count layers are dense
ROTARY_ROWS = ("llama", "smollm3")             # the architectures whose q / k rows llama.cpp's converter permutes
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3           # gguf.TokenType values
Q8_BLOCK = 32                                  # values per q8_0 block (along a row)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConfigError("--gguf needs the gguf package: pip install 'wgpu-train[gguf]'") from None
    return gguf


def rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """q / k projection rows from Hugging Face's rotary order (each head's first half, then its second) to
    llama.cpp's (the two halves interleaved), as its converter writes llama-arch models. w (n_head * D, in)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check(config: ModelConfig, dtype: str):
    """One line (ConfigError) for what this writer does not export, or without the gguf package."""
    _gguf()
    if config.architecture not in ARCHES:
        raise ConfigError(f"--gguf: architecture {config.architecture} is not exported (only "
                          f"{', '.join(sorted(ARCHES))})")
    if dtype not in TYPES:
        raise ConfigError(f"--gguf-type {dtype!r}: choose from {', '.join(TYPES)}")
    if config.rope_scaling:
        raise ConfigError(f"--gguf: rope_scaling {config.rope_scaling.get('rope_type', config.rope_scaling)} is "
                          "not exported")
    moe, arch = config.moe, ARCHES[config.architecture]
    check_hybrid(config, arch)
    if moe is not None:
        dense = [i for i in range(config.num_hidden_layers) if not moe.is_sparse(i)]
        if dense and not (arch in LEADING_DENSE and dense == list(range(len(dense)))):
            raise ConfigError(f"--gguf: llama.cpp's {arch} has experts in every layer; layers {dense} of this model "
                              "are dense (mlp_only_layers / decoder_sparse_step)")
        if moe.normalize != RENORMALISES[arch]:
            raise ConfigError(f"--gguf: llama.cpp's {arch} {'renormalises' if RENORMALISES[arch] else 'keeps'} the "
                              f"top-k weights; this model's norm_topk_prob is {moe.normalize}")


def tokenizer_fields(folder, vocab_size: int | None = None) -> dict:
    """tokens, token types, merges and special ids of a byte-level BPE tokenizer.json, the chat template; the
    token list padded to vocab_size (the embedding's rows: llama.cpp wants one token per row)."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--gguf: cannot read {folder / 'tokenizer.json'} ({e})") from None
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or not any(
            (p or {}).get("type") == "ByteLevel" for p in [raw.get("pre_tokenizer") or {}]
            + list((raw.get("pre_tokenizer") or {}).get("pretokenizers") or [])):
        raise ConfigError("--gguf: only byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM) are "
                          f"exported; this one is {model.get('type')}")
    vocab = dict(model["vocab"])
    added = {t["content"]: (t["id"], t.get("special", False)) for t in raw.get("added_tokens", [])}
    size = max([*vocab.values(), *(i for i, _ in added.values())]) + 1
    if vocab_size is not None:
        if size > vocab_size:
            raise ConfigError(f"--gguf: the tokenizer has token id {size - 1}, beyond the model's vocab_size "
                              f"{vocab_size}")
        size = vocab_size
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [_TOKEN_NORMAL] * size
    for text, i in vocab.items():
        tokens[i] = text
    for text, (i, special) in added.items():
        tokens[i] = text
        types[i] = _TOKEN_CONTROL if special else _TOKEN_NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg = {}
    if (folder / "tokenizer_config.json").is_file():
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    by_text = {t: i for i, t in enumerate(tokens)}

    def token_id(key):
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return by_text.get(value) if isinstance(value, str) else None

    return {"tokens": tokens, "types": types, "merges": merges, "template": template,
            "eos": token_id("eos_token"), "bos": token_id("bos_token"), "pad": token_id("pad_token")}


def _gguf_tensors(gguf, names, hf_name: str, value, config: ModelConfig) -> list:
    """[(llama.cpp's name, float32 array)] of one of our tensors: an MoE layer's fused gate_up_proj (E, 2I, H)
    split into the stacked gate and up experts, its down_proj (E, H, I) as the stacked down experts; Qwen2-MoE's
    shared expert gate (1, H) as the vector llama.cpp (and transformers' GGUF reader) take; q / k rows in llama's
    rotary order; any other under gguf's name map."""
    w = np.asarray(value, dtype=np.float32)
    arch = ARCHES[config.architecture]
    hybrid = hybrid_tensors(names, hf_name, w, config, arch)
    if hybrid is not None:
        return hybrid
    if ".experts." in hf_name:                     # under mlp, or LFM2-MoE's feed_forward
        layer = int(hf_name.split(".")[2])
        gate, up, down = (gguf.TENSOR_NAMES[t].format(bid=layer) + ".weight" for t in (
            gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP, gguf.MODEL_TENSOR.FFN_DOWN_EXP))
        if hf_name.endswith("gate_up_proj"):
            inter = config.moe.expert_size
            return [(gate, w[:, :inter]), (up, w[:, inter:])]
        return [(down, w)]
    gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise ConfigError(f"--gguf: no llama.cpp name for tensor {hf_name}")
    if hf_name.endswith("shared_expert_gate.weight"):
        w = w.reshape(-1)
    elif arch in ROTARY_ROWS and hf_name.endswith("q_proj.weight"):
        w = rotary_rows(w, config.num_attention_heads)
    elif arch in ROTARY_ROWS and hf_name.endswith("k_proj.weight"):
        w = rotary_rows(w, config.num_key_value_heads)
    return [(gname, w)]


def tensor_type(gname: str, shape: tuple, dtype: str) -> str:
    """The type ("f32", "f16" or "q8_0") of llama.cpp's tensor `gname` of `shape` in a `dtype` file, as llama.cpp's
    converter (convert_hf_to_gguf.py's prepare_tensors) chooses it: float32 for 1-D tensors, norms, anything not a
    .weight and the tensors it keeps in float32 (F32_SUFFIXES: routers, convolutions); the file's type otherwise,
    with q8_0's rows that are no whole number of 32-value blocks in f16 (the quantiser refuses them)."""
    if len(shape) <= 1 or dtype == "f32" or gname.endswith(("_norm.weight", *F32_SUFFIXES)) \
            or not gname.endswith(".weight"):
        return "f32"
    if dtype == "f16" or shape[-1] % Q8_BLOCK:
        return "f16"
    return "q8_0"


def write_gguf(path, config: ModelConfig, weights: dict, tokenizer_folder, dtype: str = "f16",
               name: str = "") -> Path:
    """Write `weights` (Hugging Face names -> float32 arrays, e.g. Model.merged_weights()) of `config` with the
    tokenizer in `tokenizer_folder` as a GGUF file at `path`; returns the path."""
    gguf = _gguf()
    check(config, dtype)
    arch = ARCHES[config.architecture]
    tok = tokenizer_fields(tokenizer_folder, config.vocab_size)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or path.stem)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    # llama.cpp's llama (Mixtral) and olmoe graphs size their experts by feed_forward_length (no expert width key
    # is read), as the converter writes Mixtral's and OLMoE's intermediate_size, their experts' width
    experts_by_ffn = config.moe is not None and arch in ("llama", "olmoe")
    writer.add_feed_forward_length(config.moe.expert_size if experts_by_ffn else config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(head_count_kv(config, arch))
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(rope_dimension_count(config))
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
        if arch in ("qwen2moe", "qwen3moe", "qwen3next", "qwen35moe", "lfm2moe"):   # beside the dense MLP's width
            writer.add_expert_feed_forward_length(config.moe.expert_size)
        if config.moe.shared_expert_size:
            writer.add_expert_shared_feed_forward_length(config.moe.shared_expert_size)
    add_hybrid_fields(writer, config, arch)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    for key, adder in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id)):
        if tok[key] is not None:
            adder(tok[key])
    if tok["template"]:                        # llama.cpp's converter drops SmolLM3's "[:]", which its Jinja lacks
        writer.add_chat_template(tok["template"].replace("[:]", "") if arch == "smollm3" else tok["template"])

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers)
    tensors = dict(weights)
    if "lm_head.weight" not in tensors:            # tied: llama.cpp and transformers' loader both read output.weight
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for hf_name, value in tensors.items():
        for gname, w in _gguf_tensors(gguf, names, hf_name, value, config):
            kind = tensor_type(gname, w.shape, dtype)
            if kind == "f32":
                writer.add_tensor(gname, w)
            elif kind == "f16":
                writer.add_tensor(gname, w.astype(np.float16))
            else:
                q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
