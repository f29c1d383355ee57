"""Text-only fine-tuning of a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration: gemma-3-4b and
larger): its language model's config, and that model's names in the checkpoint's files and in PEFT adapters,
which put it under model.language_model. The engines see a plain text model (model.layers.N..., lm_head); the
vision tower and the projector are carried through merge untouched."""
from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np

from wgpu_train.errors import AdapterError, ConfigError, ModelFileError

log = logging.getLogger("wgpu_train")

WRAPPERS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",    # multimodal class -> its text model's
            "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
            "SmolVLMForConditionalGeneration": "LlamaForCausalLM",
            "Idefics3ForConditionalGeneration": "LlamaForCausalLM",
            "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
            "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
            "Lfm2VlForConditionalGeneration": "Lfm2ForCausalLM"}
# the multimodal class's own default of tie_word_embeddings (transformers 5 ties the head by the top-level config)
_TIED_BY_DEFAULT = {"Gemma3ForConditionalGeneration": True, "Qwen3_5ForConditionalGeneration": False,
                    "Qwen3_5MoeForConditionalGeneration": False, "SmolVLMForConditionalGeneration": False,
                    "Idefics3ForConditionalGeneration": False, "Qwen3VLForConditionalGeneration": False,
                    "Qwen3VLMoeForConditionalGeneration": False,
                    "Lfm2VlForConditionalGeneration": True}
# what the multimodal class's text model fixes whatever its text_config says (Qwen3-VL-MoE's router always
# renormalises its top k: Qwen3VLMoeTextTopKRouter; its config has no norm_topk_prob)
_TEXT_FIXED = {"Qwen3VLMoeForConditionalGeneration": {"norm_topk_prob": True}}
# Where the language model's modules live: transformers >= 4.52's module tree (model.language_model.*, what
# PEFT's adapters name now), and the older tree (language_model.model.*, with language_model.lm_head), which
# hub checkpoints and transformers' save_pretrained still use for the files. Each: (body prefix, head path).
LIVE = ("model.language_model.", "lm_head")
OLD = ("language_model.model.", "language_model.lm_head")
TEXT_MODEL = ("model.text_model.", "lm_head")      # SmolVLM's and Idefics3's, in files and module paths alike
LAYOUTS = (OLD, LIVE, TEXT_MODEL)
PEFT_ROOT = "base_model.model."
# the module groups under a layer that are not self_attn / mlp (models/config.LAYER_GROUPS): Qwen3.5's linear
# attention, LFM2's convolution and feed-forward
_OWN_GROUPS = ("linear_attn", "conv", "feed_forward")
# beside the tokenizer's: the files of the processor that feeds images (hub gemma-3-*-it folders have them)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json")


def live_layout(wrapper: str) -> tuple:
    """The layout of a multimodal class's module paths (what PEFT names and matches): SmolVLM's and Idefics3's
    text_model, the others' language_model."""
    return TEXT_MODEL if wrapper in ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration") else LIVE


def from_wrapper(cls, raw: dict, source: str):
    """The ModelConfig of a multimodal checkpoint's language model, read from its text_config (transformers'
    text defaults where the hub's file leaves fields out, the top-level eos / bos ids where it has none) as the
    multimodal class runs it: tied by the top-level tie_word_embeddings (transformers 5 ties the class by its own
    config: Gemma 3's default true, Qwen3.5's false), and with no soft-cap on the logits (Gemma 3's forward applies
    none, whatever final_logit_softcapping says)."""
    arch = raw["architectures"][0]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a {arch} config needs a 'text_config' object")
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw and k not in text}
    cfg = cls.from_dict({**text, **ids, **_TEXT_FIXED.get(arch, {}), "architectures": [WRAPPERS[arch]]},
                        f"{source} (text_config)")
    return dataclasses.replace(cfg, wrapper=arch, tie_word_embeddings=bool(raw.get("tie_word_embeddings", _TIED_BY_DEFAULT[arch])),
                               logit_softcap=0.0, raw=raw)


def outer_path(path: str, layout=LIVE) -> str:
    """A module path or weight name of ours (model.layers.0.self_attn.q_proj, lm_head.weight) as a multimodal
    model of `layout` names it (model.language_model.layers.0.self_attn.q_proj)."""
    if path.startswith("model."):
        return layout[0] + path[len("model."):]
    return layout[1] + path[len("lm_head"):] if path.startswith("lm_head") else path


def inner_path(name: str, layout) -> str | None:
    """outer_path's inverse: a module path or tensor name of `layout`'s language model as ours; None for one
    outside the language model."""
    body, head = layout
    if name.startswith(body):
        return "model." + name[len(body):]
    return "lm_head" + name[len(head):] if name == head or name.startswith(head + ".") else None


