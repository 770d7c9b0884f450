"""The package surface: small, lazy, and clear when the extension is broken."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_runs_nothing():
    code = "import sys, fastpipe; print('fastpipe._C' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_version_and_all():
    import fastpipe

    assert fastpipe.__version__.count(".") == 2
    assert "__version__" in fastpipe.__all__
    for name in fastpipe.__all__:
        assert hasattr(fastpipe, name), name


def test_broken_extension_names_the_fix(monkeypatch):
    import importlib

    from fastpipe import _ext

    real_import = importlib.import_module

    def fail(name, *args):
        if name == "fastpipe._C":
            raise ImportError("undefined symbol: _ZN8fastpipe")
        return real_import(name, *args)

    _ext.native.cache_clear()
    monkeypatch.setattr(importlib, "import_module", fail)
    try:
        with pytest.raises(ImportError, match=r"pip install -e \.") as info:
            _ext.native()
        assert "undefined symbol" in str(info.value)
    finally:
        monkeypatch.undo()
        _ext.native.cache_clear()
    assert _ext.native().__name__ == "fastpipe._C"


def test_runtime_exposes_native_names_lazily():
    import fastpipe.runtime as rt

    assert rt.HostRing.__module__ == "fastpipe._C"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rt.nope  # noqa: B018


def test_stub_and_marker_ship_with_the_package():
    from importlib.resources import files

    pkg = files("fastpipe")
    assert (pkg / "py.typed").is_file()
    assert (pkg / "_C.pyi").is_file()
