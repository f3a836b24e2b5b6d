"""The follower loop: a rank >= 1 of a tensor-parallel server runs the model only, no HTTP.

`python -m dsv41 serve --tp N --rank R --master HOST:PORT [same --model]` (scripts/serve.sh --tp N starts every rank on
one host). It connects to rank 0 (either may start first; each waits --tp-start-timeout-s), opens the ring, loads its
share of the checkpoint, then runs every plan rank 0 sends through the same ModelRunner code rank 0 uses, and
answers each round with the digest of its logits rows (dsv41/sched/tp.py says why logits only). It exits 0 when
rank 0 shuts down cleanly, and 1 with a line naming the rank when rank 0 is lost, failed, or the ranks diverged.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from dsv41.comm.channel import Follower
from dsv41.comm.plan import CommError
from dsv41.comm.ring import open_ring
from dsv41.sched.host import IDLE_TRIM_S, release_free_heap
from dsv41.sched.tp import DigestingModel, ring_comm
from dsv41.serve_config import ServeConfig


def follower_device(want: str, rank: int, same_host: bool) -> str:
    """cpu, or this rank's GPU: on one host rank r uses cuda:(r mod the visible GPUs) (the cuda-ipc ring needs every
    rank's GPU visible; on a one-GPU host both ranks share cuda:0, which CUDA IPC allows and NCCL would not)."""
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise CommError(f"rank {rank}: --device cuda: no CUDA device is visible")
    return f"cuda:{rank % torch.cuda.device_count() if same_host else 0}"


def run_follower(cfg: ServeConfig) -> int:
    """Serve plans until rank 0 says stop (0) or the lane fails (1, with a line that names the rank)."""
    from dsv41.api.engine import builtin_checkpoint, load_model
    from dsv41.model.weights import RankShare
    from dsv41.sched.runner import ModelRunner

    rank, world = cfg.rank, cfg.tp
    tag = f"dsv41: rank {rank} of {world}"
    ckpt = Path(cfg.model) if cfg.model else builtin_checkpoint()
    if not (ckpt / "config.json").is_file():
        print(f"{tag}: --model {ckpt}: no config.json there", file=sys.stderr, flush=True)
        return 1
    print(f"{tag}: waiting for rank 0 at {cfg.master}", flush=True)
    rounds = 0
    runner = None
    try:
        with Follower(cfg.master, rank, world, heartbeat_interval=cfg.heartbeat_interval_s,
                      heartbeat_timeout=cfg.heartbeat_timeout_s, start_timeout=cfg.tp_start_timeout_s,
                      lost_after=cfg.rank_lost_s) as chan:
            device = follower_device(cfg.device, rank, chan.same_host)
            if device.startswith("cuda"):
                torch.cuda.set_device(device)    # Triton launches and bare "cuda" tensors go to the current device
            ring = open_ring(rank, world, device, master=cfg.master, session=chan.session,
                             same_host=chan.same_host, timeout=cfg.heartbeat_timeout_s)
            ring.set_abort(lambda: chan.hb.lost)
            try:
                t0 = time.monotonic()
                model = load_model(cfg, ckpt, device=device, dtype=torch.float32, share=RankShare(rank, world),
                                   comm=ring_comm(ring, world))
                whole = model.plan.whole()      # families the shapes do not let the world cut (weights.SplitPlan)
                print(f"{tag}: ready: {ckpt} on {device}, ring {ring.kind}, loaded in "
                      f"{time.monotonic() - t0:.1f} s; products in {model.plan.parts} parts"
                      + (f", not cut: {', '.join(whole)}" if whole else ""), flush=True)
                dm = DigestingModel(model)
                runner = ModelRunner(dm, follower=True)   # takes rank 0's draft decisions
                runner.poll_ahead = chan.poll_ahead       # rank 0's next round, told while this one runs
                # idle after rounds: the heap they freed handed back, once (recv calls on_idle once a wait)
                while (plan := chan.recv(idle_s=IDLE_TRIM_S,
                                         on_idle=release_free_heap if rounds else None)) is not None:
                    runner.execute(plan)            # draws nothing: only rank 0 samples
                    chan.reply(plan.round, dm.take_digest())
                    rounds += 1
            finally:
                ring.close()
    except CommError as e:
        print(f"{tag}: stopping after {rounds} rounds: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"{tag}: interrupted after {rounds} rounds", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - rank 0 was told why (Follower.__exit__ sends Error); say it here too
        print(f"{tag}: failed after {rounds} rounds: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    ahead = runner.rounds_ahead if runner is not None else 0
    print(f"{tag}: rank 0 shut down; {rounds} rounds served, {ahead} of them prepared ahead", flush=True)
    return 0
