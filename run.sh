#!/usr/bin/env bash
# Install (idempotent) and launch the dashboard on the bundled default model, on localhost.
# Extra arguments go to streamlit, e.g. ./run.sh --server.port 8600
set -euo pipefail
cd "$(dirname "$0")"
./install.sh
exec .venv/bin/python -m streamlit run app.py --server.address 127.0.0.1 --server.headless true "$@"
