# Set-up and the two README commands: `make demo` (installs the core and torch only) and `make test` (also
# the extras the suite needs).
# Outside a virtual environment everything installs into the project's own `.venv`, made with the system
# `python3` (so an externally-managed interpreter such as Debian's is never touched); inside one, that one
# is used. Every recipe runs with the environment's bin/ first on PATH.
SYSTEM_PYTHON ?= python3
VENV ?= .venv
FMNIST := /usr/share/datasets/fashion-mnist

ifndef VIRTUAL_ENV
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
endif
PY := $(VIRTUAL_ENV)/bin/python

# torch: the CPU-only build from PyTorch's CPU wheel index where that index answers within
# TORCH_INDEX_TIMEOUT seconds, else the default index's build (on Linux x86-64 the CUDA one: GBs more); pip
# shows its progress. PIP_INSTALL is the command both installs run (tests/test_install_fallback.py points
# TORCH_CPU_INDEX at a dead address to check the fallback).
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_TIMEOUT ?= 10
PIP_INSTALL ?= $(PY) -m pip install --disable-pip-version-check
# what was last installed: each stamp reruns its pip only when pyproject.toml or this Makefile changed.
# CORE_STAMP: fedpcd alone and torch (`make demo`); STAMP: the extras the suite uses too (`make install`,
# `make test`). A core install never uninstalls an extra, so `make demo` after `make test` changes nothing.
CORE_STAMP := $(VIRTUAL_ENV)/.fedpcd-core-installed
STAMP := $(VIRTUAL_ENV)/.fedpcd-installed
TEST_EXTRAS := test,flower,docs,trackers,privacy,hf,cluster

.PHONY: install install-core torch demo test check-release bench

$(PY):
	$(SYSTEM_PYTHON) -m venv $(VIRTUAL_ENV)

# prints nothing where the index answers, else what happened: no answer within the timeout, or a failure
# at once (a name that does not resolve, a refused connection, an HTTP error) with its reason
define PROBE_INDEX
import sys, urllib.request
url, timeout = sys.argv[1].rstrip("/") + "/torch/", float(sys.argv[2])
try:
    urllib.request.urlopen(url, timeout=timeout)
except Exception as exc:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, TimeoutError):
        print(f"did not answer within {sys.argv[2]} s")
    else:
        print(f"failed at once ({str(reason) or type(reason).__name__})")
endef
export PROBE_INDEX

torch: $(PY)
	@failure=$$($(PY) -c "$$PROBE_INDEX" "$(TORCH_CPU_INDEX)" "$(TORCH_INDEX_TIMEOUT)" 2>&1); \
	if [ -z "$$failure" ]; then \
	  from="the CPU index $(TORCH_CPU_INDEX)"; \
	  $(PIP_INSTALL) --timeout $(TORCH_INDEX_TIMEOUT) --index-url "$(TORCH_CPU_INDEX)" "$(TORCH)" \
	    || { echo "torch: the install from $(TORCH_CPU_INDEX) failed: $(TORCH) from the default index"; from=; }; \
	else \
	  echo "torch: $(TORCH_CPU_INDEX) $$failure: $(TORCH) from the default index"; \
	fi; \
	if [ -z "$$from" ]; then $(PIP_INSTALL) "$(TORCH)" || exit 1; from="the default index"; fi; \
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "torch: $$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))') from $$from:" \
	  "$$(du -sm "$$site/torch" | cut -f1) MB in site-packages/torch," \
	  "$$(du -smc "$$site"/nvidia* "$$site"/triton 2>/dev/null | tail -n1 | cut -f1) MB of CUDA libraries (nvidia*, triton)"

install: $(STAMP)
install-core: $(CORE_STAMP)

$(CORE_STAMP): pyproject.toml Makefile | $(PY)
	@if [ ! -d $(FMNIST) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	  else echo "note: install Debian's dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist) or set FEDPCD_DATA"; fi; \
	fi
	@$(MAKE) --no-print-directory torch
	$(PIP_INSTALL) -e .
	@touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP) pyproject.toml Makefile
	$(PIP_INSTALL) -e ".[$(TEST_EXTRAS)]"
	@touch $(STAMP)

demo: install-core
	fedpcd demo

# the suite's files spread over the cores (a file's tests share one worker: its module fixtures run once),
# in collection order: tests/conftest.py puts the files with tests marked `procs` (Ray, Flower and job
# processes) first, each followed by another file, then the files with slow tests. pyproject.toml's addopts
# leave out the tests marked `release`: they install the project again (a clone's `make install`, the wheel
# in a fresh environment, which also runs every block of README.md and docs/getting-started.md: minutes), and
# run in `make check-release` (CI runs both: .ci/run). The 25 slowest tests are listed at the end, where the
# suite's time goes.
test: install
	ruff check src tests benchmarks
	$(PY) -m pytest -rs -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations 25

check-release: install
	$(PY) -m pytest -m release -n auto --maxprocesses 4 --dist loadfile

bench: install
	$(PY) benchmarks/throughput.py
