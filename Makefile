# Two commands for a fresh clone: `make train` and `make test` (both install first, idempotently).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch; a GPU user installs a CUDA torch into .venv first (README).
TORCH  ?= torch==2.13.0

.PHONY: install train test test-slow clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,slurm]"
	touch $(STAMP)

train: install
	$(PY) train.py $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
