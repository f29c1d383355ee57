"""PEFT's modules_to_save for the embedding and lm_head: full float32 copies trained beside LoRA. Which
names are accepted, which base weights they make trainable (and whether a tied model's head gets its own
tensor), their adapter file keys and their parameter count."""
from __future__ import annotations

from wgpu_train.errors import ConfigError

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# module name -> its path in a Llama-family model (PEFT matches a name that is the path or ends it after a dot)
PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}


def check_modules(value) -> tuple:
    """modules_to_save (None, a comma-separated string or a list of names) as a tuple of "embed_tokens" /
    "lm_head" in that order; PEFT's longer spellings ("model.embed_tokens") are accepted, other modules are
    refused with one line."""
    if value is None:
        return ()
    names = [t.strip() for t in value.split(",") if t.strip()] if isinstance(value, str) else list(value)
    out = set()
    for name in names:
        found = [m for m, path in PATHS.items() if isinstance(name, str) and name
                 and (path == name or path.endswith("." + name))]
        if not found:
            raise ConfigError(f"modules_to_save {name!r} is not supported: only embed_tokens and lm_head")
        out.add(found[0])
    return tuple(m for m in PATHS if m in out)


def trained_weights(tied: bool, modules: tuple, ensure_weight_tying: bool) -> tuple[tuple, bool]:
    """(base weight names trained beside LoRA, whether a tied model's lm_head gets its own tensor), as PEFT
    0.21 builds modules_to_save: on an untied model each named module gets its copy; on a tied one
    (tie_word_embeddings) with ensure_weight_tying one copy of the embedding serves the lookup and the head,
    and without it each named module gets its own copy while the other keeps the original (frozen) weight."""
    wanted = tuple(EMBED if m == "embed_tokens" else HEAD for m in modules)
    if not tied or not wanted:
        return wanted, False
    if ensure_weight_tying:
        return (EMBED,), False
    return wanted, True


def adapter_keys(tied: bool, modules: tuple, ensure_weight_tying: bool) -> dict:
    """{adapter_model.safetensors key: the weight it holds} of the copies, as PEFT saves them: a tied copy
    (ensure_weight_tying) under both the embedding's and lm_head's keys."""
    names, _ = trained_weights(tied, modules, ensure_weight_tying)
    if tied and ensure_weight_tying and names:
        return {peft_key(HEAD): EMBED, peft_key(EMBED): EMBED}
    return {peft_key(n): n for n in names}


def peft_key(name: str) -> str:
    """The adapter file key of a trained copy of base weight `name`."""
    return "base_model.model." + name


def count(cfg, lora) -> int:
    """Parameters of the trained copies of a LoraConfig on a ModelConfig."""
    names, _ = trained_weights(cfg.tie_word_embeddings, lora.modules_to_save, lora.ensure_weight_tying)
    return len(names) * cfg.vocab_size * cfg.hidden_size
