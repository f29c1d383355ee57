"""Training records: the five record shapes (chat, completions, alpaca, instruction, text) checked and turned
into message lists or plain text, each remembering where it was read; a conversation's tools, tool calls and tool
results as TRL and transformers define them."""

from __future__ import annotations

from typing import Any, Iterable, Sequence, Union

from wgpu_train.errors import ToolError
from wgpu_train.formats.tool_calls import tool_schemas

IGNORE_INDEX = -100  # label of a position that carries no loss (transformers' convention)
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
RAW_SEPARATOR = "\n\n"  # between prompt and response in raw (no chat template) mode, except for completions data

# {"role": "system" | "user" | "assistant" | "tool", "content": str}; an assistant message may also hold
# "tool_calls" (then its content may be ""), a tool message "name" and "tool_call_id"; the user message of
# completions data also holds "raw_separator": "" (raw mode continues its prompt directly, see raw_prompt_text)
Message = dict
Record = Union[list, str]  # a conversation (list of Message) or, for the "text" format, a plain string

# format name -> (required string fields, optional string fields); "chat" is checked separately. The optional
# "input" (Alpaca) and "context" (Dolly) are more prompt text: they follow the instruction after a blank line;
# an "instruction" beside a prompt and a completion goes before the prompt, after a blank line.
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "chat": (("messages",), ()),
    "completions": (("prompt", "completion"), ("instruction", "system")),
    "alpaca": (("instruction", "output"), ("input", "context", "system")),
    "instruction": (("instruction", "response"), ("input", "context", "system")),
    "text": (("text",), ()),
}

_SHAPES = {
    "chat": '{"messages": [...]} or {"conversations": [...]}',
    "completions": '{"prompt", "completion"}',
    "alpaca": '{"instruction", "input"?, "output"}',
    "instruction": '{"instruction", "response", "system"?}',
    "text": '{"text"}',
}


class Conversation(list):
    """A record's messages that remember where they were read: `source` is "file:line" ("" when built in code);
    `tools`, the tools the chat template renders with them (JSON schemas or, built in code, Python functions), or
    None."""

    def __init__(self, messages: Iterable[Message] = (), source: str = "", tools: Sequence[Any] | None = None) -> None:
        super().__init__(messages)
        self.source = source
        self.tools = tools


class Text(str):
    """A plain-text record that remembers where it was read: `source` is "file:line"."""

    source: str

    def __new__(cls, text: str, source: str = "") -> "Text":
        obj = super().__new__(cls, text)
        obj.source = source
        return obj


class BadRecord(Exception):
    """A problem with one record; the reader adds where the record was (file:line, file:row)."""


def detect_format(obj: Any) -> str:
    """The format name of one record object (BadRecord when it has none)."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj or "conversations" in obj:
        return "chat"
    # before "prompt": Alpaca-style rows may carry a pre-rendered prompt of the same instruction
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    if "instruction" in obj and "response" in obj:
        return "instruction"
    if "prompt" in obj or "completion" in obj:
        return "completions"
    if "instruction" in obj:
        return "alpaca" if "input" in obj else "instruction"  # reported below as a missing field
    if "text" in obj:
        return "text"
    keys = ", ".join(sorted(obj)[:6]) or "none"
    raise BadRecord(f"unknown record shape (keys: {keys}); expected one of " + ", ".join(_SHAPES.values()))


def string_field(obj: dict, key: str, where: str = "") -> str:
    """obj[key], a string that is not blank (returned as given); BadRecord naming the field otherwise."""
    if key not in obj or obj[key] is None:
        raise BadRecord(f'missing field "{key}"{where}')
    value = obj[key]
    if not isinstance(value, str):
        raise BadRecord(f'field "{key}"{where} must be a string, got {type(value).__name__}')
    if not value.strip():
        raise BadRecord(f'field "{key}"{where} is empty')
    return value


def optional_string(obj: dict, key: str) -> str | None:
    """obj[key] when it is a string that is not blank, else None (absent, null or blank); BadRecord for a value
    of another type."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRecord(f'field "{key}" must be a string, got {type(value).__name__}')
    return value if value.strip() else None


