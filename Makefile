# fastpipe: the README's two commands.
#   make demo   set up .venv, install fastpipe, run the main job
#   make test   set up .venv, install fastpipe with its test extras, run the suite
#   make tsan   build the native ring with ThreadSanitizer and run its tests on it
#   make asan   the same with AddressSanitizer
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
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/chain/*.cpp csrc/chain/*.h)

.PHONY: demo test tsan asan bench torch clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Build tools for --no-build-isolation (one environment, no second download).
$(VENV)/.build-tools: | $(PY)
	$(PIP) install -q "setuptools>=77" "pybind11>=2.12" wheel
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

# Sanitizers: the host ring and buffer ring (no CUDA part) built with
# -fsanitize=thread (make tsan) or -fsanitize=address (make asan) into
# build/<name>, next to a copy of the Python package and the tests, which then
# load it (conftest checks that they do). Any report makes the run fail. The
# copy leaves out fastpipe._chain (chain stages then take autograd, as before).
# pytest captures at the Python level only (--capture=sys), so a sanitizer's
# report, written to fd 2 just before it ends the process, reaches the log.
# .ci/tsan.supp says which reports are torch's own (uninstrumented) frees.
SAN_SOURCES := csrc/event.cpp csrc/host_ring.cpp csrc/mailbox.cpp csrc/shm_link.cpp \
               csrc/slot_ring.cpp csrc/module.cpp
SAN_TESTS := tests/test_host_ring.py tests/test_buffer_ring.py tests/test_mailbox.py tests/test_shm_link.py
CXX ?= g++
TSAN_ENV := TSAN_OPTIONS="halt_on_error=1 exitcode=66 suppressions=$(CURDIR)/.ci/tsan.supp"
# CPython frees little at exit by design: leak checks would only report it.
# libstdc++ is preloaded too, so the sanitizer runtime finds __cxa_throw.
ASAN_ENV := ASAN_OPTIONS="detect_leaks=0 halt_on_error=1 exitcode=67"

define sanitize
	rm -rf build/$(1) && mkdir -p build/$(1)
	cp -r fastpipe tests build/$(1)/
	rm -f build/$(1)/fastpipe/_C*.so build/$(1)/fastpipe/_chain*.so
	pids=""; for f in $(SAN_SOURCES); do \
	  $(CXX) -std=c++17 -fPIC -fvisibility=hidden -fsanitize=$(2) -fno-omit-frame-pointer -O1 -g \
	    $$($(PY) -m pybind11 --includes) -Icsrc -c $$f -o build/$(1)/$$(basename $$f .cpp).o & \
	  pids="$$pids $$!"; done; for p in $$pids; do wait $$p || exit 1; done
	$(CXX) -shared -fsanitize=$(2) build/$(1)/*.o -ldl -lrt \
	  -o build/$(1)/fastpipe/_C$$($(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
	cd build/$(1) && FASTPIPE_TEST_NATIVE_DIR=$(CURDIR)/build/$(1) FASTPIPE_CUDA=0 $(3) \
	  LD_PRELOAD="$$($(CXX) -print-file-name=lib$(1).so) $$($(CXX) -print-file-name=libstdc++.so)" \
	  $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider --capture=sys $(SAN_TESTS)
endef

tsan: $(VENV)/.installed-test
	$(call sanitize,tsan,thread,$(TSAN_ENV))

asan: $(VENV)/.installed-test
	$(call sanitize,asan,address,$(ASAN_ENV))

bench: $(VENV)/.installed-test
	$(PY) -m bench

clean:
	rm -rf build *.egg-info fastpipe/_C*.so $(VENV)/.installed $(VENV)/.installed-test
