"""Softmax explorer: power-law probabilities, per head, attention over the image, sinks."""
import numpy as np
import streamlit as st

from vizq import plots
from vizq.capture import key_mass, powerlaw_tail
from vizq.data import as_seen
from vizq.ui.state import chart, current_images, guard, image_model_only, page_capture

st.title("Softmax explorer")
lm, cap, names = page_capture("post_softmax", "post-Softmax")

c1, c2 = st.columns([2, 3])
site = c1.selectbox("Layer", names, index=min(2, len(names) - 1))
stt = cap.site(site)
n_heads = stt.log_hist.shape[0]
heads = c2.multiselect("Heads", list(range(n_heads)), default=list(range(min(n_heads, 4))))
with guard("Drawing the softmax views"):
    tail = powerlaw_tail(stt)
    m1, m2, m3 = st.columns(3)
    m1.metric("tail exponent α", f"{tail['alpha']:.2f}", help="fit of log CCDF vs log p between 2^-12 and 0.5")
    m2.metric("share of p > 0.5", f"{100 * tail['frac_above_0.5']:.3f} %")
    m3.metric("share of p ≥ 1/8", f"{100 * tail['frac_above_0.125']:.2f} %")
    chart(*plots.softmax_log2_histogram(stt.log_hist, heads or None, f"{site}: probabilities per log2 bin"), "softmax-hist")
    chart(*plots.ccdf_loglog(stt.log_hist, tail, f"{site}: CCDF on log-log axes"), "softmax-ccdf")

st.subheader("Attention of one query over the image")
grid = lm.info.patch_grid
x = stt.sample()
n_tokens = x.shape[-1]
prefix = cap.num_prefix_tokens
if not image_model_only(lm, "The image overlay"):
    pass
elif n_tokens != grid[0] * grid[1] + prefix:
    st.info(f"Hidden: {site} attends within {n_tokens}-token windows (Swin), which do not map onto the "
            f"{grid[0]}×{grid[1]} patch grid as one picture.")
else:
    c1, c2, c3 = st.columns(3)
    img_i = c1.number_input("Image (captured sample)", 0, x.shape[0] - 1, 0)
    head = c2.selectbox("Head", ["mean over heads"] + list(range(n_heads)))
    query = c3.slider("Query token (0 = CLS)" if prefix else "Query token", 0, n_tokens - 1, 0)
    a = x[img_i].mean(0) if head == "mean over heads" else x[img_i, head]
    images = current_images(lm)
    by_id = {r.id: r for r in images.records}
    rid = cap.reservoir_ids[img_i] if img_i < len(cap.reservoir_ids) else None
    with guard("Drawing the overlay"):
        dc = lm.info.data_config
        pic = (as_seen(by_id[rid].open(), lm.transform, dc["mean"], dc["std"]) if rid in by_id
               else np.zeros((*lm.info.input_size[1:], 3), np.uint8))
        if pic.shape[-1] == 1:
            pic = np.repeat(pic, 3, -1)
        chart(*plots.attention_overlay(pic, a[query].numpy(), grid, f"{site}, query {query}, image {rid}"), "attention-overlay")

st.subheader("Attention sinks across layers")
with guard("Drawing the sink view"):
    chart(*plots.key_mass_heatmap({n: key_mass(cap.site(n)) for n in names}, prefix), "attention-sinks")
