"""ServeConfig: every server knob in one msgspec Struct, read from CLI flags and DSV41_* environment variables.

Precedence: CLI flag > DSV41_<NAME> env > default. The flag for field `max_streams` is `--max-streams`, its env
variable `DSV41_MAX_STREAMS`. Booleans take `--x` / `--no-x` and env `1/0/true/false/yes/no/on/off`; list fields
repeat the flag and take a comma-separated env value. docs/server.md documents each knob; `FIELD_HELP` below is the
single source of those texts.
"""
from __future__ import annotations

import argparse
import os
import typing
from typing import Literal

import msgspec


class ServeConfigError(ValueError):
    """A knob has a bad value; the message names the flag and the env variable."""


class ServeConfig(msgspec.Struct, kw_only=True):
    # what to serve
    model: str = ""                      # checkpoint dir; "" = the built-in tiny checkpoint (made once, cached)
    name: str = ""                       # served model id; "" = the checkpoint folder's name
    served_model_name: list[str] = []    # more ids a request's `model` may name (aliases; vLLM's flag)
    tokenizer: str = ""                  # tokenizer dir; "" = the checkpoint's tokenizer.json, else kit/tokenizer
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cuda_graphs: bool = True             # on CUDA, decode rounds replay their row-only pieces as CUDA graphs
    kernels: bool = True                 # on CUDA, the kernels of kernels/ (off: the torch fallbacks; docs/gpu.md)
    # where to listen
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] = []
    api_key_file: str = ""               # more keys, one a line (dsv41/api/auth.py); read at start
    metrics_open: bool = False
    # what one request may cost (dsv41/api/limits.py)
    max_body_bytes: int = 32 << 20       # larger request bodies get 413 (a Content-Length above it: before reading)
    body_timeout_s: float = 60.0         # the whole body must arrive within this (408)
    prepare_timeout_s: float = 60.0      # tokenizing and compiling the grammar of one request, in worker threads
    # shape of the engine
    context: int = 0                     # positions per sequence; 0 = the model's max_position_embeddings
    max_streams: int = 32                # sequences in a round at once
    max_waiting: int = 1024              # queued requests beyond the streams; more get 503
    prefill_chunk: int = 2048            # prompt rows per round (one or several prompts)
    stall_target_s: float = 1.0          # while replies decode, prompt rows per round fit this many seconds
    state_budget_gib: float = 0.0        # bytes for sequence states; 0 = auto (a share of free memory)
    # long prompts and the shared window (docs/long.md)
    max_model_len: int = 1048576         # positions one request may hold (prompt + max_tokens)
    window: int = 2097152                # positions all streams share; admission reserves prompt + max_tokens
    engram: str = ""                     # folder holding the Engram tables; "" = the checkpoint folder
    no_engram: bool = False              # serve without the Engram tables (degraded replies)
    engram_cache_mib: int = 256          # host memory for hot Engram rows (0 = no cache, no read-ahead)
    prompt_cache_gib: float = 2.0        # bytes for kept prompt states (dsv41/sched/kept.py); 0 = none kept
    drafts: bool = True                  # speculative decoding with the DSpark head (docs/drafts.md)
    round_rows: int = 192                # rows a round may reach by adding draft tokens (graphs.ROW_BUCKETS)
    draft_tokens: int = 0                # draft tokens each sequence verifies; 0 = picked per round (confidence, costs)
    # request defaults
    max_tokens: int = 32768
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0
    thinking: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high", "xhigh", "max"] = "high"
    thinking_budget: int = 0             # reply tokens of open reasoning before the close is forced; 0 = none
    loop_guard: bool = False             # default of the per-request reasoning loop guard
    seed_random: bool = False            # no seed in the request: draw a random one instead of the prompt-derived one
    seed_salt: str = "0"
    # image input (docs/vision.md)
    max_images: int = 16                 # images per conversation; more get 400
    image_urls: bool = False             # fetch http(s) image URLs (else only base64 data URLs)
    image_url_max_bytes: int = 20 << 20  # largest image file fetched from a URL
    image_url_timeout_s: float = 10.0    # whole fetch of one image URL
    image_url_allow_nets: list[str] = [] # networks fetched although not public (default: public addresses only)
    image_max_pixels: int = 8192 * 8192  # larger images (stored width x height) get 400 (decompression bombs)
    image_exif_orientation: bool = False # turn images upright by their EXIF tag first (the reference ignores it)
    # streaming and life cycle
    keepalive_s: float = 10.0
    shutdown_grace_s: float = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # tensor parallel (docs/tp.md)
    tp: int = 1                          # ranks serving one model; rank 0 serves HTTP, the others only the model
    rank: int = 0
    tp_shards: int = 2                   # split products computed in this many shards: one rank == two ranks' bytes
    master: str = "127.0.0.1:29500"      # rank 0's HOST:PORT as the other ranks reach it (uses PORT..PORT+2)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 30.0
    tp_start_timeout_s: float = 300.0
    rank_lost_s: float = 1.0             # a same-host rank stopped, or a rank's connection closed, this long is lost
    kill_grace_s: float = 10.0           # scripts/serve.sh --tp N: seconds before the ranks left get SIGKILL

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ServeConfigError:
            return ServeConfigError(f"--{field.replace('_', '-')} (DSV41_{field.upper()}): {why}")

        if not (0 <= self.port <= 65535):
            raise bad("port", f"{self.port} is not a TCP port")
        if self.api_key_file:                    # refuse to start (rather than serve open) on a bad key file
            from dsv41.api.auth import KeyFileError, read_key_file
            try:
                read_key_file(self.api_key_file)
            except KeyFileError as e:
                raise bad("api_key_file", str(e)) from None
        if self.max_body_bytes < 1:
            raise bad("max_body_bytes", "must be at least 1")
        for f in ("body_timeout_s", "prepare_timeout_s"):
            if getattr(self, f) <= 0:
                raise bad(f, "must be positive")
        for f in ("max_streams", "prefill_chunk", "max_tokens"):
            if getattr(self, f) < 1:
                raise bad(f, "must be at least 1")
        for f in ("context", "max_waiting", "top_k", "thinking_budget"):
            if getattr(self, f) < 0:
                raise bad(f, "must not be negative")
        if self.round_rows < 1:
            raise bad("round_rows", "must be at least 1")
        if not 0 <= self.draft_tokens <= 16:
            raise bad("draft_tokens", "must be in 0..16 (the draft head proposes its block size at most)")
        if self.stall_target_s < 0:
            raise bad("stall_target_s", "must not be negative")
        if self.state_budget_gib < 0:
            raise bad("state_budget_gib", "must not be negative")
        for f in ("max_model_len", "window"):
            if getattr(self, f) < 2:
                raise bad(f, "must be at least 2")
        if self.engram_cache_mib < 0:
            raise bad("engram_cache_mib", "must not be negative")
        if self.no_engram and self.engram:
            raise bad("no_engram", "contradicts --engram DIR (give one of them)")
        if self.prompt_cache_gib < 0:
            raise bad("prompt_cache_gib", "must not be negative")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if self.temperature < 0:
            raise bad("temperature", "must not be negative")
        if self.keepalive_s <= 0:
            raise bad("keepalive_s", "must be positive")
        if self.shutdown_grace_s < 0:
            raise bad("shutdown_grace_s", "must not be negative")
        if self.max_images < 0:
            raise bad("max_images", "must not be negative")
        if self.image_url_max_bytes < 1:
            raise bad("image_url_max_bytes", "must be at least 1")
        if self.image_url_timeout_s <= 0:
            raise bad("image_url_timeout_s", "must be positive")
        for net in self.image_url_allow_nets:
            import ipaddress
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise bad("image_url_allow_nets", f"{net!r} is not a network (e.g. 10.1.2.0/24, fd00::/8)") from None
        if self.image_max_pixels < 1:
            raise bad("image_max_pixels", "must be at least 1")
        if self.tp < 1:
            raise bad("tp", "must be at least 1")
        if not (0 <= self.rank < self.tp):
            raise bad("rank", f"must be in 0..{self.tp - 1} (--tp {self.tp})")
        if self.tp_shards < 1 or self.tp_shards & (self.tp_shards - 1):
            raise bad("tp_shards", "must be a power of two (1, 2, 4, ...)")
        if not (0 < self.heartbeat_interval_s < self.heartbeat_timeout_s):
            raise bad("heartbeat_interval_s", f"must be positive and below --heartbeat-timeout-s "
                                              f"({self.heartbeat_timeout_s:g})")
        if self.tp_start_timeout_s <= 0:
            raise bad("tp_start_timeout_s", "must be positive")
        if self.rank_lost_s < 0:
            raise bad("rank_lost_s", "must not be negative (0 = heartbeats only)")
        if self.kill_grace_s <= 0:
            raise bad("kill_grace_s", "must be positive")


