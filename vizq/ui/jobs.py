"""Streamlit glue for background jobs: one job per session key.

While a job runs, the page keeps redrawing one progress line (phase, count, ETA) in a short
polling loop. Pressing Cancel makes Streamlit rerun the page, which interrupts the loop; the
new run sees the click and cancels the job, which stops at its next site or batch. (A polling
loop is used instead of st.fragment's run_every, which under st.navigation re-rendered the page
with the pages/ folder's default navigation.)

Messages belong to the run that made them: starting a run clears the outcome keys it names
(``clears``), so an old success box never sits next to a new run or a cancel.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import streamlit as st

from ..errors import message
from ..jobs import Job


def start(key: str, fn: Callable[..., Any], *args: Any, clears: Iterable[str] = (), **kwargs: Any) -> None:
    old = st.session_state.get(key)
    if old is not None and not old.finished:
        st.warning("A run is already in progress; cancel it first.")
        return
    for k in clears:
        st.session_state.pop(k, None)
    st.session_state.pop(f"{key}-outcome", None)
    st.session_state[key] = Job(fn, *args, **kwargs).start()


def running(key: str) -> bool:
    job = st.session_state.get(key)
    return job is not None and not job.finished


def show(key: str, on_done: Callable[[Any], None], poll: float = 0.3) -> None:
    """One progress line and a Cancel button until the job ends, then its outcome."""
    job: Job | None = st.session_state.get(key)
    if job is not None:
        if not job.finished:
            slot = st.empty()
            if slot.button("Cancel", key=f"cancel-{key}"):
                job.cancel()
            bar = st.progress(0.0, text="starting…")
            while not job.finished:
                bar.progress(job.step.fraction if job.step else 0.0, text=job.line())
                time.sleep(poll)
            bar.empty()
            slot.empty()
        if job.status == "done":
            on_done(job.result)
        elif job.status == "cancelled":
            st.session_state[f"{key}-outcome"] = ("warning", "Cancelled; nothing was recorded.")
        else:
            st.session_state[f"{key}-outcome"] = ("error", f"The run failed: {message(job.error)}")
        st.session_state.pop(key, None)
    outcome = st.session_state.get(f"{key}-outcome")
    if outcome:
        getattr(st, outcome[0])(outcome[1])
