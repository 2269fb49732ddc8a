# Two entry points, both idempotent: `make run` (install + dashboard), `make test` (install + tests).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install install-test browser

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): requirements.txt requirements-test.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements-test.txt
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python -m streamlit run app.py --server.address 127.0.0.1 --server.headless true

test: install
	$(BIN)/python -m pytest -q tests
