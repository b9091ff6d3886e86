# Two commands for a fresh clone: `make train` and `make test` (both install first, idempotently).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch; a GPU user installs a CUDA torch into .venv first (README).
TORCH  ?= torch==2.13.0

.PHONY: install train test test-slow clean constraints

install: $(STAMP)

# constraints.txt: the versions `make test` passed with (never torch: a GPU user's CUDA torch stays).
# After upgrading a dependency on purpose: make constraints (then make test, and commit both).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,slurm]"
	touch $(STAMP)

constraints: install
	( echo "# pip constraints: the versions the test suite passed with (make install uses them)."; \
	  echo "# Regenerate with: make constraints (torch and normlab itself are never pinned here)."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^(torch|pip|setuptools|wheel)==' ) > constraints.txt

train: install
	$(PY) train.py $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
