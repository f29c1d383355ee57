"""Records (records.py, read by sources.py) -> token ids with loss masks from the chat template's offsets, the
tokenized examples that batching.py batches or packs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from wgpu_train.data.batching import Example
from wgpu_train.data.records import IGNORE_INDEX, RAW_SEPARATOR, Message, Record
from wgpu_train.errors import ConfigError, DataError, ToolError
from wgpu_train.formats.tokenizer import Tokenizer
from wgpu_train.formats.tool_calls import supports_tools, tool_schemas

__all__ = ["TokenizeStats", "raw_prompt_text", "generation_prompt_ids", "tokenize_example", "tokenize_dataset"]

# ---------------------------------------------------------------------------------------------------------------
# Tokenization with loss masks


@dataclass
class TokenizeStats:
    """What tokenize_dataset did to the records."""

    n_records: int = 0
    n_examples: int = 0
    n_truncated: int = 0
    n_dropped: int = 0  # nothing left to train on after truncation
    n_skipped: int = 0  # refused by the chat template, with skip_invalid
    n_tokens: int = 0
    n_trained_tokens: int = 0


def raw_prompt_text(messages: Sequence[Message]) -> str:
    """The prompt text of raw (no chat template) mode: the non-assistant contents joined by blank lines, then the
    separator the response follows, RAW_SEPARATOR (a blank line), or none when the last of them says
    "raw_separator": "" (completions data: prompt and completion are concatenated as given). The trainer appends
    the response and the EOS token; generation uses this same prompt."""
    prompts = [m for m in messages if m["role"] != "assistant"]
    if not prompts:
        return ""
    return "\n\n".join(m["content"] for m in prompts) + prompts[-1].get("raw_separator", RAW_SEPARATOR)


def generation_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Message], chat_template: bool = True) -> list[int]:
    """Token ids that ask the model for the next assistant turn after `messages`: the chat template with its
    generation prompt, or raw mode's prompt text (raw_prompt_text) after BOS when the tokenizer adds one."""
    if chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    return bos + tokenizer.encode(raw_prompt_text(messages))


def _in_span(tok_start: int, tok_end: int, start: int, end: int) -> bool:
    """Whether a token is trained for the char span [start, end): it holds at least one character of it.
    A token straddling the span start (a template whose prompt ends in a space, then " Hi") holds part of
    the answer, so the model must learn to produce it."""
    if tok_end > tok_start:
        return tok_start < end and tok_end > start
    return start <= tok_start < end


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _prompt_end(prompt: str, text: str) -> int:
    """Where the generation prompt `prompt` ends in `text`, the rendered conversation. Usually the prompt is a
    prefix of it, but some templates render the context differently once an answer follows: Mistral v3 writes the
    system message into the last user turn only, DeepSeek-R1 opens the answer with <think> only when asking for
    one. Then the answer starts after the beginning both share and the longest ending of the prompt that the
    text continues with there (Mistral: the last user message and [/INST]; DeepSeek-R1: nothing)."""
    if text.startswith(prompt):
        return len(prompt)
    c = _common_prefix_len(prompt, text)
    rest = prompt[c:]
    k = text.rfind(rest[-1], c, c + len(rest))  # the overlap text[c:k + 1] ends with the prompt's last character
    while k >= c:
        if rest.endswith(text[c:k + 1]):
            return k + 1
        k = text.rfind(rest[-1], c, k)
    return c


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    """Where, from `start` on, the text holds an assistant content as templates render it: as given, stripped,
    or (reasoning models drop past thinking) only the answer after </think>, stripped."""
    variants = [content, content.strip()]
    if "</think>" in content:
        variants.append(content.rsplit("</think>", 1)[1].strip())
    for v in variants:
        at = text.find(v, start) if v else -1
        if at >= 0:
            return at, at + len(v)
    return None


def _first_marker(text: str, markers: Sequence[str], start: int) -> tuple[int, int] | None:
    """The char span of the first end-of-turn marker from `start` on."""
    best = None
    for marker in markers:
        pos = text.find(marker, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, pos + len(marker))
    return best


