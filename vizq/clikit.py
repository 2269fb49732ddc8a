"""What every command shares: the COMMANDS registry, progress bar, tables, model options.

``vizq.commands`` registers its commands here and ``vizq.cli`` runs them; this module imports
neither, so there is no cycle between the runner and the commands.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from .device import resolve_device
from .progress import Progress, Reporter, Step

__all__ = ["COMMANDS", "ProgressBar", "bar", "add_model_args", "command", "load_from_args", "nonnegative", "positive",
           "print_table", "resolve_device", "write_json_out", "OneLineParser"]

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = {}


def command(name: str, help: str, args: Callable[[argparse.ArgumentParser], None] | None = None) -> Callable:  # noqa: A002
    """Register ``fn(namespace) -> exit code`` as a sub-command; ``args`` adds its options."""

    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = (args or (lambda p: None), fn, help)
        return fn

    return deco


class ProgressBar:
    """A :class:`~vizq.progress.Step` sink: one stderr line per phase, redrawn in place
    ("calibrating 40/75 steps · … · ETA 3 s", then "evaluating 96/468 images · … · ETA 41 s")."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.last = 0.0

    def __call__(self, step: Step) -> None:
        now = time.time()
        if step.phase != self.phase:
            if self.phase is not None:
                sys.stderr.write("\n")
            self.phase, self.last = step.phase, 0.0
        if step.done < step.total and now - self.last < 0.2:
            return
        self.last = now
        bar = "#" * int(20 * step.fraction)
        sys.stderr.write(f"\r[{bar:<20}] {step.line()[:100]:<100}")
        if step.total and step.done >= step.total:
            sys.stderr.write("\n")
            self.phase = None
        sys.stderr.flush()


def bar(phase: str, unit: str) -> Progress:
    """A one-phase progress callback drawn by :class:`ProgressBar` (for direct library calls)."""
    return Reporter(ProgressBar()).phase(phase, unit)


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
