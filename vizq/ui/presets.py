"""Widgets to build a QuantConfig: a preset, bit widths, and per-kind overrides."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from ..ptq.config import QuantConfig
from ..ptq.presets import PRESETS, QUANTIZED_ACT_KINDS
from ..quant import list_quantizers


def config_form(prefix: str) -> QuantConfig | None:
    """Returns the config the user built (None until it validates)."""
    c1, c2, c3 = st.columns([2, 1, 1])
    method = c1.selectbox("Method", list(PRESETS), index=list(PRESETS).index("repq"), key=f"{prefix}-method",
                          format_func=lambda m: f"{m} — {PRESETS[m].description}")
    wbits = c2.selectbox("W bits", [2, 3, 4, 5, 6, 8], index=2, key=f"{prefix}-w")
    abits = c3.selectbox("A bits", [2, 3, 4, 5, 6, 8], index=2, key=f"{prefix}-a")
    c1, c2, c3 = st.columns(3)
    calib = c1.number_input("Calibration images", 1, 1024, 32, key=f"{prefix}-calib")
    seed = c2.number_input("Calibration seed", 0, 2**31 - 1, 0, key=f"{prefix}-seed")
    overrides = {}
    with st.expander("Custom mix: override the quantizer per site kind"):
        base = pd.DataFrame([{"kind": k, "quantizer": "(preset)", "bits": 0, "enabled": True} for k in QUANTIZED_ACT_KINDS + ("weight",)])
        edited = st.data_editor(base, key=f"{prefix}-ovr", hide_index=True, disabled=["kind"], column_config={
            "quantizer": st.column_config.SelectboxColumn(options=["(preset)"] + list_quantizers()),
            "bits": st.column_config.NumberColumn(min_value=0, max_value=16, help="0: the W/A bits above")})
        for r in edited.to_dict("records"):
            rule = {}
            if not r["enabled"]:
                rule["enabled"] = False
            if r["quantizer"] != "(preset)":
                rule["quantizer"] = r["quantizer"]
            if r["bits"]:
                rule["bits"] = int(r["bits"])
            if rule:
                overrides[r["kind"]] = rule
    return QuantConfig(method=method, wbits=int(wbits), abits=int(abits), overrides=overrides,
                       calibration={"images": int(calib), "seed": int(seed), "batch_size": 32})
