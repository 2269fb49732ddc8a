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

_LOCK = threading.Lock()


def home() -> Path:
    return Path(os.environ.get("VIZQ_HOME", "runs"))


def history_path() -> Path:
    return home() / "history.json"


def load_history(path: Path | None = None) -> list[dict[str, Any]]:
    p = path or history_path()
    if not p.is_file():
        return []
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError:
        return []  # an unreadable file is treated as empty, never overwritten silently below
    return data if isinstance(data, list) else []


def append_run(record: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Add a run (gets an id and a timestamp) and rewrite the file atomically."""
    p = path or history_path()
    rec = {"id": uuid.uuid4().hex[:8], "time": time.strftime("%Y-%m-%d %H:%M:%S"), **record}
    with _LOCK:
        runs = load_history(p)
        runs.append(rec)
        atomic.write_json(p, runs)
    return rec


def clear_history(path: Path | None = None) -> None:
    with _LOCK:
        atomic.write_json(path or history_path(), [])