def _assistant_spans(tokenizer: Tokenizer, messages: Sequence[Message], text: str,
                     tools: list[dict] | None) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant turn: the char span in `text` (the rendered conversation)
    from where the generation prompt ends through the token that closes the turn (its tool calls included). A turn
    whose content the template drops entirely (a past reasoning turn that held only thinking) has no span."""
    markers = tokenizer.end_of_turn_strings()
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        start = _prompt_end(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tools=tools),
                            text)
        if start < cursor:
            raise DataError(f"cannot locate assistant turn {i} in the rendered chat template text")
        found = _find_content(text, messages[i]["content"], start)
        first = _first_marker(text, markers, start)
        if found is not None and first is not None and found[0] > first[0]:
            found = None  # that text belongs to a later turn
        closing = _first_marker(text, markers, found[1]) if found is not None else first
        if found is None and not text[start:closing[0] if closing else len(text)].strip():
            continue  # dropped by the template: nothing of it to learn
        # through the closing token; without one, through the content (or all that is left when it was reformatted)
        end = closing[1] if closing else found[1] if found else len(text.rstrip())
        spans.append((i, start, end))
        cursor = end
    return spans


def _record_tools(tokenizer: Tokenizer, messages: Record, use_chat_template: bool) -> list[dict] | None:
    """A conversation's tools as JSON schemas (functions converted), None without any; ToolError when tools or
    tool calls meet a template that cannot render them, or raw text mode."""
    tools = tool_schemas(messages.tools) if getattr(messages, "tools", None) else None
    uses_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools and not use_chat_template:
        raise ToolError("tools and tool calls need the chat template (raw text mode has no place for them)")
    if uses_tools and not supports_tools(tokenizer.chat_template):
        raise ToolError("the chat template does not render tools and tool calls (as TRL's supports_tool_calling "
                        "checks); use a model whose template does, e.g. Qwen2.5, Qwen3 or Llama 3.1")
    return tools


def _chat_example(tokenizer: Tokenizer, messages: Sequence[Message], train_on_last_turn: bool,
                  tools: list[dict] | None) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    last = len(messages) - 1  # the conversation ends with its last answer
    spans = [(start, end) for i, start, end in _assistant_spans(tokenizer, messages, text, tools)
             if i == last or not train_on_last_turn]
    ids, offsets = tokenizer.encode_with_offsets(text)
    labels = [IGNORE_INDEX] * len(ids)
    k = 0
    for j, (tok_start, tok_end) in enumerate(offsets):
        # spans are sorted and disjoint; offsets never decrease
        while k < len(spans) and tok_start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if _in_span(tok_start, tok_end, spans[k][0], spans[k][1]):
            labels[j] = ids[j]
    return ids, labels


def _raw_example(tokenizer: Tokenizer, messages: Sequence[Message],
                 train_on_last_turn: bool) -> tuple[list[int], list[int]]:
    """Raw mode: per assistant turn, the prompt text (raw_prompt_text of the turns since the last answer, which
    ends with the separator) directly followed by the response, then the EOS id."""
    eos = tokenizer.eos_token_id
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    ids: list[int] = list(bos)
    labels: list[int] = [IGNORE_INDEX] * len(bos)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    pending: list[Message] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            pending.append(m)
            continue
        prompt = raw_prompt_text(pending)
        pending = []
        chunk_ids, offsets = tokenizer.encode_with_offsets(prompt + m["content"])
        train = not train_on_last_turn or i == last
        ids += chunk_ids
        n = len(prompt + m["content"])
        labels += [t if train and _in_span(s, e, len(prompt), n) else IGNORE_INDEX
                   for t, (s, e) in zip(chunk_ids, offsets)]
        if eos is not None:
            ids.append(eos)
            labels.append(eos if train else IGNORE_INDEX)
    return ids, labels


def _text_example(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    body = tokenizer.encode(text) + eos
    return bos + body, [IGNORE_INDEX] * len(bos) + body


def tokenize_example(tokenizer: Tokenizer, messages: Record, max_seq_len: int, use_chat_template: bool = True,
                     train_on_last_turn: bool = False) -> Example | None:
    """Tokenize one record and mark which tokens are trained.

    Conversations: only assistant responses are trained (every assistant turn, or only the last with
    `train_on_last_turn`), each with the token that closes it (e.g. <|im_end|>), found from character offsets of
    the rendered chat template (a ChatML fallback when the tokenizer has none). A conversation's `tools` are
    rendered with it (`tools=`, as transformers passes them); its tool calls are trained with their assistant turn,
    tool results are not; tools or tool calls with a template that cannot render them raise ToolError. A turn the
    template drops entirely (Qwen3 keeps only the answer after </think> of past turns: one that held only thinking)
    is not trained. With `use_chat_template=False`, raw text: prompt (see raw_prompt_text) + response + EOS. Plain text
    records: every token plus an appended EOS. Longer than `max_seq_len` is truncated; returns None when no
    trained token survives. A conversation the chat template refuses raises DataError.
    """
    if max_seq_len < 2:
        raise ConfigError(f"max_seq_len must be at least 2, got {max_seq_len}")
    if isinstance(messages, str):
        ids, labels = _text_example(tokenizer, messages)
    else:
        tools = _record_tools(tokenizer, messages, use_chat_template)
        # turns after the last answer teach nothing; leave them out
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last < 0:
            return None
        messages = list(messages[:last + 1])
        if use_chat_template:
            ids, labels = _chat_example(tokenizer, messages, train_on_last_turn, tools)
        else:
            ids, labels = _raw_example(tokenizer, messages, train_on_last_turn)
    truncated = len(ids) > max_seq_len
    input_ids = np.asarray(ids[:max_seq_len], dtype=np.int32)  # (T,)
    label_arr = np.asarray(labels[:max_seq_len], dtype=np.int64)  # (T,)
    if not (label_arr[1:] != IGNORE_INDEX).any():
        return None
    return Example(input_ids, label_arr, truncated)


def tokenize_dataset(tokenizer: Tokenizer, records: Sequence[Record], max_seq_len: int, use_chat_template: bool = True,
                     train_on_last_turn: bool = False,
                     skip_invalid: bool = False) -> tuple[list[Example], TokenizeStats]:
    """Tokenize every record (see tokenize_example); returns the kept examples and counts of what happened.

    A record the chat template refuses raises DataError "file:line: ..." (its source; "record k" for records
    built in code), or is skipped and counted in n_skipped when `skip_invalid`."""
    stats = TokenizeStats(n_records=len(records))
    examples: list[Example] = []
    for k, record in enumerate(records):
        try:
            ex = tokenize_example(tokenizer, record, max_seq_len, use_chat_template, train_on_last_turn)
        except (DataError, ToolError) as e:
            if skip_invalid and isinstance(e, DataError):
                stats.n_skipped += 1
                continue
            raise type(e)(f"{getattr(record, 'source', '') or f'record {k}'}: {e}") from None
        if ex is None:
            stats.n_dropped += 1
            continue
        stats.n_truncated += int(ex.truncated)
        stats.n_tokens += len(ex)
        stats.n_trained_tokens += ex.n_trained
        examples.append(ex)
    stats.n_examples = len(examples)
    return examples, stats
