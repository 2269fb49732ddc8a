"""Evaluation history on disk: survives restarts; every write is atomic.

The history is one JSON list at ``$VIZQ_HOME/history.json`` (default ``./runs``). A failed or
cancelled run is never recorded, and a crash mid-write leaves the previous file intact.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from . import atomic
from .ptq.config import migrate

_LOCK = threading.Lock()


def home() -> Path:
    return Path(os.environ.get("VIZQ_HOME", "runs"))


def history_path() -> Path:
    return home() / "history.json"


def load_history(path: Path | None = None) -> list[dict[str, Any]]:
    """The recorded runs; an unreadable file reads as empty (and is kept aside on the next write)."""
    runs = _read(path or history_path())
    return [_current(r) for r in runs] if runs is not None else []


def _current(run: Any) -> Any:
    """A record in today's keys and names: runs recorded before the rename name their preset
    "method"; a ``ptq4vit`` run from before config version 3 was what is now ``ptq4vit-mse``."""
    if isinstance(run, dict) and "method" in run and "preset" not in run:
        run = {("preset" if k == "method" else k): v for k, v in run.items()}
    if isinstance(run, dict) and run.get("preset") == "ptq4vit":
        cfg = run.get("config") if isinstance(run.get("config"), dict) else {}
        if cfg.get("version", 1) < 3:
            run = {**run, "preset": "ptq4vit-mse", "config": migrate(cfg) if cfg else cfg}
    return run


def _read(p: Path) -> list[dict[str, Any]] | None:
    """The runs, [] if there is no file, None if the file exists but is not a run list."""
    if not p.is_file():
        return []
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, list) else None


def _update(p: Path, change: Any) -> None:
    """Read-modify-write under a lock shared by threads and processes (torchrun ranks). A
    damaged history is renamed to ``history.json.damaged-<time>``, never overwritten."""
    p.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK, atomic.locked(p):
        runs = _read(p)
        if runs is None:
            os.replace(p, p.with_name(f"{p.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"))
            runs = []
        atomic.write_json(p, change(runs))


def append_run(record: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Add a run (gets an id and a timestamp) and rewrite the file atomically."""
    rec = {"id": uuid.uuid4().hex[:8], "time": time.strftime("%Y-%m-%d %H:%M:%S"), **record}
    _update(path or history_path(), lambda runs: [*runs, rec])
    return rec


def clear_history(path: Path | None = None) -> None:
    _update(path or history_path(), lambda runs: [])
