"""The command line: ``python -m vizq <command>``.

Errors users can fix (bad model spec, missing folder, bad option) print one clear line and
exit 2; Ctrl-C cancels cleanly (exit 130) and leaves no partial output file.
"""
from __future__ import annotations

import sys

from . import commands  # noqa: F401 - registers the commands
from .clikit import COMMANDS, OneLineParser, ProgressBar, resolve_device

__all__ = ["COMMANDS", "ProgressBar", "main", "resolve_device"]


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 a problem the user can fix (one line on stderr),
    130 interrupted (nothing written); anything else is a bug and keeps its traceback."""
    from .errors import is_user_error, message

    try:
        parser = OneLineParser(prog="python -m vizq", description="PTQ analysis for vision transformers")
        sub = parser.add_subparsers(dest="cmd", required=True)
        for name, (setup, _, help_) in COMMANDS.items():
            setup(sub.add_parser(name, help=help_, description=help_))
        a = parser.parse_args(argv)
        _, fn, _ = COMMANDS[a.cmd]
        return fn(a)
    except KeyboardInterrupt:
        print("\ncancelled; no output was written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - only user errors are caught; bugs are re-raised
        if not is_user_error(e):
            raise
        import os

        rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"error{rank}: {message(e)}", file=sys.stderr)
        return 2
