"""Command line: `python -m dsv41 serve [flags]` (flags and DSV41_* env: docs/server.md)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m dsv41 serve [flags]   (python -m dsv41 serve --help lists the flags)")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from dsv41.serve_config import ServeConfigError, from_env_and_args
        try:
            cfg = from_env_and_args(rest)
        except ServeConfigError as e:
            print(f"dsv41: {e}", file=sys.stderr)
            return 2
        if any(a == "--api-key" or a.startswith("--api-key=") for a in rest):
            print("dsv41: warning: --api-key on the command line is visible to every user of this host (ps, "
                  "/proc/PID/cmdline); prefer --api-key-file FILE (mode 600, re-read on SIGHUP) or DSV41_API_KEY "
                  "(scripts/serve.sh moves --api-key there for the ranks it starts)", file=sys.stderr, flush=True)
        from dsv41.api.server import serve
        return serve(cfg)
    print(f"dsv41: unknown command {cmd!r} (try: serve)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
