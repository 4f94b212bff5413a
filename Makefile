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

.PHONY: install demo test bench

$(PY):
	$(SYSTEM_PYTHON) -m venv $(VIRTUAL_ENV)

install: $(PY)
	@if [ ! -d $(FMNIST) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	  else echo "note: install Debian's dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist) or set FEDPCD_DATA"; fi; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,flower,docs,trackers]"

demo: install
	fedpcd demo

# the suite's files spread over the cores (a file's tests share one worker: its module fixtures run once),
# in collection order: tests/conftest.py puts the files with slow tests first
test: install
	ruff check src tests benchmarks
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

bench: install
	$(PY) benchmarks/throughput.py
