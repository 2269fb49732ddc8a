"""Background jobs with progress and cancellation, for the dashboard (no Streamlit here).

``Job(fn, ...)`` runs ``fn(..., progress=cb, cancel=flag)`` in a thread. The UI polls
``job.progress`` and calls ``job.cancel()``; library code raises ``Cancelled`` when asked.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .capture import Cancelled


class Job:
    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done_count, self.total, self.message = 0, 0, "starting"
        self.result: Any = None
        self.error: BaseException | None = None
        self.status = "pending"  # pending, running, done, failed, cancelled
        self.started = 0.0
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Job":
        self.started = time.time()
        self.status = "running"
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed", "cancelled")

    @property
    def eta(self) -> float | None:
        if not self.done_count or not self.total:
            return None
        return (time.time() - self.started) / self.done_count * (self.total - self.done_count)

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _progress(self, done: int, total: int, message: str = "") -> None:
        self.done_count, self.total, self.message = done, total, message

    def _run(self) -> None:
        try:
            self.result = self.fn(*self.args, progress=self._progress, cancel=self._cancel.is_set, **self.kwargs)
            self.status = "done"
        except Cancelled:
            self.status = "cancelled"
        except BaseException as e:  # noqa: BLE001 - reported to the UI as a message
            self.error = e
            self.status = "failed"
