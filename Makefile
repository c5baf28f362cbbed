# Two commands work on a fresh machine:
#   make demo   - capture a real sentence encoder on real sentences, probe it, write a report
#   make test   - set everything up from nothing and run the test suite
# Everything lives in a virtualenv inside the repository (.venv); torch 2.13.0 is installed
# first so that no other torch build is pulled in, and the C++ extension is built against it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.acs-installed
NATIVE := $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: install build test test-fast demo bench bench-quick clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python pyproject.toml setup.py
	@date -u +"%F %T UTC: installing into $(VENV)"
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "setuptools>=77" wheel "pybind11>=2.11" ninja "numpy>=1.26"
	$(PIP) install -q --no-build-isolation -e ".[dev,demo,dask,interop]" torch==2.13.0
	touch $(STAMP) activationscope/.native-stamp

install: $(STAMP) build

# Rebuild the extension in place when a C++ file changed.
build: activationscope/.native-stamp
activationscope/.native-stamp: $(STAMP) $(NATIVE) setup.py
	$(PY) setup.py -q build_ext --inplace
	touch $@

test: install
	@date -u +"%F %T UTC: running the tests"
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 tests

demo: install
	$(PY) -m activationscope demo

# The peers the benchmark compares with (nnsight, TorchLens, SAELens, ...): the bench extra.
BENCH_STAMP := $(VENV)/.acs-bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q --no-build-isolation -e ".[bench]" torch==2.13.0
	touch $@

bench: install $(BENCH_STAMP)
	$(PY) -m benchmark.runner

bench-quick: install $(BENCH_STAMP)
	$(PY) -m benchmark.runner --quick

clean:
	rm -rf build activationscope/_C*.so activationscope/.native-stamp
