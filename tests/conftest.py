"""Test-wide set-up. Runs before any test module is imported."""

import os

# Triton kernels have no GPU here: run them in the interpreter. This must be
# set before any module that defines a kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per process keeps multi-process tests from
# oversubscribing the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