FIELD_HELP: dict[str, str] = {
    "model": "checkpoint folder (config.json + safetensors); empty = the built-in tiny checkpoint, made once by "
             "dsv41.tools.make_tiny with the real tokenizer and cached under ${XDG_CACHE_HOME:-~/.cache}/dsv41/",
    "name": "model id served in /v1/models and echoed in replies; empty = the checkpoint folder's name",
    "served_model_name": "another id a request's `model` may name (repeat the flag; env: comma-separated); replies "
                         "report --name. A request naming no served id (nor `dsv41`) gets 404 model_not_found",
    "tokenizer": "tokenizer folder (tokenizer.json); empty = the checkpoint's own, else kit/tokenizer",
    "device": "auto (cuda when there is a GPU, else cpu), cpu or cuda",
    "cuda_graphs": "on CUDA, replay each decode round's row-only pieces (mHC, norms, projections, attention over the "
                   "gathered keys, MoE) as CUDA graphs captured per row bucket; the same bits as running them eagerly "
                   "(docs/gpu.md)",
    "kernels": "on CUDA, compute with the kernels of kernels/ where they exist; --no-kernels: the torch fallbacks "
               "everywhere (the same float32 function; to compare the two, or a way out should a kernel misbehave). "
               "Chosen once at load as the model's op set (docs/gpu.md \"Which function computes each op\")",
    "host": "address to listen on",
    "port": "TCP port to listen on (0 = any free port; the chosen one is printed)",
    "api_key": "accepted API key (repeat the flag; env: comma-separated). Set = every route but /health needs "
               "'Authorization: Bearer K' or 'x-api-key: K'. On a command line it shows in `ps` (the server warns): "
               "prefer --api-key-file or the env",
    "api_key_file": "file of accepted API keys, one a line: `key` or `label: key`, `#` comments and blank lines "
                    "skipped; read at start and again on SIGHUP, added to --api-key's; a missing or unreadable file, "
                    "one its group or others may read or write (chmod 600), or one with no key, stops the server "
                    "from starting (on SIGHUP: the keys in use stay)",
    "metrics_open": "serve /metrics without a key even when keys are set",
    "max_body_bytes": "largest request body in bytes; a larger one gets 413 (refused before it is read when its "
                      "Content-Length says so); base64 images count",
    "body_timeout_s": "seconds a request's whole body may take to arrive; slower gets 408 and the connection is "
                      "closed (a client that disconnects meanwhile is counted as status 499, not an error)",
    "prepare_timeout_s": "seconds one request's tokenization and grammar compilation may take (they run in worker "
                         "threads, never on the event loop); a prompt that takes longer gets 413, a grammar 400",
    "context": "the older name of --max-model-len (positions one request may hold, prompt + max_tokens); 0 = not "
               "given",
    "max_streams": "sequences decoded together in one round",
    "max_waiting": "requests queued beyond the running ones; a request past this bound gets 503",
    "prefill_chunk": "prompt rows per round; several short prompts share one chunk, a long one spans rounds with "
                     "decode rows in each, so running replies never stall behind it for more than one chunk",
    "stall_target_s": "while replies are decoding, a round carries no more prompt rows than fit this many seconds "
                      "(at the measured seconds per row, at least 16 rows), bounding how long a running reply waits "
                      "between tokens behind long prompts; 0 = always full chunks",
    "state_budget_gib": "memory for sequence states (KV, compressed KV, indexer keys, Engram history), reserved at "
                        "admission for prompt + max_tokens; 0 = auto: the whole memory plan within 90%% of the free memory "
                        "after the weights load",
    "max_model_len": "positions one request may hold (prompt + max_tokens); lowered to --window and the model's "
                     "max_position_embeddings; --context, when given, is the same limit under its older name",
    "window": "positions shared by all streams: admission reserves each request's prompt + max_tokens here and a "
              "request that does not fit waits until room frees (never an out-of-memory); lowered to what "
              "--state-budget-gib (or, on auto, 90%% of free memory) holds; the memory plan is printed at start",
    "engram": "folder holding the Engram tables layers.N.engram.embed.weight/.scale (e.g. the release's "
              "model-00047/48; its index is used when it lists them, else the *.safetensors headers are searched); "
              "empty = the checkpoint folder. Without the tables the server refuses to start unless --no-engram",
    "no_engram": "serve without the Engram tables: the Engram layers add nothing to the streams (as if every row "
                 "were zero); replies are degraded and the server says so at start",
    "engram_cache_mib": "host memory for hot Engram rows (LRU); also bounds the read-ahead of the next prompt chunk "
                        "and decode row; 0 = no cache and no read-ahead",
    "prompt_cache_gib": "memory for kept prompt states: a request resumes from the longest kept state its prompt "
                        "starts with (same cache_salt) and computes only the rest; states are kept at the end of the "
                        "system + tools prefix, before the generation header and at prompt + reply, least recently "
                        "used evicted first; 0 = keep none",
    "drafts": "speculative decoding: the model's DSpark head drafts tokens that the next round verifies with the "
              "target (replies are the same token ids as without; requests opt out with \"draft\": false); "
              "--no-drafts = serial decoding for every request",
    "round_rows": "draft tokens are added to a round only while it stays within this many rows",
    "draft_tokens": "draft tokens each sequence verifies per round; 0 = chosen per round from the draft head's "
                    "confidence and the round cost table measured at start",
    "max_tokens": "reply-length default when a request gives none (capped to the room left in the context)",
    "temperature": "default temperature (T <= 0 = greedy)",
    "top_p": "default nucleus mass",
    "top_k": "default top-k (0 = off; always clamped to the sampler's candidate width, 1024)",
    "min_p": "default min-p (0 = off)",
    "thinking": "chat requests think unless they say otherwise",
    "reasoning_effort": "default reasoning effort while thinking",
    "thinking_budget": "default thinking budget: after this many reply tokens of open reasoning the server forces "
                       "the close (`\\n</think>\\n\\n`) and the reply goes on into its answer; 0 = none (requests "
                       "set `thinking_budget`)",
    "loop_guard": "default of the reasoning loop guard (serving.md §3.7; requests set `loop_guard`)",
    "seed_random": "a request without a seed draws a fresh random seed (default: derived from its prompt ids, so "
                   "identical conversations sample identically)",
    "seed_salt": "salt mixed into the prompt-derived seed",
    "max_images": "images one conversation may hold (image_url parts in user messages and tool results); more get "
                  "400; 0 = no image input",
    "image_urls": "also take http(s) image URLs, fetched by the server within --image-url-max-bytes and "
                  "--image-url-timeout-s (off: only base64 data URLs)",
    "image_url_max_bytes": "largest image file fetched from a URL; a larger one gets 400",
    "image_url_timeout_s": "seconds one image URL fetch may take (connect + download); slower gets 400",
    "image_url_allow_nets": "networks (CIDR, repeat the flag; env: comma-separated) whose addresses image URLs may "
                            "reach although they are not public; by default every address a URL's host resolves to "
                            "(and each redirect's) must be public: loopback, private, link-local (cloud metadata), "
                            "multicast, reserved and shared addresses get 400",
    "image_max_pixels": "images whose stored width x height is larger get 400 (decompression bombs); Pillow itself "
                        "refuses above about 179 M pixels",
    "image_exif_orientation": "turn each image upright by its EXIF orientation tag before preprocessing (phone "
                              "photos); off = as DeepSeek's reference, which ignores the tag",
    "keepalive_s": "seconds between ': keepalive' SSE comments while a streamed request waits or its prompt fills",
    "shutdown_grace_s": "on SIGTERM: stop admitting, let running replies finish for this long, then cancel them",
    "log_level": "server log level",
    "tp_shards": "the tensor-parallel shards every split product (attention heads, wo_b, the shared expert, the "
                 "routed experts, the head) is computed in, summed in shard order: --tp N and one rank with "
                 "--tp-shards N give the same bytes (2, the default: one rank == two); 1 computes whole products in "
                 "the reference's order (docs/tp.md)",
    "tp": "tensor-parallel ranks (1, 2, 4 or 8; docs/tp.md): rank 0 serves HTTP and schedules, every rank runs its "
          "share of the model on the plans rank 0 sends; scripts/serve.sh --tp N starts them all on one host",
    "rank": "this process's rank (0 = the HTTP server; >= 1 = a follower that runs the model only)",
    "master": "rank 0's HOST:PORT as the other ranks reach it; the lane uses PORT, PORT+1 and PORT+2",
    "heartbeat_interval_s": "seconds between heartbeats between ranks",
    "heartbeat_timeout_s": "a rank silent this long is lost: the other stops with a line naming it (in-flight "
                           "requests end with an error)",
    "tp_start_timeout_s": "how long a rank waits at start-up for the others (either may start first)",
    "rank_lost_s": "besides heartbeats, each rank watches the others' processes (same host) and connections (any "
                   "host) every 0.1 s: a process gone is lost at once, one stopped (SIGSTOP) or a connection closed "
                   "this many seconds is lost (the other stops naming it, in-flight requests end with an error); 0 "
                   "= heartbeats only",
    "kill_grace_s": "scripts/serve.sh --tp N (both ranks on one host): once a rank exits, the others get half of "
                    "this to end by themselves, then SIGTERM, then SIGKILL at its end; the script then exits non-zero "
                    "unless every rank ended cleanly (rank 0 is given --shutdown-grace-s more to drain on SIGTERM)",
}


