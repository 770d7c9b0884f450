# fastpipe: the README's two commands.
#   make demo   set up .venv, install fastpipe, run the main job
#   make test   set up .venv, install fastpipe with its test extras, run the suite
#   make tsan   build the native ring with ThreadSanitizer and run its tests on it
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

.PHONY: demo test tsan bench torch clean

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

# ThreadSanitizer: the host ring and buffer ring (no CUDA part) built with
# -fsanitize=thread into build/tsan, next to a copy of the Python package and
# the tests, which then load it (conftest checks that they do). Any race
# report makes TSAN exit non-zero.
TSAN_DIR := build/tsan
TSAN_SOURCES := csrc/event.cpp csrc/host_ring.cpp csrc/slot_ring.cpp csrc/module.cpp
CXX ?= g++
tsan: $(VENV)/.installed-test
	rm -rf $(TSAN_DIR) && mkdir -p $(TSAN_DIR)
	cp -r fastpipe tests $(TSAN_DIR)/
	rm -f $(TSAN_DIR)/fastpipe/_C*.so
	$(CXX) -std=c++17 -shared -fPIC -fvisibility=hidden -fsanitize=thread -O1 -g \
	  $$($(PY) -m pybind11 --includes) -Icsrc $(TSAN_SOURCES) -ldl \
	  -o $(TSAN_DIR)/fastpipe/_C$$($(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
	cd $(TSAN_DIR) && FASTPIPE_TEST_NATIVE_DIR=$(CURDIR)/$(TSAN_DIR) FASTPIPE_CUDA=0 \
	  TSAN_OPTIONS="halt_on_error=1 exitcode=66" \
	  LD_PRELOAD=$$($(CXX) -print-file-name=libtsan.so) \
	  $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider tests/test_host_ring.py tests/test_buffer_ring.py

bench: $(VENV)/.installed-test
	$(PY) -m bench

clean:
	rm -rf build *.egg-info fastpipe/_C*.so $(VENV)/.installed $(VENV)/.installed-test
