"""OpenAI's response objects: chat.completion and text_completion, their streamed chunks, usage, the model
list, and server-sent events framing (`data: {...}\\n\\n`, then `data: [DONE]\\n\\n`)."""
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
        """The whole response: answers are (text, finish_reason), one per choice."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                        "logprobs": None} for i, (text, reason) in enumerate(answers)]
            out = self._frame("chat.completion", choices)
        else:
            choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                       for i, (text, reason) in enumerate(answers)]
            out = self._frame("text_completion", choices)
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    def chunk(self, index: int, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              with_usage: bool = False) -> dict:
        """One streamed chunk of choice `index`: a piece of text, its first (the assistant role) or its last
        (the finish reason); `usage` null on each when the client asked for usage at the end."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            out = self._frame("chat.completion.chunk", [{"index": index, "delta": delta,
                                                         "finish_reason": finish_reason, "logprobs": None}])
        else:
            out = self._frame("text_completion", [{"index": index, "text": text or "",
                                                   "finish_reason": finish_reason, "logprobs": None}])
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        out = self._frame("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out


def model_list(names: list, created: int) -> dict:
    """/v1/models: every served name."""
    return {"object": "list", "data": [model_card(n, created) for n in names]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "wgpu-train"}
