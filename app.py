"""vizq dashboard: the router. Pages live in pages/; the library does the work."""
from pathlib import Path

import streamlit as st

from vizq.ui.state import chosen_units, data_label, init_state

ASSETS = Path(__file__).resolve().parent / "assets"

# The icon is a local file: Material icon names (":material/…:") make the browser fetch SVGs from
# fonts.gstatic.com, and the dashboard sends no request off this machine.
st.set_page_config(page_title="vizq — PTQ for vision transformers", page_icon=str(ASSETS / "vizq-icon.png"),
                   layout="wide")
init_state()

pages = [
    st.Page("pages/1_model_data.py", title="Model & data", default=True),
    st.Page("pages/2_softmax.py", title="Softmax explorer"),
    st.Page("pages/3_layernorm.py", title="LayerNorm explorer"),
    st.Page("pages/7_massive.py", title="Massive activations"),
    st.Page("pages/4_lab.py", title="Quantizer lab"),
    st.Page("pages/5_evaluate.py", title="Evaluate"),
    st.Page("pages/6_export.py", title="Export"),
]
# position="hidden" + page links: the sidebar never flashes the pages/ folder's default menu
nav = st.navigation(pages, position="hidden")
with st.sidebar:
    st.markdown("### vizq")
    for page in pages:
        st.page_link(page)
    st.divider()
    s = st.session_state
    st.markdown(f"**Model** `{s.model_spec}`  \n**Data** {data_label()} · up to {s.n_images} {chosen_units()} · seed {s.seed}")
    st.caption("Change them on *Model & data*.")
nav.run()
