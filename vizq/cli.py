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

    def __call__(self, done: int, total: int, message: str = "") -> None:
        now = time.time()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / max(total, 1)
        eta = (now - self.t0) / max(done, 1) * (total - done)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {done}/{total} ETA {eta:5.0f}s {message[:60]:<60}")
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
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available; use --device cpu or auto")
    return torch.device(name)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vizq-vit-tiny", help="model spec (see `vizq models`)")
    p.add_argument("--checkpoint", default=None, help="local .safetensors/.pth weights for a timm architecture")
    p.add_argument("--img-size", type=int, default=None, help="input size for timm architectures (random init, tests)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1 …")
    p.add_argument("--batch-size", type=int, default=32)


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
    from . import commands  # noqa: F401 - registers the commands

    parser = argparse.ArgumentParser(prog="python -m vizq", description="PTQ analysis for vision transformers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, (setup, _, help_) in COMMANDS.items():
        setup(sub.add_parser(name, help=help_, description=help_))
    a = parser.parse_args(argv)
    _, fn, _ = COMMANDS[a.cmd]
    from .errors import USER_ERRORS, message

    try:
        return fn(a)
    except KeyboardInterrupt:
        print("\ncancelled; no output was written", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {message(e)}", file=sys.stderr)
        return 2
