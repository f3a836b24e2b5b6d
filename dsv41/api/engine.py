"""Engine: what the routes need once the server is up (config, tokenizer, scheduler, limits), and how it is built.

`load_engine` runs in a worker thread at start-up (the routes answer 503 "loading" meanwhile): resolve the
checkpoint (the built-in tiny one when none is given), load the tokenizer and the model, size the state budget and
the context, and build the runner and the scheduler. `builtin_checkpoint` makes the tiny checkpoint once with
dsv41.tools.make_tiny and caches it.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsv41 import BUILTIN_TOKENIZER_DIR, REPO_ROOT, __version__
from dsv41.serve_config import ServeConfig

log = logging.getLogger("dsv41.server")


class StartError(RuntimeError):
    """The server cannot start with these settings (bad checkpoint path, no GPU for --device cuda, ...)."""


@dataclass
class Engine:
    cfg: ServeConfig
    name: str
    tok: object                      # dsv41.chat Tokenizer
    sched: object                    # dsv41.sched.scheduler.Scheduler
    context_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    bos_id: int
    think_end_id: int | None         # `</think>`: reasoning tokens are counted through it
    checkpoint: str
    device: str
    created: int = field(default_factory=lambda: int(time.time()))
    lane: object = None              # dsv41.sched.tp.TPLane with --tp > 1 (rank 0), else None
    plan: object = None              # dsv41.sched.memory.MemoryPlan, printed at start
    images: object = None            # dsv41.api.images.ImageService when the checkpoint has vision weights
    aliases: tuple[str, ...] = ()    # more ids a request's `model` may name (--served-model-name, "dsv41")

    def serves(self, model: str | None) -> bool:
        """Whether a request's `model` names this server's model (no `model` does)."""
        return model is None or model == self.name or model in self.aliases


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv41"


def builtin_checkpoint() -> Path:
    """The built-in small checkpoint (random weights, the real V4.1 tokenizer), made once and cached."""
    try:
        from dsv41.tools import make_tiny
        version = str(getattr(make_tiny, "VERSION", __version__))
    except ImportError as e:
        raise StartError(f"no --model given and dsv41.tools.make_tiny is unavailable ({e})") from None
    out = cache_root() / f"tiny-{version}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"dsv41: making the built-in tiny checkpoint in {out} (once)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{version}-", dir=out.parent))
    os.chmod(tmp, 0o755)
    cmd = [sys.executable, "-m", "dsv41.tools.make_tiny", "--out", str(tmp), "--seed", "0",
           "--tokenizer", str(BUILTIN_TOKENIZER_DIR), "--vision"]
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise StartError(f"making the tiny checkpoint failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    try:
        os.replace(tmp, out)             # atomic: another server racing us leaves one complete folder
    except OSError:
        if not (out / "config.json").is_file():
            raise
    return out


def pick_device(want: str) -> str:
    import torch
    if want == "cuda" and not torch.cuda.is_available():
        raise StartError("--device cuda: no CUDA device is visible")
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return want


def free_memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _kept_index(cfg: ServeConfig, ckpt: Path, text: dict, cost, tok):
    """The kept prompt states' index (dsv41/sched/kept.py), or None with --prompt-cache-gib 0. The model identity
    in every key: the checkpoint's path and config, the tokenizer and this code's version."""
    if cfg.prompt_cache_gib <= 0:
        return None
    import dataclasses
    import hashlib

    from dsv41.sched.kept import KeptIndex
    ident = hashlib.sha256(f"{__version__}|{ckpt.resolve()}|{tok.path}|".encode()
                           + (ckpt / "config.json").read_bytes()).hexdigest()
    user, = tok.encode("<\uff5cUser\uff5c>", special=True)
    assistant, = tok.encode("<\uff5cAssistant\uff5c>", special=True)
    return KeptIndex(int(cfg.prompt_cache_gib * (1 << 30)), dataclasses.replace(cost, margin=1.0).bytes_for,
                     model_id=ident, user_id=user, assistant_id=assistant,
                     window=int(text.get("sliding_window", 0)), chunk=cfg.prefill_chunk)


def engram_args(cfg: ServeConfig) -> dict:
    """Model.load's Engram arguments from --engram / --no-engram / --engram-cache-mib (every rank loads alike)."""
    return {"engram": cfg.engram or None, "engram_tables": not cfg.no_engram,
            "engram_cache_bytes": cfg.engram_cache_mib << 20}


def load_model(cfg: ServeConfig, ckpt: Path, **kw):
    """Model.load with the Engram knobs; missing tables become a StartError that says how to go on."""
    from dsv41.model.engram_store import EngramMissing
    from dsv41.model.model import Model
    try:
        model = Model.load(str(ckpt), **kw, **engram_args(cfg), cuda_graphs=cfg.cuda_graphs, tp_shards=cfg.tp_shards,
                           kernels=cfg.kernels)
    except EngramMissing as e:
        raise StartError(f"the Engram tables are missing ({e}): pass --engram DIR, the folder holding "
                         f"layers.N.engram.embed.weight/.scale (the release's model-00047/48), or --no-engram to "
                         f"serve without them (degraded replies)") from None
    if cfg.no_engram and model.t.engram_layer_ids:
        msg = ("serving WITHOUT the Engram tables (--no-engram): layers "
               f"{list(model.t.engram_layer_ids)} add nothing to the streams; replies are degraded")
        log.warning(msg)
        print(f"dsv41: {msg}", flush=True)
    return model


