"""The command line: ``python -m vizq <command>``. Commands register themselves in COMMANDS.

Errors users can fix (bad model spec, missing folder, bad option) print one clear line and
exit 2; Ctrl-C cancels cleanly (exit 130) and leaves no partial output file.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = {}


def command(name: str, help: str, args: Callable[[argparse.ArgumentParser], None] | None = None) -> Callable:  # noqa: A002
    """Register ``fn(namespace) -> exit code`` as a sub-command; ``args`` adds its options."""

    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (args or (lambda p: None), fn, help)
        return fn

    return deco


class ProgressBar:
    """A one-line stderr progress bar with count and ETA."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.time()
        self.last = 0.0
        self.total = None

    def __call__(self, done: int, total: int, message: str = "") -> None:
        now = time.time()
        if total != self.total:  # a new phase (e.g. calibration steps, then images): its own clock
            self.t0, self.total = now, total
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / max(total, 1)
        eta = f"{(now - self.t0) / done * (total - done):5.0f}s" if done else "    ?"
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {done}/{total} ETA {eta} {message[:60]:<60}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda``/``cuda:N``, ``mps``; anything else, or a
    device this machine does not have, is an :class:`InputError` naming what is available."""
    from .errors import InputError

    have = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        have.append("mps")
    hint = f"use auto or one of: {', '.join(have)}"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise InputError(f"--device {name!r} is not a device name; {hint}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"--device {name} was asked for but this machine has no such CUDA device; {hint}")
    if dev.type not in ("cpu", "cuda") and str(dev) not in have:
        raise InputError(f"--device {name} is not available here; {hint}")
    return dev


def positive(what: str, least: int = 1) -> Callable[[str], int]:
    """argparse type: an integer >= ``least``, with a message naming the option."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"{what} must be at least {least}, got {v}")
        return v

    return parse


def nonnegative(what: str) -> Callable[[str], int]:
    return positive(what, least=0)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (via :class:`InputError`), not usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from .errors import InputError

        raise InputError(f"{self.prog}: {message} (see --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vizq-vit-tiny", help="model spec (see `vizq models`)")
    p.add_argument("--checkpoint", default=None, help="local .safetensors/.pth weights for a timm architecture")
    p.add_argument("--img-size", type=positive("--img-size"), default=None, help="input size for timm architectures (random init, tests)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1 …")
    p.add_argument("--batch-size", type=positive("--batch-size"), default=32)


def load_from_args(a: argparse.Namespace):  # noqa: ANN201
    from .models import load_model

    kw = {}
    if a.checkpoint:
        kw["checkpoint"] = a.checkpoint
    if getattr(a, "img_size", None):
        kw["img_size"] = a.img_size
    return load_model(a.model, **kw)


def write_json_out(path: str | None, obj: Any) -> None:
    if path:
        from . import atomic

        atomic.write_json(path, obj)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 a problem the user can fix (one line on stderr),
    130 interrupted (nothing written); anything else is a bug and keeps its traceback."""
    from .errors import is_user_error, message

    try:
        from . import commands  # noqa: F401 - registers the commands

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
