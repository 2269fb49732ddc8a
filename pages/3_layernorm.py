"""LayerNorm explorer: inter-channel variation and what reparameterization does to it."""
import streamlit as st

from vizq import plots
from vizq.capture import channel_variation
from vizq.ptq.reparam import preview_ranges
from vizq.quant import get_quantizer
from vizq.ui.state import chart, guard, page_capture

st.title("LayerNorm explorer")
lm, cap, names = page_capture("post_ln", "post-LayerNorm")

with guard("Computing inter-channel variation"):
    rows = [{"site": n, "block": cap.site(n).site.block if cap.site(n).site.block is not None else "merge",
             "position": n.rsplit(".", 1)[-1], "variation": channel_variation(cap.site(n))} for n in names]
    chart(*plots.variation_heatmap(rows), "ln-variation")

c1, c2, c3 = st.columns([3, 1, 1])
site = c1.selectbox("Post-LN site", names, index=max(0, len(names) - 2))
sort = c2.toggle("Sort channels by range", value=True)
factor = c3.number_input("Outlier if range > k × median", 1.5, 50.0, 3.0, step=0.5)
stt = cap.site(site)
with guard("Drawing channel ranges"):
    st.metric("max / median channel range", f"{channel_variation(stt):.2f}×")
    chart(*plots.channel_ranges(stt.channel.min, stt.channel.max, stt.percentiles(), sort, factor, f"{site}: per-channel ranges"),
          "ln-channels")

st.subheader("Reparameterization preview")
c1, c2 = st.columns(2)
bits = c1.slider("Per-channel calibration bits", 2, 8, 4)
mode = c2.radio("Layer scale", ["mean", "median"], horizontal=True,
                help="mean: RepQ-ViT; median: DopQ-ViT's MOSF, robust to outlier channels")
with guard("Folding scales"):
    q = get_quantizer("uniform", bits, granularity="channel").calibrate(stt.sample())
    prev = preview_ranges(stt.channel.min, stt.channel.max, q.state["scale"], q.state["zero_point"], mode)
    before = (prev["before_max"] - prev["before_min"])
    after = (prev["after_max"] - prev["after_min"])
    m1, m2 = st.columns(2)
    m1.metric("max/median range before", f"{float(before.max() / before.median()):.2f}×")
    m2.metric("max/median range after folding", f"{float(after.max() / after.median()):.2f}×")
    chart(*plots.reparam_preview(prev, f"{site}: ranges before/after folding ({mode} scale)"), "ln-reparam")
