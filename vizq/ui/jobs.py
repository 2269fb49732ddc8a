"""Streamlit glue for background jobs: one job per session key.

While a job runs, the page keeps redrawing a progress bar (count, ETA) in a short polling
loop. Pressing Cancel makes Streamlit rerun the page, which interrupts the loop; the new
run sees the click and cancels the job. (A polling loop is used instead of st.fragment's
run_every, which under st.navigation re-rendered the page with the pages/ folder's default
navigation.)
"""
from __future__ import annotations

import time
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


def show(key: str, on_done: Callable[[Any], None], poll: float = 0.3) -> None:
    """Progress with count and ETA and a Cancel button until the job ends, then its outcome."""
    job: Job | None = st.session_state.get(key)
    if job is None:
        return
    if not job.finished:
        slot = st.empty()
        if slot.button("Cancel", key=f"cancel-{key}"):
            job.cancel()
        bar = st.progress(0.0, text="starting…")
        while not job.finished:
            frac = job.done_count / job.total if job.total else 0.0
            eta = f", ETA {job.eta:.0f}s" if job.eta is not None else ""
            bar.progress(min(frac, 1.0), text=f"{job.done_count}/{job.total or '?'} · {job.message}{eta}")
            time.sleep(poll)
        bar.empty()
        slot.empty()
    if job.status == "done":
        on_done(job.result)
    elif job.status == "cancelled":
        st.warning("Cancelled; nothing was recorded.")
    else:
        st.error(f"The run failed: {message(job.error)}")
    st.session_state.pop(key, None)
