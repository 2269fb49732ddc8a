"""Quantizer lab: several quantizers on the same captured tensor, live."""
import time

import pandas as pd
import streamlit as st

from vizq import plots
from vizq.lab import lab_input, run_quantizer
from vizq.quant import GRANULARITY_AXES, QuantizerError, list_quantizers, quantizer_class
from vizq.quant.registry import bits_for
from vizq.ui.state import chart, chart_table, current_capture, current_model, guard, units

st.title("Quantizer lab")
lm = current_model()
cap = current_capture(lm)
names = list(cap.stats)
default = next((n for n in names if n.endswith("2.attn.softmax")), next((n for n in names if n.endswith("softmax")), names[0]))
c1, c2 = st.columns([3, 1])
site = c1.selectbox("Site", names, index=names.index(default))
bits = c2.slider("Bits (integer / log grids)", 2, 8, 4)
chosen = st.multiselect("Quantizers", list_quantizers(), default=["uniform", "log2", "logsqrt2", "adalog", "tanq", "sulq"])

choices, unavailable = [], []
with st.expander("Options per quantizer"):
    for name in chosen:
        cls = quantizer_class(name)
        cols = st.columns(4)
        cols[0].markdown(f"**{name}**  \n{cls.description}")
        opts = {}
        if "granularity" in cls.defaults:
            opts["granularity"] = cols[1].selectbox("granularity", list(GRANULARITY_AXES)[:4], key=f"g-{name}")
        for i, (key, allowed) in enumerate(cls.choices.items()):
            val = cols[2 + i % 2].selectbox(key, list(allowed), index=list(allowed).index(cls.defaults[key]), key=f"o-{name}-{key}")
            if val != cls.defaults[key]:
                opts[key] = val
        if opts.get("granularity") == "tensor":
            opts.pop("granularity")
        try:  # the one bits rule: fixed-width formats keep their width; other ranges must hold the slider's
            choices.append((name, bits_for(cls, bits), opts))
        except QuantizerError as e:
            unavailable.append(f"{name}: {e}")

# Results are kept per (capture, site, quantizer, bits, options) for this session: a control
# that changes one quantizer recomputes that one only.
cache = st.session_state.setdefault("_lab_cache", {})
inp_key = (id(cap), site)
if cache.get("input", (None,))[0] != inp_key:
    cache.clear()
    cache["input"] = (inp_key, lab_input(cap, site, lm.model))
inp = cache["input"][1]
t0 = time.perf_counter()
rows, levels, outs = [], {}, {}
with guard("Running the quantizers"):
    for name, b, opts in choices:
        key = (name, b, tuple(sorted(opts.items())))
        if key not in cache:
            cache[key] = run_quantizer(inp, name, b, opts)
        row, q, xq = cache[key]
        row = dict(row)
        label = f"{name} {q.bits}b" + (f" ({','.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")
        row["label"] = label
        rows.append(row)
        lv = q.levels()
        levels[label] = lv if lv.dim() == 1 else lv[0]
        outs[label] = xq
elapsed = 1000 * (time.perf_counter() - t0)
st.caption(f"{inp.kind} tensor {tuple(inp.x.shape)}: the {len(cap.reservoir_ids)} of {cap.num_images} captured "
           f"{units(lm)} kept whole · "
           f"updated in **{elapsed:.0f} ms** for {len(choices)} quantizers (results kept per quantizer; "
           f"the ms column is each one's own calibration + quantization time)"
           + (" · per-group levels: the first group's are drawn" if any(o for _, _, o in choices) else ""))
if not rows:
    st.info("Choose at least one quantizer.")
    st.stop()
if unavailable:
    st.info("Not drawn at this width: " + "; ".join(unavailable))
table = pd.DataFrame(rows).set_index("label").drop(columns=["options"])
task = inp.task_metric
other = sorted({int(b) for b in table.bits if b != bits})
table.insert(0, "compared_at", ["slider width" if b == bits else f"own width ({b} bits)" for b in table.bits])
if task and task in table:  # rank within one width: a fixed 4-bit format is not ranked against a 6-bit grid
    table = table.assign(_w=table.bits != bits).sort_values(["_w", task]).drop(columns="_w")
if other:
    st.caption(f"Fixed-width formats run at their own width ({', '.join(f'{b} bits' for b in other)}), not at the "
               f"slider's {bits}: they are listed after the {bits}-bit grids and ranked among themselves.")
chart_table(table.reset_index(), "lab-metrics")
log_x = inp.kind == "post_softmax"
with guard("Drawing"):
    chart(*plots.levels_over_histogram(inp.x, levels, log_x=log_x, title=f"{site}: values and quantization levels"), "lab-levels")
    chart(*plots.error_scatter(inp.x, outs, log=False), "lab-error")
