# The two commands a newcomer needs: `make serve` and `make test`.
# `make install` is the one source of truth for installing Augur (the Dockerfile runs it too):
# it creates $(VENV) when absent, installs torch $(TORCH_VERSION) only if torch is not importable (an
# unpinned torch would pull gigabytes of CUDA packages), then installs the project.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test
# The torch the tests run (installed only when torch is missing), and the wheel index to take it from
# (empty: PyPI; the Dockerfile passes PyTorch's per-CUDA indexes through here).
TORCH_VERSION := 2.13.0
TORCH_INDEX_URL ?=

ifeq ($(VENV),none)
PY := $(PYTHON)
BIN :=
else
PY := $(VENV)/bin/python
BIN := $(VENV)/bin/
endif

.PHONY: install install-now test serve lint bench

# In a virtualenv, the install runs again only when pyproject.toml or this file changed, or for other
# extras (the install is editable: code changes need none), so `make serve` restarts in seconds.
comma := ,
ifeq ($(VENV),none)
install: install-now
else
STAMP := $(VENV)/.augur-installed-$(subst $(comma),_,$(EXTRAS))
install: $(STAMP)
$(STAMP): pyproject.toml Makefile
	@$(MAKE) --no-print-directory install-now
	@touch $@
endif

install-now:
ifneq ($(VENV),none)
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
endif
	@$(PY) -c "import torch" 2>/dev/null || \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $(if $(strip $(TORCH_INDEX_URL)),--index-url $(TORCH_INDEX_URL))
	@$(PY) -m pip install -q -e ".$(if $(strip $(EXTRAS)),[$(EXTRAS)])"

# The suite runs in $(PYTEST_WORKERS) pytest-xdist workers, each taking a whole file at a time (a module's
# server and fixtures stay in one process), slowest files first (tests/conftest.py: SLOWEST_FIRST, not
# xdist's order by number of tests); PYTEST_WORKERS=0 runs it in this process alone.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

serve: install
	$(BIN)augur serve $(ARGS)

lint: install
	$(BIN)ruff check engine server loadtest tests
	$(BIN)lint-imports

bench: install
	$(BIN)augur bench $(ARGS)
