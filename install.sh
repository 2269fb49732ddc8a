#!/usr/bin/env bash
# Create .venv and install the pinned requirements; re-installs only when they change.
# `./install.sh test` adds the test tools. Needs Python 3.11 and pip, nothing else.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
req=requirements.txt
[ "${1:-}" = test ] && req=requirements-test.txt
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed-$(cat requirements.txt requirements-test.txt "$req" | sha256sum | cut -c1-16)-$(basename "$req")"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r "$req"
  touch "$stamp"
fi
