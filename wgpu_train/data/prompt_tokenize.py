"""GRPO's prompts -> the token ids generation starts from, as TRL 1.16's GRPOTrainer tokenizes them
(_tokenize_prompts): conversations through the chat template with its generation prompt, strings as they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from wgpu_train.data.prompt_records import PromptRecord
from wgpu_train.data.tokenize import generation_prompt_ids
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tokenizer import Tokenizer


@dataclass(eq=False)
class PromptExample:
    """One tokenized prompt and the record it came from (its columns go to the reward functions)."""

    input_ids: np.ndarray  # (T,) int32
    record: PromptRecord
    truncated: bool = False  # its beginning was cut to max_prompt_length

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PromptStats:
    """What tokenize_prompts did to the records."""

    n_records: int = 0
    n_examples: int = 0
    n_truncated: int = 0  # kept, their beginning cut to max_prompt_length
    n_skipped: int = 0  # refused by the chat template, with skip_invalid
    n_tokens: int = 0
    max_tokens: int = 0  # the longest kept prompt

    def describe(self) -> str:
        """One line for the log, e.g. '1000 prompts: 998 kept, up to 41 tokens (3 truncated to max_prompt_length)'."""
        out = f"{self.n_records} prompts: {self.n_examples} kept, up to {self.max_tokens} tokens"
        if self.n_truncated:
            out += f" ({self.n_truncated} truncated to max_prompt_length)"
        if self.n_skipped:
            out += f", {self.n_skipped} skipped (refused by the chat template)"
        return out


def prompt_ids(tokenizer: Tokenizer, record: PromptRecord, use_chat_template: bool = True) -> list[int]:
    """A prompt's token ids as TRL 1.16's GRPOTrainer makes them. Conversational: the chat template with
    add_generation_prompt=True, tokenized without special tokens (the template writes its own BOS, as
    transformers' apply_chat_template(tokenize=True) does). Standard: the string tokenized with the tokenizer's
    special tokens (processing_class(text=prompts): a BOS where its post-processor adds one), nothing appended.
    With `use_chat_template=False` a conversation is laid out as SFT's raw mode lays out its prompt
    (raw_prompt_text after the BOS), so that a model trained that way is asked the same way."""
    if isinstance(record.prompt, list):
        return generation_prompt_ids(tokenizer, record.prompt, use_chat_template)
    return tokenizer.encode(record.prompt, add_special_tokens=True)


def tokenize_prompts(tokenizer: Tokenizer, records: Sequence[PromptRecord], max_prompt_length: int | None = None,
                     use_chat_template: bool = True,
                     skip_invalid: bool = False) -> tuple[list[PromptExample], PromptStats]:
    """Tokenize every prompt (see prompt_ids); returns the examples and counts of what happened.

    TRL 1.16's GRPOConfig has no max_prompt_length, and None (no limit) is its behaviour; a limit keeps a prompt's
    last max_prompt_length tokens, as earlier TRL versions did (the tokenizer's truncation_side="left"), so the
    generation prompt that ends it stays. A prompt the chat template refuses raises DataError "file:line: ...",
    or is skipped and counted with `skip_invalid`."""
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ConfigError(f"max_prompt_length must be at least 1, got {max_prompt_length}")
    stats = PromptStats(n_records=len(records))
    examples: list[PromptExample] = []
    for k, record in enumerate(records):
        try:
            ids = prompt_ids(tokenizer, record, use_chat_template)
        except DataError as e:
            if skip_invalid:
                stats.n_skipped += 1
                continue
            raise DataError(f"{record.source or f'record {k}'}: {e}") from None
        truncated = max_prompt_length is not None and len(ids) > max_prompt_length
        if truncated:
            ids = ids[-max_prompt_length:]
        examples.append(PromptExample(np.asarray(ids, dtype=np.int32), record, truncated))
        stats.n_truncated += int(truncated)
        stats.n_tokens += len(ids)
        stats.max_tokens = max(stats.max_tokens, len(ids))
    stats.n_examples = len(examples)
    return examples, stats
