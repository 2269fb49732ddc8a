"""vizq dashboard: the router. Pages live in pages/; the library does the work."""
import streamlit as st

from vizq.ui.state import data_label, init_state

st.set_page_config(page_title="vizq — PTQ for vision transformers", layout="wide")
init_state()

pages = [
    st.Page("pages/1_model_data.py", title="Model & data", icon=":material/memory:", default=True),
    st.Page("pages/2_softmax.py", title="Softmax explorer", icon=":material/insights:"),
    st.Page("pages/3_layernorm.py", title="LayerNorm explorer", icon=":material/bar_chart:"),
    st.Page("pages/7_massive.py", title="Massive activations", icon=":material/warning:"),
    st.Page("pages/4_lab.py", title="Quantizer lab", icon=":material/science:"),
    st.Page("pages/5_evaluate.py", title="Evaluate", icon=":material/speed:"),
    st.Page("pages/6_export.py", title="Export", icon=":material/download:"),
]
# position="hidden" + page links: the sidebar never flashes the pages/ folder's default menu
nav = st.navigation(pages, position="hidden")
with st.sidebar:
    st.markdown("### vizq")
    for page in pages:
        st.page_link(page)
    st.divider()
    s = st.session_state
    st.markdown(f"**Model** `{s.model_spec}`  \n**Data** {data_label()} · up to {s.n_images} images · seed {s.seed}")
    st.caption("Change them on *Model & data*.")
nav.run()
