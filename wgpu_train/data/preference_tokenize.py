"""Preference records -> token ids as TRL 1.16's DPOTrainer and KTOTrainer tokenize them (prompt and completion
ids split where their tokenizations diverge, EOS appended to standard answers, examples whose prompt fills
max_length dropped), and the rows a model scores, truncated as TRL's collators truncate them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from wgpu_train.data.batching import Example
from wgpu_train.data.preference_records import Part, PreferenceRecord, UnpairedRecord, is_conversational
from wgpu_train.data.records import IGNORE_INDEX, Message
from wgpu_train.data.tokenize import raw_prompt_text
from wgpu_train.errors import ConfigError, DataError, ToolError
from wgpu_train.formats.tokenizer import Tokenizer
from wgpu_train.formats.tool_calls import supports_tools, tool_schemas

TRUNCATION_MODES = ("keep_start", "keep_end")


def _row(prompt_ids: np.ndarray, completion_ids: np.ndarray, max_length: int | None,
         truncation_mode: str, images: list) -> Example:
    """prompt + completion as one Example, completion tokens labelled, carrying the prompt's images; longer than
    max_length cut as TRL's collators cut it (keep_start: its first max_length tokens; keep_end: its last)."""
    ids = np.concatenate([prompt_ids, completion_ids]).astype(np.int32)  # (P + C,)
    labels = np.concatenate([np.full(len(prompt_ids), IGNORE_INDEX, dtype=np.int64),
                             completion_ids.astype(np.int64)])  # (P + C,)
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids, labels = ids[cut], labels[cut]
    return Example(ids, labels, truncated, list(images))


@dataclass(eq=False)
class PreferenceExample:
    """One tokenized pair, as TRL's DPO dataset columns hold it: the whole prompt and answer tokens. rows() gives
    what is trained: prompt + chosen and prompt + rejected, each cut to `max_length` by `truncation_mode`."""

    prompt_ids: np.ndarray  # (P,) int32
    chosen_ids: np.ndarray  # (C,) int32, completion tokens only
    rejected_ids: np.ndarray  # (R,) int32
    truncated: bool = False  # a row is longer than max_length
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    images: list = field(default_factory=list)  # records with images: the prompt's, which both rows carry

    def rows(self) -> tuple[Example, Example]:
        """(prompt + chosen, prompt + rejected) as Examples: labels are the token ids of the completion tokens
        and IGNORE_INDEX on the prompt, truncated as TRL's DataCollatorForPreference truncates."""
        return (_row(self.prompt_ids, self.chosen_ids, self.max_length, self.truncation_mode, self.images),
                _row(self.prompt_ids, self.rejected_ids, self.max_length, self.truncation_mode, self.images))


@dataclass(eq=False)
class UnpairedExample:
    """One tokenized KTO record, as TRL's KTO dataset columns hold it; row() gives what is trained, cut to
    `max_length` (TRL's KTO keeps the start)."""

    prompt_ids: np.ndarray  # (P,) int32
    completion_ids: np.ndarray  # (C,) int32
    label: bool
    truncated: bool = False
    max_length: int | None = None
    images: list = field(default_factory=list)  # records with images: the prompt's

    def row(self) -> Example:
        """prompt + completion, the completion labelled, truncated as TRL's DataCollatorForUnpairedPreference."""
        return _row(self.prompt_ids, self.completion_ids, self.max_length, "keep_start", self.images)

    def mismatched_row(self, other: "UnpairedExample") -> Example:
        """This prompt with `other`'s completion, for KTO's KL estimate (TRL's KL_completion_ids), truncated
        the same way."""
        return _row(self.prompt_ids, other.completion_ids, self.max_length, "keep_start", self.images)


