"""Streamlit glue for background jobs: one job per session key, polled by a fragment."""
from __future__ import annotations

from typing import Any, Callable

import streamlit as st

from ..errors import message
from ..jobs import Job


def start(key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    old = st.session_state.get(key)
    if old is not None and not old.finished:
        st.warning("A run is already in progress; cancel it first.")
        return
    st.session_state[key] = Job(fn, *args, **kwargs).start()


def show(key: str, on_done: Callable[[Any], None]) -> None:
    """Progress bar with count and ETA, a Cancel button, and the outcome once finished."""

    @st.fragment(run_every=0.5)
    def _poll() -> None:
        job: Job | None = st.session_state.get(key)
        if job is None:
            return
        if not job.finished:
            frac = job.done_count / job.total if job.total else 0.0
            eta = f", ETA {job.eta:.0f}s" if job.eta is not None else ""
            st.progress(min(frac, 1.0), text=f"{job.done_count}/{job.total or '?'} · {job.message}{eta}")
            if st.button("Cancel", key=f"cancel-{key}"):
                job.cancel()
            return
        if job.status == "done":
            on_done(job.result)
        elif job.status == "cancelled":
            st.warning("Cancelled; nothing was recorded.")
        else:
            st.error(f"The run failed: {message(job.error)}")
        st.session_state.pop(key, None)
        st.rerun()

    _poll()
