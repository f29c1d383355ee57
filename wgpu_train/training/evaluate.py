"""Evaluation on any engine: token loss and perplexity over a dataset, and exact match of greedy answers."""
from __future__ import annotations

import math
import re
from typing import Sequence

import numpy as np

from wgpu_train.data.records import IGNORE_INDEX
from wgpu_train.data.batching import Batch, Example, make_batches
from wgpu_train.data.tokenize import tokenize_example
from wgpu_train.errors import ConfigError, DataError
from wgpu_train.formats.tool_calls import tool_schemas
from wgpu_train.engines.shared.labels import shift_labels


def engine_batch(batch: Batch) -> tuple:
    """The engine's micro-batch tuple (ids int32, targets int64 shifted, segment_ids int32, position_ids int32)."""
    return (np.ascontiguousarray(batch.input_ids, dtype=np.int32),
            shift_labels(np.asarray(batch.labels, dtype=np.int64)),
            np.ascontiguousarray(batch.segment_ids, dtype=np.int32),
            np.ascontiguousarray(batch.position_ids, dtype=np.int32))


def perplexity(mean_loss: float) -> float:
    """exp(mean token loss), inf when it overflows."""
    return math.exp(mean_loss) if mean_loss < 700 else math.inf


def evaluate_loss(engine, examples: Sequence[Example], batch_size: int = 8, pad_id: int = 0,
                  pad_to_multiple: int = 1, loss=None) -> dict:
    """Mean token loss and perplexity of `examples` (their trained tokens only) on an engine; `loss`, when given,
    scores a batch in place of the engine's loss (a VisionModel's, with the batch's images).

    Returns {"loss", "perplexity", "tokens"}; loss is None when there is nothing to score.
    """
    if not examples:
        return {"loss": None, "perplexity": None, "tokens": 0}
    batches = make_batches(examples, batch_size, np.random.default_rng(0), shuffle=False, bucket=True,
                           pad_id=pad_id, pad_to_multiple=pad_to_multiple)
    loss_sum, count = 0.0, 0
    for batch in batches:
        ls, n = engine.loss(*engine_batch(batch)) if loss is None else loss(batch)
        loss_sum += float(ls)
        count += int(n)
    if count == 0:
        return {"loss": None, "perplexity": None, "tokens": 0}
    mean = loss_sum / count
    return {"loss": mean, "perplexity": perplexity(mean), "tokens": count}


def generation_prompt(tokenizer, messages: Sequence[dict], use_chat_template: bool = True) -> list[int] | None:
    """Token ids that ask for the last assistant turn of `messages` (None when the record cannot be asked).

    With the chat template: the conversation before that turn rendered with the generation prompt (and the
    record's tools). Raw: the same prefix the trainer saw in raw mode (prompt text, BOS when the tokenizer adds
    one).
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        return None
    if use_chat_template:
        tools = getattr(messages, "tools", None)
        text = tokenizer.apply_chat_template(list(messages[:last]), add_generation_prompt=True,
                                             tools=tool_schemas(tools) if tools else None)
        return tokenizer.encode(text)
    ex = tokenize_example(tokenizer, list(messages[:last + 1]), 1 << 30, use_chat_template=False,
                          train_on_last_turn=True)
    if ex is None:
        return None
    trained = np.flatnonzero(ex.labels != IGNORE_INDEX)
    return ex.input_ids[:int(trained[0])].tolist() if trained.size and trained[0] > 0 else None


# A reasoning block before the answer (Qwen3's template trains an empty "<think>\n\n</think>\n\n").
_THINK = re.compile(r"\s*<think>.*?</think>\s*", re.DOTALL)


def answer_text(text: str) -> str:
    """The answer that exact match compares: `text` without a leading <think>...</think> block, trimmed."""
    m = _THINK.match(text)
    return (text[m.end():] if m else text).strip()


def exact_match(model, tokenizer, records: Sequence, use_chat_template: bool = True, max_new_tokens: int = 64,
                max_samples: int = 0, keep_samples: int = 5, batch_size: int = 16, max_seq_len: int | None = None,
                skip_invalid: bool = False) -> dict:
    """Greedy-generate the last assistant turn of each conversation and compare it with the reference.

    Output and reference are compared after removing a leading <think>...</think> block (a reasoning
    template such as Qwen3's trains an empty one before every answer) and the whitespace around the answer
    (answer_text). Plain-text records are skipped. At most `max_samples` records (0: all) are considered.
    Answers are generated batch_size at a time (Model.generate_batch: one engine call per decoding step for
    the whole batch), each with its own budget: max_new_tokens, at most the reference's tokens + 16, and
    within the positions left by the prompt. The positions are max_seq_len (when given) and the model's
    max_position_embeddings (when it has a config); a prompt that leaves no room for the reference's tokens
    and an end token is skipped and counted in "skipped_too_long", not asked. A conversation the chat
    template refuses raises its DataError, or with skip_invalid is skipped and counted in "skipped_invalid".

    Returns {"exact_match" (fraction, None when nothing was asked), "correct", "n" (asked), "skipped_too_long",
    "skipped_invalid", "samples"} where samples holds the first `keep_samples` (prompt, reference, output)
    triples.
    """
    if batch_size < 1:
        raise ConfigError(f"exact match needs a batch size of at least 1, got {batch_size}")
    if max_new_tokens < 1 or max_samples < 0:
        raise ConfigError(f"exact match needs max_new_tokens >= 1 and max_samples >= 0, got {max_new_tokens} "
                          f"and {max_samples}")
    limits = [max_seq_len, getattr(getattr(model, "config", None), "max_position_embeddings", None)]
    positions = min((n for n in limits if n), default=None)
    asked = []                                  # (prompt ids, reference, budget, user prompt) per sample
    skipped = invalid = 0
    for record in records:
        if isinstance(record, str):
            continue
        if max_samples and len(asked) + skipped + invalid >= max_samples:
            break
        try:
            ids = generation_prompt(tokenizer, record, use_chat_template)
        except DataError:
            if not skip_invalid:
                raise
            invalid += 1
            continue
        if not ids:
            continue
        last = max(i for i, m in enumerate(record) if m["role"] == "assistant")
        reference = record[last]["content"]
        wanted = len(tokenizer.encode(reference))
        # Exact match fails anyway once the answer is much longer than the reference.
        budget = min(max_new_tokens, wanted + 16)
        if positions is not None:
            room = positions - len(ids)
            if room < min(max_new_tokens, wanted + 1):
                skipped += 1
                continue
            budget = min(budget, room)
        asked.append((ids, reference, budget, record[last - 1]["content"] if last > 0 else ""))
    stops = set(tokenizer.stop_token_ids)
    correct = 0
    samples = []
    for b0 in range(0, len(asked), batch_size):
        batch = asked[b0:b0 + batch_size]
        outs = model.generate_batch([np.asarray(a[0]) for a in batch], max_new_tokens=[a[2] for a in batch],
                                    temperature=0.0, stop_token_ids=tokenizer.stop_token_ids)
        for (_, reference, _, prompt), out in zip(batch, outs):
            if out and out[-1] in stops:
                out = out[:-1]
            text = tokenizer.decode(out, skip_special_tokens=False)
            ok = answer_text(text) == answer_text(reference)
            correct += int(ok)
            if len(samples) < keep_samples:
                samples.append({"prompt": prompt, "reference": reference, "output": text, "match": ok})
    n = len(asked)
    return {"exact_match": (correct / n) if n else None, "correct": correct, "n": n, "skipped_too_long": skipped,
            "skipped_invalid": invalid, "samples": samples}
