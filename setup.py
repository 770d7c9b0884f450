"""Build of fastpipe._C: the sources in csrc/, plus the CUDA lane backend when
CUDA headers are found. pyproject.toml declares everything else.

FASTPIPE_CUDA=auto (default) builds the CUDA backend if cuda_runtime_api.h is
under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda; 1 requires it; 0 skips it.
Only headers are used: libcudart is opened at run time, never linked, so the
same build imports on machines without CUDA. No GPU is probed here.
"""

import os
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

CSRC = Path("csrc")
CUDA_SOURCES = {"bind_cuda.cpp", "cuda_lane.cpp", "cuda_runtime.cpp"}


def cuda_include_dir() -> str | None:
    mode = os.environ.get("FASTPIPE_CUDA", "auto").strip().lower()
    if mode not in {"auto", "0", "1"}:
        raise SystemExit(f"FASTPIPE_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return None
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in filter(None, roots):
        include = Path(root) / "include"
        if (include / "cuda_runtime_api.h").is_file():
            return str(include)
    if mode == "1":
        raise SystemExit(
            "FASTPIPE_CUDA=1 but no cuda_runtime_api.h under $CUDA_HOME, $CUDA_PATH or "
            "/usr/local/cuda; set CUDA_HOME or build with FASTPIPE_CUDA=0"
        )
    return None


def extension() -> Pybind11Extension:
    cuda_include = cuda_include_dir()
    sources = sorted(
        str(p) for p in CSRC.glob("*.cpp") if cuda_include or p.name not in CUDA_SOURCES
    )
    return Pybind11Extension(
        "fastpipe._C",
        sources,
        include_dirs=[str(CSRC)] + ([cuda_include] if cuda_include else []),
        define_macros=[("FASTPIPE_WITH_CUDA", "1")] if cuda_include else [],
        extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        libraries=["dl", "rt"],
        cxx_std=17,
    )


ParallelCompile("FASTPIPE_BUILD_JOBS", default=2).install()
setup(ext_modules=[extension()], cmdclass={"build_ext": build_ext})
