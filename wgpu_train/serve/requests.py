"""The request bodies of /v1/chat/completions and /v1/completions: each field checked against OpenAI's
meaning, a bad one refused as a 400 naming it; what this server cannot honour refused, never ignored."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from wgpu_train.serve.api_error import ApiError
from wgpu_train.serve.tool_calls import ToolRequest, parse_tools, template_message

MAX_STOPS = 4                   # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = {True: 20, False: 5}       # OpenAI's limits: chat's top_logprobs, completions' logprobs
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class GenerationRequest:
    """What one request asks: a chat (messages) or text prompts (each a string or token ids), and how to sample."""

    model: str
    messages: list | None           # chat: [{"role", "content"}] with string contents
    prompts: list | None            # completions: each a str or a list of token ids; one choice each
    max_tokens: int | None          # None: not given (prompts.budget decides)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple
    stream: bool
    include_usage: bool
    n: int = 1                      # choices per prompt
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None     # alternatives given with each token's log-probability; None: no logprobs
    echo: bool = False              # completions: the prompt before its answer (with its logprobs)
    tools: ToolRequest | None = None    # chat: the tools, tool_choice and parallel_tool_calls; None: no tools
    images: tuple = ()              # chat: the image_url parts' URLs in the messages' order (serve/images.py)


def json_body(raw: bytes) -> dict:
    """The request's JSON object; a body that is not one is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    try:                        # JSON may escape a lone UTF-16 surrogate (\ud800), which is no Unicode text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds a lone surrogate {e.object[e.start]!a}, which is not valid "
                            f"Unicode text", code="invalid_json") from None
    return body


def _bad_type(name: str, want: str, value) -> ApiError:
    return ApiError(400, f"invalid type for '{name}': expected {want}, got {json.dumps(value)}", name, "invalid_type")


def _bad_value(name: str, want: str, value) -> ApiError:
    return ApiError(400, f"invalid value for '{name}': {want}, got {json.dumps(value)}", name, "invalid_value")


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad_type(name, "a finite number", value)
    if value > high or value < low:
        raise _bad_value(name, f"must lie in [{low:g}, {high:g}]", value)
    return float(value)


def _whole(body: dict, name: str, default, minimum: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(name, "an integer", value)
    if value < minimum:
        raise _bad_value(name, f"must be at least {minimum}", value)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad_type(name, "a boolean", value)
    return value


def _stop(body: dict) -> tuple:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad_type("stop", "a string or a list of strings", value)
    if len(stops) > MAX_STOPS:
        raise _bad_value("stop", f"at most {MAX_STOPS} strings", value)
    return tuple(s for s in stops if s)


def _unsupported(body: dict, names_and_neutral: dict):
    """Refuse a field this server does not compute, unless it holds its neutral value."""
    for name, neutral in names_and_neutral.items():
        value = body.get(name)
        if value is not None and value not in neutral:
            raise ApiError(400, f"'{name}' is not supported by this server (got {json.dumps(value)})", name,
                           "unsupported_parameter")


def _common(body: dict, max_tokens_names: tuple) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad_type("model", "the name of a served model (see /v1/models)", model)
    _unsupported(body, {"logit_bias": ({},)})
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _whole(body, name, max_tokens, 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad_type("stream_options", "an object", options)
    include_usage = _flag(options or {}, "include_usage")
    stream = _flag(body, "stream")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options",
                       "invalid_value")
    top_k = _whole(body, "top_k", 0, -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad_type("seed", "an integer", seed)
    return dict(model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0), top_k=max(top_k, 0),
                seed=None if seed is None else seed & 0xFFFFFFFFFFFFFFFF, stop=_stop(body), stream=stream,
                include_usage=include_usage, n=_whole(body, "n", 1, 1),
                presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0))


def _content(message: dict, index: int, images: list):
    """A message's content as the chat template takes it: text (a string, or a list of text parts joined), or
    with image_url parts the parts in order ({"type": "image"} and {"type": "text"}), their URLs added to
    `images`."""
    content = message.get("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise _bad_type(f"{param}[{j}].image_url", "{\"url\": a data:, file:// or http(s) URL}",
                                    part.get("image_url"))
                images.append(url)
                parts.append({"type": "image"})
            else:
                raise ApiError(400, f"{param}: only text and image_url parts are supported ({{\"type\": \"text\", "
                                    f"\"text\": ...}}, {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}})",
                               param, "unsupported_content")
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise _bad_type(param, "a string or a list of text and image_url parts", content)


def parse_chat(body: dict) -> GenerationRequest:
    """A /v1/chat/completions body, checked."""
    _unsupported(body, {"functions": ([],), "response_format": ({"type": "text"},), "audio": ({},)})
    tools = parse_tools(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _bad_type("messages", "a non-empty list of messages", raw)
    messages, calls_by_id, images = [], {}, []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad_type(f"messages[{i}]", "an object with 'role' and 'content'", m)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
                           f"messages[{i}].role", "invalid_value")
        messages.append(template_message(m, ROLES[role], _content(m, i, images), i, calls_by_id))
    top = _whole(body, "top_logprobs", None, 0)
    if top is not None and top > MAX_TOP_LOGPROBS[True]:
        raise _bad_value("top_logprobs", f"must be at most {MAX_TOP_LOGPROBS[True]}", top)
    wanted = _flag(body, "logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if wanted and tools is not None and tools.choice != "none":
        raise ApiError(400, "'logprobs' with tools is not supported by this server", "logprobs",
                       "unsupported_parameter")
    return GenerationRequest(messages=messages, prompts=None, logprobs=(top or 0) if wanted else None, tools=tools,
                             images=tuple(images),
                             **_common(body, ("max_tokens", "max_completion_tokens")))


def parse_completion(body: dict) -> GenerationRequest:
    """A /v1/completions body, checked: prompt a string, a list of token ids, or a list of either (a choice
    each)."""
    _unsupported(body, {"best_of": (1,), "suffix": ("",)})
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise _bad_type("prompt", "a string, a list of token ids, or a non-empty list of either", prompt)
    logprobs = _whole(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS[False]:
        raise _bad_value("logprobs", f"must be at most {MAX_TOP_LOGPROBS[False]}", logprobs)
    return GenerationRequest(messages=None, prompts=prompts, logprobs=logprobs, echo=_flag(body, "echo"),
                             **_common(body, ("max_tokens",)))


def _token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)