@dataclass
class PreferenceStats:
    """What tokenize_preferences / tokenize_unpaired did to the records."""

    what: str = "pairs"  # "pairs" (tokenize_preferences) or "records" (tokenize_unpaired)
    n_records: int = 0
    n_examples: int = 0  # kept
    n_truncated: int = 0  # kept, with a row cut to max_length
    n_dropped: int = 0  # nothing left to train: the prompt alone fills max_length
    n_skipped: int = 0  # refused by the chat template, with skip_invalid
    n_desirable: int = 0  # unpaired: kept records labelled True
    n_undesirable: int = 0  # unpaired: kept records labelled False

    def describe(self) -> str:
        """One line for the log, e.g. '1000 pairs: 990 kept (12 truncated), 10 dropped (prompt fills max_length)'."""
        out = f"{self.n_records} {self.what}: {self.n_examples} kept"
        if self.n_truncated:
            out += f" ({self.n_truncated} truncated to max_length)"
        if self.what == "records":
            out += f", {self.n_desirable} desirable / {self.n_undesirable} undesirable"
        if self.n_dropped:
            out += f", {self.n_dropped} dropped (the prompt fills max_length)"
        if self.n_skipped:
            out += f", {self.n_skipped} skipped (refused by the chat template)"
        return out


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _raw_text(messages: Sequence[Message], eos: str) -> str:
    """A conversation as raw (no chat template) text, as SFT's raw mode lays it out: per answer, the prompt text
    of the turns before it (raw_prompt_text), the answer and the EOS; then the prompt text of the turns left."""
    out, pending = "", []
    for m in messages:
        if m["role"] == "assistant":
            out += raw_prompt_text(pending) + m["content"] + eos
            pending = []
        else:
            pending.append(m)
    return out + raw_prompt_text(pending)


def _as_text(prompt: Part, answers: Sequence[Part], eos: str) -> tuple[str, list[str]]:
    """Conversational parts as raw text (prompt, answers), each answer what follows the prompt text."""
    prompt_text = _raw_text(prompt, eos)
    answer_texts = []
    for answer in answers:
        whole = _raw_text(list(prompt) + list(answer), eos)
        assert whole.startswith(prompt_text), "raw text of the prompt is a prefix of prompt + answer's"
        answer_texts.append(whole[len(prompt_text):])
    return prompt_text, answer_texts


