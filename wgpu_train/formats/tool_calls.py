"""Tool calling in chat formats: a Python function's JSON schema (as transformers' get_json_schema makes it), which
tool-call syntax a chat template writes, and model output parsed into a message with tool_calls (as transformers'
parse_response does with TRL 1.16's response templates). (Over 450 lines: the three parts of transformers and TRL's tool
calling, each small, which the data readers, GRPO's tool loop and the server all import together.)"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jinja2

from wgpu_train.errors import ToolError
from wgpu_train.formats.tokenizer import compile_chat_template

__all__ = ["FORMATS", "ToolCallFormat", "function_schema", "parse_response", "supports_tools", "tool_call_format",
           "tool_schemas"]

# ---- JSON schemas of Python functions ----

_JSON_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_PLAIN_TYPES: dict[Any, dict] = {**{t: {"type": name} for t, name in _JSON_SCALARS.items()},
                                 list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"},
                                 typing.Any: {}}
_SECTION = re.compile(r"Args:|Returns:|Raises:")
_ARGS_BLOCK = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(?:Returns:|Raises:|\Z)", re.DOTALL)
_RETURNS_BLOCK = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(?:Raises:|\Z)", re.DOTALL)
# one argument of an Args: block: "name (type): text", the text running on until the next "name:" line that is not
# indented deeper than this one
_ARG_ENTRY = re.compile(r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
                        r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _enum_schema(values: list) -> dict:
    kinds = list(dict.fromkeys(_JSON_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint_schema(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint (transformers' rules: unions as a type list or anyOf, Optional as nullable,
    Literal and Enum as enum, tuples as prefixItems, dict values as additionalProperties)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        if not values or any(type(v) not in _JSON_SCALARS for v in values):
            raise ToolError(f"{where}: the Enum {hint.__name__} has no members or values that are not JSON scalars")
        return _enum_schema(values)
    if origin is None:
        if hint in _PLAIN_TYPES:
            return dict(_PLAIN_TYPES[hint])
        raise ToolError(f"{where}: cannot write the type hint {hint!r} as a JSON schema (use int, float, str, bool, "
                        f"Enum, Literal, list, tuple, dict or unions of them, or give the tool's schema as a dict)")
    if origin is typing.Union or origin is types.UnionType:
        parts = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(p.keys() == {"type"} and isinstance(p["type"], str) for p in parts):
            names = sorted({p["type"] for p in parts})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        if any(type(a) not in _JSON_SCALARS for a in args):
            raise ToolError(f"{where}: typing.Literal may only list int, float, str, bool or None values")
        return _enum_schema(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ToolError(f"{where}: a tuple hint needs two or more fixed element types (use list[...] instead)")
        return {"type": "array", "prefixItems": [_hint_schema(a, where) for a in args]}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _hint_schema(args[1], where)} if len(args) == 2
                                     else {})}
    raise ToolError(f"{where}: cannot write the type hint {hint!r} as a JSON schema")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str], str | None]:
    """A Google-style docstring's description, its Args: descriptions by name and its Returns: text."""
    section = _SECTION.search(doc)
    description = (doc[:section.start()] if section else doc).strip()
    args: dict[str, str] = {}
    block = _ARGS_BLOCK.search(doc)
    if block:
        lines = "\n".join(line for line in block.group(1).split("\n") if line.strip())
        args = {m.group(2): re.sub(r"\s*\n+\s*", " ", m.group(3).strip()) for m in _ARG_ENTRY.finditer(lines)}
    returns = _RETURNS_BLOCK.search(doc)
    return description, args, returns.group(1).strip() if returns else None