def load_engine(cfg: ServeConfig, metrics=None) -> Engine:
    import torch

    from dsv41.chat.tokenizer import Tokenizer
    from dsv41.sched.runner import ModelRunner

    ckpt = Path(cfg.model) if cfg.model else builtin_checkpoint()
    if not (ckpt / "config.json").is_file():
        raise StartError(f"--model {ckpt}: no config.json there")
    raw = json.loads((ckpt / "config.json").read_text())
    text = raw.get("text_config", raw)
    device = pick_device(cfg.device)
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer else (ckpt if (ckpt / "tokenizer.json").is_file()
                                                           else BUILTIN_TOKENIZER_DIR)
    tok = Tokenizer.from_dir(tok_dir)
    tok.plain                # the client-text encoder, built now (~1 s) rather than inside the first chat request
    t0 = time.monotonic()
    if cfg.tp > 1:
        return _load_tp(cfg, metrics, ckpt, raw, text, device, tok)
    try:
        model = load_model(cfg, ckpt, device=device, dtype=torch.float32)
    except ValueError as e:
        if cfg.device != "auto" or device == "cpu":
            raise
        # --device auto picked the GPU but this model build runs only on the CPU: say so and serve there
        log.warning("the model does not run on %s (%s); serving on cpu", device, e)
        print(f"dsv41: the model does not run on {device} ({e}); serving on cpu", flush=True)
        device = "cpu"
        model = load_model(cfg, ckpt, device=device, dtype=torch.float32)
    log.info("model loaded from %s on %s in %.1f s", ckpt, device, time.monotonic() - t0)
    return _build(cfg, metrics, ckpt, raw, text, device, tok, ModelRunner(model), None)


def _load_tp(cfg: ServeConfig, metrics, ckpt: Path, raw: dict, text: dict, device: str, tok) -> Engine:
    """Rank 0 of --tp N: wait for the followers, open the ring, load this rank's share; the runner sends each plan
    to the followers and checks their digests (dsv41/sched/tp.py)."""
    import torch

    from dsv41.model.weights import RankShare
    from dsv41.sched.runner import ModelRunner
    from dsv41.sched.tp import DigestingModel, TPLane

    lane = TPLane.open(cfg.master, cfg.tp, device, heartbeat_interval=cfg.heartbeat_interval_s,
                       heartbeat_timeout=cfg.heartbeat_timeout_s, start_timeout=cfg.tp_start_timeout_s,
                       step_timeout=900.0, lost_after=cfg.rank_lost_s)
    try:
        t0 = time.monotonic()
        model = load_model(cfg, ckpt, device=device, dtype=torch.float32, share=RankShare(0, cfg.tp), comm=lane.comm)
        log.info("rank 0 share of %s loaded on %s in %.1f s", ckpt, device, time.monotonic() - t0)
        return _build(cfg, metrics, ckpt, raw, text, device, tok, lane.wrap(ModelRunner(DigestingModel(model))),
                      lane)
    except BaseException as e:
        lane.die(e)
        lane.close()
        raise


def _build(cfg: ServeConfig, metrics, ckpt: Path, raw: dict, text: dict, device: str, tok, runner, lane) -> Engine:
    from dsv41.sched.memory import MemoryBudget, memory_plan, state_cost, window_that_fits
    from dsv41.sched.scheduler import Scheduler

    cost = state_cost(text, elem_bytes=4)
    kept_bytes = int(cfg.prompt_cache_gib * (1 << 30))

    def plan_for(window: int):
        return memory_plan(text, cost, window, cfg.max_streams, cfg.prefill_chunk, kept_bytes)

    # the window as asked, lowered to what the memory holds: --state-budget-gib bounds the state lines (window KV,
    # partials, compressed KV, indexer keys, Engram history); auto: the whole plan within 90% of free memory
    if cfg.state_budget_gib > 0:
        limit, what = int(cfg.state_budget_gib * (1 << 30)), "--state-budget-gib"
        window = window_that_fits(plan_for, limit, cfg.window, lambda p: p.pool + p.fixed)
    else:
        limit, what = int(free_memory_bytes(device) * 0.9), "90% of free memory"
        window = window_that_fits(plan_for, limit, cfg.window, lambda p: p.total)
    if window < 2:
        raise StartError(f"{what} ({limit} bytes) does not hold the memory plan even for 2 positions "
                         f"(--max-streams {cfg.max_streams}, --prefill-chunk {cfg.prefill_chunk}, "
                         f"--prompt-cache-gib {cfg.prompt_cache_gib:g}): raise it or lower those")
    if window < cfg.window:
        print(f"dsv41: --window lowered from {cfg.window:,} to {window:,} positions to fit {what}", flush=True)
    plan = plan_for(window)
    budget = MemoryBudget(plan.pool + plan.fixed, cost, window=window)
    model_max = int(text.get("max_position_embeddings", 1 << 20))
    context = min(cfg.context or cfg.max_model_len, model_max, window)
    sched = Scheduler(runner, budget, max_streams=cfg.max_streams, max_waiting=cfg.max_waiting,
                      prefill_chunk=cfg.prefill_chunk, stall_target_s=cfg.stall_target_s,
                      metrics=metrics, kept=_kept_index(cfg, ckpt, text, cost, tok),
                      drafts=cfg.drafts, round_rows=cfg.round_rows, draft_tokens=cfg.draft_tokens)
    eos = raw.get("eos_token_id", text.get("eos_token_id", 1))
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos])
    from dsv41.api.images import ImageService
    images = ImageService.load(ckpt, cfg, device) if cfg.max_images > 0 else None
    return Engine(cfg=cfg, name=cfg.name or ckpt.name, tok=tok, sched=sched, context_len=context,
                  vocab_size=int(text["vocab_size"]), eos_ids=eos_ids, bos_id=tok.bos_id,
                  think_end_id=tok.think_end_id, checkpoint=str(ckpt), device=device, plan=plan, lane=lane,
                  images=images, aliases=(*cfg.served_model_name, "dsv41"))
