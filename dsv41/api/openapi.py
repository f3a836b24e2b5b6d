"""The server's OpenAPI 3.1 document, generated from the msgspec types the routes decode their bodies with.

`GET /openapi.json` serves it (open, like /health: it describes the API, nothing about the model or the keys). Request
bodies are the Structs the routes check a body against (api.schemas, responses.ResponsesRequest,
anthropic.MessagesRequest / CountTokensRequest), so a field's documented type is the type the server enforces; error
bodies are the OpenAI shape (Anthropic's on /v1/messages*). Reply bodies are documented as objects (JSON) or SSE
streams: they are built as plain dicts, so their fields are described in docs/server.md and docs/apis.md.
"""
from __future__ import annotations

from typing import Literal

import msgspec

import dsv41
from dsv41.api.anthropic import CountTokensRequest, MessagesRequest
from dsv41.api.responses import ResponsesRequest
from dsv41.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)

REF = "#/components/schemas/{name}"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx/5xx body outside /v1/messages (api.errors.ApiError.body)."""
    error: ErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct):
    """Every 4xx/5xx body on /v1/messages and /v1/messages/count_tokens (api.anthropic.error_body)."""
    type: Literal["error"]
    error: AnthropicErrorDetail


# (method, path, request type or None, reply media types, error shape, open, summary, aliases)
_JSON, _SSE, _TEXT = "application/json", "text/event-stream", "text/plain"
OPERATIONS = [
    ("post", "/v1/chat/completions", ChatCompletionRequest, (_JSON, _SSE), "openai", False,
     "Chat completion (an SSE stream when `stream` is true)", ()),
    ("post", "/v1/completions", CompletionRequest, (_JSON, _SSE), "openai", False,
     "Text completion from a string or token ids (an SSE stream when `stream` is true)", ()),
    ("post", "/v1/responses", ResponsesRequest, (_JSON, _SSE), "openai", False,
     "OpenAI Responses API on the chat path (docs/apis.md)", ()),
    ("get", "/v1/responses/{response_id}", None, (_JSON,), "openai", False, "A stored response", ()),
    ("delete", "/v1/responses/{response_id}", None, (_JSON,), "openai", False, "Delete a stored response", ()),
    ("post", "/v1/messages", MessagesRequest, (_JSON, _SSE), "anthropic", False,
     "Anthropic Messages API on the chat path (docs/apis.md)", ()),
    ("post", "/v1/messages/count_tokens", CountTokensRequest, (_JSON,), "anthropic", False,
     "Prompt tokens of a Messages body", ()),
    ("get", "/v1/models", None, (_JSON,), "openai", False, "The served model", ()),
    ("get", "/v1/models/{model}", None, (_JSON,), "openai", False,
     "The served model's card, under any id it answers to (--name, --served-model-name, dsv41)", ()),
    ("post", "/tokenize", TokenizeRequest, (_JSON,), "openai", False,
     "Token ids of a prompt string or of chat messages rendered as a chat request would be", ("/v1/tokenize",)),
    ("post", "/detokenize", DetokenizeRequest, (_JSON,), "openai", False, "Text of token ids",
     ("/v1/detokenize",)),
    ("get", "/health", None, (_JSON,), "openai", True, "Liveness (open; with keys set, only the status)",
     ("/", "/v1/health")),
    ("get", "/metrics", None, (_TEXT,), "openai", False,
     "Prometheus text 0.0.4 (open with --metrics-open)", ("/v1/metrics",)),
    ("get", "/openapi.json", None, (_JSON,), "openai", True, "This document (open)", ()),
]


# the operations whose body's `model` must name the served model (404 model_not_found else)
_NAMES_MODEL = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def _content(media: tuple[str, ...], ok_schema: dict) -> dict:
    # An SSE stream's schema describes each event ({"event"?, "data"}); /metrics is text.
    other = {_SSE: {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                    "required": ["data"]},
             _TEXT: {"type": "string"}}
    return {m: {"schema": ok_schema if m == _JSON else other[m]} for m in media}


def document() -> dict:
    """The OpenAPI 3.1 document (a plain dict, ready for JSON)."""
    request_types = [op[2] for op in OPERATIONS if op[2] is not None]
    _, components = msgspec.json.schema_components(
        [*request_types, ModelList, ModelCard, ErrorResponse, AnthropicErrorResponse], ref_template=REF)
    paths: dict[str, dict] = {}
    for method, path, req, media, errors, open_, summary, aliases in OPERATIONS:
        err_ref = {"$ref": REF.format(name="AnthropicErrorResponse" if errors == "anthropic" else "ErrorResponse")}
        ok_schema = {"$ref": REF.format(name="ModelList")} if req is None and path == "/v1/models" else \
            {"type": "object"}
        op: dict = {
            "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": _content(media, ok_schema)},
                "400": {"description": "Bad request: the message says what to change, `param` names the field",
                        "content": {_JSON: {"schema": err_ref}}},
                "503": {"description": "Loading, overloaded or shutting down; retry",
                        "content": {_JSON: {"schema": err_ref}}},
            },
        }
        if method == "post":        # the body's limits (dsv41/api/limits.py)
            op["responses"]["413"] = {"description": "The body is larger than --max-body-bytes, or its prompt took "
                                                     "longer than --prepare-timeout-s to tokenize (code "
                                                     "request_too_large)", "content": {_JSON: {"schema": err_ref}}}
            op["responses"]["408"] = {"description": "The body did not arrive within --body-timeout-s (code "
                                                     "request_timeout); the connection closes",
                                      "content": {_JSON: {"schema": err_ref}}}
        if aliases:
            op["description"] = "Also served at " + ", ".join(f"`{a}`" for a in aliases) + "."
        if open_:
            op["security"] = []
            del op["responses"]["400"]
        else:
            op["responses"]["401"] = {"description": "A valid API key is required (when keys are set)",
                                      "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                                      "content": {_JSON: {"schema": err_ref}}}
        if path in _NAMES_MODEL:
            op["responses"]["404"] = {"description": "`model` names no model this server serves "
                                                     "(code model_not_found)", "content": {_JSON: {"schema": err_ref}}}
        if path == "/v1/models/{model}":
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
            op["responses"]["200"]["content"][_JSON]["schema"] = {"$ref": REF.format(name="ModelCard")}
            op["responses"]["404"] = {"description": "Not a model this server serves (code model_not_found)",
                                      "content": {_JSON: {"schema": err_ref}}}
        if "{response_id}" in path:
            op["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                 "schema": {"type": "string"}}]
            op["responses"]["404"] = {"description": "No stored response with this id",
                                      "content": {_JSON: {"schema": err_ref}}}
        if req is not None:
            op["requestBody"] = {"required": True,
                                 "content": {_JSON: {"schema": {"$ref": REF.format(name=req.__name__)}}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "dsv41", "version": dsv41.__version__,
                 "description": "OpenAI- and Anthropic-compatible inference server for DeepSeek-V4.1-Flash. Request "
                                "fields not listed are ignored; extensions (thinking_budget, loop_guard, priority, "
                                "cache_salt, return_token_ids, draft) are in docs/apis.md and docs/server.md."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
        },
        "security": [{"bearer": []}, {"apiKey": []}],
    }
