"""DataKind: what a dataset's records are read as (SFT records, preference pairs, unpaired KTO records or GRPO's
prompts); each objective names the kind it reads (training/objectives/), and data/sources.py reads it."""
from __future__ import annotations

import enum

from wgpu_train.errors import ConfigError


class DataKind(enum.Enum):
    """The records an objective reads; the values are the names `resolve_data(kind=...)` also takes."""

    SFT = "sft"                 # conversations or text, a token loss on the completion
    PAIRS = "preference"        # chosen / rejected pairs
    UNPAIRED = "unpaired"       # single completions labelled desirable or not (KTO)
    PROMPTS = "prompts"         # prompts alone, the completions generated during training (GRPO)

    @classmethod
    def parse(cls, kind: DataKind | str) -> DataKind:
        """A DataKind, or its value as a string; ConfigError (one line listing the kinds) for anything else."""
        if isinstance(kind, cls):
            return kind
        try:
            return cls(kind)
        except ValueError:
            raise ConfigError(f"unknown record kind {kind!r}; the kinds are "
                              f"{', '.join(k.value for k in cls)}") from None


__all__ = ["DataKind"]
