"""The only Streamlit-aware layer: cached loaders, session keys, error guard, chart helper.

Models are cached with ``st.cache_resource`` and shared by every session, so they are never
mutated (the PTQ engine works on a deep copy). Captures are cached per (model, data, images,
seed) in a shared dict, computed with a visible progress bar.
"""
from __future__ import annotations

import json
import os
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pandas as pd
import streamlit as st

from ..data import DataError
from ..dataspec import DataSpec, Source
from ..errors import is_user_error, message
from ..models import REAL_DEFAULT

#: The dashboard opens on the bundled real ViT-Ti (ImageNet weights in assets/) with the
#: photographs scikit-image ships; VIZQ_DASHBOARD_MODEL picks another (the page tests use the
#: fast digits model).
DEFAULTS = {
    "model_mode": "bundled",
    "model_spec": REAL_DEFAULT,
    "model_kwargs": {},
    "data_mode": "bundled",
    "data_path": "",
    "uploads": [],
    "n_images": 32,
    "seed": 0,
}


def init_state() -> None:
    env = os.environ.get("VIZQ_DASHBOARD_MODEL")  # read per session, not at import
    for k, v in {**DEFAULTS, **({"model_spec": env} if env else {})}.items():
        st.session_state.setdefault(k, v)


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show errors as messages that say what to do; never a raw traceback on the page."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - user errors as messages; bugs said to be bugs, trace in the log
        if is_user_error(e):
            st.error(f"**{what}**: {message(e)}")
            st.stop()
        traceback.print_exc()
        st.error(f"**{what}** failed unexpectedly ({type(e).__name__}: {e}). The details are in the server log; "
                 "try other settings or report it with that log.")
        st.stop()


@st.cache_resource(show_spinner="Loading model…", max_entries=4)
def _load(spec: str, kwargs_json: str) -> Any:
    from ..models import load_model

    return load_model(spec, **json.loads(kwargs_json))


def current_model() -> Any:
    init_state()
    with guard(f"Loading {st.session_state.model_spec}"):
        return _load(st.session_state.model_spec, json.dumps(st.session_state.model_kwargs, sort_keys=True))


def _data_spec() -> DataSpec:
    s = st.session_state
    if s.data_mode == "folder":
        if not s.data_path:
            raise DataError("the data source is 'folder' but no path is set; enter one on Model & data")
        return DataSpec.of(s.data_path)
    if s.data_mode == "upload":
        return DataSpec.uploads(s.uploads)
    return DataSpec.bundled()


def current_data() -> DataSpec:
    """The data the sidebar names, as the value every service call gets (one source of truth)."""
    with guard("Choosing the data"):
        return _data_spec()


def data_key() -> str:
    return current_data().key()


def data_label(lm: Any | None = None) -> str:
    """What the sidebar says the data is (the bundled samples depend on the model's family)."""
    try:
        spec = _data_spec()
    except DataError as e:
        return f"not usable: {message(e)}"
    if lm is not None:
        return spec.label(lm)
    if spec.source is Source.BUNDLED:
        from ..models import family_for

        return family_for(st.session_state.model_spec).samples_label
    return spec.label(None)


def current_images(lm: Any, part: str = "eval") -> Any:
    with guard("Reading images"):
        return current_data().open(lm, part)


def units(lm: Any) -> str:
    """What the model's samples are called on the page."""
    return units_of(getattr(lm.info, "modality", "image"))


def units_of(modality: str) -> str:
    """What a ``modality`` model's samples are called."""
    return "sentences" if modality == "text" else "images"


def chosen_units() -> str:
    """What the chosen model's samples are called, from its family alone (the sidebar is drawn
    before any page loads the model)."""
    from ..models import family_for

    try:
        return units_of(family_for(st.session_state.model_spec).modality)
    except Exception:  # noqa: BLE001 - an unusable spec is reported by the page that loads it
        return "images"


