"""Test-wide set-up. Runs before any test module is imported."""

import os

# Triton kernels have no GPU here: run them in the interpreter. This must be
# set before any module that defines a kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per process keeps multi-process tests from
# oversubscribing the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make tsan` runs the ring tests against a ThreadSanitizer build of
# fastpipe._C: make sure that build, not the regular one, is the one loaded.
_native_dir = os.environ.get("FASTPIPE_TEST_NATIVE_DIR")
if _native_dir:
    import fastpipe._C

    if not os.path.realpath(fastpipe._C.__file__).startswith(os.path.realpath(_native_dir)):
        raise RuntimeError(f"expected fastpipe._C from {_native_dir}, got {fastpipe._C.__file__}")
