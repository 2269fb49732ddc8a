"""Widgets to build a QuantConfig: a preset, bit widths, and per-kind overrides.

Evaluate and Export draw the same form under one key prefix, and every value is kept per
session (:func:`kept`), so the configuration chosen on one page is the one the other shows and
leaving a page never resets it."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from ..ptq.catalog import Procedure
from ..ptq.config import GPTQ_DAMP, QuantConfig, ReconLoss
from ..ptq.presets import PRESETS, QUANTIZED_ACT_KINDS, presets_for
from ..quant import list_quantizers
from .state import kept, units_of


def config_form(modality: str, prefix: str = "cfg") -> QuantConfig:
    """The config the user built (raises ConfigError when it does not validate); only the
    presets that apply to a ``modality`` model are offered."""
    c1, c2, c3 = st.columns([2, 1, 1])
    offered = presets_for(modality)
    store = st.session_state.setdefault("_kept", {})
    if store.get(f"{prefix}-method", "repq") not in offered:  # chosen for a model of another kind
        store.pop(f"{prefix}-method")
    method = kept(c1.selectbox, "Preset", f"{prefix}-method", "repq", options=offered,
                  format_func=lambda m: f"{m} ({PRESETS[m].paper})" if PRESETS[m].paper else m)
    wbits = kept(c2.selectbox, "W bits", f"{prefix}-w", 4, options=[2, 3, 4, 5, 6, 8])
    abits = kept(c3.selectbox, "A bits", f"{prefix}-a", 4, options=[2, 3, 4, 5, 6, 8])
    st.caption(f"**{method}**: {PRESETS[method].description}")  # in full: what it does and how faithful it is
    if PRESETS[method].cost:
        st.warning(f"{method}: {PRESETS[method].cost}.")
    if PRESETS[method].fixed_format:
        st.caption(f"{method} is a fixed-width format: its own bit widths apply, not the W/A bits above.")
    c1, c2, c3 = st.columns(3)
    calib = kept(c1.number_input, f"Calibration {units_of(modality)}", f"{prefix}-calib", 32, min_value=1, max_value=1024)
    seed = kept(c2.number_input, "Calibration seed", f"{prefix}-seed", 0, min_value=0, max_value=2**31 - 1)
    overrides = {}
    with st.expander("Custom mix: override the quantizer per site kind"):
        base = store.get(f"{prefix}-ovr-table") or [{"kind": k, "quantizer": "(preset)", "bits": 0, "enabled": True}
                                                    for k in QUANTIZED_ACT_KINDS + ("weight",)]
        edited = st.data_editor(pd.DataFrame(base), key=f"{prefix}-ovr", hide_index=True, disabled=["kind"], column_config={
            "quantizer": st.column_config.SelectboxColumn(options=["(preset)"] + list_quantizers()),
            "bits": st.column_config.NumberColumn(min_value=0, max_value=16, help="0: the W/A bits above")})
        store[f"{prefix}-ovr-table"] = edited.to_dict("records")
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
    gptq_ok = PRESETS[method].procedure is Procedure.SEQUENTIAL and not PRESETS[method].fixed_format
    gptq = kept(st.checkbox, "GPTQ weight rounding", f"{prefix}-gptq", False, disabled=not gptq_ok,
                help="round each Linear's integer weights one input column at a time, compensating the error on "
                     "the calibration inputs (closed form, seconds; no training). Integer presets with the "
                     "sequential calibration only.")
    act_order = kept(st.checkbox, "GPTQ act order", f"{prefix}-gptq-order", False, disabled=not (gptq and gptq_ok),
                     help="round each layer's input columns by decreasing energy (largest calibration inputs "
                          "first), as GPTQ's act-order option does")
    asym = kept(st.checkbox, "GPTAQ (asymmetric)", f"{prefix}-gptaq", False, disabled=not (gptq and gptq_ok),
                help="GPTAQ: round the Linears one by one on the inputs the quantized network feeds them, "
                     "against the float layer's output on the float inputs, so each layer also makes up for "
                     "upstream quantization error (closed form; each block runs alone on its kept input, once "
                     "per Linear in it)")
    damp = kept(st.columns([1, 2])[0].number_input, "GPTQ damping", f"{prefix}-gptq-damp", GPTQ_DAMP, min_value=0.001, max_value=1.0,
                step=0.01, format="%.3f", disabled=not (gptq and gptq_ok),
                help="added to the diagonal of the calibration inputs' Gram matrix before it is inverted, as a "
                     "fraction of its mean (GPTQ's percdamp): 0.01 is GPTQ's default, 0.1 GPTAQ's ViT script's")
    is_ias = PRESETS[method].procedure is Procedure.IAS
    ias_iters = 0
    if is_ias:  # its own two trainings replace the optional block reconstruction below
        ias_iters = kept(st.columns([1, 2])[0].number_input, "I&S-ViT steps per block (0: the code's)",
                         f"{prefix}-ias", 0, min_value=0, max_value=20000, step=100,
                         help="Adam steps for each unit in each of the released code's two trainings; 0 runs "
                              "its own: 1,000 (200 at W6A6), about 2 hours for ViT-Ti on 2 CPU cores (0.26 s a block step), "
                              "and on ViT-Ti with 32 calibration images it gave 2.99 % top-1 at W4A4 (31.84 % at 5 steps; "
                              "README, Side by side)")
    with st.expander("Block reconstruction (optional; slow: ~10 min for ViT-Ti at 200 steps on 2 CPU cores)"):
        st.caption("After calibration, re-round each block's integer weights (AdaRound with QDrop) so the block "
                   "reproduces the float block's output on the calibration images. On ViT-Ti with 32 images, "
                   "200 steps take about 45 s per block on 2 CPU cores; learning activation scales adds about a "
                   "third. Weights without an integer grid (FP, MX, log) keep their rounding.")
        r1, r2, r3 = st.columns(3)
        iters = kept(r1.number_input, "Steps per block (0: off)", f"{prefix}-recon", 0, min_value=0, max_value=20000,
                     step=100, disabled=is_ias, help="not with ias-released, which trains every block itself"
                     if is_ias else None)
        iters = 0 if is_ias else iters
        rbatch = kept(r2.number_input, "Samples per step (0: all)", f"{prefix}-rbatch", 0, min_value=0, max_value=1024,
                      help="a seeded random draw from the calibration samples at every step. Measured on "
                           "ViT-Ti W4A4 (README): 8 a step at 200 steps costs about a quarter of the "
                           "arithmetic and moved top-1 by +2.1 and -0.6 points against all samples on two "
                           "calibration sets; 4x the steps at 8 overfits 32 images and falls below no "
                           "reconstruction")
        scales = kept(r3.checkbox, "Learn activation scales (LSQ)", f"{prefix}-rscales", False, disabled=not iters,
                      help="the uniform activation quantizers' scales are trained with the rounding, as BRECQ and "
                           "QDrop do")
        rloss = kept(st.selectbox, "Reconstruction loss", f"{prefix}-rloss", ReconLoss.MSE.value,
                     options=[r.value for r in ReconLoss], disabled=not iters,
                     help="mse: BRECQ's and QDrop's summed squared error on the block's output. token: each token's "
                          "error divided by that token's float mean square, so the few massive-activation tokens "
                          "(over 90 % of the residual's energy from block 7 of ViT-Ti on) do not outweigh every "
                          "ordinary token. Measured on ViT-Ti W4A4 after GPTAQ (README): no effect beyond float-order "
                          "noise, five-set mean 66.32 % against 66.41 % with mse")
        ranges, views = 0, 1
        if modality == "image":  # both split or augment a batch of images
            v1, v2 = st.columns(2)
            ranges = kept(v1.number_input, "Range images (0: all)", f"{prefix}-rranges", 0,
                          min_value=0, max_value=1024, disabled=not iters,
                          help="only the first N calibration images set the ranges, AdaLog's bases, the post-LN "
                               "fold and GPTQ; reconstruction trains on all of them, so more images cost little "
                               "more than the reconstruction. Measured on ViT-Ti W4A4 (README): 32 for ranges "
                               "and 128 for reconstruction gave 70.43 % on set 0 against 66.67 % with 32 and "
                               "71.51 % with 128 for everything")
            views = kept(v2.number_input, "Views per image (1: the images only)", f"{prefix}-rviews", 1,
                         min_value=1, max_value=16, disabled=not iters,
                         help="reconstruction also trains on seeded random crops and mirror images of each "
                              "calibration image (ranges and GPTQ still see the images alone); with samples per "
                              "step set, a step costs the same. Measured on ViT-Ti W4A4 after GPTAQ (README): "
                              "4 views, set 0, +0.64 points, within float-order noise")
    return QuantConfig(preset=method, wbits=int(wbits), abits=int(abits), overrides=overrides,
                       recon_iters=int(iters), recon_scales=bool(scales and iters), recon_batch=int(rbatch),
                       recon_views=int(views) if iters else 1,
                       range_images=int(ranges) if iters else 0,
                       recon_loss=ReconLoss(rloss) if iters else ReconLoss.MSE, gptq=bool(gptq and gptq_ok),
                       gptq_act_order=bool(act_order and gptq and gptq_ok), gptaq=bool(asym and gptq and gptq_ok),
                       gptq_damp=float(damp) if gptq and gptq_ok else GPTQ_DAMP,
                       ias_iters=int(ias_iters),
                       calibration={"images": int(calib), "seed": int(seed), "batch_size": 32})
