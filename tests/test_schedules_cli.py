"""``python -m fastpipe``: ``simulate`` (grid, figures, ``--compare``, errors), ``info``, help."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fastpipe import __version__
from fastpipe._cli import _extension_status, main
from fastpipe.schedules import build, names


def _makespan(out: str) -> float:
    return float(next(line for line in out.splitlines() if line.startswith("makespan:")).split()[1])


def test_simulate_prints_grid_bubble_and_inflight(capsys) -> None:
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "zbv",
                "--ranks",
                "4",
                "--microbatches",
                "8",
                "--costs",
                "F=1,I=1,W=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert build("zbv", 4, 8).render_text() in out
    assert "bubble ratio: 0.0588" in out  # (p - 1) / (6 m + p - 1) = 3 / 51
    assert "peak in-flight per rank: [8, 8, 8, 8]" in out


def test_simulate_lean_holds_nothing_for_w_beyond_the_in_flight_count(capsys) -> None:
    args = ["simulate", "--schedule", "zbv", "--ranks", "4", "--microbatches", "8"]
    assert main(args) == 0
    held = build("zbv", 4, 8).simulate().peak_held
    assert f"peak held until W per rank: {held}" in capsys.readouterr().out
    assert max(held) > 8
    assert main([*args, "--lean"]) == 0
    out = capsys.readouterr().out
    assert build("zbv", 4, 8, lean=True).render_text() in out
    assert "peak in-flight per rank: [8, 8, 8, 8]" in out and "held until W" not in out
    assert main(["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                 "--lean"]) == 0  # a fixed order has nothing to hold for W: lean changes nothing
    assert build("1f1b", 2, 4).render_text() in capsys.readouterr().out


def test_simulate_writes_png_and_trace(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "1f1b",
                "--ranks",
                "2",
                "--microbatches",
                "2",
                "--png",
                str(png),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "traceEvents" in json.loads(trace.read_text())
    out = capsys.readouterr().out
    assert f"wrote {png}\n" in out and f"wrote {trace}\n" in out


def test_by_cost_orders_zero_bubble_schedules_for_the_costs(capsys) -> None:
    """A cheap W: ZB-H1 in the order for the costs beats its built-in order;
    --by-cost leaves schedules of a fixed order as they are."""
    argv = ["simulate", "--schedule", "zb-h1", "--ranks", "2", "--costs", "F=1,I=1,W=0.25"]
    assert main(argv) == 0
    built = _makespan(capsys.readouterr().out)
    assert main([*argv, "--by-cost"]) == 0
    out = capsys.readouterr().out
    assert _makespan(out) < built
    assert build("zb-h1", 2, 8, costs={"F": 1, "I": 1, "W": 0.25}).render_text() in out
    argv[2] = "1f1b"
    assert main(argv) == 0
    fixed = capsys.readouterr().out
    assert main([*argv, "--by-cost"]) == 0
    assert capsys.readouterr().out == fixed


def test_compare_sorts_by_makespan(capsys) -> None:
    assert main(["simulate", "--compare", "--ranks", "4", "--microbatches", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert sorted(line.split()[0] for line in lines) == sorted(names())
    spans = [float(line.split()[2]) for line in lines]
    assert spans == sorted(spans)
    assert lines[0].split()[0] == "zbv" and lines[-1].split()[0] in ("1f1b", "gpipe")


def test_compare_skips_schedules_that_cannot_take_the_parameters(capsys) -> None:
    assert main(["simulate", "--compare", "--stages-per-rank", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert sorted(line.split()[0] for line in lines) == ["interleaved-1f1b", "looped-bfs"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "zbv", "--costs", "F=x"], "invalid costs 'F=x'"),
        (["--schedule", "zbv", "--costs", "Q=1"], "invalid costs 'Q=1'"),
        (["--schedule", "zbv", "--costs", "F=-1"], "invalid costs 'F=-1'"),
        (["--schedule", "zb-h4"], "invalid choice: 'zb-h4'"),
        (["--schedule", "gpipe", "--stages-per-rank", "2"], "has exactly 1 stage"),
        (["--schedule", "gpipe", "--ranks", "0"], "expected an integer >= 1, got '0'"),
        ([], "--schedule is required unless --compare is given"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["simulate", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_kinds_left_out_cost_their_defaults_split_over_the_stages(capsys) -> None:
    spans = {}
    for costs in ("F=1,B=2", "F=1,B=2,I=1,W=1"):
        assert main(["simulate", "--schedule", "zbv", "--costs", costs]) == 0
        spans[costs] = _makespan(capsys.readouterr().out)
    assert spans["F=1,B=2"] == spans["F=1,B=2,I=1,W=1"] == 25.5
    assert main(["simulate", "--compare", "--costs", "F=1,B=2"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["zbv", "2", "25.5"]


def test_grid_says_it_shows_unit_steps_while_the_makespan_uses_the_costs(capsys) -> None:
    assert main(["simulate", "--schedule", "gpipe", "--ranks", "2", "--microbatches", "2",
                 "--costs", "F=3,B=5"]) == 0
    out = capsys.readouterr().out
    assert build("gpipe", 2, 2).render_text() in out  # unit steps: 6 columns
    assert "the grid gives every action one step; makespan and bubble ratio use the costs" in out
    assert _makespan(out) == 3 + 3 + 3 + 5 + 5 + 5


@pytest.mark.parametrize("flag", ["--png", "--trace"])
def test_compare_refuses_pictures(flag: str, tmp_path, capsys) -> None:
    path = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--compare", flag, str(path)])
    assert info.value.code == 2
    assert "--png and --trace draw one schedule" in capsys.readouterr().err
    assert not path.exists()


def test_unwritable_picture_is_a_one_line_error(tmp_path, capsys) -> None:
    path = tmp_path / "missing" / "t.json"
    assert main(["simulate", "--schedule", "1f1b", "--trace", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"fastpipe: error: cannot write {path}: No such file or directory\n"


def test_closed_stdout_exits_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before fastpipe writes a line
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fastpipe", "simulate", "--compare"],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"fastpipe {__version__}\n"


def test_info_lists_versions_and_extensions(capsys) -> None:
    import torch

    assert main(["info"]) == 0
    rows = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    rows = {label: value.strip() for label, value in rows.items()}
    assert list(rows) == [
        "fastpipe", "python", "torch", "CUDA runtime", "fastpipe._C", "fastpipe._chain",
        "fastpipe._chain built against torch", "triton", "transformers",
    ]
    assert rows["fastpipe"] == __version__ and rows["torch"] == torch.__version__
    assert rows["python"].startswith(".".join(map(str, sys.version_info[:3])))
    chain_loaded = rows["fastpipe._chain"] == "loaded"
    assert rows["fastpipe._chain built against torch"] == (torch.__version__ if chain_loaded else "-")
    for name in ("fastpipe._C", "fastpipe._chain"):
        assert rows[name].startswith(("loaded", "not built", "failed ("))


def test_extension_status_names_the_reason(tmp_path, monkeypatch) -> None:
    def wrapped():  # how native() fails: its ImportError wraps the import's own
        raise ImportError("build it with pip install -e .") from ImportError("undefined symbol")

    (tmp_path / "fp_stale_ext.py").write_text("raise ImportError('built against torch 2.4')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _extension_status("fastpipe._no_such_extension", wrapped) == "not built"
    assert _extension_status("fastpipe._version", wrapped) == "failed (undefined symbol)"
    # how native_chain() fails: None, without the reason
    assert _extension_status("fp_stale_ext", lambda: None) == "failed (built against torch 2.4)"
    loaded = sys.modules["fastpipe._version"]
    assert _extension_status("fastpipe._version", lambda: loaded) == "loaded"


def test_help_says_what_each_command_does_for_a_user(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help to the terminal's width
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "the library logs" not in top  # no internals
    assert "simulate show a schedule's timeline and bubble for given per-action costs" in top
    for command in ("demo", "simulate", "plan", "info"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: fastpipe {command}")
