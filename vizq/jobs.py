"""Background jobs with progress and cancellation, for the dashboard (no Streamlit here).

``Job(fn, ...)`` runs ``fn(..., run=Run(on_step=…, cancel=…))`` in a thread: the service call
reports :class:`~vizq.progress.Step` lines (the latest is ``job.step``) and stops at the next
site or batch once ``job.cancel()`` is called (it raises ``Cancelled``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .errors import Cancelled
from .progress import Run, Step


class Job:
    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.step: Step | None = None
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

    def line(self) -> str:
        """The one progress line to show now."""
        return self.step.line() if self.step is not None else "starting…"

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _on_step(self, step: Step) -> None:
        self.step = step

    def _run(self) -> None:
        try:
            run = Run(on_step=self._on_step, cancel=self._cancel.is_set)
            self.result = self.fn(*self.args, run=run, **self.kwargs)
            self.status = "done"
        except Cancelled:
            self.status = "cancelled"
        except BaseException as e:  # noqa: BLE001 - reported to the UI as a message
            self.error = e
            self.status = "failed"
