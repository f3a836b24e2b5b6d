"""Two ranks on two "hosts": two network namespaces made here, joined by a veth pair, each rank in its own namespace
with its own host name (UTS namespace), so the lane sees two hosts: ZeroMQ and torch.distributed run over the veth
(`--master` is rank 0's address inside its namespace), and the tensors go through gloo, the ring across hosts
(docs/comm.md), not through /dev/shm. The replies equal one rank's (tp-shards 2: bit for bit), and a rank that dies
stops the other, which names it.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip netns` and util-linux's `unshare`; skips with the reason
otherwise. The addresses (10.231.7.1 and .2) exist only inside the two namespaces; nothing is sent anywhere else.
The namespaces are removed whatever happens.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.test_tp_serve import COMMON, ENV, PROMPTS, ROOT, Proc, complete

A_ADDR, B_ADDR = "10.231.7.1", "10.231.7.2"
PORT = 29400           # inside the namespaces: nothing else listens there
JOBS = [(PROMPTS[k], None) for k in (1, 3, 6)] + [(PROMPTS[2], 7)]

CLIENT = r"""
import json, sys, httpx
url, jobs = sys.argv[1], json.loads(sys.argv[2])
out = []
for prompt, seed in jobs:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "logprobs": 3, "return_token_ids": True,
            "ignore_eos": True}
    body.update({"temperature": 0.0} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed})
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    out.append({"ids": c["token_ids"], "top": c["logprobs"]["top_logprobs"], "lp": c["logprobs"]["token_logprobs"]})
print(json.dumps(out))
"""


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


class _Hosts:
    """Two namespaces a, b with a veth pair (addresses A_ADDR / B_ADDR); removed by close()."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = {"a": f"dsv41-{tag}-a", "b": f"dsv41-{tag}-b"}
        self.dev = {"a": f"dsv{tag}a", "b": f"dsv{tag}b"}     # interface names: at most 15 characters
        self.made: list[str] = []
        for side in "ab":
            r = _run("ip", "netns", "add", self.ns[side])
            if r.returncode:
                self.close()
                pytest.skip(f"cannot make a network namespace here: {r.stderr.strip()}")
            self.made.append(self.ns[side])
        steps = [("ip", "link", "add", self.dev["a"], "netns", self.ns["a"], "type", "veth", "peer", "name",
                  self.dev["b"], "netns", self.ns["b"])]
        for side, addr in (("a", A_ADDR), ("b", B_ADDR)):
            steps += [("ip", "-n", self.ns[side], "addr", "add", f"{addr}/24", "dev", self.dev[side]),
                      ("ip", "-n", self.ns[side], "link", "set", self.dev[side], "up"),
                      ("ip", "-n", self.ns[side], "link", "set", "lo", "up")]
        for step in steps:
            r = _run(*step)
            if r.returncode:
                self.close()
                pytest.skip(f"cannot join the namespaces by a veth pair ({' '.join(step)}): {r.stderr.strip()}")

    def prefix(self, side: str) -> list[str]:
        """Run inside namespace `side` under its own host name (a UTS namespace: the lane's host identity)."""
        return ["ip", "netns", "exec", self.ns[side], "unshare", "--uts", "sh", "-c",
                f'hostname dsv41-host-{side} && exec "$0" "$@"']

    def close(self) -> None:
        for ns in self.made:              # deleting a namespace deletes its end of the veth pair, and the pair
            _run("ip", "netns", "del", ns)
        self.made = []


class _NsProc(Proc):
    """A `python -m dsv41 serve` inside a namespace (Proc's output pumping and stop)."""

    def __init__(self, prefix: list[str], *args: str, env: dict):
        self.proc = subprocess.Popen(prefix + [sys.executable, "-m", "dsv41", "serve", *args], cwd=ROOT,
                                     env=dict(os.environ, **ENV, **env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = []
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if not (shutil.which("ip") and shutil.which("unshare")):
        pytest.skip("needs iproute2 (ip netns) and util-linux (unshare)")
    h = _Hosts()
    try:
        yield h
    finally:
        h.close()


def test_two_hosts_over_gloo_reply_as_one_and_a_dead_rank_stops_the_other(hosts):
    master = f"{A_ADDR}:{PORT}"
    knobs = ["--tp", "2", "--master", master, "--heartbeat-interval-s", "0.25", "--heartbeat-timeout-s", "20",
             *COMMON]
    one = Proc("--port", "0", *COMMON)                                 # the reference, on this host's loopback
    r1 = _NsProc(hosts.prefix("b"), *knobs, "--rank", "1", env={"GLOO_SOCKET_IFNAME": hosts.dev["b"]})
    r0 = _NsProc(hosts.prefix("a"), *knobs, "--port", "0", "--host", "127.0.0.1",
                 env={"GLOO_SOCKET_IFNAME": hosts.dev["a"]})
    try:
        r1.wait_line(r"rank 1 of 2: ready: .* ring gloo", 180)
        r0.wait_line(r"rank 0: 2 ranks joined, ring gloo", 60)
        r0.wait_line(r"listening on http://", 120)
        assert "dsv41-host-a" not in r1.text()
        # rank 0's HTTP is inside namespace a: the client runs there too (its loopback)
        jobs = json.dumps(JOBS)
        deadline = time.monotonic() + 120
        while True:     # the server listens before the model is loaded: retry on "loading" (503)
            res = subprocess.run(["ip", "netns", "exec", hosts.ns["a"], sys.executable, "-c", CLIENT, r0.url, jobs],
                                 capture_output=True, text=True, timeout=300, env=dict(os.environ, **ENV))
            if res.returncode == 0 or "loading" not in res.stderr or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert res.returncode == 0, res.stderr[-3000:] + r0.text()[-2000:]
        got = json.loads(res.stdout)
        one.wait_ready()
        want = [complete(one.url, p, s) for p, s in JOBS]
        assert got == want
        # rank 1's host goes away (its process killed): rank 0 finds its connection closed and exits naming it
        r1.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert r0.proc.wait(timeout=30) == 1, r0.text()[-2000:]
        said = r0.first(r"lane failed: rank 1 lost")
        assert said is not None, r0.text()[-2000:]
        assert said - t0 < 10, said - t0
        assert not re.search(r"its process \d+ exited", r0.text())   # another host: no pid to watch
    finally:
        for p in (r0, r1, one):
            p.stop()
