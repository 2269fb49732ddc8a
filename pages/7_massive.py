"""Massive activations: where they are, and what a range choice does to them."""
import pandas as pd
import plotly.express as px
import streamlit as st

from vizq.data import pick
from vizq.massive import RATIO, consumer_weight, find_massive, range_study, site_tensor
from vizq.sites import find_site
from vizq.ui.state import chart, chart_table, current_images, current_model, data_key, guard, image_model_only

st.title("Massive activations")
st.caption(f"A value is massive when |x| ≥ ratio × the median |x| of its site's tensor (default {RATIO:g}×). "
           "A handful of them decide a min/max or MSE range search on their own; this page shows where they are "
           "and what each range choice costs the ordinary values and the layer they feed.")
lm = current_model()
if not image_model_only(lm, "The massive-activation scan"):
    st.stop()
s = st.session_state
images = current_images(lm)
idx = pick(len(images), int(s.n_images), int(s.seed))
ratio = st.number_input("ratio (× median |x|)", 10.0, 1e6, RATIO, step=100.0, key="massive-ratio")

store = s.setdefault("massive_scans", {})
key = f"{lm.info.model_id}|{lm.info.weights_sha256[:12]}|{data_key()}|{len(idx)}|{s.seed}|{ratio}"
if key not in store:
    bar = st.progress(0.0, text="Scanning…")
    with guard("Scanning for massive activations"):
        store[key] = find_massive(lm, images, idx, batch_size=16, ratio=ratio,
                                  progress=lambda d, t, m: bar.progress(min(d / max(t, 1), 1.0), text=m))
    bar.empty()
found = store[key]
rows = pd.DataFrame([f.row() for f in found])
hit = rows[rows.massive > 0]
m1, m2, m3 = st.columns(3)
m1.metric("sites with massive values", f"{len(hit)} of {len(rows)}")
m2.metric("largest |x|", f"{rows.max_abs.max():.1f}" if len(rows) else "-")
m3.metric("largest |x| / median", f"{hit.max_over_median.max():,.0f}×" if len(hit) else "-")
st.caption(f"{len(idx)} images ({data_key()}), float model; the post-Softmax sites are left out (probabilities).")
if hit.empty:
    st.info("No site of this model holds values this far from its median on these images. Real pretrained ViTs "
            "do (the bundled ViT-Ti: the input of blocks.7.mlp.fc2 and the residual stream after block 7); the digits model does not.")
    chart_table(rows, "massive-sites")
    st.stop()

fig = px.bar(hit, x="site", y="massive", color="kind", log_y=True,
             hover_data=["max_abs", "median_abs", "max_over_median", "channels", "tokens"],
             labels={"massive": "massive values (count, log)", "site": "site (most massive first)"},
             title=f"Massive values per site (|x| ≥ {ratio:g} × median)")
chart(fig, hit, "massive-sites")

st.subheader("What a range choice does to them")
with_consumer = [n for n in hit.site if find_site(lm.sites, n).consumers]
if not with_consumer:
    st.info("The sites with massive values here feed no Linear layer directly (residual stream); range choices "
            "matter where a quantizer sits, e.g. the post-GELU input of fc2.")
    st.stop()
c1, c2 = st.columns([3, 1])
name = c1.selectbox("Site (feeds a Linear)", with_consumer, key="massive-site")
bits = c2.select_slider("bits", [3, 4, 5, 6, 8], value=4, key="massive-bits")
site = find_site(lm.sites, name)
tkey = f"{key}|{name}"
if s.get("massive_tensor_key") != tkey:
    with guard(f"Reading {name}"), st.spinner(f"Reading {name} for {len(idx)} images…"):
        s.massive_tensor, s.massive_tensor_key = site_tensor(lm, images, idx, site, 16), tkey
x = s.massive_tensor
with guard("Comparing range choices"):
    study = pd.DataFrame(range_study(x, consumer_weight(lm, site), int(bits), ratio))
entry = next(f for f in found if f.site == name)
loc1, loc2 = st.columns(2)
for col, what, data in ((loc1, "channel", entry.channels), (loc2, "token", entry.tokens)):
    t = pd.DataFrame(sorted(data.items(), key=lambda kv: -kv[1])[:20], columns=[what, "massive values"])
    if not t.empty:
        with col:
            f = px.bar(t.astype({what: str}), x=what, y="massive values",
                       labels={what: f"{what} index", "massive values": "massive values (count)"},
                       title=f"{name}: by {what} (top 20)")
            f.update_xaxes(type="category")  # indices are names here, not quantities
            chart(f, t, f"massive-{what}")
SCORES = {"mse": "the tensor's own MSE", "output_mse": "MSE of the next Linear's output",
          "output_rel_per_token": "next Linear's error per token, relative (repq+'s score)"}
long = study.melt(id_vars=["range"], value_vars=[c for c in SCORES if c in study], var_name="error", value_name="value")
long["error"] = long["error"].map(SCORES)
f = px.bar(long, x="range", y="value", color="error", barmode="group", log_y=True,
           labels={"value": "error (log; two MSEs and one relative error)", "range": f"uniform {bits}-bit range"},
           title=f"{name} at {bits} bits: own error vs the error of what it feeds")
chart(f, study, "massive-range-study")
picks = {label: study.loc[study[col].idxmin(), "range"] for col, label in SCORES.items() if col in study}
st.markdown("Lowest error by each score: " + "; ".join(f"{label}: **{r}**" for label, r in picks.items()) + ".")
if len(set(picks.values())) > 1:
    def what(col: str) -> str:
        r = study.loc[study[col].idxmin()]
        return (f"**{r['range']}** clips {int(r['massive_clipped'])} massive values and rounds "
                f"{r['ordinary_to_zero_pct']:.0f} % of the ordinary values to zero")

    last = "output_rel_per_token" if "output_rel_per_token" in study else "output_mse"
    st.markdown(f"The scores disagree. By the tensor's own MSE, {what('mse')}; by {SCORES[last]}, {what(last)}. "
                "`repq` (RepQ-ViT's code) scores its range candidates by the tensor's own MSE; `repq+` scores "
                "post-GELU ranges per token on the next layer's output.")
