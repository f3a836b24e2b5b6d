"""API pieces that need no model: config parsing, SSE framing and keepalive, auth, error shapes."""
import asyncio
import json

import msgspec
import pytest
from starlette.testclient import TestClient

from dsv41.api import sse
from dsv41.api.app import create_app
from dsv41.api.errors import from_decode_error
from dsv41.api.schemas import ChatCompletionRequest, CompletionRequest
from dsv41.serve_config import ServeConfig, ServeConfigError, build_arg_parser, from_env_and_args


def test_serve_config_flags_env_and_defaults():
    assert from_env_and_args([], env={}) == ServeConfig()
    cfg = from_env_and_args(["--port", "9000", "--no-thinking", "--api-key", "a", "--api-key", "b"],
                            env={"DSV41_PORT": "7000", "DSV41_MAX_STREAMS": "8", "DSV41_SEED_RANDOM": "yes",
                                 "DSV41_API_KEY": "x,y"})
    assert cfg.port == 9000 and cfg.max_streams == 8 and cfg.seed_random is True and cfg.thinking is False
    assert cfg.api_key == ["a", "b"]
    assert from_env_and_args([], env={"DSV41_API_KEY": "x, y"}).api_key == ["x", "y"]
    for argv, env in ((["--port", "x"], {}), ([], {"DSV41_TOP_P": "0"}), ([], {"DSV41_THINKING": "maybe"}),
                      (["--max-streams", "0"], {})):
        with pytest.raises(ServeConfigError):
            from_env_and_args(argv, env=env)
    # every field has a flag and a help text
    flags = build_arg_parser().format_help()
    for f in ServeConfig.__struct_fields__:
        assert "--" + f.replace("_", "-") in flags


def test_decode_errors_name_the_field():
    for body, param in ((b'{"messages": [], "temperature": "hot"}', "temperature"),
                        (b'{"messages": [], "seed": 1.5}', "seed"),
                        (b'{"messages": [], "stream_options": {"include_usage": 3}}', "stream_options"),
                        (b'{"messages": [], "reasoning_effort": "extreme"}', "reasoning_effort"),
                        (b'{"temperature": 1}', None)):
        with pytest.raises(msgspec.DecodeError) as e:
            msgspec.json.decode(body, type=ChatCompletionRequest)
        err = from_decode_error(e.value)
        assert err.status == 400 and err.param == param, (body, err.message)
    err = None
    try:
        msgspec.json.decode(b'{"prompt": [1, "a"', type=CompletionRequest)
    except msgspec.DecodeError as e:
        err = from_decode_error(e)
    assert err is not None and "not valid JSON" in err.message and err.param is None
    # unknown fields are ignored, batches of one prompt decode
    assert msgspec.json.decode(b'{"prompt": [[1, 2]], "foo": 1}', type=CompletionRequest).prompt == [[1, 2]]


def test_sse_frames_are_single_lines():
    f = sse.frame({"t": "a\u2028b\x85c\u2029\nd"})
    assert f.startswith(b"data: ") and f.endswith(b"\n\n")
    body = f.decode()[6:-2]
    assert body.splitlines() == [body] and json.loads(body)["t"] == "a\u2028b\x85c\u2029\nd"


def test_request_stream_sends_keepalives_only_while_idle_and_cancels_its_timer():
    """Request.stream: the idle marker after each idle_s without an event, none while events keep coming, and no
    timer left armed when the consumer goes away mid-wait."""
    from dsv41.sched.request import FinishEvent, Request, TokenEvent
    from dsv41.sched.sampler import Sample, SamplingParams

    async def run():
        loop = asyncio.get_running_loop()
        r = Request([1, 2], SamplingParams(), max_tokens=4)
        loop.call_later(0.25, r.events.put_nowait, TokenEvent(5, "a", Sample(5)))
        loop.call_later(0.26, r.events.put_nowait, TokenEvent(6, "b", Sample(6)))
        loop.call_later(0.27, r.events.put_nowait, FinishEvent("length", ""))
        out = [ev async for ev in r.stream(0.1, "K")]
        r2 = Request([1], SamplingParams(), max_tokens=4)
        gen = r2.stream(0.05, "K")
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.01)
        waiting.cancel()                              # the consumer goes away while the queue is empty
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.1)
        return out, r2.events.qsize()

    out, left = asyncio.run(run())
    keep = [ev for ev in out if ev == "K"]
    assert [type(ev).__name__ for ev in out if ev != "K"] == ["TokenEvent", "TokenEvent", "FinishEvent"]
    assert 1 <= len(keep) <= 3 and out[:len(keep)] == keep      # only before the first event: 0.25 s idle
    assert left == 0                                            # the cancelled wait's timer never fired


@pytest.fixture
def app_with_keys():
    app, state = create_app(ServeConfig(api_key=["k1", "k2"]))
    return TestClient(app)


def test_auth_gates_every_route_but_health(app_with_keys):
    c = app_with_keys
    assert c.get("/health").status_code == 503          # open, but the model is not loaded here
    assert c.get("/").status_code == 503
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    # past the key check: the route answers (503: loading)
    assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 503
    assert c.get("/v1/models", headers={"x-api-key": "k1"}).status_code == 503
    dup = c.get("/v1/models", headers=[("x-api-key", "k1"), ("x-api-key", "k1")])
    assert dup.status_code == 401
    assert c.get("/metrics").status_code == 401
    assert c.post("/v1/chat/completions", json={}).status_code == 401


def test_metrics_open_and_error_shapes():
    app, state = create_app(ServeConfig(api_key=["k"], metrics_open=True))
    c = TestClient(app)
    r = c.get("/metrics")
    assert r.status_code == 200 and "dsv41:client_disconnections_total 0" in r.text
    assert "# TYPE dsv41:time_to_first_token_seconds histogram" in r.text
    c = TestClient(create_app(ServeConfig())[0])
    r = c.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"] == "unknown path /v1/nowhere"
    r = c.delete("/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"] and r.json()["error"]["code"] == "method_not_allowed"
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
