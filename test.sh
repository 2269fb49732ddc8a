#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./install.sh test
# Two workers: much of the suite waits on subprocesses (CLI, torchrun, the dashboard server,
# the browser), so two in parallel finish well before one; VIZQ_TEST_WORKERS=0 runs serially.
exec .venv/bin/python -m pytest -q -n "${VIZQ_TEST_WORKERS:-2}" tests "$@"
