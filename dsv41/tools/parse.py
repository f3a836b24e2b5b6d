"""python -m dsv41.tools.parse

JSON lines on stdin, each {"text": str, "thinking_mode": "thinking"|"chat", "tools"?: [...]}; one JSON line out per
input: {"ok": true, "message": {"content", "reasoning_content", "tool_calls": [{"type", "function": {"name",
"arguments"}}]}} or {"ok": false, "error": str}. The text is a whole reply as decoded text; it ends at the first EOS.
Without "tools" every invoked name is a call (as the reference parser); with it, calls to other names are text.
"""
from __future__ import annotations

import json
import sys

from dsv41.chat.parser import parse_reply
from dsv41.chat.tokenizer import EOS


def parse_call(obj: dict) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        return {"ok": False, "error": "text must be a string"}
    mode = obj.get("thinking_mode")
    if mode not in ("thinking", "chat"):
        return {"ok": False, "error": "thinking_mode must be 'thinking' or 'chat'"}
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        return {"ok": False, "error": "tools must be a list"}
    final = parse_reply(obj["text"].split(EOS, 1)[0], mode == "thinking", tools, any_tool=tools is None)
    return {"ok": True, "message": {
        "content": final.content,
        "reasoning_content": final.reasoning_content,
        "tool_calls": [{"type": "function", "function": dict(c["function"])} for c in final.tool_calls],
    }}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            out = {"ok": False, "error": f"bad JSON line: {e}"}
        else:
            out = parse_call(obj)
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
