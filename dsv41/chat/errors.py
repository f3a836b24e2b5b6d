"""The one error type of the chat layer: a request the encoding cannot represent, or a malformed field."""
from __future__ import annotations


class ChatError(ValueError):
    """A client mistake in a chat request. The server answers it with HTTP 400 and this message.

    `param` names the request field at fault (OpenAI's error `param`), e.g. "messages" or "reasoning_effort".
    """

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.message = message
        self.param = param
