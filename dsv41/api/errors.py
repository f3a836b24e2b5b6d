"""OpenAI-shaped errors: one exception type the routes raise, one function that renders it."""
from __future__ import annotations

import re

import msgspec
from starlette.responses import Response


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PATH = re.compile(r" - at `\$\.?(.*)`$")


def from_decode_error(e: msgspec.DecodeError) -> ApiError:
    """msgspec's message carries the JSON path of the bad field: turn it into `param`."""
    msg = str(e)
    if isinstance(e, msgspec.ValidationError):
        m = _PATH.search(msg)
        param = None
        if m:
            param = re.sub(r"\[\d+\]", "", m.group(1)).split(".")[0] or None
            msg = f"invalid request field `{m.group(1)}`: {msg[:m.start()]}"
        return bad_request(msg, param=param)
    return bad_request(f"the body is not valid JSON: {msg}")


def context_exceeded(limit: int, prompt_len: int, max_tokens: int | None, param: str) -> ApiError:
    if max_tokens is None:
        msg = (f"This server's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens. "
               f"Shorten the prompt.")
    else:
        msg = (f"This server's maximum context length is {limit} tokens, but {prompt_len} prompt tokens + "
               f"{max_tokens} max_tokens = {prompt_len + max_tokens}. Lower max_tokens to at most "
               f"{max(limit - prompt_len, 0)} or shorten the prompt.")
    return ApiError(400, msg, param=param, code="context_length_exceeded")
