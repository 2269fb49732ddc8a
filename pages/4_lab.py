"""Quantizer lab: several quantizers on the same captured tensor, live."""
import time

import pandas as pd
import streamlit as st

from vizq import plots
from vizq.lab import lab_input, run_quantizer
from vizq.quant import GRANULARITY_AXES, list_quantizers, quantizer_class
from vizq.ui.state import chart, chart_table, current_capture, current_model, guard

st.title("Quantizer lab")
lm = current_model()
cap = current_capture(lm)
names = list(cap.stats)
default = next((n for n in names if n.endswith("2.attn.softmax")), next((n for n in names if n.endswith("softmax")), names[0]))
c1, c2 = st.columns([3, 1])
site = c1.selectbox("Site", names, index=names.index(default))
bits = c2.slider("Bits (integer / log grids)", 2, 8, 4)
chosen = st.multiselect("Quantizers", list_quantizers(), default=["uniform", "log2", "logsqrt2", "adalog", "tanq", "sulq"])

choices = []
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
        lo, hi = cls.bit_range
        choices.append((name, bits if lo <= bits <= hi else hi, opts))

inp = lab_input(cap, site, lm.model)
t0 = time.perf_counter()
rows, levels, outs = [], {}, {}
with guard("Running the quantizers"):
    for name, b, opts in choices:
        row, q, xq = run_quantizer(inp, name, b, opts)
        label = f"{name} {q.bits}b" + (f" ({','.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")
        row["label"] = label
        rows.append(row)
        lv = q.levels()
        levels[label] = lv if lv.dim() == 1 else lv[0]
        outs[label] = xq
elapsed = 1000 * (time.perf_counter() - t0)
st.caption(f"{inp.kind} tensor {tuple(inp.x.shape)} from {cap.num_images} captured images · "
           f"updated in **{elapsed:.0f} ms** for {len(choices)} quantizers"
           + (" · per-group levels: the first group's are drawn" if any(o for _, _, o in choices) else ""))
if not rows:
    st.info("Choose at least one quantizer.")
    st.stop()
table = pd.DataFrame(rows).set_index("label").drop(columns=["options"])
task = inp.task_metric
if task and task in table:
    table = table.sort_values(task)
chart_table(table.reset_index(), "lab-metrics")
log_x = inp.kind == "post_softmax"
with guard("Drawing"):
    chart(*plots.levels_over_histogram(inp.x, levels, log_x=log_x, title=f"{site}: values and quantization levels"), "lab-levels")
    chart(*plots.error_scatter(inp.x, outs, log=False), "lab-error")
