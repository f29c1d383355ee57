"""OpenAI-style errors: an ApiError raised while answering a request becomes its status and the JSON object
{"error": {"message", "type", "param", "code"}} that OpenAI's API and clients use."""
from __future__ import annotations


class ApiError(Exception):
    """A request the server refuses: its HTTP status, one-line message, the offending parameter and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON error object of OpenAI's API."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
