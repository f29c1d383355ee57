"""OpenAI's tools in chat requests: the request's tools, tool_choice and parallel_tool_calls checked, the
assistant tool calls and tool results of its messages made template messages, the prompt's prefill that makes the
model call a tool (`required` or a named function), and the model's calls parsed from its answer (as TRL's
parse_response) in OpenAI's shape."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from wgpu_train.formats.tool_calls import ToolCallFormat, parse_response, supports_tools, tool_call_format
from wgpu_train.serve.api_error import ApiError

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools (JSON schemas as the template renders them) and what it asks of them: `choice`
    none, auto, required or a function's name; `parallel`: several calls in one answer allowed."""

    tools: tuple
    choice: str
    parallel: bool

    @property
    def named(self) -> str | None:
        """The function tool_choice names, or None."""
        return None if self.choice in CHOICES else self.choice


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def parse_tools(body: dict) -> ToolRequest | None:
    """The body's tools, tool_choice and parallel_tool_calls, checked as OpenAI checks them: each tool
    {"type": "function", "function": {"name", "description"?, "parameters"?}}, tool_choice one of none / auto /
    required / {"type": "function", "function": {"name"}} naming one of them; None without tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"invalid type for 'parallel_tool_calls': expected a boolean, got "
                                          f"{json.dumps(parallel)}", "invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "'tool_choice' is only allowed when 'tools' are given")
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"invalid type for 'tools': expected a list of tools, got {json.dumps(tools)}",
                   "invalid_type")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", f"tools[{i}] is not a function tool: each tool must be {{\"type\": "
                                      f"\"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema "
                                                          "object")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}")
        if name not in names:
            raise _bad("tool_choice", f"tool_choice names the function '{name}', which is not among the tools "
                                      f"({', '.join(names)})")
        choice = name
    elif choice not in CHOICES:
        raise _bad("tool_choice", f"tool_choice must be none, auto, required or a function, got {json.dumps(choice)}")
    return ToolRequest(tuple(tools), choice, True if parallel is None else parallel)


def template_message(message: dict, role: str, content: str, index: int, calls_by_id: dict) -> dict:
    """A request message as the chat template takes it: an assistant's tool calls with their JSON-string arguments
    parsed (templates write them with tojson, as vLLM passes them), a tool result with the name of the call it
    answers (by tool_call_id)."""
    out = {"role": role, "content": content}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise _bad(f"messages[{index}].tool_calls", f"messages[{index}].tool_calls must be a list")
        parsed = []
        for j, call in enumerate(calls):
            param = f"messages[{index}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(param, f"{param} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                  "\"arguments\"}}")
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError:
                    raise _bad(f"{param}.function.arguments", f"{param}.function.arguments is not valid JSON") \
                        from None
            if not isinstance(arguments, dict):
                raise _bad(f"{param}.function.arguments", f"{param}.function.arguments must be a JSON object")
            if isinstance(call.get("id"), str):
                calls_by_id[call["id"]] = fn["name"]
            parsed.append({"type": "function", "function": {"name": fn["name"], "arguments": arguments}})
        out["tool_calls"] = parsed
    if role == "tool":
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            out["tool_call_id"] = call_id
            if call_id in calls_by_id:
                out["name"] = calls_by_id[call_id]
    return out


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answer is asked and read: the template's format, the prompt's text, the text written
    after it (`prefill`: a call's opening for tool_choice required or a named function) and whether the answer's
    calls are parsed (not for tool_choice none)."""

    request: ToolRequest
    fmt: ToolCallFormat | None
    prompt: str
    prefill: str
    parse: bool


def plan_tools(tokenizer, tools: ToolRequest, prompt: str) -> ToolPlan:
    """The plan of a request with tools whose prompt (the rendered messages and generation prompt) is `prompt`;
    a 400 when the template cannot render or parse tool calls, or cannot be made to call one."""
    if not supports_tools(tokenizer.chat_template):
        raise _bad("tools", "this model's chat template does not support tools (it does not render tool calls and "
                            "tool results)", "tools_not_supported")
    if tools.choice == "none":
        return ToolPlan(tools, None, prompt, "", False)
    fmt = tool_call_format(tokenizer.chat_template)
    if fmt is None:
        raise _bad("tools", "this model's chat template writes tool calls in a syntax this server cannot parse "
                            "(known: Qwen2.5 / Qwen3, Qwen3.5, GLM-4-MoE, Llama 3.1 / 3.2, gpt-oss)",
                   "tools_not_supported")
    prefill = ""
    if tools.choice != "auto":
        if not prompt.endswith(fmt.start_anchor):
            raise _bad("tool_choice", f"tool_choice {tools.choice} is not supported with this chat template: its "
                                      "generation prompt opens more than the assistant's turn (e.g. thinking)")
        prefill = fmt.opener if tools.named is None else fmt.named % tools.named
    return ToolPlan(tools, fmt, prompt, prefill, True)


def live_content(plan: ToolPlan, text: str) -> str:
    """The content of an answer still being written (its text so far) that may be streamed now: the text before
    the first marker of another region (a call, thinking), less a tail that may begin one, stripped as the parsed
    content is; "" when the answer does not start in the content (a prefilled call, a prompt that opens thinking,
    gpt-oss's channels)."""
    fmt = plan.fmt
    if plan.prefill or not plan.prompt.endswith(fmt.start_anchor) or all(r.opener for r in fmt.regions):
        return ""
    found = [i for i in (text.find(m) for m in fmt.markers) if i >= 0]
    if found:
        return text[:min(found)].strip()
    held = max((n for m in fmt.markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
    return text[:len(text) - held].strip()


def openai_message(tokenizer, plan: ToolPlan, text: str) -> tuple[dict, bool]:
    """The assistant message of an answer's text (special tokens kept, after the prefill): its content, and its
    tool calls in OpenAI's shape (an id each, arguments as a JSON string), the first only when parallel calls are
    off; whether it holds calls."""
    parsed = parse_response(plan.prefill + text, plan.fmt, list(plan.request.tools), prefix=plan.prompt,
                            eos_token=tokenizer.eos_token, special_tokens=tokenizer.special_tokens)
    calls = parsed.get("tool_calls", [])[:None if plan.request.parallel else 1]
    message = {"role": "assistant", "content": parsed["content"] or (None if calls else "")}
    if calls:
        message["tool_calls"] = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                  "function": {"name": c["function"]["name"],
                                               "arguments": _json_text(c["function"]["arguments"])}}
                                 for c in calls]
    return message, bool(calls)


def _json_text(arguments) -> str:
    """Arguments as OpenAI sends them: a JSON string (a model's string arguments as written)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
