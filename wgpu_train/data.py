"""Training data: records (records.py, read by sources.py) -> token ids with loss masks -> padded or packed
batches, with a resumable batch stream for the trainer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from wgpu_train.errors import ConfigError, DataError
from wgpu_train.records import FORMATS, IGNORE_INDEX, RAW_SEPARATOR, Conversation, Message, Record, Text
from wgpu_train.sources import DataSplits, load_records, resolve_data
from wgpu_train.tokenizer import Tokenizer

__all__ = [
    "IGNORE_INDEX", "FORMATS", "RAW_SEPARATOR", "Message", "Record", "Conversation", "Text",
    "DataSplits", "Example", "TokenizeStats", "Batch", "BatchStream", "load_records", "resolve_data", "raw_prompt_text",
    "tokenize_example", "tokenize_dataset", "make_batches", "collate", "pack_examples",
]

# ---------------------------------------------------------------------------------------------------------------
# Tokenization with loss masks


@dataclass(eq=False)
class Example:
    """One tokenized sample. Labels are not shifted: the model's logits at t are scored against labels[t + 1]."""

    input_ids: np.ndarray  # (T,) int32
    labels: np.ndarray  # (T,) int64, IGNORE_INDEX where no loss
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_trained(self) -> int:
        """Number of positions that carry loss after the shift."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


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


def _assistant_spans(tokenizer: Tokenizer, messages: Sequence[Message], text: str) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant turn: the char span in `text` (the rendered conversation)
    from where the generation prompt ends through the token that closes the turn. A turn whose content the
    template drops entirely (a past reasoning turn that held only thinking) has no span."""
    markers = tokenizer.end_of_turn_strings()
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        start = _prompt_end(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True), text)
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


