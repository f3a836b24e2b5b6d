"""A second live server with keys and tight limits: 401 without a key, minimal /health, 503 when the queue is full."""
import threading
import time

import httpx
import pytest

from test_server import LiveServer, ids_prompt, metric


@pytest.fixture(scope="module")
def server():
    with LiveServer("--max-streams", "1", "--max-waiting", "1", "--api-key", "sekrit", "--metrics-open",
                    "--state-budget-gib", "1") as s:
        yield s


def _hold(url: str, stop: threading.Event, got: dict, key: str) -> None:
    """A streamed request that stays open until `stop` (the client then leaves)."""
    with httpx.Client(timeout=120, headers={"Authorization": "Bearer sekrit"}) as http:
        with http.stream("POST", url + "/v1/completions",
                         json={"prompt": ids_prompt(3), "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            got[key] = r.status_code
            for _ in r.iter_lines():
                if stop.is_set():
                    return


def test_keys_and_open_routes(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                    headers={"x-api-key": "sekrit"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
    assert httpx.get(server.url + "/metrics").status_code == 200           # --metrics-open


def test_full_queue_answers_503_then_recovers(server):
    stop = threading.Event()
    got: dict = {}
    threads = [threading.Thread(target=_hold, args=(server.url, stop, got, k)) for k in ("a", "b")]
    for t in threads:
        t.start()
        time.sleep(0.5)
    t0 = time.monotonic()
    while not (metric(server.url, "requests_running") == 1 and metric(server.url, "requests_waiting") == 1):
        assert time.monotonic() - t0 < 60
        time.sleep(0.1)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                   headers={"Authorization": "Bearer sekrit"}, timeout=60)
    assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert got == {"a": 200, "b": 200}
    t0 = time.monotonic()
    while metric(server.url, "requests_running") or metric(server.url, "requests_waiting"):
        assert time.monotonic() - t0 < 30
        time.sleep(0.1)
    again = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                       headers={"Authorization": "Bearer sekrit"}, timeout=120)
    assert again.status_code == 200