def function_schema(fn: Callable) -> dict:
    """The tool schema {"type": "function", "function": {name, description, parameters}} of a Python function, as
    transformers' get_json_schema makes it from its type hints and Google-style docstring (Args: one line per
    parameter, an optional "(choices: [...])" at the end becoming an enum). A method's self/cls is left out.
    Raises ToolError for a function without a docstring, a parameter without a type hint or without a description."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolError(f"tool {name}: no docstring (a tool needs one, with an Args: line per parameter)")
    description, described, returns_doc = _docstring_parts(doc.strip())
    try:
        hints = typing.get_type_hints(fn)
        params = inspect.signature(fn).parameters
    except (NameError, TypeError, ValueError) as e:
        raise ToolError(f"tool {name}: cannot read its signature or type hints ({e})") from None
    first = next(iter(params), None)
    receiver = first if first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty else None
    required = []
    for pname, param in params.items():
        if pname == receiver:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise ToolError(f"tool {name}: argument {pname} has no type hint")
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    properties: dict[str, dict] = {}
    returns = None
    for pname, hint in hints.items():
        if pname == "return":
            try:
                returns = _hint_schema(hint, f"tool {name}")
            except ToolError:
                pass  # the model never writes the return value: a hint without a schema is left out
        elif pname != receiver and pname in params:
            properties[pname] = _hint_schema(hint, f"tool {name}, argument {pname}")
    for pname, schema in properties.items():
        if pname not in described:
            raise ToolError(f"tool {name}: the docstring's Args: has no description of argument {pname}")
        text = described[pname]
        choices = _CHOICES.search(text)
        if choices:
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[:choices.start()].strip()
        schema["description"] = text
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        if returns_doc is not None:
            returns["description"] = returns_doc
        out["return"] = returns
    return {"type": "function", "function": out}


def _checked_schema(tool: Any, where: str) -> dict:
    if isinstance(tool, str):
        try:
            tool = json.loads(tool)
        except json.JSONDecodeError as e:
            raise ToolError(f"{where}: not valid JSON ({e.msg})") from None
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return function_schema(tool)
    if not isinstance(tool, dict):
        raise ToolError(f"{where}: a tool must be a JSON schema (an object) or a Python function, "
                        f"got {type(tool).__name__}")
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"{where}: a tool schema needs a function name ({{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ..., \"parameters\": {{...}}}}}})")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise ToolError(f"{where}: tool {fn['name']}'s parameters must be a JSON schema object")
    return tool


def tool_schemas(tools: Any) -> list[dict]:
    """`tools` as the list of JSON schemas chat templates render: a list of Python functions (their
    `function_schema`) and schema dicts (kept as given), or a JSON string of such a list or of one schema (a
    dataset's `tools` column). Raises ToolError naming the first entry that is neither."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ToolError(f"tools: not valid JSON ({e.msg})") from None
        tools = [tools] if isinstance(tools, dict) else tools
    if not isinstance(tools, (list, tuple)):
        raise ToolError(f"tools must be a list of JSON schemas or functions, got {type(tools).__name__}")
    return [_checked_schema(t, f"tools[{i}]") for i, t in enumerate(tools)]


# ---- which syntax a chat template writes ----

# The conversation TRL's supports_tool_calling renders: a template supports tools when the call's name, its argument
# and the tool's result all show in the text.
_SENTINELS = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")


@functools.lru_cache(maxsize=16)
def supports_tools(chat_template: str) -> bool:
    """Whether `chat_template` renders a whole tool exchange (user, an assistant tool call, the tool's result), as
    TRL's supports_tool_calling decides: no error, and the call's name, argument and the result in the text."""
    name, key, value, result = _SENTINELS
    try:
        template = compile_chat_template(chat_template)
    except jinja2.TemplateError:
        return False
    for arguments in ({key: value}, json.dumps({key: value})):  # some templates want arguments as a JSON string
        messages = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]},
                    {"role": "tool", "name": name, "content": result}]
        try:
            text = template.render(messages=messages, tools=None, documents=None, add_generation_prompt=False)
        except jinja2.TemplateError:
            return False
        except TypeError:
            continue
        return all(s in text for s in _SENTINELS)
    return False


@dataclass(frozen=True)
class _Region:
    """A part of an assistant message: the text between an opener and a closer (no opener: the text outside every
    other region), parsed as text, JSON or XML-ish <parameter> tags into the message field `field`."""

    field: str
    opener: re.Pattern | None
    closer: re.Pattern | None
    parse: str                     # "text", "json" or "tags"
    repeats: bool = False          # a list of values (tool calls), else the last one
    named: bool = False            # a call whose name the opener captured and whose body is the arguments
    tag: re.Pattern | None = None  # for "tags": one argument, (?P<key>) and (?P<value>)


