"""Text-only fine-tuning of a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration: gemma-3-4b and
larger): its language model's config, and that model's names in the checkpoint's files and in PEFT adapters,
which put it under model.language_model. The engines see a plain text model (model.layers.N..., lm_head); the
vision tower and the projector are carried through merge untouched."""
from __future__ import annotations

import re

from .errors import AdapterError, ConfigError

WRAPPERS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}    # multimodal class -> its text model's
# the language model's tensor names in files: hub checkpoints (and transformers' save_pretrained) write
# language_model.model.* and language_model.lm_head.*; transformers' live module names are model.language_model.*
FILE_PREFIXES = ("language_model.model.", "model.language_model.")
FILE_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
OUTER = "model.language_model."      # the language model's module paths in the live model (PEFT's adapters)
PEFT_ROOT = "base_model.model."


def text_config(raw: dict, source: str) -> dict:
    """The config dict of a multimodal checkpoint's language model: its text_config, named as the text
    model's architecture, with the top-level token ids where the text config lacks them."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a {raw['architectures'][0]} config needs a 'text_config' object")
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw and k not in text}
    return {**text, **ids, "architectures": [WRAPPERS[raw["architectures"][0]]]}


def outer_path(path: str) -> str:
    """A module path or weight name of ours (model.layers.0.self_attn.q_proj) as a multimodal model names it
    (model.language_model.layers.0.self_attn.q_proj)."""
    return OUTER + path[len("model."):] if path.startswith("model.") else path


def language_names(names, folder) -> dict:
    """{our name: file name} of a multimodal checkpoint's language-model tensors (either spelling, FILE_PREFIXES);
    the other tensors (vision tower, projector) are not listed."""
    out = {}
    for name in names:
        prefix = next((p for p in FILE_PREFIXES if name.startswith(p)), None)
        ours = "model." + name[len(prefix):] if prefix else "lm_head.weight" if name in FILE_HEADS else None
        if ours is not None:
            if ours in out:
                raise ConfigError(f"{folder}: tensors {out[ours]} and {name} are both the language model's {ours}")
            out[ours] = name
    return out


def language_keys(tensors: dict, where) -> dict | None:
    """A PEFT adapter's tensors keyed as ours when it was saved on a multimodal model (keys under
    base_model.model.model.language_model., or older PEFT's base_model.model.language_model.model.): ->
    base_model.model.model.*; None for a text model's adapter. A tensor outside the language model (LoRA on
    the vision tower) is refused with one line."""
    roots = (PEFT_ROOT + OUTER, PEFT_ROOT + "language_model.model.")
    if not any(k.startswith(roots) for k in tensors):
        return None
    out = {}
    for key, value in tensors.items():
        root = next((r for r in roots if key.startswith(r)), None)
        if root is not None:
            out[PEFT_ROOT + "model." + key[len(root):]] = value
        elif key.startswith((PEFT_ROOT + "lm_head.", PEFT_ROOT + "language_model.lm_head.")):
            out[PEFT_ROOT + "lm_head." + key.split(".lm_head.", 1)[1]] = value
        else:
            raise AdapterError(f"{where}: not supported: {key} is outside the language model (text-only fine-tuning "
                               f"of a multimodal checkpoint applies LoRA to model.language_model only)")
    return out


def adapter_key_out(key: str) -> str:
    """Our adapter key as PEFT names it on the multimodal model (language_keys' inverse)."""
    return PEFT_ROOT + outer_path(key[len(PEFT_ROOT):]) if key.startswith(PEFT_ROOT) else key


def target_regex(modules: tuple, layers: tuple | None) -> str:
    """PEFT target_modules selecting `modules` in `layers` (None: all) of the language model only: a regular
    expression on module paths (a list of names would put LoRA on the vision tower's q_proj / v_proj too)."""
    which = r"\d+" if layers is None else "(?:" + "|".join(map(str, layers)) + ")"
    return re.escape(OUTER) + rf"layers\.{which}\.(?:self_attn|mlp)\.(?:{'|'.join(modules)})"
