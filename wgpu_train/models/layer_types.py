"""config.json's layer_types of a model whose layers differ in kind (LFM2, Qwen3.5): one kind per layer, checked."""
from __future__ import annotations

from wgpu_train.errors import ConfigError


def checked_layer_types(types, layers: int, kinds: tuple, source: str) -> list:
    """`types` (config.json's layer_types, or the family's default list) with one of `kinds` for each of the
    `layers` layers; ConfigError naming the field otherwise."""
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{source}: field 'layer_types' must list a kind for each of the {layers} layers")
    unknown = [t for t in types if t not in kinds]
    if unknown:
        raise ConfigError(f"{source}: field 'layer_types' has the layer kind {unknown[0]!r}; supported: "
                          f"{', '.join(kinds)}")
    return types