def _tokenize(tokenizer: Tokenizer, prompt: Part, answers: Sequence[Part], use_chat_template: bool,
              tools: list[dict] | None = None) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [answer ids]) as TRL 1.16 tokenizes them: conversations through the chat template (the prompt
    with the generation prompt, prompt + answer without), strings through the tokenizer with its special tokens
    and the EOS appended to answers that do not end with it; the answers start where the tokenized prompt and
    the tokenized prompt + answer first differ (for every answer), which is usually the prompt's end. A
    conversation's `tools` (JSON schemas) are rendered with it, as TRL renders a dataset's tools column."""
    if is_conversational(prompt) and use_chat_template:
        if tools and not supports_tools(tokenizer.chat_template):
            raise ToolError("the chat template does not render tools (as TRL's supports_tool_calling checks)")
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tools=tools))
        whole = [tokenizer.encode(tokenizer.apply_chat_template(list(prompt) + list(a), tools=tools))
                 for a in answers]
    else:
        eos = tokenizer.eos_token or ""
        if is_conversational(prompt):
            prompt, answers = _as_text(prompt, answers, eos)
        answers = [a if a.endswith(eos) else a + eos for a in answers]
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        whole = [tokenizer.encode(prompt + a, add_special_tokens=True) for a in answers]
    n = min(_common_prefix_length(prompt_ids, w) for w in whole)
    return prompt_ids[:n], [w[n:] for w in whole]


def _check_settings(max_length: int | None, max_prompt_length: int | None, truncation_mode: str) -> None:
    if max_length is not None and max_length < 2:
        raise ConfigError(f"max_length must be at least 2, got {max_length}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ConfigError(f"max_prompt_length must be at least 1, got {max_prompt_length}")
    if truncation_mode not in TRUNCATION_MODES:
        raise ConfigError(f"truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, got {truncation_mode!r}")


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def _tokenize_all(tokenizer: Tokenizer, records: Sequence, answers_of, stats: PreferenceStats,
                  use_chat_template: bool, max_prompt_length: int | None, skip_invalid: bool):
    """(record, prompt ids, [answer ids]) of each record the chat template accepts."""
    for k, record in enumerate(records):
        try:
            tools = tool_schemas(record.tools) if record.tools else None
            prompt_ids, answer_ids = _tokenize(tokenizer, record.prompt, answers_of(record), use_chat_template,
                                               tools)
        except (DataError, ToolError) as e:
            if skip_invalid and isinstance(e, DataError):
                stats.n_skipped += 1
                continue
            raise type(e)(f"{record.source or f'record {k}'}: {e}") from None
        if max_prompt_length is not None:
            prompt_ids = prompt_ids[-max_prompt_length:]
        yield record, _ids(prompt_ids), [_ids(a) for a in answer_ids]


def tokenize_preferences(tokenizer: Tokenizer, records: Sequence[PreferenceRecord], max_length: int | None,
                         max_prompt_length: int | None = None, use_chat_template: bool = True,
                         truncation_mode: str = "keep_start",
                         skip_invalid: bool = False) -> tuple[list[PreferenceExample], PreferenceStats]:
    """Tokenize preference pairs as TRL 1.16's DPOTrainer does (see _tokenize); returns the kept examples and
    counts of what happened.

    max_length: the longest row; a longer row is cut by `truncation_mode` when rows() builds it: "keep_start"
    (TRL's default: the start is kept, and a pair whose prompt alone holds max_length tokens or more is dropped,
    as TRL drops it) or "keep_end" (the end is kept, so the prompt loses its beginning; nothing is dropped).
    max_prompt_length (not in TRL 1.16; older TRL's meaning) keeps only the prompt's last tokens. With
    `use_chat_template=False` conversations are laid out as raw text (SFT's raw mode) and tokenized as strings.
    A pair the chat template refuses raises DataError "file:line: ...", or is skipped and counted with
    `skip_invalid`."""
    _check_settings(max_length, max_prompt_length, truncation_mode)
    stats = PreferenceStats("pairs", n_records=len(records))
    examples: list[PreferenceExample] = []
    for _, prompt_ids, (chosen_ids, rejected_ids) in _tokenize_all(
            tokenizer, records, lambda r: (r.chosen, r.rejected), stats, use_chat_template, max_prompt_length,
            skip_invalid):
        if max_length is not None and truncation_mode == "keep_start" and len(prompt_ids) >= max_length:
            stats.n_dropped += 1
            continue
        longest = len(prompt_ids) + max(len(chosen_ids), len(rejected_ids))
        truncated = max_length is not None and longest > max_length
        stats.n_truncated += int(truncated)
        examples.append(PreferenceExample(prompt_ids, chosen_ids, rejected_ids, truncated, max_length,
                                          truncation_mode))
    stats.n_examples = len(examples)
    return examples, stats


def tokenize_unpaired(tokenizer: Tokenizer, records: Sequence[UnpairedRecord], max_length: int | None,
                      max_prompt_length: int | None = None, use_chat_template: bool = True,
                      truncation_mode: str = "keep_start",
                      skip_invalid: bool = False) -> tuple[list[UnpairedExample], PreferenceStats]:
    """Tokenize unpaired records as TRL 1.16's KTOTrainer does (as tokenize_preferences, one answer each);
    TRL's KTO truncates only "keep_start": a record whose prompt alone holds max_length tokens is dropped."""
    _check_settings(max_length, max_prompt_length, truncation_mode)
    if truncation_mode != "keep_start":
        raise ConfigError("unpaired (KTO) data is truncated keep_start only, as TRL's KTOTrainer truncates it")
    stats = PreferenceStats("records", n_records=len(records))
    examples: list[UnpairedExample] = []
    for record, prompt_ids, (completion_ids,) in _tokenize_all(
            tokenizer, records, lambda r: (r.completion,), stats, use_chat_template, max_prompt_length,
            skip_invalid):
        if max_length is not None and len(prompt_ids) >= max_length:
            stats.n_dropped += 1
            continue
        truncated = max_length is not None and len(prompt_ids) + len(completion_ids) > max_length
        stats.n_truncated += int(truncated)
        stats.n_desirable += int(record.label)
        stats.n_undesirable += int(not record.label)
        examples.append(UnpairedExample(prompt_ids, completion_ids, bool(record.label), truncated, max_length))
    stats.n_examples = len(examples)
    return examples, stats
