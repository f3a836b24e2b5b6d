"""`python -m dsv41 serve`: uvicorn on uvloop (one loop for HTTP and the scheduler), model loaded in a worker thread.

Start-up prints where it listens at once (/health answers 503 "loading" until the model is up) and `ready` when
requests are served. SIGTERM / SIGINT: stop admitting (new requests get 503), let running replies finish for
--shutdown-grace-s, cancel what is left, then exit. A second signal exits at once. SIGHUP re-reads --api-key-file
(a file that cannot be used leaves the keys as they were, and says why).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvicorn

from dsv41.api.app import create_app
from dsv41.api.engine import load_engine
from dsv41.api.metrics import Metrics
from dsv41.serve_config import ServeConfig

log = logging.getLogger("dsv41.server")
LANE_FAILED_LINGER_S = 1.0   # after a lost rank: /health answers 503 with the reason this long, then rank 0 exits


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, grace_s: float):
        super().__init__(config)
        self.dsv41 = state
        self.grace_s = grace_s
        self._drain_started = False
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        if not self._drain_started and self._loop is not None and self.dsv41.engine is not None:
            self._drain_started = True
            print(f"dsv41: draining (grace {self.grace_s:g} s)", flush=True)
            self._loop.call_soon_threadsafe(self._start_drain)
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.dsv41.engine.sched.drain(self.grace_s))


async def _serve(cfg: ServeConfig) -> int:
    metrics = Metrics()
    exit_code = 0
    server: _Server | None = None

    async def load(state) -> None:
        nonlocal exit_code
        loop = asyncio.get_running_loop()
        try:
            eng = await loop.run_in_executor(None, load_engine, cfg, metrics)
        except Exception as e:  # noqa: BLE001 - report and stop: the server cannot serve without a model
            log.exception("start-up failed")
            state.load_error = f"{type(e).__name__}: {e}"
            print(f"dsv41: start-up failed: {state.load_error}", file=sys.stderr, flush=True)
            exit_code = 1
            server.should_exit = True
            return
        if eng.plan is not None:     # the memory plan admission keeps to (docs/long.md)
            for line in eng.plan.lines():
                print(f"dsv41: {line}", flush=True)
        eng.sched.start()
        metrics.scheduler = eng.sched
        metrics.model_name = eng.name
        state.engine = eng
        if eng.lane is not None:
            eng.lane.attach(loop, lane_failed)
        print(f"dsv41: ready: model {eng.name!r} ({eng.checkpoint}) on {eng.device}, context {eng.context_len}, "
              f"{cfg.max_streams} streams", flush=True)

    def lane_failed(why: str) -> None:
        # a rank of --tp N was lost (or diverged): its rounds already failed their requests; stop admitting, exit 1
        # after LANE_FAILED_LINGER_S, during which /health answers 503 with the reason (a client or load balancer
        # polling it sees why, not a refused connection; serve.sh gives rank 0 half of --kill-grace-s to stop)
        nonlocal exit_code
        exit_code = 1
        print(f"dsv41: {why}; exiting", file=sys.stderr, flush=True)
        if server.dsv41.engine is not None:
            server.dsv41.engine.sched.begin_drain()
        server._loop.call_later(LANE_FAILED_LINGER_S, lambda: setattr(server, "should_exit", True))

    def reload_keys(state) -> None:
        from dsv41.api.auth import KeyCheck, KeyFileError
        if not cfg.api_key_file:
            print("dsv41: SIGHUP: no --api-key-file to re-read; keys unchanged", flush=True)
            return
        try:
            keys = KeyCheck.from_config(cfg)
        except KeyFileError as e:
            log.error("SIGHUP: keeping the keys in use: %s", e)
            print(f"dsv41: SIGHUP: keeping the keys in use: {e}", file=sys.stderr, flush=True)
            return
        state.keys = keys
        print(f"dsv41: SIGHUP: re-read {cfg.api_key_file}: {keys.from_file} keys from it, "
              f"{len(cfg.api_key)} from --api-key / DSV41_API_KEY", flush=True)

    async def on_startup(state) -> None:
        server._loop = asyncio.get_running_loop()
        state.load_task = asyncio.ensure_future(load(state))
        if hasattr(signal, "SIGHUP"):
            server._loop.add_signal_handler(signal.SIGHUP, reload_keys, state)

    async def on_shutdown(state) -> None:
        if state.engine is not None:
            await state.engine.sched.stop()
            if state.engine.lane is not None:
                state.engine.lane.close()       # followers stop (cleanly, unless the lane failed)

    app, state = create_app(cfg, metrics, on_startup, on_shutdown)
    # log_config=None: uvicorn's own lines go through the root logger, in the one format set in serve().
    # http "auto": httptools (a dependency) parses and frames, else h11; every streamed token is a chunk written
    # on the event loop, and h11's pure-Python framing was the largest part of that after the socket write itself
    # (bench/http_rate.py: the loop's CPU per streamed token)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, http="auto", lifespan="on", access_log=False,
                            log_config=None, log_level=cfg.log_level,
                            timeout_graceful_shutdown=int(cfg.shutdown_grace_s) + 5, timeout_keep_alive=30)
    server = _Server(config, state, cfg.shutdown_grace_s)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                print(f"dsv41: listening on http://{host}:{port} (loading the model; /health answers 200 when "
                      f"ready)", flush=True)

    ann = asyncio.ensure_future(announce())
    await server.serve()
    ann.cancel()
    return exit_code


def serve(cfg: ServeConfig) -> int:
    if cfg.rank > 0:                    # a follower of --tp N: the model only, no HTTP (dsv41/sched/follower.py)
        from dsv41.sched.follower import run_follower
        return run_follower(cfg)
    import uvloop
    # The round's forward holds the GIL between torch ops; a 0.5 ms switch interval (default 5 ms) keeps the event
    # loop answering sockets and keepalives promptly while it runs (serving.md §6.8).
    sys.setswitchinterval(0.0005)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return uvloop.run(_serve(cfg))
