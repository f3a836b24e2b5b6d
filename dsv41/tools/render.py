"""python -m dsv41.tools.render [--shield] [--tokenizer DIR]

JSON lines on stdin, one `encoder_call` object each (the arguments of DeepSeek's `encode_messages`: messages,
thinking_mode, reasoning_effort, drop_thinking, context, add_default_bos_token); one JSON line out per input:
{"ok": true, "prompt": str, "token_ids": [...], "images": [...]} or {"ok": false, "error": str}.
token_ids are the reference's (added tokens matched anywhere, client text included); --shield gives the shielded ids
(client text never becomes a special token).
"""
from __future__ import annotations

import argparse
import json
import sys

from dsv41.chat.encoding import encode_messages
from dsv41.chat.errors import ChatError
from dsv41.chat.tokenizer import Tokenizer


ENCODER_ARGS = ("messages", "thinking_mode", "reasoning_effort", "drop_thinking", "context", "add_default_bos_token")


def render_call(call: dict, tok: Tokenizer, shield: bool = False) -> dict:
    if not isinstance(call, dict) or "messages" not in call or "thinking_mode" not in call:
        return {"ok": False, "error": "an encoder_call object needs messages and thinking_mode"}
    args = {k: v for k, v in call.items() if k != "return_multi_modal_data"}  # images always come back
    unknown = sorted(set(args) - set(ENCODER_ARGS))
    if unknown:
        return {"ok": False, "error": f"unknown encoder_call fields {unknown}; known: {list(ENCODER_ARGS)}"}
    try:
        rendered = encode_messages(**args, shield=shield)
    except ChatError as e:
        return {"ok": False, "error": e.message}
    return {"ok": True, "prompt": rendered.prompt, "token_ids": tok.encode_pieces(rendered.pieces, shield=shield),
            "images": rendered.images}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.tools.render", description=__doc__.split("\n\n")[1])
    ap.add_argument("--shield", action="store_true", help="tokenize client text without special-token matching")
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the built-in one)")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_dir(args.tokenizer) if args.tokenizer else Tokenizer.builtin()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            call = json.loads(line)
        except ValueError as e:
            out = {"ok": False, "error": f"bad JSON line: {e}"}
        else:
            out = render_call(call, tok, shield=args.shield)
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