def _message_content(m: dict, key: str, k: int) -> str:
    """Message k's content: a string, or OpenAI-style parts [{"type": "text", "text": ...}] whose texts are joined."""
    value = m.get(key)
    if value is None:
        raise BadRecord(f'missing field "{key}" in message {k}')
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRecord(f'field "{key}" in message {k} must be a string or a list of text parts, '
                       f"got {type(value).__name__}")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":     # vision records are recognised in one local file only (vision_records.is_vision_data)
            raise BadRecord(f"message {k} has an image part; images train from one local .json/.jsonl file whose "
                            f"first record has an images column (not a folder, glob or hub dataset yet)")
        if kind != "text":
            what = f"type {kind!r}" if kind is not None else "no type"
            raise BadRecord(f"message {k} has a content part of {what}; only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise BadRecord(f'a text part of message {k} has no string "text"')
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(m: dict, k: int) -> list[dict]:
    """Message k's tool_calls as given ({"type": "function", "function": {"name", "arguments"}} or the function
    itself), each checked to name its function; BadRecord otherwise."""
    calls = m["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise BadRecord(f'"tool_calls" of message {k} must be a non-empty list')
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments", {}), (dict, str)):
            raise BadRecord(f"tool call {j} of message {k} must be {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ..., \"arguments\": {{...}}}}}}")
    return calls


def convert_messages(messages: Any, key: str) -> list[Message]:
    """The field `key`'s messages checked and normalised to {"role", "content"} (ShareGPT's from / value and
    OpenAI-style text parts accepted; an empty system message left out); an assistant message keeps its
    "tool_calls" (its content "" when it has none), a tool message its "name" and "tool_call_id"; BadRecord for
    anything else."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f'"{key}" must be a non-empty list')
    out: list[Message] = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRecord(f"message {k} must be an object with role and content")
        if "role" not in m and "from" in m:  # ShareGPT: {"from": "human" | "gpt" | "system", "value": ...}
            role = SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None
            content_key = "value"
            if role is None:
                raise BadRecord(f"message {k} is from {m['from']!r}; ShareGPT messages must be from human, gpt "
                               "or system")
        else:
            role, content_key = m.get("role"), "content"
            if role not in ROLES:
                raise BadRecord(f"message {k} has role {role!r}; roles must be system, user, assistant or tool")
        calls = _tool_calls(m, k) if role == "assistant" and m.get("tool_calls") is not None else None
        content = "" if calls is not None and m.get(content_key) is None else _message_content(m, content_key, k)
        if not content.strip() and calls is None and role != "tool":
            if role == "system":
                continue  # an empty system message is no system message
            raise BadRecord(f'field "{content_key}" in message {k} is empty')
        if role == "system" and out:
            raise BadRecord(f"message {k}: a system message may only come first")
        message = {"role": role, "content": content}
        if calls is not None:
            message["tool_calls"] = calls
        if role == "tool":
            message.update({name: m[name] for name in ("name", "tool_call_id") if isinstance(m.get(name), str)})
        out.append(message)
    return out


def record_tools(obj: dict) -> list[dict] | None:
    """A record's "tools" column as JSON schemas (a list of them, or a JSON string of one; TRL's SFTTrainer reads
    both), None when absent or empty; BadRecord naming the problem."""
    if obj.get("tools") is None:
        return None
    try:
        return tool_schemas(obj["tools"]) or None
    except ToolError as e:
        raise BadRecord(f'field "tools": {e}') from None


def _convert_chat(obj: dict) -> Conversation:
    key = "messages" if "messages" in obj else "conversations"
    out = Conversation(convert_messages(obj[key], key), tools=record_tools(obj))
    first = 1 if out and out[0]["role"] == "system" else 0
    if len(out) <= first or out[first]["role"] != "user":
        raise BadRecord("the conversation must start with a user message (after an optional system message)")
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("the conversation has no assistant message to train on")
    return out


def convert(obj: Any, fmt: str) -> Record:
    """Check `obj` against `fmt` and turn it into a message list (or the text, for the text format)."""
    found = detect_format(obj)
    if found != fmt:
        raise BadRecord(f"record looks like {found} format {_SHAPES[found]}, "
                       f"but the file is {fmt} format {_SHAPES[fmt]}")
    if fmt == "chat":
        return _convert_chat(obj)
    if fmt == "text":
        return string_field(obj, "text")
    response_key = FORMATS[fmt][0][1]
    return prompt_messages(obj, fmt) + [{"role": "assistant", "content": string_field(obj, response_key)}]


def prompt_messages(obj: dict, fmt: str) -> list[Message]:
    """The messages before the answer of a record of the completions, alpaca or instruction format, as SFT lays
    them out: an optional system message, then the user turn (the instruction with the input or context after it,
    or the instruction before a completion's prompt, after a blank line); BadRecord naming a bad field."""
    (prompt_key, _), optional = FORMATS[fmt]
    user = string_field(obj, prompt_key)
    extras = [optional_string(obj, key) for key in optional if key != "system"]
    parts = extras + [user] if fmt == "completions" else [user] + extras
    user = "\n\n".join(part for part in parts if part is not None)
    system = optional_string(obj, "system")
    messages = [{"role": "system", "content": system}] if system is not None else []
    prompt = {"role": "user", "content": user}
    if fmt == "completions":
        prompt["raw_separator"] = ""  # a completion continues its prompt as given
    return messages + [prompt]
