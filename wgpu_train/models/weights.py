"""A model folder's weights: the tensor names and shapes a ModelConfig needs, reading them checked (a
multimodal checkpoint's language model included), and writing complete model folders."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from wgpu_train.errors import ConfigError, ModelFileError
from wgpu_train.formats.safetensors import (FLOAT_DTYPES, LazyWeights, TensorMap, _as_array, _read_raw,
                                           write_safetensors)
from wgpu_train.formats.tokenizer import TOKENIZER_FILES
from wgpu_train.models.config import ATTENTION_MODULES, EXPERT_PARAMETERS, LAYER_GROUPS, ModelConfig
from wgpu_train.models.expert_layout import hub_layout, in_out_names, is_fused, read_fused
from wgpu_train.models.layer_plan import layer_plan
from wgpu_train.models.multimodal import PROCESSOR_FILES, carried_tensors, file_name, language_names


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelFileError(f"{index}: not a valid safetensors index (needs 'weight_map')") from None
        return [folder / f for f in sorted(set(weight_map.values()))]
    if single.is_file():
        return [single]
    raise ModelFileError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def expected_shapes(cfg: ModelConfig) -> dict:
    """Every tensor name the model needs mapped to its shape (the attention's biases handled by the caller); a
    layer's norms are its layer plan's, an MoE layer's experts 3-D tensors under mlp.experts (expert_path), with
    gpt-oss's biases, and its attention sinks."""
    c, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, c), "model.norm.weight": (c,)}
    for i in range(cfg.num_hidden_layers):
        plan = layer_plan(cfg, i)
        shapes.update({f"model.layers.{i}.{op.param}": (d if op.heads else plan.widths[op.inputs[0]],)
                       for op in plan.ops if op.kind == "rmsnorm"})
        shapes.update({f"model.layers.{i}.{op.param}": (plan.widths[op.inputs[0]], 1, op.size)
                       for op in plan.ops if op.kind == "short_conv"})      # LFM2's, Qwen3.5's depthwise Conv1d weight
        shapes.update({f"model.layers.{i}.{op.param}": (plan.widths[op.inputs[0]] // plan.head_count(cfg, op),)
                       for op in plan.ops if op.kind == "gated_rmsnorm"})   # Qwen3.5's gated norm, per value head
        shapes.update({f"model.layers.{i}.{op.param}.{p}": (plan.widths[op.outputs[0]],)
                       for op in plan.ops if op.kind == "decay" for p in ("A_log", "dt_bias")})
        for m in cfg.layer_modules(i):
            shapes[module_path(i, m) + ".weight"] = cfg.linear_shape(m)
        if cfg.is_sparse(i):
            shapes.update({expert_path(i, p, cfg.moe.block): cfg.expert_shape(p) for p in EXPERT_PARAMETERS})
            if cfg.moe.expert_bias:  # LFM2-MoE: the bias its router chooses by (a buffer in transformers)
                shapes[f"model.layers.{i}.{cfg.moe.block}.expert_bias"] = (cfg.moe.num_experts,)
            if cfg.moe.biases:       # gpt-oss: the router's and each expert's projections' biases
                shapes[module_path(i, cfg.moe.router) + ".bias"] = (cfg.moe.num_experts,)
                shapes.update({expert_path(i, p) + "_bias": cfg.expert_shape(p)[:2] for p in EXPERT_PARAMETERS})
        if cfg.attention_sinks:
            shapes[f"model.layers.{i}.self_attn.sinks"] = (cfg.num_attention_heads,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, c)
    return shapes


def expert_path(layer: int, param: str, block: str = "mlp") -> str:
    """The transformers 5 name of an MoE layer's expert tensor, e.g. model.layers.0.mlp.experts.gate_up_proj
    (block: MoeConfig.block, LFM2-MoE's feed_forward)."""
    return f"model.layers.{layer}.{block}.experts.{param}"


def is_buffer(name: str) -> bool:
    """Whether a tensor is one transformers keeps as a buffer, read but never trained (LFM2-MoE's expert_bias)."""
    return name.endswith(".expert_bias")


def module_name(path: str) -> str:
    """The layer's module a module path names (module_path's inverse): q_proj, shared_expert.gate_proj,
    conv.in_proj, ..."""
    parts = path.split(".")[3:]
    return ".".join(parts if parts[0] in LAYER_GROUPS else parts[1:])


def module_path(layer: int, module: str) -> str:
    """The Hugging Face path of one linear module, e.g. model.layers.0.self_attn.q_proj (LFM2's conv.in_proj and
    feed_forward.w1 name their own group: config.LAYER_GROUPS)."""
    if module.split(".")[0] in LAYER_GROUPS:
        return f"model.layers.{layer}.{module}"
    group = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


# the final norm where a family's checkpoints name it otherwise than model.norm (the name the engines use)
FINAL_NORM = "model.norm.weight"
_FINAL_NORMS = {family: "model.embedding_norm.weight" for family in ("lfm2", "lfm2_moe", "lfm3")}


def final_norm_name(cfg: ModelConfig) -> str:
    """The final norm's name in cfg's checkpoints (LFM2's model.embedding_norm.weight)."""
    return _FINAL_NORMS.get(cfg.family, FINAL_NORM)


def _folder_tensors(folder: Path) -> dict:
    tensors = {}
    for f in weight_files(folder):
        tensors.update(_read_raw(f))
    return tensors


def load_weights(folder, cfg: ModelConfig) -> LazyWeights:
    """All weights of a model folder, checked for presence and shape, as a LazyWeights (float32 on reading);
    of a multimodal checkpoint, its language model's (multimodal.language_names)."""
    folder = Path(folder)
    tensors = _folder_tensors(folder)
    if cfg.wrapper:
        tensors = {ours: tensors[name] for ours, name in language_names(tensors, folder).items()}
    if cfg.moe is not None:
        tensors = read_fused(tensors, cfg, str(folder))
    if cfg.family == "lfm3":      # the hub's LFM3 names g_proj self_attn.gate_proj (transformers renames it)
        tensors = {k.replace(".self_attn.gate_proj.", ".self_attn.g_proj."): v for k, v in tensors.items()}
    if final_norm_name(cfg) in tensors:
        tensors[FINAL_NORM] = tensors.pop(final_norm_name(cfg))
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    # Biases: q/k/v (Qwen2, Llama attention_bias) and o_proj (Llama attention_bias).
    for i in range(cfg.num_hidden_layers):
        for m in cfg.layer_modules(i):
            name = module_path(i, m) + ".bias"
            if name in tensors:
                shapes[name] = (cfg.linear_shape(m)[0],)
            elif cfg.attention_bias and m in ("q_proj", "k_proj", "v_proj"):
                shapes[name] = (cfg.linear_shape(m)[0],)
    missing = [k for k in shapes if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelFileError(f"{folder}: missing tensors {', '.join(missing[:3])}{more}")
    for k, shape in shapes.items():
        if tuple(tensors[k][0].shape) != tuple(shape):
            raise ModelFileError(f"{folder}: tensor {k} has shape {tuple(tensors[k][0].shape)}, expected {tuple(shape)}")
    return LazyWeights({k: tensors[k] for k in shapes})


def checkpoint_float_dtype(folder, cfg: ModelConfig) -> str:
    """The dtype (formats.safetensors.FLOAT_DTYPES) a model folder's weights are stored in, as transformers'
    dtype="auto" finds it: config.json's (ModelConfig.checkpoint_dtype), else the first weight file's first
    tensor stored in one of them, else float32."""
    if cfg.checkpoint_dtype in FLOAT_DTYPES:
        return cfg.checkpoint_dtype
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return next((names[dtype] for _, dtype in _folder_tensors(Path(folder)).values() if dtype in names), "float32")


def _fused_source(cfg: ModelConfig, source_folder) -> bool:
    """Whether an MoE model came from a checkpoint in transformers 5's fused layout, which our tensors' names are
    (gpt-oss's is its own: gpt_oss_layout.hub_layout writes it whatever it came in)."""
    if cfg.family == "gpt_oss" or source_folder is None:
        return False
    try:
        return is_fused(_folder_tensors(Path(source_folder)))
    except ModelFileError:          # no weights there (a model made in memory): the hub's layout
        return False


def save_model_folder(out, cfg: ModelConfig, weights, source_folder=None, dtype: str = "float32"):
    """A complete Hugging Face model folder: config.json, model.safetensors, tokenizer files copied. weights:
    name -> array, a dict or a mapping that makes each when read (Model.merged_weights), read one at a time, and
    stored in `dtype` (float32, bfloat16 or float16: formats.safetensors.FLOAT_DTYPES), which config.json names.
    A multimodal checkpoint's folder gets its language model's weights under the source's names beside the
    source's other tensors (vision tower, projector: multimodal.carried_tensors), all in that dtype, and its
    processor's files. An MoE model's experts are written in the layout of the source's checkpoint: transformers
    5's fused tensors (Qwen3-VL-MoE's as its checkpoint orients them), else (and without a source) the hub's one
    tensor per expert. The weights are written
    before config.json, so that a failure leaves no model behind."""
    out = Path(out)
    companions = TOKENIZER_FILES
    if cfg.wrapper:
        if source_folder is None:
            raise ConfigError(f"saving a {cfg.wrapper} model needs the folder it was loaded from (its vision tower)")
        source = _folder_tensors(Path(source_folder))
        names = language_names(source, source_folder)
        carried = carried_tensors(source, names, source_folder)
        # the final norm under the family's own name first (LFM2's embedding_norm), as the source names it
        language = {file_name(final_norm_name(cfg) if k == FINAL_NORM else k, names): k for k in weights}
        ours, swapped = weights, in_out_names(cfg, source)

        def fetch(k: str):
            if k not in language:
                return _as_array(*carried[k])
            w = ours[language[k]]       # Qwen3-VL-MoE's (E, in, out) experts written back so
            return np.ascontiguousarray(np.swapaxes(w, 1, 2)) if k in swapped else w

        weights = TensorMap([k for k in carried if k not in language] + list(language), fetch)
        companions += PROCESSOR_FILES
    if cfg.moe is not None and not _fused_source(cfg, source_folder):   # the experts one tensor per expert and
        weights = hub_layout(cfg, weights)                                # projection, as the hub's checkpoints
    if final_norm_name(cfg) != FINAL_NORM:
        named, inner = {final_norm_name(cfg) if k == FINAL_NORM else k: k for k in weights}, weights
        weights = TensorMap(list(named), lambda k: inner[named[k]])
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(cfg.raw)
    raw["torch_dtype"] = raw["dtype"] = dtype
    if isinstance(raw.get("text_config"), dict):        # a multimodal checkpoint's language model says it too
        raw["text_config"] = {**raw["text_config"], **{k: dtype for k in ("torch_dtype", "dtype")
                                                       if k in raw["text_config"]}}
    raw.pop("quantization_config", None)       # the weights written are dequantised (gpt-oss's MXFP4 experts)
    if cfg.tie_word_embeddings and any(k.endswith("lm_head.weight") for k in weights):   # a head trained apart
        raw["tie_word_embeddings"] = False                                                # (modules_to_save)
        if cfg.wrapper:
            raw["text_config"] = {**raw["text_config"], "tie_word_embeddings": False}
    write_safetensors(out / "model.safetensors", TensorMap(weights, lambda k: np.asarray(weights[k], np.float32)),
                      metadata={"format": "pt"}, dtype=dtype)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    if source_folder is not None:
        for name in companions:
            src = Path(source_folder) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
