"""Pictures: the text grid, the Chrome trace and the PNG timeline."""

from __future__ import annotations

import json
import sys

import pytest

from fastpipe.schedules import build, lower

GPIPE_2x2 = """\
gpipe: 2 ranks, 2 stages, 2 microbatches (one column per unit-time step)
step     0   1   2   3   4   5
rank 0 0F0 0F1   .   . 0B0 0B1
rank 1   . 1F0 1F1 1B0 1B1   ."""


def test_time_grid_exact() -> None:
    assert build("gpipe", 2, 2).render_text() == GPIPE_2x2


def test_time_grid_has_one_column_per_unit_step() -> None:
    schedule = build("zbv", 3, 4)
    lines = schedule.render_text().splitlines()
    steps = len(lines[1].split()) - 1
    # every compute action takes one step: 6 m per rank plus the fill of p - 1
    assert steps == 6 * 4 + 3 - 1
    for rank, line in enumerate(lines[2:]):
        cells = line.split()[2:]
        assert [c for c in cells if c != "."] == [str(a) for a in schedule.actions[rank]]


def test_list_grid_shows_comm_and_marks() -> None:
    from fastpipe.schedules._render import render_text

    lowered = lower(build("1f1b", 2, 1))
    text = render_text(lowered, by="list", marks=[(1, 1)])
    assert "one column per list position" in text
    assert text.splitlines()[3].split()[2:] == ["1RECV_F0", ">1F0<", "1B0", "1SEND_B0"]
    with pytest.raises(ValueError, match="by must be 'time' or 'list'"):
        render_text(lowered, by="grid")  # type: ignore[arg-type]


def test_chrome_trace(tmp_path) -> None:
    sim = build("1f1b", 2, 2).simulate({"F": 1, "B": 2}, latency=0.5)
    path = sim.to_chrome_trace(tmp_path / "t.json", us_per_unit=1000.0)
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["tid"] for e in spans if e["cat"] in "FB"} == {0}
    assert {e["tid"] for e in spans if e["cat"].startswith("SEND")} == {1}
    first_b = next(e for e in spans if e["name"] == "1B0")
    assert first_b["dur"] == 2000.0 and first_b["args"] == {"stage": 1, "microbatch": 0}
    names = {(e["pid"], e.get("tid"), e["args"].get("name")) for e in events if e["ph"] == "M"}
    assert (0, None, "rank 0") in names and (1, 1, "comm") in names
    with pytest.raises(ValueError, match="us_per_unit must be > 0"):
        sim.to_chrome_trace(tmp_path / "u.json", us_per_unit=0)


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    sim = build("zbv", 2, 3).simulate(latency=0.1)
    figure = sim.plot(tmp_path / "zbv.png")
    assert (tmp_path / "zbv.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.axes and figure.axes[0].get_xlabel() == "time (cost units)"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    sim = build("gpipe", 2, 2).simulate()
    with pytest.raises(ImportError, match=r"pip install fastpipe\[plot\]"):
        sim.plot(tmp_path / "x.png")