def kept(widget: Callable[..., Any], label: str, key: str, default: Any, **kw: Any) -> Any:
    """A keyed widget whose value survives leaving the page (Streamlit drops the state of
    widgets that are not drawn, and a widget on another page with the same key starts afresh).
    The value lives per session in ``_kept``: a change is stored by the widget's ``on_change``
    (before the rerun), and the stored value is put back before the widget is drawn."""
    s = st.session_state
    store = s.setdefault("_kept", {})
    s[key] = store.get(key, default)

    def remember() -> None:
        store[key] = s[key]

    return widget(label, key=key, on_change=remember, **kw)


@st.cache_resource
def _captures() -> dict[str, Any]:
    return {}


def current_capture(lm: Any, force: bool = False) -> Any:
    """The capture for the current model/data/count/seed; computed once with a progress bar."""
    from ..capture import capture_activations
    from ..data import pick, warn_skipped

    s = st.session_state
    key = f"{lm.info.model_id}|{lm.info.weights_sha256[:12]}|{data_key()}|{s.n_images}|{s.seed}"
    store = _captures()
    if key in store and not force:
        return store[key]
    images = current_images(lm)
    bar = st.progress(0.0, text="Capturing activations…")
    with guard("Capturing activations"):
        cap = capture_activations(lm, images, pick(len(images), int(s.n_images), int(s.seed)), batch_size=16,
                                  reservoir_images=min(8, int(s.n_images)), seed=int(s.seed),
                                  progress=lambda d, t, m: bar.progress(min(d / max(t, 1), 1.0), text=f"Capturing: {m}"))
    bar.empty()
    w = warn_skipped(images)
    if w:
        st.warning(w)
    if len(store) > 8:
        store.pop(next(iter(store)))
    store[key] = cap
    return cap


def chart(fig: Any, table: pd.DataFrame, name: str) -> None:
    """A plotly chart with its data one click away (CSV download and a table). Tick labels
    use powers of ten (1e-6), never SI prefixes ("1μ" reads as micro-units, not a probability)."""
    fig.update_xaxes(exponentformat="power")
    fig.update_yaxes(exponentformat="power")
    st.plotly_chart(fig, width="stretch", key=f"chart-{name}")
    c1, c2 = st.columns([1, 4])
    c1.download_button("Data (CSV)", table.to_csv(index=False).encode(), file_name=f"{name}.csv",
                       mime="text/csv", key=f"csv-{name}", on_click="ignore")
    with c2.expander("Show data"):
        st.dataframe(table, width="stretch", height=240)


def image_model_only(lm: Any, what: str) -> bool:
    """False (and an explanation) for models without images (text encoders)."""
    if getattr(lm.info, "modality", "image") != "image":
        st.info(f"{what} needs an image model; {lm.info.model_id} reads text, so this view is hidden.")
        return False
    return True


def chart_table(table: pd.DataFrame, name: str) -> None:
    """A table with a CSV download."""
    st.dataframe(table, width="stretch", hide_index=True)
    st.download_button("Table (CSV)", table.to_csv(index=False).encode(), file_name=f"{name}.csv", mime="text/csv",
                       key=f"csv-{name}", on_click="ignore")


def save_upload(uploaded: Any) -> str:
    """Write an uploaded checkpoint under $VIZQ_HOME/uploads (atomically) and return its path."""
    from .. import atomic
    from ..runs import home

    name = "".join(ch for ch in uploaded.name if ch.isalnum() or ch in "._-") or "checkpoint.safetensors"
    path = home() / "uploads" / name
    atomic.write_bytes(path, uploaded.getvalue())
    return str(path)


def page_capture(kind: str, label: str) -> tuple[Any, Any, list[str]]:
    """The current model, its capture, and the captured site names of ``kind`` (stops the
    page with a message when there are none)."""
    lm = current_model()
    cap = current_capture(lm)
    names = [n for n, st_ in cap.stats.items() if st_.site.kind == kind]
    if not names:
        st.info(f"This capture has no {label} sites.")
        st.stop()
    return lm, cap, names
