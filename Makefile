# Two commands for a fresh clone: `make train` and `make test` (both install first, idempotently).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch; a GPU user installs a CUDA torch into .venv first (docs/training.md, "GPU install").
TORCH  ?= torch==2.13.0

.PHONY: install train test test-fast test-kernels test-slow clean constraints

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

# The suite on every core: one worker per core, a test file per worker at a time (its module
# fixtures are built once); 9.4 min from a fresh clone on the 2-core AMD EPYC with AVX-512 (README).
TEST_JOBS ?= auto
# Bytecode on for the tests, whatever the environment says: pytest keeps each test module's
# assertion-rewritten bytecode in tests/__pycache__ (git ignores it), so a later run's collection
# does not rewrite ~140 modules in every worker again (15 -> 8 s a worker on the AMD EPYC).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
test: install
	$(PYTEST) -q -n $(TEST_JOBS) --dist loadfile $(ARGS)

# The inner loop: the unit tests only (2.3 min from a fresh clone, 1.9 min the next time, on the
# 2-core AMD EPYC with AVX-512; issue 37). It leaves out the
# integration tests, which train or run a command through the entry point (tests/pyramid.py says
# which; tests/test_pyramid.py keeps the marks honest), and the slow ones; make test runs the former.
test-fast: install
	$(PYTEST) -q -n $(TEST_JOBS) --dist loadfile -m "not integration and not slow" $(ARGS)

# The pinned, bitwise and end-to-end tests again on another kernel path (issue 34): ATen's scalar
# `default` kernels, MKL's SSE2 `COMPATIBLE` branch and oneDNN at SSE4.1, a path no x86-64 CPU takes
# by itself, so a test that holds only on the CPU it was written on fails on that CPU too. (MKL's
# other branches are its native one on AMD CPUs: MKL_CBWR=AVX2 changes nothing there.)
KERNEL_ENV   := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41
KERNEL_TESTS := tests/test_schemes_pinned.py tests/test_norm_precision.py tests/test_qk_norm_precision.py \
                tests/test_norms.py tests/test_model.py tests/test_schemes_recent.py tests/test_decoding.py tests/test_bias.py \
                tests/test_continuation.py tests/test_train_e2e.py tests/test_final_test.py tests/test_hardware.py \
                "tests/test_runs_survive.py::test_kill_9_then_rerun_continues_exactly" \
                "tests/test_runs_survive.py::test_a_max_time_stop_is_a_pause_the_rerun_continues_exactly"
test-kernels: install
	$(KERNEL_ENV) $(PYTEST) -q -n $(TEST_JOBS) --dist loadfile $(KERNEL_TESTS) $(ARGS)

test-slow: install
	$(PYTEST) -q -m slow $(ARGS)

clean:
	rm -rf outputs multirun .pytest_cache
