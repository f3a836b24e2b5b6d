"""Hardening of the live server (issue 27): API keys kept off command lines and re-read on SIGHUP.

Servers run as scripts/serve.sh runs them (`python -m dsv41 serve`, the built-in tiny checkpoint) on free loopback
ports; every request goes to loopback.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from test_server import ROOT, LiveServer


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


# ------------------------------------------------------------------------------------------------ API keys
def test_key_file_is_re_read_on_sighup_and_refused_when_others_may_read_it(tmp_path):
    kf = tmp_path / "keys"
    kf.write_text("one: key-one\n")
    kf.chmod(0o600)
    s = LiveServer("--context", "256", "--state-budget-gib", "1", "--no-drafts", "--api-key-file", str(kf),
                   "--api-key", "flag-key", "--name", "tiny")
    try:
        s.wait_ready()

        def status(key: str) -> int:
            return httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

        assert [status(k) for k in ("key-one", "flag-key", "key-two")] == [200, 200, 401]
        text = "".join(s.lines)
        assert "--api-key on the command line is visible to every user" in text
        # a new key file: SIGHUP makes it the file's keys (the flag's stay)
        kf.write_text("two: key-two\n")
        s.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: re-read" in "".join(s.lines), 10, "reload line")
        assert [status(k) for k in ("key-one", "flag-key", "key-two")] == [401, 200, 200]
        # a file others may read is refused: the keys in use stay, the line says why
        kf.write_text("three: key-three\n")
        kf.chmod(0o644)
        s.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "keeping the keys in use" in "".join(s.lines), 10, "refusal line")
        assert "mode 0644" in "".join(s.lines) and "chmod 600" in "".join(s.lines)
        assert [status(k) for k in ("key-two", "key-three")] == [200, 401]
        assert s.proc.poll() is None                   # SIGHUP does not end the server
    finally:
        s.stop()
    log = "".join(s.lines)
    for k in ("key-one", "key-two", "key-three", "flag-key"):
        assert k not in log, f"key {k!r} in the server's output"


def test_serve_sh_keeps_keys_off_the_ranks_command_lines(tmp_path):
    """serve.sh with --api-key: the ranks it starts get the keys in DSV41_API_KEY, not on their command lines, and
    the follower gets no key flag at all (nor --api-key-file); the script warns. A stand-in Python records what each
    rank was given."""
    out = tmp_path / "ranks"
    out.mkdir()
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n{{ printf "%s\\n" "DSV41_API_KEY=$DSV41_API_KEY"; printf "%s\\n" "$@"; }} '
                    f'> {out}/$$\n')
    fake.chmod(0o755)
    kf = tmp_path / "keys"
    kf.write_text("k\n")
    kf.chmod(0o600)
    env = dict(os.environ, PYTHON=str(fake))
    env.pop("DSV41_API_KEY", None)
    for tp in ("1", "2"):
        for f in out.iterdir():
            f.unlink()
        p = subprocess.run([str(ROOT / "scripts/serve.sh"), "--tp", tp, "--api-key", "sekrit-1", "--port", "0",
                            "--api-key=sekrit-2", "--api-key-file", str(kf), "--kill-grace-s", "2"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 0, p.stderr
        assert "--api-key on a command line is visible" in p.stderr
        ranks = {}
        for f in out.iterdir():
            lines = f.read_text().splitlines()
            rank = lines[lines.index("--rank") + 1] if "--rank" in lines else "0"
            ranks[rank] = lines
        assert sorted(ranks) == (["0"] if tp == "1" else ["0", "1"]), ranks
        for rank, lines in ranks.items():
            assert lines[0] == "DSV41_API_KEY=sekrit-1,sekrit-2"
            argv = lines[1:]
            assert not any("sekrit" in a or a.startswith("--api-key=") or a == "--api-key" for a in argv), argv
            assert ("--api-key-file" in argv) == (rank == "0"), argv       # the follower serves no HTTP
            assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--kill-grace-s") + 1] == "2"
    p = subprocess.run([str(ROOT / "scripts/serve.sh"), "--api-key"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert p.returncode == 2 and "expected a key" in p.stderr