def _chat_example(tokenizer: Tokenizer, messages: Sequence[Message],
                  train_on_last_turn: bool) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    last = len(messages) - 1  # the conversation ends with its last answer
    spans = [(start, end) for i, start, end in _assistant_spans(tokenizer, messages, text)
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
    the rendered chat template (a ChatML fallback when the tokenizer has none). A turn the template drops
    entirely (Qwen3 keeps only the answer after </think> of past turns: one that held only thinking) is not
    trained. With `use_chat_template=False`, raw text: prompt (see raw_prompt_text) + response + EOS. Plain text
    records: every token plus an appended EOS. Longer than `max_seq_len` is truncated; returns None when no
    trained token survives. A conversation the chat template refuses raises DataError.
    """
    if max_seq_len < 2:
        raise ConfigError(f"max_seq_len must be at least 2, got {max_seq_len}")
    if isinstance(messages, str):
        ids, labels = _text_example(tokenizer, messages)
    else:
        # turns after the last answer teach nothing; leave them out
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last < 0:
            return None
        messages = list(messages[:last + 1])
        if use_chat_template:
            ids, labels = _chat_example(tokenizer, messages, train_on_last_turn)
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
        except DataError as e:
            if skip_invalid:
                stats.n_skipped += 1
                continue
            raise DataError(f"{getattr(record, 'source', '') or f'record {k}'}: {e}") from None
        if ex is None:
            stats.n_dropped += 1
            continue
        stats.n_truncated += int(ex.truncated)
        stats.n_tokens += len(ex)
        stats.n_trained_tokens += ex.n_trained
        examples.append(ex)
    stats.n_examples = len(examples)
    return examples, stats


# ---------------------------------------------------------------------------------------------------------------
# Batching and packing


@dataclass(eq=False)
class Batch:
    """A padded (and possibly packed) batch. Attention is allowed only within one segment id; 0 is padding."""

    input_ids: np.ndarray  # (B, T) int32
    labels: np.ndarray  # (B, T) int64, IGNORE_INDEX where no loss; not shifted
    attention_mask: np.ndarray  # (B, T) int32, 1 for real tokens
    segment_ids: np.ndarray  # (B, T) int32, 0 for padding, 1..n for the samples packed in a row
    position_ids: np.ndarray  # (B, T) int32, restarting at 0 for each sample
    n_tokens: int  # positions that carry loss after the shift: (labels[:, 1:] != IGNORE_INDEX).sum()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def collate(rows: Sequence[Sequence[Example]], pad_id: int = 0, length: int | None = None,
            pad_to_multiple: int = 1) -> Batch:
    """Build a batch whose row r holds the examples rows[r] one after another, right-padded with `pad_id`
    to `length` (default: the longest row, rounded up to `pad_to_multiple`)."""
    used = [sum(len(e) for e in row) for row in rows]
    T = length if length is not None else _round_up(max(used), max(1, pad_to_multiple))
    if max(used) > T:
        raise ValueError(f"a row of {max(used)} tokens does not fit length {T}")
    B = len(rows)
    input_ids = np.full((B, T), pad_id, dtype=np.int32)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    segment_ids = np.zeros((B, T), dtype=np.int32)
    position_ids = np.zeros((B, T), dtype=np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            n = len(ex)
            input_ids[r, at:at + n] = ex.input_ids
            labels[r, at:at + n] = ex.labels
            if s > 0:
                labels[r, at] = IGNORE_INDEX  # logits at at-1 belong to the previous sample
            segment_ids[r, at:at + n] = s + 1
            position_ids[r, at:at + n] = np.arange(n, dtype=np.int32)
            at += n
    attention_mask = (segment_ids > 0).astype(np.int32)
    n_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return Batch(input_ids, labels, attention_mask, segment_ids, position_ids, n_tokens)


def pack_examples(lengths: Sequence[int], max_seq_len: int, chunk: int = 4096) -> list[list[int]]:
    """First-fit packing of samples (in the given order) into rows of `max_seq_len` tokens; returns the sample
    indices of each row. Works on chunks of `chunk` samples so that the cost stays linear in the dataset."""
    rows: list[list[int]] = []
    for c0 in range(0, len(lengths), chunk):
        room = np.zeros(0, dtype=np.int64)  # free tokens of each row of this chunk
        chunk_rows: list[list[int]] = []
        for i in range(c0, min(c0 + chunk, len(lengths))):
            n = int(lengths[i])
            if n > max_seq_len:
                raise ValueError(f"sample {i} has {n} tokens, more than max_seq_len={max_seq_len}")
            fits = np.flatnonzero(room >= n)
            if fits.size:
                r = int(fits[0])
                room[r] -= n
                chunk_rows[r].append(i)
            else:
                room = np.append(room, max_seq_len - n)
                chunk_rows.append([i])
        rows += chunk_rows
    return rows


def token_groups(lengths: Sequence[int], max_tokens: int, multiple: int = 1) -> list[tuple[int, int]]:
    """(start, end) of consecutive runs of rows, in order, each as long as it stays within max_tokens once padded:
    rows x its longest length rounded up to `multiple` (a row longer than that alone makes its own run)."""
    out, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        w = max(width, _round_up(int(n), max(1, multiple)))
        if i > start and (i - start + 1) * w > max_tokens:
            out.append((start, i))
            start, w = i, _round_up(int(n), max(1, multiple))
        width = w
    if len(lengths):
        out.append((start, len(lengths)))
    return out


def make_batches(examples: Sequence[Example], batch_size: int, rng: np.random.Generator, shuffle: bool = True,
                 pack: bool = False, max_seq_len: int | None = None, bucket: bool = True, pad_id: int = 0,
                 pad_to_multiple: int = 1, max_tokens: int | None = None, micro_batches: int = 1) -> list[Batch]:
    """One epoch of batches.

    Samples are shuffled with `rng` (when `shuffle`); with `bucket`, sorted by length within chunks of
    50 * batch_size so that a batch holds similar lengths, and the batch order is shuffled again. With `pack`,
    samples are first-fit packed into rows of `max_seq_len` tokens (segment ids and positions per sample).
    The last batch may hold fewer rows. With max_tokens, a batch is `micro_batches` consecutive token_groups
    of the (bucketed) rows instead of batch_size rows: split_batch(..., max_tokens=) cuts it back into them.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    if not examples:
        return []
    n = len(examples)
    order = rng.permutation(n) if shuffle else np.arange(n)
    lengths = np.array([len(e) for e in examples], dtype=np.int64)

    if pack:
        if max_seq_len is None:
            raise ConfigError("packing needs max_seq_len")
        rows = [[int(order[i]) for i in row] for row in pack_examples(lengths[order], max_seq_len)]
        row_len = np.array([lengths[row].sum() for row in rows])
    else:
        rows = [[int(i)] for i in order]
        row_len = lengths[order]

    row_order = np.arange(len(rows))
    if bucket:
        chunk = 50 * batch_size
        for c0 in range(0, len(rows), chunk):
            part = row_order[c0:c0 + chunk]
            row_order[c0:c0 + chunk] = part[np.argsort(-row_len[part], kind="stable")]
    if max_tokens:
        runs = token_groups(row_len[row_order], max_tokens, pad_to_multiple)
        groups = [row_order[runs[g][0]:runs[min(g + micro_batches, len(runs)) - 1][1]]
                  for g in range(0, len(runs), micro_batches)]
    else:
        groups = [row_order[b:b + batch_size] for b in range(0, len(rows), batch_size)]
    if bucket and shuffle:
        groups = [groups[i] for i in rng.permutation(len(groups))]
    return [collate([[examples[i] for i in rows[r]] for r in g], pad_id=pad_id, pad_to_multiple=pad_to_multiple)
            for g in groups]


class BatchStream:
    """Endless, resumable stream of (epoch, index, Batch): epoch e's batches come from
    make_batches(..., rng=np.random.default_rng([seed, e])), so state_dict() fully describes the position."""

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, pack: bool = False,
                 max_seq_len: int | None = None, shuffle: bool = True, bucket: bool = True, pad_id: int = 0,
                 pad_to_multiple: int = 1, max_tokens: int | None = None, micro_batches: int = 1) -> None:
        if not examples:
            raise DataError("no training examples left after tokenization")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.pack = pack
        self.max_seq_len = max_seq_len
        self.shuffle = shuffle
        self.bucket = bucket
        self.pad_id = pad_id
        self.pad_to_multiple = pad_to_multiple
        self.max_tokens, self.micro_batches = max_tokens, micro_batches
        self.epoch = 0
        self.position = 0  # index of the next batch within the epoch
        self._cache: tuple[int, list[Batch]] | None = None
        self._fingerprint: str | None = None

    def epoch_batches(self, epoch: int) -> list[Batch]:
        """All batches of `epoch` (deterministic in seed and epoch)."""
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            batches = make_batches(self.examples, self.batch_size, rng, shuffle=self.shuffle, pack=self.pack,
                                   max_seq_len=self.max_seq_len, bucket=self.bucket, pad_id=self.pad_id,
                                   pad_to_multiple=self.pad_to_multiple, max_tokens=self.max_tokens,
                                   micro_batches=self.micro_batches)
            self._cache = (epoch, batches)
        return self._cache[1]

    def __len__(self) -> int:
        """Batches in the current epoch (with packing this can vary slightly between epochs)."""
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[tuple[int, int, Batch]]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.position < len(batches):
                index = self.position
                self.position += 1  # advanced before yielding so a state_dict taken now resumes after this batch
                yield self.epoch, index, batches[index]
            self.epoch += 1
            self.position = 0

    def fingerprint(self) -> str:
        """A hash of every example's token ids and labels, in order: equal only for the same training data."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            for ex in self.examples:
                h.update(np.int64(len(ex)).tobytes())
                h.update(np.ascontiguousarray(ex.input_ids, dtype=np.int32).tobytes())
                h.update(np.ascontiguousarray(ex.labels, dtype=np.int64).tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream and the fingerprint of its data, JSON-serialisable."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "n_examples": len(self.examples), "batch_size": self.batch_size, "pack": self.pack,
                "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state_dict() of a stream over the same examples and settings; ConfigError when the
        data differ (states saved before fingerprints existed are checked by their number of examples)."""
        n, now = state.get("n_examples", len(self.examples)), len(self.examples)
        if n != now or state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            detail = (f"{n} examples then, {now} now" if n != now else
                      "other token ids or labels: the records, tokenizer, chat template or max_seq_len differ")
            raise ConfigError(f"the training data changed since the checkpoint ({detail}); "
                              "resume with the data it was trained on")
        for key, now in (("batch_size", self.batch_size), ("pack", self.pack)):
            if key in state and state[key] != now:
                raise DataError(f"cannot resume the data stream: it was saved with {key}={state[key]}, now {now}")
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