def language_names(names, folder) -> dict:
    """{our name: file name} of a multimodal checkpoint's language-model tensors (either layout); the other
    tensors (vision tower, projector) are not listed."""
    out = {}
    for name in names:
        ours = next((p for layout in LAYOUTS if (p := inner_path(name, layout)) is not None), None)
        if ours is not None:
            if ours in out:
                raise ModelFileError(f"{folder}: tensors {out[ours]} and {name} are both the language model's {ours}")
            out[ours] = name
    return out


def file_name(ours: str, names: dict) -> str:
    """The name a merged folder gives our tensor `ours`: the source's (`names`, language_names), or for one the
    source lacks (a tied model's head trained apart) the name in the source's layout."""
    if ours in names:
        return names[ours]
    return outer_path(ours, OLD if any(n.startswith(OLD[0]) for n in names.values()) else LIVE)


def language_keys(tensors: dict, where) -> tuple[dict, tuple] | None:
    """A PEFT adapter's tensors keyed as ours, and the layout its module paths had, when it was saved on a
    multimodal model (keys under base_model.model.model.language_model., or base_model.model.language_model.model.
    from transformers before 4.52); None for a text model's adapter.

    LoRA outside the language model (PEFT's all-linear or a list of names puts it on the vision tower too) is
    dropped, with a note, where every such module's B is zero: a text-only training leaves it so, and it
    changes nothing. Any other tensor outside the language model is refused."""
    layout = next((lay for lay in (LIVE, OLD, TEXT_MODEL) if any(k.startswith(PEFT_ROOT + lay[0]) for k in tensors)),
                  None)
    if layout is None:
        return None
    out, dropped = {}, set()
    for key, value in tensors.items():
        ours = inner_path(key[len(PEFT_ROOT):], layout) if key.startswith(PEFT_ROOT) else None
        if ours is not None:
            out[PEFT_ROOT + ours] = value
        else:
            module = re.sub(r"\.lora_[AB](\.default)?\.weight$", "", key)
            b = tensors.get(module + ".lora_B.weight", tensors.get(module + ".lora_B.default.weight"))
            if module == key or b is None or np.any(b):
                raise AdapterError(f"{where}: not supported: {key} is outside the language model and changes it "
                                   f"(text-only fine-tuning of a multimodal checkpoint takes LoRA on "
                                   f"model.language_model only; PEFT's all-linear or a list of names also reaches "
                                   f"the vision tower: use a regular expression on model.language_model)")
            dropped.add(module)
    if dropped:
        log.warning("wgpu-train: %s: dropped the LoRA of %d modules outside the language model (the vision "
                    "tower's): their B is zero, so they change nothing", where, len(dropped))
    return out, layout


def live_patterns(patterns: dict, layout) -> dict:
    """An adapter's rank_pattern / alpha_pattern keys, written for the paths of `layout`, for the LIVE paths they
    are matched on: the OLD layout's literal language_model.model. (plain or regex-escaped) becomes
    model.language_model.; other keys (layers.0.self_attn.q_proj, q_proj) match either way."""
    if layout is LIVE:
        return patterns
    return {k.replace(re.escape(OLD[0]), re.escape(LIVE[0])).replace(OLD[0], LIVE[0]): v for k, v in patterns.items()}


def adapter_key_out(key: str, layout=LIVE) -> str:
    """Our adapter key as PEFT names it on the multimodal model (language_keys' inverse, `layout`'s paths)."""
    return PEFT_ROOT + outer_path(key[len(PEFT_ROOT):], layout) if key.startswith(PEFT_ROOT + "model.") else key


def target_regex(modules: tuple, layers: tuple | None, layout=LIVE) -> str:
    """PEFT target_modules selecting `modules` in `layers` (None: all) of the language model only: a regular
    expression on module paths (a list of names would put LoRA on the vision tower's q_proj / v_proj too). Qwen3.5's
    linear-attention modules name their own group (linear_attn.in_proj_qkv), and so do LFM2's (conv.in_proj,
    feed_forward.w1)."""
    which = r"\d+" if layers is None else "(?:" + "|".join(map(str, layers)) + ")"
    grouped = [re.escape(m) for m in modules if m.split(".")[0] in _OWN_GROUPS]
    plain = [m for m in modules if m.split(".")[0] not in _OWN_GROUPS]
    paths = ([rf"(?:self_attn|mlp)\.(?:{'|'.join(plain)})"] if plain else []) + grouped
    body = paths[0] if len(paths) == 1 else f"(?:{'|'.join(paths)})"
    return re.escape(layout[0]) + rf"layers\.{which}\.{body}"


def carried_tensors(source: dict, names: dict, folder) -> dict:
    """The tensors of a multimodal checkpoint beside its language model's (`names`, language_names), for a
    merged folder of the same class; refused when there are none (a folder without them would not load as it)."""
    rest = {k: v for k, v in source.items() if k not in names.values()}
    if not rest:
        raise ModelFileError(f"{folder}: no vision tower or projector tensors beside the language model's; a merged "
                             f"folder would not load as its multimodal class")
    return rest