def _env_name(field: str) -> str:
    return "DSV41_" + field.upper()


def _parse_bool(text: str, field: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ServeConfigError(f"{_env_name(field)}={text!r}: expected 1/0/true/false")


def _field_types() -> dict[str, object]:
    return typing.get_type_hints(ServeConfig)


def from_env_and_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> ServeConfig:
    """Build the config: defaults, then DSV41_* env, then CLI flags. Bad values raise ServeConfigError."""
    env = os.environ if env is None else env
    hints = _field_types()
    values: dict[str, object] = {}
    for field, tp in hints.items():
        raw = env.get(_env_name(field))
        if raw is None:
            continue
        if tp is bool:
            values[field] = _parse_bool(raw, field)
        elif typing.get_origin(tp) is list:
            values[field] = [p.strip() for p in raw.split(",") if p.strip()]
        else:
            values[field] = raw
    parser = build_arg_parser()
    ns = parser.parse_args(argv or [])
    for field in hints:
        v = getattr(ns, field, None)
        if v is not None:
            values[field] = v
    try:
        return msgspec.convert(values, ServeConfig, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        # "Expected `int`, got `str` - at `$.port`" -> name the flag and env variable
        field = msg.rsplit("$.", 1)[-1].rstrip("`") if "$." in msg else ""
        where = f" (--{field.replace('_', '-')} / {_env_name(field)})" if field in hints else ""
        raise ServeConfigError(f"bad server setting{where}: {msg}") from None
    except ServeConfigError:
        raise


def build_arg_parser() -> argparse.ArgumentParser:
    """`python -m dsv41 serve` flags, one per ServeConfig field (all default to None = not given)."""
    p = argparse.ArgumentParser(prog="python -m dsv41 serve", description="dsv41 OpenAI-compatible server",
                                argument_default=None)
    defaults = ServeConfig()
    for field, tp in _field_types().items():
        flag = "--" + field.replace("_", "-")
        h = f"{FIELD_HELP[field]} [env {_env_name(field)}; default {getattr(defaults, field)!r}]"
        if tp is bool and field.startswith("no_"):     # --no-x alone (argparse would read --no-x as "false")
            p.add_argument(flag, dest=field, action="store_const", const=True, default=None, help=h)
        elif tp is bool:
            p.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=h)
        elif typing.get_origin(tp) is list:
            p.add_argument(flag, dest=field, action="append", default=None, help=h)
        elif typing.get_origin(tp) is Literal:
            p.add_argument(flag, dest=field, choices=list(typing.get_args(tp)), default=None, help=h)
        else:
            p.add_argument(flag, dest=field, type=str, default=None, help=h)
    return p
