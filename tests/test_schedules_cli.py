"""``python -m fastpipe simulate``: the grid, the figures, ``--compare`` and its errors."""

from __future__ import annotations

import json

import pytest

from fastpipe._cli import main
from fastpipe.schedules import build, names


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
