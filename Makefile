# Two commands on a fresh machine: `make demo` and `make test`. Both build the virtualenv first, with everything:
# the CPU torch, then lorad with its training stack (`train`) and the test tools (`dev`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; a plain `torch` requirement on a fresh venv could pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[train,dev]'
	touch $(STAMP)

demo: $(STAMP)
	bash configs/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --timeout=600 tests

lint: $(STAMP)
	$(BIN)/ruff check engine daemon tests bench

clean:
	rm -rf $(VENV) demo-home
