"""The OpenAPI document (dsv41/api/openapi.py) and a schemathesis run against the live server (issue 13).

The document must list every route the app serves, each request body as the msgspec type the route checks it
against. Then schemathesis reads /openapi.json from a live server (built-in tiny checkpoint, keys on) and sends
schema-valid and schema-invalid bodies to every operation: no 5xx, every 4xx an OpenAI error body (Anthropic's on
/v1/messages*), schema-invalid data rejected, replies of the documented status codes and media types; afterwards
the server still answers and holds no request. Bounded: DSV41_OPENAPI_EXAMPLES examples per operation (25).
"""
from __future__ import annotations

import os

import httpx
import pytest
schemathesis = pytest.importorskip("schemathesis")  # test dep (scripts/setup.sh); skip where absent
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from test_server import LiveServer

KEY = "openapi-key"
CONTEXT = 96
REPLY_CAP = 2                 # reply tokens (see map_body)
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("DSV41_OPENAPI_EXAMPLES", "25"))


def test_document_lists_every_route_and_body_type():
    from starlette.routing import Route

    from dsv41.api.app import create_app
    from dsv41.api.openapi import OPERATIONS, document
    from dsv41.serve_config import ServeConfig
    doc = document()
    assert doc["openapi"].startswith("3.1")
    guard, _ = create_app(ServeConfig())
    documented = {(m.upper(), p) for m, p, *_ in OPERATIONS}
    aliases = {(m.upper(), a): p for m, p, *_, al in OPERATIONS for a in al}
    served = {(m, r.path.replace(":path}", "}")) for r in guard.app.routes if isinstance(r, Route)
              for m in r.methods if m != "HEAD"}
    missing = {s for s in served if s not in documented and s not in aliases}
    assert not missing, f"routes served but not in the OpenAPI document: {sorted(missing)}"
    assert documented <= served, f"documented but not served: {sorted(documented - served)}"
    schemas = doc["components"]["schemas"]
    for _, path, req, *_ in OPERATIONS:
        if req is not None:
            assert req.__name__ in schemas
    # a field's documented type is the type the route enforces (spot checks)
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "temperature" in chat["properties"]
    assert schemas["MessagesRequest"]["required"] == ["messages", "max_tokens"]
    assert schemas["ResponsesRequest"]["required"] == ["input"]
    schemathesis.openapi.from_dict(doc).validate()       # a valid OpenAPI 3.1 document


@pytest.fixture(scope="module")
def server():
    with LiveServer("--context", str(CONTEXT), "--max-tokens", str(REPLY_CAP), "--prefill-chunk", "64",
                    "--keepalive-s", "0.3", "--state-budget-gib", "1", "--name", "tiny", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    r = httpx.get(server.url + "/openapi.json")            # open, like /health
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    s = schemathesis.openapi.from_url(server.url + "/openapi.json")
    s.config.update(base_url=server.url)
    return s


@schemathesis.check
def no_server_error(ctx, response, case):
    """No 5xx, but the 501 serving.md gives a method a path does not serve (schemathesis probes TRACE)."""
    documented = case.method.lower() in case.operation.schema.raw_schema["paths"].get(case.path, {})
    assert response.status_code < 500 or (response.status_code == 501 and not documented), \
        f"{response.status_code}: {response.text[:300]}"
    return True


@schemathesis.check
def error_body_shape(ctx, response, case):
    """Every 4xx is the route's error body with a message that says something; no Python internals leak."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body.get("type") == "error" and isinstance(body.get("error"), dict), body
        err = body["error"]
        assert isinstance(err.get("type"), str) and err["type"].endswith("_error"), body
    else:
        err = body.get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
        assert err["type"] == "invalid_request_error", body
    assert isinstance(err.get("message"), str) and len(err["message"]) > 5, body
    assert "Traceback" not in response.text and "object at 0x" not in response.text, body
    return True


schema = schemathesis.pytest.from_fixture("api_schema")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@schemathesis.hook
def map_body(ctx, body):
    """Bounded time: a reply length the context can hold is cut to REPLY_CAP tokens (a CPU token costs ~0.3 s on a
    busy 2-core box); lengths past the context are sent as drawn (they must get 400)."""
    if isinstance(body, dict):
        for f in LENGTH_FIELDS:
            v = body.get(f)
            if type(v) is int and REPLY_CAP < v <= CONTEXT:
                body[f] = REPLY_CAP
    return body


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=True)
def test_fuzz_every_operation(case):
    case.call_and_validate(headers=AUTH, timeout=60,
                           checks=[no_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance, negative_data_rejection, error_body_shape])


def test_server_still_answers_and_holds_nothing(server, api_schema):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        m = c.get("/metrics").text
        for g in ("requests_running", "requests_waiting"):
            line = next(ln for ln in m.splitlines() if ln.startswith(f"dsv41:{g} "))
            assert float(line.split()[1]) == 0, line