def _re(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


@dataclass(frozen=True)
class ToolCallFormat:
    """A chat template family's tool-call syntax: where its assistant message starts (`start_anchor`) and the
    regions of the message (content, reasoning, tool calls), which `parse_response` reads model output with; and
    how a call opens (`opener`), and opens naming its function (`named`, with %s for the name), which a server
    writes after the generation prompt to make the model call a tool; `markers`, the text that begins a region
    other than the content (the content before the first is plain text a server may stream as it comes)."""

    name: str
    start_anchor: str
    regions: tuple[_Region, ...]
    opener: str
    named: str
    markers: tuple[str, ...] = ()


_QWEN_JSON = ToolCallFormat("qwen", "<|im_start|>assistant\n", (
    _Region("reasoning_content", _re(re.escape("<think>")), _re(r"</think>\s*"), "text"),
    _Region("tool_calls", _re(re.escape("<tool_call>")), _re(r"</tool_call>\s*"), "json", repeats=True),
    _Region("content", None, _re(r"<\|im_end\|>\s*"), "text")),
    "<tool_call>\n", '<tool_call>\n{"name": "%s", "arguments": ', ("<think>", "<tool_call>"))
_QWEN_XML = ToolCallFormat("qwen3_5", "<|im_start|>assistant\n", (
    _Region("reasoning_content", _re(re.escape("<think>")), _re(r"</think>\s*"), "text"),
    _Region("tool_calls", _re(r"<tool_call>\s*<function=(?P<name>[^\n>]+)>"), _re(r"</tool_call>\s*"), "tags",
            repeats=True, named=True, tag=_re(r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>")),
    _Region("content", None, _re(r"<\|im_end\|>\s*"), "text")),
    "<tool_call>\n<function=", "<tool_call>\n<function=%s>\n", ("<think>", "<tool_call>"))
_GLM4_MOE = ToolCallFormat("glm4_moe", "<|assistant|>", (
    _Region("reasoning_content", _re(re.escape("<think>")), _re(r"</think>\s*"), "text"),
    _Region("tool_calls", _re(r"<tool_call>(?P<name>\S+)\n?"), _re(r"</tool_call>\s*"), "tags", repeats=True,
            named=True, tag=_re(r"<arg_key>(?P<key>[^<]+)</arg_key>\s*\n<arg_value>(?P<value>.*?)</arg_value>")),
    _Region("content", None, _re(r"<\|user\|>\s*|$"), "text")),
    "<tool_call>", "<tool_call>%s\n", ("<think>", "<tool_call>"))
_LLAMA3 = ToolCallFormat("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", (
    _Region("tool_calls", _re(r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*'), _re(r"\}<\|eot_id\|>\s*"),
            "json", repeats=True, named=True),
    _Region("content", None, _re(r"<\|eot_id\|>\s*"), "text")),
    '{"name": "', '{"name": "%s", "parameters": ', ('{"name"',))
_GPT_OSS = ToolCallFormat("gpt_oss", "<|start|>assistant", (
    _Region("thinking", _re(re.escape("<|channel|>analysis<|message|>")), _re(r"<\|end\|>\s*"), "text"),
    _Region("content", _re(re.escape("<|channel|>final<|message|>")), _re(r"<\|return\|>\s*"), "text"),
    _Region("tool_calls", _re(r"to=functions\.(?P<name>\S+?)<\|channel\|>commentary\s+json<\|message\|>"),
            _re(r"<\|call\|>\s*"), "json", repeats=True, named=True)),
    " to=functions.", " to=functions.%s<|channel|>commentary json<|message|>")

# the known syntaxes, by name
FORMATS = {f.name: f for f in (_QWEN_JSON, _QWEN_XML, _GLM4_MOE, _LLAMA3, _GPT_OSS)}


def tool_call_format(chat_template: str) -> ToolCallFormat | None:
    """The tool-call syntax `chat_template` writes: Qwen2.5 / Qwen3's <tool_call>{json}</tool_call>, Qwen3.5's
    <tool_call><function=...><parameter=...>, GLM-4-MoE's <tool_call>NAME<arg_key>..., Llama 3.1 / 3.2's bare
    {"name": ..., "parameters": ...} or gpt-oss's to=functions.NAME commentary; None for a template without tool
    support (`supports_tools`) or whose syntax is none of these."""
    if not supports_tools(chat_template):
        return None
    if "<|channel|>commentary" in chat_template and "<|call|>" in chat_template:
        return _GPT_OSS
    if "<tool_call>" in chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return _QWEN_XML
    if "<tool_call>" in chat_template and "<arg_key>" in chat_template:
        return _GLM4_MOE
    if "<tool_call>" in chat_template:
        return _QWEN_JSON
    if '"parameters": ' in chat_template and "<|eot_id|>" in chat_template:
        return _LLAMA3
    return None


# ---- model output -> a message ----

def _coerce(raw: str, kinds: tuple[str, ...]) -> Any:
    """`raw` as the first of the schema's types it reads as; else the text unchanged."""
    for kind in kinds:
        try:
            if kind == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(raw)
                if number == number and abs(number) != float("inf"):
                    return int(number) if number.is_integer() and "." not in raw else number
            elif kind == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif kind == "null" and raw.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw


def _schema_kinds(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    kinds = [declared] if isinstance(declared, str) else []
    if isinstance(declared, list):
        kinds.extend(t for t in declared if isinstance(t, str))
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            kinds.extend(_schema_kinds(choice))
    if schema.get("nullable") and "null" not in kinds:
        kinds.append("null")
    return tuple(kinds)


def _tool_parameters(tools: Iterable[Any] | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for tool in tools or []:
        if inspect.isfunction(tool) or inspect.ismethod(tool):
            tool = function_schema(tool)
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _type_arguments(call: Any, params: dict[str, dict], typed: bool) -> None:
    """Cast a call's string arguments by its tool's schema ("7" -> 7 for an integer); `typed` (JSON) keeps the
    strings of parameters that may be strings."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), dict):
        return
    props = params.get(fn["name"])
    for key, value in (fn["arguments"].items() if props else ()):
        kinds = _schema_kinds(props[key]) if key in props else ()
        if not kinds or (typed and "string" in kinds):
            continue
        if isinstance(value, str):
            fn["arguments"][key] = _coerce(value, kinds)
        elif isinstance(value, list) and "array" not in kinds:
            fn["arguments"][key] = [_coerce(v, kinds) if isinstance(v, str) else v for v in value]


def _region_value(region: _Region, body: str, name: str | None) -> Any:
    if region.parse == "text":
        return body.strip()
    if region.parse == "json":
        content = json.loads(body)  # a JSONDecodeError is a ValueError: the caller falls back to plain text
    else:
        content = {m.group("key"): m.group("value").strip() for m in region.tag.finditer(body)}
    return {"type": "function", "function": {"name": name, "arguments": content} if region.named else content}


def _parse_regions(text: str, fmt: ToolCallFormat, params: dict[str, dict]) -> dict:
    """The message `text` makes, region by region: at each step the earliest opener or closer that can come next
    (the longest on a tie, an opener before a closer)."""
    implicit = next((r for r in fmt.regions if r.opener is None), None)
    out: dict[str, Any] = {"role": "assistant"}
    current, body, opened, name = implicit, "", False, None
    pos = 0

    def close() -> None:
        nonlocal current, body, opened, name
        if current is not None and opened:
            value = _region_value(current, body, name)
            if params:
                _type_arguments(value, params, typed=current.parse == "json")
            if current.repeats:
                out.setdefault(current.field, []).append(value)
            else:
                out[current.field] = value
        current, body, opened, name = implicit, "", False, None

    while True:
        if current is not None and current is not implicit:
            watch = [("close", current)] if current.closer is not None else []
        else:
            watch = [("open", r) for r in fmt.regions if r.opener is not None]
            if implicit is not None and implicit.closer is not None:
                watch.append(("close", implicit))
        best, best_key = None, None
        for kind, region in watch:
            m = (region.opener if kind == "open" else region.closer).search(text, pos)
            if m is not None:
                key = (m.start(), m.start() - m.end(), kind != "open", region.field)
                if best_key is None or key < best_key:
                    best, best_key = (kind, region, m), key
        if best is None:
            if pos < len(text) and current is not None:
                body, opened = body + text[pos:], True
            close()
            break
        kind, region, m = best
        if m.start() > pos and current is not None:
            body, opened = body + text[pos:m.start()], True
        pos = m.end()
        if kind == "open":
            close()
            current, body, opened, name = region, "", True, m.groupdict().get("name")
        else:
            had_body = opened
            close()
            if not had_body and m.start() == m.end():
                break
    return {k: v for k, v in out.items() if k == "role" or not (v is None or (isinstance(v, (list, dict, str))
                                                                               and not v))}


def parse_response(text: str, fmt: ToolCallFormat, tools: Sequence[Any] | None = None, *, prefix: str = "",
                   eos_token: str | None = None, special_tokens: Sequence[str] = ()) -> dict:
    """The assistant message model output `text` (decoded with its special tokens) makes in format `fmt`: exactly
    what TRL 1.16's parse_response gives (transformers' parse_response with TRL's response template for the chat
    template): {"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function": {"name",
    "arguments": dict}}], "reasoning_content" / "thinking" when written}, each call's arguments typed by its tool's
    schema in `tools` (schemas or functions). `prefix` is the prompt's text (what the template wrote of the
    message before generation starts). Output that does not parse (malformed JSON, a call without a name) is plain
    content: the text without `special_tokens` (as decoding with skip_special_tokens gives it); `eos_token` is
    taken off the end of the content."""
    anchors = [m.end() for m in re.finditer(re.escape(fmt.start_anchor), prefix)]
    start = prefix[anchors[-1]:] if anchors else prefix
    try:
        message = _parse_regions(start + text, fmt, _tool_parameters(tools))
        for i, call in enumerate(message.get("tool_calls", [])):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tool call {i} has no function name")
            if fn.get("arguments") is None:
                fn["arguments"] = {}
    except (ValueError, TypeError):
        for token in special_tokens:
            text = text.replace(token, "")
        return {"role": "assistant", "content": text}
    content = message.get("content")
    if isinstance(content, str) and eos_token:
        message["content"] = content.removesuffix(eos_token)
    if not message.get("content"):
        message["content"] = ""
    return message
