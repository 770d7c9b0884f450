"""The timeline picture: a plain Figure, labelled in the timeline's unit, with a legend."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.timeline import MeasuredStep, measured
from fastpipe.schedules import Action, TimelineRecord, build, lower
from fastpipe.schedules._plot import plot
from tests.models import mlp

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _legend(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def _one_microbatch_step() -> MeasuredStep:
    """1F1B on 2 ranks, 1 microbatch, in seconds: a send, a wait, 12.345678901 ms in all."""
    a = Action.parse
    records = [
        TimelineRecord(0, a("0F0"), 0.0, 0.002),
        TimelineRecord(0, a("0SEND_F0"), 0.002, 0.0025, "comm"),
        TimelineRecord(1, a("1RECV_F0"), 0.0, 0.003, "comm"),
        TimelineRecord(1, a("1F0"), 0.003, 0.005),
        TimelineRecord(1, a("1B0"), 0.005, 0.009),
        TimelineRecord(0, a("0B0"), 0.0095, 0.012345678901),
    ]
    return measured(lower(build("1f1b", 2, 1)), records)


def test_plot_leaves_the_backend_and_pyplot_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(matplotlib.rcParams, "backend", "svg")  # not Agg, so a switch shows

    def no_switch(*args, **kwargs):
        raise AssertionError(f"matplotlib.use{args} switched the session's backend")

    monkeypatch.setattr(matplotlib, "use", no_switch)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing pyplot fails
    fig = build("zbv", 2, 3).simulate(latency=0.1).plot(tmp_path / "zbv.png")
    assert isinstance(fig, Figure)
    assert (tmp_path / "zbv.png").read_bytes()[:8] == PNG
    assert matplotlib.get_backend() == "svg"


def test_plot_draws_on_the_callers_axes_and_returns_their_figure(tmp_path) -> None:
    sim = build("1f1b", 2, 2).simulate()
    fig = Figure()
    ax = fig.add_subplot()
    assert plot(sim, ax=ax) is fig
    assert len(ax.patches) == len(sim.timeline)  # one bar per record, on the caller's axes
    assert list(tmp_path.iterdir()) == []
    step = _one_microbatch_step()
    fig2 = Figure()
    assert step.plot(tmp_path / "step.png", ax=fig2.add_subplot()) is fig2
    assert (tmp_path / "step.png").read_bytes()[:8] == PNG


def test_plot_without_a_path_writes_nothing_and_with_one_writes_it(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    sim = build("gpipe", 2, 2).simulate()
    assert isinstance(plot(sim), Figure)
    assert list(tmp_path.iterdir()) == []
    plot(sim, str(tmp_path / "g.svg"))  # the suffix picks the format
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")


def test_simulated_timeline_is_labelled_in_cost_units() -> None:
    fig = plot(build("1f1b", 2, 2).simulate({"F": 1, "B": 2}))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time (cost units)"
    assert ax.get_title() == "1f1b: 2 ranks, 2 microbatches\nbubble 33.3%, makespan 9 cost units"
    assert _legend(fig) == ["F forward", "B backward"]  # one stage a rank, no transfers


def test_legend_names_stage_shades_and_communication() -> None:
    fig = plot(build("zbv", 2, 3).simulate(latency=0.1))
    assert _legend(fig) == [
        "F forward", "I input grad", "W weight grad", "stages 0, 1", "stages 2, 3", "communication"
    ]  # fmt: skip
    alphas = [h.get_alpha() for h in fig.axes[0].get_legend().legend_handles[3:5]]
    assert alphas[0] == 1.0 and alphas[1] < 1.0  # each rank's later stage is drawn lighter


def test_measured_timeline_is_labelled_in_ms() -> None:
    step = _one_microbatch_step()
    assert step.makespan == pytest.approx(12.345678901)
    ax = step.plot().axes[0]
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_title().endswith("makespan 12.3 ms")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "F forward", "B backward", "communication"
    ]  # fmt: skip


def test_step_with_timeline_plots_in_ms() -> None:
    pipe = Pipe(mlp(), chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    _, step = pipe.step_with_timeline(
        torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
        nn.functional.mse_loss,
    )  # fmt: skip
    assert isinstance(step, MeasuredStep)
    ax = step.plot().axes[0]
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_title().endswith(" ms")


def test_plot_refuses_what_is_not_an_axes() -> None:
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes, got Figure"):
        plot(build("gpipe", 2, 2).simulate(), ax=Figure())
