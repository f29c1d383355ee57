"""GRPO's prompt-only records in TRL's formats: a prompt (a string, or messages asking for the next assistant turn)
with every other column of the record kept for the reward functions; also the prompts of SFT conversations, of
prompt-completion records and of Alpaca / instruction records (as SFT lays out their prompt), whose answer becomes
the `answer` column."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wgpu_train.data.preference_records import Part, is_conversational
from wgpu_train.data.records import (FORMATS, BadRecord, Message, convert_messages, optional_string, prompt_messages,
                                     string_field)

ANSWER_COLUMN = "answer"
REFERENCE_COLUMNS = ("answer", "solution")  # the columns the exact-match reward compares with, in this order
# Keyword arguments the trainer passes to reward functions itself; TRL leaves a "completion_ids" column out of
# the reward columns, and a column of another of these names would collide with the argument.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")

_SHAPES = {
    "prompt": '{"prompt": "..."}',
    "conversational prompt": '{"prompt": [messages]}',
    "prompt-completion": '{"prompt": "...", "completion": "..."}',
    "conversational prompt-completion": '{"prompt": [messages], "completion": [messages]}',
    "chat": '{"messages": [...]}',
    "alpaca": '{"instruction", "input"?, "output"?}',
    "instruction": '{"instruction", "response"?}',
}
INSTRUCTION_FORMATS = ("alpaca", "instruction")   # SFT's formats whose prompt is an instruction: a user turn


@dataclass(frozen=True)
class PromptRecord:
    """A prompt for GRPO: a string (TRL's standard format) or a message list ending with a user turn
    (conversational), and the record's other columns by name, which reward functions receive as keyword lists.
    `source` is "file:line" ("" when built in code)."""

    prompt: Part
    columns: dict = field(default_factory=dict)
    source: str = ""
    images: list = field(default_factory=list)     # records with images: those the prompt's placeholders take


def detect_prompt_format(obj: Any) -> str:
    """The format of one record read as prompts (a key of _SHAPES); BadRecord for a record without a prompt."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    if obj.get("prompt") is not None:
        kind = "prompt-completion" if obj.get("completion") is not None else "prompt"
        return f"conversational {kind}" if isinstance(obj["prompt"], list) else kind
    if obj.get("messages") is not None or obj.get("conversations") is not None:
        return "chat"
    if obj.get("instruction") is not None:     # TRL's GRPOTrainer has no such format; SFT's reading of it
        has = {k for k in ("output", "response", "input") if obj.get(k) is not None}
        return "alpaca" if "output" in has or has == {"input"} else "instruction"
    keys = ", ".join(sorted(map(str, obj))[:6]) or "none"
    raise BadRecord(f"no prompt (keys: {keys}); expected {_SHAPES['prompt']}, {_SHAPES['conversational prompt']}, "
                    f"a conversation {_SHAPES['chat']} or an instruction {_SHAPES['alpaca']}")


def is_conversational_format(fmt: str) -> bool:
    """Whether a format of detect_prompt_format gives message-list prompts."""
    return fmt in ("chat",) + INSTRUCTION_FORMATS or fmt.startswith("conversational")


def _check_prompt_messages(messages: list[Message], key: str) -> None:
    """A conversational prompt asks for the next assistant turn: a user message must come last."""
    role = messages[-1]["role"]
    if role != "user":
        article = "an" if role == "assistant" else "a"
        raise BadRecord(f'the prompt in "{key}" must end with a user message, not with {article} {role} message')


def _last_answer(messages: list[Message], key: str) -> str:
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if not answers:
        raise BadRecord(f'"{key}" has no assistant message')
    return answers[-1]


def _split_chat(obj: dict) -> tuple[list[Message], str | None]:
    """(prompt, answer) of a conversation: a conversation ending with an answer gives the messages before it and
    that answer; one ending with a user message is a prompt as it is, without an answer."""
    key = "messages" if obj.get("messages") is not None else "conversations"
    messages = convert_messages(obj[key], key)
    if messages[-1]["role"] == "assistant":
        messages, answer = messages[:-1], messages[-1]["content"]
    else:
        answer = None
    if not messages:
        raise BadRecord(f'"{key}" holds only an answer, no prompt')
    _check_prompt_messages(messages, key)
    return messages, answer


def _prompt_and_answer(obj: dict, fmt: str) -> tuple[Part, str | None]:
    if fmt == "chat":
        return _split_chat(obj)
    if fmt in INSTRUCTION_FORMATS:      # the user turn (and system message) SFT trains the answer after
        return prompt_messages(obj, fmt), optional_string(obj, FORMATS[fmt][0][1])
    if is_conversational_format(fmt):
        prompt: Part = convert_messages(obj["prompt"], "prompt")
        _check_prompt_messages(prompt, "prompt")
    else:
        prompt = string_field(obj, "prompt")
    if not fmt.endswith("prompt-completion"):
        return prompt, None
    completion = obj["completion"]
    if isinstance(completion, list) != is_conversational(prompt):
        raise BadRecord('"prompt" and "completion" must both be strings or both message lists')
    if isinstance(completion, list):
        return prompt, _last_answer(convert_messages(completion, "completion"), "completion")
    return prompt, string_field(obj, "completion")


def convert_prompt(obj: Any, fmt: str, source: str = "") -> PromptRecord:
    """Check `obj` against `fmt`, the file's format (a name of detect_prompt_format), and turn it into a
    PromptRecord read at `source`. A file's records may mix formats of one form, strings or message lists, but
    not the two forms (TRL tokenizes a batch as its first prompt is).

    Its columns are the record's fields but the prompt's ("prompt", "messages" / "conversations"; an
    instruction record's instruction, input, context and system) and a completion's. The answer of a conversation,
    prompt-completion or instruction record (the last assistant turn's content, the completion string, Alpaca's
    output or the response) becomes the "answer" column when the record has neither an "answer" nor a "solution"
    column of its own, so an SFT dataset serves GRPO with the exact-match reward. An instruction record's prompt is
    the conversation SFT trains on, without its answer: an optional system message, then the user turn with the
    instruction and the input or context after it (records.prompt_messages)."""
    found = detect_prompt_format(obj)
    if is_conversational_format(found) != is_conversational_format(fmt):
        raise BadRecord(f"record looks like {found} format {_SHAPES[found]}, but the file is {fmt} format "
                        f"{_SHAPES[fmt]}; string and conversational prompts do not mix")
    prompt, answer = _prompt_and_answer(obj, found)
    own = (("messages", "conversations") if found == "chat" else sum(FORMATS[found], ())
           if found in INSTRUCTION_FORMATS else ("prompt", "completion"))
    columns = {k: v for k, v in obj.items() if k not in own and k != "completion_ids"}
    clash = [k for k in RESERVED_COLUMNS if k in columns]
    if clash:
        raise BadRecord(f'column "{clash[0]}" is named as an argument reward functions get from the trainer; '
                        "rename that column")
    if answer is not None and all(columns.get(k) is None for k in REFERENCE_COLUMNS):
        columns[ANSWER_COLUMN] = answer
    return PromptRecord(prompt, columns, source)
