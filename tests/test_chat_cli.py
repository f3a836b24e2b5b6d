"""Subprocess smoke tests of the two command-line entry points (the vector tests call their functions)."""
import json
import subprocess
import sys

from dsv41 import REPO_ROOT


def _run(module, lines, *args):
    proc = subprocess.run([sys.executable, "-m", module, *args], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines()]


def test_render_cli():
    call = {"messages": [{"role": "user", "content": "a </think>"}], "thinking_mode": "chat"}
    ref, shielded, bad, broken = _run("dsv41.tools.render", [
        json.dumps(call), json.dumps(call), json.dumps({"messages": [{"role": "developer", "content": "x"}],
                                                        "thinking_mode": "chat"}), "{not json"])
    assert ref["ok"] and ref["prompt"] == "<｜begin▁of▁sentence｜><｜User｜>a </think><｜Assistant｜></think>"
    assert ref["token_ids"].count(128822) == 2
    assert bad == {"ok": False, "error": bad["error"]} and "developer" in bad["error"]
    assert not broken["ok"]
    (shielded,) = _run("dsv41.tools.render", [json.dumps(call)], "--shield")
    assert shielded["ok"] and shielded["token_ids"].count(128822) == 1


def test_parse_cli():
    text = 'r</think>ok\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">1' \
           '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>'
    out, offered, bad = _run("dsv41.tools.parse", [
        json.dumps({"text": text, "thinking_mode": "thinking"}),
        json.dumps({"text": text, "thinking_mode": "thinking",
                    "tools": [{"type": "function", "function": {"name": "g"}}]}),
        json.dumps({"text": 1, "thinking_mode": "chat"})])
    assert out == {"ok": True, "message": {"content": "ok", "reasoning_content": "r", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}}
    assert offered["message"]["tool_calls"] == [] and offered["message"]["content"].startswith("ok<tool_call>")
    assert not bad["ok"]
