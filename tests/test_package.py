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


def test_public_names_are_typed_and_listed():
    """Checkers and IDEs see every public name through the TYPE_CHECKING
    imports (at run time they load lazily), and dir() lists them."""
    import ast

    import fastpipe

    tree = ast.parse(open(fastpipe.__file__).read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {alias.asname or alias.name for n in block.body for alias in n.names}
    assert typed == set(fastpipe.__all__) - {"__version__"}
    assert set(dir(fastpipe)) == set(fastpipe.__all__)
    for name in fastpipe.__all__:
        assert getattr(fastpipe, name) is not None


def test_the_demo_progress_is_plain_lines_off_a_terminal():
    import io

    from fastpipe._demo import _progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, tty = io.StringIO(), Terminal()
    for step in range(1, 21):
        _progress(step, 20, f"loss {1 / step:.3f}", log)
        _progress(step, 20, f"loss {1 / step:.3f}", tty)
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines()[0] == "  step 2/20 loss 0.500"
    assert len(log.getvalue().splitlines()) == 10
    assert tty.getvalue().count("\r") == 20 and tty.getvalue().endswith("\n")


def test_the_demo_runs_end_to_end(tmp_path):
    """``make demo`` is the README's first command: the schedule comparison
    (the shell's ``simulate --compare``), then 25 steps on two gloo ranks,
    then the recorded step's trace."""
    done = subprocess.run([sys.executable, "-m", "fastpipe", "demo"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "zbv" in done.stdout and "makespan" in done.stdout
    assert "over 25 steps" in done.stdout
    assert (tmp_path / "out" / "demo_trace.json").stat().st_size > 0
