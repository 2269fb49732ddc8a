#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh test
exec .venv/bin/python -m pytest -q tests "$@"
