"""`rltt` command line: one sub-command per module in rltt.cli.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning an exit code). Exit codes: 0 done, 2 a
one-line error, `rltt.runtime.stop.EXIT_STOPPED` (75) stopped by SIGTERM / SIGINT with the
work kept (``--resume`` continues it).
"""

from __future__ import annotations

import argparse
import importlib
import sys


# sub-command name -> module under rltt.cli
COMMANDS = {
    "train": "train",
    "pretrain": "pretrain",
    "convert": "convert",
    "curate": "curate",
    "review": "review",
    "eval": "evaluate",
    "bench": "bench",
    "generate": "generate",
    "plan": "plan",
    "merge": "merge",
}


from rltt.errors import RlttError
from rltt.runtime.allocator import configure as configure_allocator
from rltt.runtime.stop import EXIT_STOPPED, Stopped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rltt", description="RL post-training for looped language models")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(f"rltt.cli.{module}")
        except ModuleNotFoundError as exc:  # a sub-command not built yet
            if exc.name != f"rltt.cli.{module}":
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_allocator()  # before anything initialises CUDA: expandable segments unless the user chose
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except Stopped as stopped:  # SIGTERM / SIGINT: the work is kept (rltt.runtime.stop)
        print(f"rltt {args.command}: {stopped}", file=sys.stderr)
        return EXIT_STOPPED
    except (RlttError, FileNotFoundError) as exc:
        msg = exc.args[0] if exc.args else str(exc)
        print(f"rltt {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
