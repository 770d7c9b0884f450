# fastpipe: the README's two commands.
#   make demo   set up .venv, install fastpipe, run the main job
#   make test   set up .venv, install fastpipe with its test extras, run the suite
# TORCH is the pip requirement for torch (default torch==2.13.0: on this project's
# machines pip takes a CPU build of it from local disk; from PyPI on Linux it is
# the CUDA build). Pass another requirement, or extra pip arguments such as a CPU
# index URL, with `make test TORCH="..."`.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: demo test bench torch clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Build tools for --no-build-isolation (one environment, no second download).
$(VENV)/.build-tools: | $(PY)
	$(PIP) install -q "setuptools>=68" "pybind11>=2.12" wheel
	touch $@

# Re-checked every run: a no-op when the requested torch is already there.
torch: | $(PY)
	$(PIP) install -q $(TORCH)

$(VENV)/.installed: $(SOURCES) $(VENV)/.build-tools | torch
	$(PIP) install -q --no-build-isolation -e ".[plot]"
	touch $@

$(VENV)/.installed-test: $(SOURCES) $(VENV)/.build-tools | torch
	$(PIP) install -q --no-build-isolation -e ".[test,plot]"
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m fastpipe demo

# pytest's exit code 5 (no tests collected) fails like any other failure.
test: $(VENV)/.installed-test
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

bench: $(VENV)/.installed-test
	$(PY) -m bench

clean:
	rm -rf build *.egg-info fastpipe/_C*.so $(VENV)/.installed $(VENV)/.installed-test
