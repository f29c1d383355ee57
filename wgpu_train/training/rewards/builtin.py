"""The built-in reward functions, with TRL's signature f(prompts, completions, **columns) -> list[float | None]:
exact match with the answer, a regular-expression format, and the share of words in their right place."""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from wgpu_train.data.prompt_records import REFERENCE_COLUMNS


def completion_text(completion: Any) -> str:
    """A completion's text: a string as it is (a standard prompt's completion), or the content of the last message
    of a conversational one, which TRL passes as [{"role": "assistant", "content": text}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(f"a completion is a string or a list of messages, got {type(completion).__name__}")


def references(n: int, columns: dict[str, Sequence]) -> list[str | None]:
    """Each row's reference answer: its "answer" column, else its "solution" column, as a string; None for a row
    that has neither (both columns missing, or both None in that row)."""
    out: list[str | None] = []
    for i in range(n):
        found = next((columns[k][i] for k in REFERENCE_COLUMNS if k in columns and columns[k][i] is not None), None)
        out.append(None if found is None else str(found))
    return out


def exact_match(prompts: Sequence, completions: Sequence, **columns: Any) -> list[float | None]:
    """1.0 where the completion's text, stripped, equals the row's reference answer (references()), stripped;
    0.0 where it does not; None (not applicable) where the row has no reference."""
    return [None if ref is None else float(completion_text(c).strip() == ref.strip())
            for c, ref in zip(completions, references(len(completions), columns))]


def word_positions(prompts: Sequence, completions: Sequence, **columns: Any) -> list[float | None]:
    """The share of word positions that the completion gets right, for tasks that reorder words (the embedded
    reversal): the number of positions i where the completion's i-th word (split on whitespace) is the reference
    answer's i-th word, over the length of the longer of the two word lists. So 1.0 only for the answer's words
    in order with nothing after them, partial credit for each word in its place, and extra words cost as missing
    ones do. An empty answer scores 1.0 against an empty completion and 0.0 otherwise; None where the row has no
    reference (as exact_match)."""
    out: list[float | None] = []
    for c, ref in zip(completions, references(len(completions), columns)):
        if ref is None:
            out.append(None)
            continue
        want, got = ref.split(), completion_text(c).split()
        longer = max(len(want), len(got))
        out.append(1.0 if longer == 0 else sum(a == b for a, b in zip(want, got)) / longer)
    return out


def format_reward(pattern: re.Pattern) -> Callable[..., list[float]]:
    """The format reward of a compiled pattern: 1.0 where the completion's stripped text matches it whole
    (re.fullmatch; compile it with re.DOTALL so that "." crosses lines), 0.0 elsewhere."""

    def format_match(prompts: Sequence, completions: Sequence, **columns: Any) -> list[float]:
        return [float(pattern.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return format_match


# the built-in names of --reward: these two, and FORMAT_REWARD, which load_rewards builds from --reward-pattern
BUILTIN_REWARDS: dict[str, Callable[..., list]] = {"exact_match": exact_match, "word_positions": word_positions}
FORMAT_REWARD = "format"
