"""Build of fastpipe._C: the sources in csrc/, plus the CUDA lane backend when
CUDA headers are found. pyproject.toml declares everything else.

FASTPIPE_CUDA=auto (default) builds the CUDA backend if cuda_runtime_api.h is
under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda; 1 requires it; 0 skips it.
Only headers are used: libcudart is opened at run time, never linked, so the
same build imports on machines without CUDA. No GPU is probed here.

fastpipe._chain (csrc/chain/) is built against the torch found at build time
(`pip install --no-build-isolation`, as the Makefile does) and skipped where
torch cannot be imported here or FASTPIPE_NATIVE_CHAIN=0: fastpipe then runs
those stages' ops from Python (fastpipe/runtime/chain.py). It is tied to that
torch's C++ ABI; after a torch upgrade, rebuild it.
"""

import os
import platform
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


def chain_extension():
    """fastpipe._chain, or None where it cannot or should not be built."""
    mode = os.environ.get("FASTPIPE_NATIVE_CHAIN", "1").strip()
    if mode not in {"0", "1"}:
        raise SystemExit(f"FASTPIPE_NATIVE_CHAIN must be 0 or 1, got {mode!r}")
    if mode == "0":
        return None
    try:
        import torch
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        return None
    macros = [
        ("TORCH_EXTENSION_NAME", "_chain"),
        # What `python -m fastpipe info` reports: the torch this build is tied to.
        ("FASTPIPE_BUILT_WITH_TORCH", '"' + torch.__version__ + '"'),
        ("TORCH_API_INCLUDE_EXTENSION_H", None),
        ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
    ]
    if platform.machine().lower() in {"x86_64", "amd64"}:
        # GELU through ATen's own CPU kernel (csrc/chain/chain.cpp says why):
        # its dispatch entry point is declared with the CPU capabilities
        # torch itself was built with, on x86-64 these two.
        macros += [("FASTPIPE_GELU_STUB", None), ("HAVE_AVX512_CPU_DEFINITION", None),
                   ("HAVE_AVX2_CPU_DEFINITION", None)]
    return CppExtension(
        "fastpipe._chain",
        ["csrc/chain/chain.cpp", "csrc/chain/wgrad.cpp", "csrc/chain/defer.cpp"],
        define_macros=macros,
        extra_compile_args=["-O2", "-g0", "-std=c++20", "-fvisibility=hidden"],
    )


ParallelCompile("FASTPIPE_BUILD_JOBS", default=2).install()
setup(ext_modules=[e for e in (extension(), chain_extension()) if e is not None],
      cmdclass={"build_ext": build_ext})
