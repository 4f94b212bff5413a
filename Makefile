# Set-up and the two README commands: `make demo` and `make test`.
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
# what `make install` last installed: it reruns pip only when pyproject.toml or this Makefile changed
STAMP := $(VIRTUAL_ENV)/.fedpcd-installed

.PHONY: install torch demo test check-release bench

$(PY):
	$(SYSTEM_PYTHON) -m venv $(VIRTUAL_ENV)

torch: $(PY)
	@if $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=float(sys.argv[2]))' \
	      "$(TORCH_CPU_INDEX)" "$(TORCH_INDEX_TIMEOUT)" 2>/dev/null; then \
	  from="the CPU index $(TORCH_CPU_INDEX)"; \
	  $(PIP_INSTALL) --timeout $(TORCH_INDEX_TIMEOUT) --index-url "$(TORCH_CPU_INDEX)" "$(TORCH)" \
	    || { echo "torch: the install from $(TORCH_CPU_INDEX) failed: $(TORCH) from the default index"; from=; }; \
	else \
	  echo "torch: $(TORCH_CPU_INDEX) did not answer within $(TORCH_INDEX_TIMEOUT) s: $(TORCH) from the default index"; \
	fi; \
	if [ -z "$$from" ]; then $(PIP_INSTALL) "$(TORCH)" || exit 1; from="the default index"; fi; \
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "torch: $$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))') from $$from:" \
	  "$$(du -sm "$$site/torch" | cut -f1) MB in site-packages/torch," \
	  "$$(du -smc "$$site"/nvidia* "$$site"/triton 2>/dev/null | tail -n1 | cut -f1) MB of CUDA libraries (nvidia*, triton)"

install: $(STAMP)

$(STAMP): pyproject.toml Makefile | $(PY)
	@if [ ! -d $(FMNIST) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	  else echo "note: install Debian's dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist) or set FEDPCD_DATA"; fi; \
	fi
	@$(MAKE) --no-print-directory torch
	$(PIP_INSTALL) -e ".[test,flower,docs,trackers,privacy,hf,cluster]"
	@touch $(STAMP)

demo: install
	fedpcd demo

# the suite's files spread over the cores (a file's tests share one worker: its module fixtures run once),
# in collection order: tests/conftest.py puts the files with tests marked `procs` (Ray, Flower and job
# processes) first, each followed by another file, then the files with slow tests. pyproject.toml's addopts
# leave out the tests marked `release`: they install the project again (a clone's `make install`, the wheel
# in a fresh environment, which also runs every block of README.md and docs/getting-started.md: minutes), and
# run in `make check-release` (CI runs both: .ci/run)
test: install
	ruff check src tests benchmarks
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

check-release: install
	$(PY) -m pytest -m release -n auto --maxprocesses 4 --dist loadfile

bench: install
	$(PY) benchmarks/throughput.py
