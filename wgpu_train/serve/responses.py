"""OpenAI's response objects: chat.completion and text_completion, their streamed chunks (tool calls' too), usage,
log-probabilities in either's shape, the model list, and server-sent events framing (`data: {...}\\n\\n`, then
`data: [DONE]\\n\\n`)."""
from __future__ import annotations

import json
import time
import uuid

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """The frame shared by one request's response or chunks: its id, creation time, model and kind."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _frame(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, answers: list, prompt_tokens: int, completion_tokens: int) -> dict:
        """The whole response: answers are (text, finish_reason, logprobs object or None), one per choice; a chat
        answer's text may be its whole message (with tool calls)."""
        if self.chat:
            choices = [{"index": i, "message": text if isinstance(text, dict) else {"role": "assistant",
                                                                                     "content": text},
                        "finish_reason": reason, "logprobs": lp} for i, (text, reason, lp) in enumerate(answers)]
            out = self._frame("chat.completion", choices)
        else:
            choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
                       for i, (text, reason, lp) in enumerate(answers)]
            out = self._frame("text_completion", choices)
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              with_usage: bool = False, logprobs: dict | None = None) -> dict:
        """One streamed chunk of choice `index`: a piece of text (with its tokens' logprobs object), its first
        (the assistant role) or its last (the finish reason); `usage` null on each when the client asked for
        usage at the end."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            out = self._frame("chat.completion.chunk", [{"index": index, "delta": delta,
                                                         "finish_reason": finish_reason, "logprobs": logprobs}])
        else:
            out = self._frame("text_completion", [{"index": index, "text": text or "",
                                                   "finish_reason": finish_reason, "logprobs": logprobs}])
        if with_usage:
            out["usage"] = None
        return out

    def tool_call_chunks(self, index: int, message: dict, sent: str = "", with_usage: bool = False) -> list[dict]:
        """A chat answer's content and tool calls as OpenAI streams them: the content (what follows `sent`, the
        content streamed already, when it begins with it), then per call a delta with its index, id, type and name
        (arguments ""), then one with its arguments."""
        content = message.get("content") or ""
        rest = content[len(sent):] if content.startswith(sent) else ""
        deltas = [{"content": rest}] if rest else []
        for k, call in enumerate(message.get("tool_calls", [])):
            deltas.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
        out = []
        for delta in deltas:
            chunk = self._frame("chat.completion.chunk", [{"index": index, "delta": delta, "finish_reason": None,
                                                           "logprobs": None}])
            if with_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        out = self._frame("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out


class Logprobs:
    """Token log-probabilities (the worker's entries: (id, logprob, [(id, logprob)] of the likeliest)) in
    OpenAI's shapes: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {tokens,
    token_logprobs, top_logprobs, text_offset}; a token's text is its own decoding, special tokens included, or
    `token_id:N` (as vLLM writes a token as its id) for a token that is part of a character (its bytes null)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer = tokenizer
        self.chat = chat

    def text(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}" if "\ufffd" in text else text

    def _bytes(self, text: str) -> list | None:
        return None if text.startswith("token_id:") else list(text.encode())

    def empty(self) -> dict:
        return {"content": []} if self.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                  "text_offset": []}

    def of(self, entries: list, offset: int = 0) -> dict:
        """The object of some tokens; offset: where the first one's text starts in the choice's text."""
        out = self.empty()
        self.extend(out, entries, offset)
        return out

    def extend(self, out: dict, entries: list, offset: int = 0):
        """Append entries to an object; a completions entry (id, None, None) is a first prompt token (echo)."""
        for token_id, logprob, top in entries:
            text = self.text(token_id)
            if self.chat:
                out["content"].append({"token": text, "logprob": logprob, "bytes": self._bytes(text),
                                       "top_logprobs": [{"token": self.text(i), "logprob": lp,
                                                         "bytes": self._bytes(self.text(i))} for i, lp in top]})
                continue
            start = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else offset
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else {self.text(i): lp for i, lp in top})
            out["text_offset"].append(start)


def model_list(names: list, created: int) -> dict:
    """/v1/models: every served name."""
    return {"object": "list", "data": [model_card(n, created) for n in names]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "wgpu-train"}
