"""The simulator: closed forms for every generator, cost models and the timeline."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.schedules import Action, Kind, build, lower, names

SPLIT_UNIT = {"F": 1, "I": 1, "W": 1}  # B = I + W = 2
FULL_UNIT = {"F": 1, "B": 2}
SIZES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 9, 16, 17, 32)]


def _loop_bubble(p: int, m: int, v: int) -> float:
    """The exact bubble of GPipe, 1F1B, interleaved 1F1B and looped BFS at F=1, B=2."""
    return 1 - v * m / (v * max(m, p) + min(m, p) - 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str) -> None:
    # F = 1, B = 2: a microbatch takes 3 units per rank; fill and drain take
    # 3 (p - 1), so makespan = 3 (m + p - 1) and bubble = (p - 1) / (m + p - 1).
    for p, m in SIZES:
        sim = build(name, p, m).simulate(FULL_UNIT)
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert sim.idle == [3 * (p - 1)] * p


@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs"])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble(name: str, v: int) -> None:
    for p, m in SIZES:
        sim = build(name, p, m, v).simulate()
        assert sim.makespan == 3 * (v * max(m, p) + min(m, p) - 1)
        assert sim.bubble_ratio == pytest.approx(_loop_bubble(p, m, v), abs=1e-12)
        if m >= p:  # Megatron's (p - 1) / (v m + p - 1), for any m >= p
            assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


def test_interleaved_divides_1f1bs_bubble_time_by_v() -> None:
    one = build("1f1b", 4, 8).simulate()
    two = build("interleaved-1f1b", 4, 8, 2).simulate({"F": 0.5, "B": 1.0})  # half stages
    assert one.busy == two.busy == [24.0] * 4
    assert one.idle == [9.0] * 4 and two.idle == [4.5] * 4


def test_zb_h1_has_a_third_of_1f1bs_bubble() -> None:
    for p, m in SIZES:
        if m < p:
            continue
        h1 = build("zb-h1", p, m).simulate(SPLIT_UNIT)
        base = build("1f1b", p, m).simulate(FULL_UNIT)
        assert sum(h1.idle) * 3 == sum(base.idle) == 3 * p * (p - 1)
        assert h1.makespan == 3 * m + p - 1  # the least possible: rank p-1 starts at p-1
        assert h1.peak_inflight == [p - r for r in range(p)]  # 1F1B's memory


def test_zb_h2_has_zero_bubble_once_m_is_2p_minus_1() -> None:
    for p, m in SIZES:
        if m < p:
            continue
        sim = build("zb-h2", p, m).simulate(SPLIT_UNIT)
        assert sim.makespan == 3 * m + p - 1
        if m >= 2 * p - 1:
            # No rank waits between its first and its last action; what
            # bubble_ratio still counts is the staggered start and end.
            assert max(sim.interior_idle) < 1e-9
            assert sim.bubble_ratio == pytest.approx((p - 1) / (3 * m + p - 1))
            assert sim.peak_inflight[0] == 2 * p - 1
    with_gap = build("zb-h2", 4, 6).simulate(SPLIT_UNIT)  # m < 2p - 1: not yet
    assert sum(with_gap.interior_idle) > 0


def test_zbv_has_zero_bubble_once_m_is_2p_minus_1() -> None:
    for p, m in SIZES:
        sim = build("zbv", p, m).simulate(SPLIT_UNIT)
        if m >= 2 * p - 1:
            assert max(sim.interior_idle) < 1e-9
            assert sim.peak_inflight == [2 * p] * p  # p full microbatches: 1F1B's
        if m >= p + 2 or (m >= p and p <= 4):
            assert sim.makespan == 6 * m + p - 1
            assert sim.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1))


def test_dualpipev_is_one_step_behind_zbv() -> None:
    for p, m in SIZES:
        if p >= 2 and m >= 2 * p:
            dual = build("dualpipev", p, m).simulate()
            assert dual.makespan == 6 * m + p
            assert dual.peak_inflight == [2 * p + 1] * p


def test_1f1b_peak_inflight_is_p_on_rank_0() -> None:
    for p, m in SIZES:
        assert build("1f1b", p, m).simulate().peak_inflight == [min(p - r, m) for r in range(p)]
    assert build("gpipe", 4, 8).simulate().peak_inflight == [8] * 4


def test_costs_defaults_and_b_from_i_plus_w() -> None:
    schedule = build("1f1b", 2, 2)
    assert schedule.simulate().makespan == schedule.simulate({"F": 1, "B": 2}).makespan == 9
    assert schedule.simulate({"I": 2, "W": 2}).makespan == 15  # B = 4
    assert schedule.simulate({Kind.F: 2, "B": 2}).makespan == 12


def test_per_stage_costs_and_callables() -> None:
    schedule = build("gpipe", 2, 1)
    assert schedule.simulate({"F": [1, 3], "B": [2, 6]}).makespan == 12
    assert schedule.simulate(lambda a: 10.0 if a.stage == 0 else 1.0).makespan == 22
    with pytest.raises(ValueError, match=r"per-stage cost for F has the wrong length"):
        schedule.simulate({"F": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"unknown cost kinds \['X'\]"):
        schedule.simulate({"X": 1})
    with pytest.raises(ValueError, match="cost for B must be a finite number >= 0, got -1"):
        schedule.simulate({"B": -1})


def test_rank_speed() -> None:
    schedule = build("gpipe", 2, 1)
    assert schedule.simulate(rank_speed=[1, 2]).makespan == pytest.approx(1 + 0.5 + 1 + 2)
    with pytest.raises(ValueError, match="rank_speed must hold 2 positive numbers"):
        schedule.simulate(rank_speed=[1, 0])


def test_p2p_latency_and_bandwidth() -> None:
    schedule = build("gpipe", 2, 1)
    plain = schedule.simulate()
    assert plain.makespan == 6 and all(r.track == "compute" for r in plain.timeline)
    slow = schedule.simulate(latency=0.5, bandwidth=100.0, message_bytes=50.0)
    assert slow.makespan == pytest.approx(6 + 2 * (0.5 + 0.5))  # one hop each way
    comm = [r for r in slow.timeline if r.track == "comm"]
    assert [str(r.action) for r in comm] == ["0SEND_F0", "1SEND_B0"]
    assert [r.end - r.start for r in comm] == [pytest.approx(1.0)] * 2
    sized = schedule.simulate(bandwidth=1.0, message_bytes=lambda a: 2.0 if a.stage == 0 else 0)
    assert sized.makespan == pytest.approx(8)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        schedule.simulate(latency=-1)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        schedule.simulate(bandwidth=0)


def test_lowered_and_compute_only_simulate_alike() -> None:
    for name in names():
        schedule = build(name, 3, 5)
        a, b = schedule.simulate(latency=0.25), lower(schedule).simulate(latency=0.25)
        assert (a.makespan, a.busy, a.peak_inflight) == (b.makespan, b.busy, b.peak_inflight)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(names()),
    st.integers(1, 6),
    st.integers(1, 12),
    st.floats(0, 0.5),
    st.lists(st.floats(0.5, 2.0), min_size=6, max_size=6),
)
def test_timeline_respects_every_dependency(
    name: str, p: int, m: int, latency: float, speed: list[float]
) -> None:
    schedule = build(name, p, m)
    sim = schedule.simulate(
        {"F": 1.0, "B": 2.5, "I": 1.5, "W": 1.0}, latency=latency, rank_speed=speed[:p]
    )
    end = {r.action: r.end for r in sim.timeline if r.track == "compute"}
    start = {r.action: r.start for r in sim.timeline if r.track == "compute"}
    assert len(end) == sum(len(row) for row in schedule.actions)
    place, eps = schedule.stage_to_rank, 1e-9

    def hop(a: Action, other: int) -> float:
        return latency if place[other] != place[a.stage] else 0.0

    for a in start:
        s, j = a.stage, a.microbatch
        if a.kind is Kind.F and s > 0:
            assert start[a] >= end[Action(s - 1, Kind.F, j)] + hop(a, s - 1) - eps
        if a.kind.is_backward:
            assert start[a] >= end[Action(s, Kind.F, j)] - eps
            if s < schedule.stages - 1:
                nxt = Action(s + 1, Kind.B, j)
                nxt = nxt if nxt in end else Action(s + 1, Kind.I, j)
                assert start[a] >= end[nxt] + hop(a, s + 1) - eps
        if a.kind is Kind.W:
            assert start[a] >= end[Action(s, Kind.I, j)] - eps
    for rank in range(p):  # one action at a time per rank, in list order
        recs = [r for r in sim.timeline if r.track == "compute" and r.rank == rank]
        assert [r.action for r in recs] == schedule.actions[rank]
        assert all(x.end <= y.start + eps for x, y in itertools.pairwise(recs))
    assert 0 <= sim.bubble_ratio < 1
    assert sum(sim.busy) + sum(sim.idle) == pytest.approx(p * sim.makespan)
    assert all(0 <= i <= d + eps for i, d in zip(sim.interior_idle, sim.idle))
    assert math.isclose(sim.bubble_ratio, sum(sim.idle) / (p * sim.makespan))


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zbv"])
def test_lean_orders_hold_no_more_for_w_than_their_f_to_i_cap(name: str) -> None:
    caps = {"zb-h1": lambda p, r: p - r, "zb-h2": lambda p, r: 2 * (p - r) - 1,
            "zbv": lambda p, r: 2 * p}[name]
    for p, m in SIZES:
        for costs in (None, {"F": 1.0, "I": 1.0, "W": 0.25}):
            lean = build(name, p, m, costs=costs, lean=True)
            lean.validate()
            held = lean.simulate(SPLIT_UNIT).peak_held
            for rank in range(p):
                assert held[rank] <= min(caps(p, rank), m * len(lean.stages_of(rank))), (p, m, rank)
            # What the default's extra W slots buy: never a slower unit-cost step
            assert build(name, p, m).simulate(SPLIT_UNIT).makespan <= lean.simulate(SPLIT_UNIT).makespan


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zbv"])
def test_lean_orders_by_bytes_are_the_count_orders_when_every_stage_weighs_alike(name: str) -> None:
    for p, m in SIZES:
        stages = p * (2 if name == "zbv" else 1)
        for costs in (None, CHEAP_W):
            counted = build(name, p, m, costs=costs, lean=True)
            for size in ((1, 1), (3e6, 3e6)):
                assert build(name, p, m, costs=costs, lean=True, sizes=[size] * stages).actions \
                    == counted.actions, (p, m, costs, size)


def _lean_budget(schedule, sizes) -> list[float]:
    """Per rank, its F-to-I cap's activations: the cap times its stages' mean F-to-I bytes."""
    caps = {"zb-h1": lambda p, r: p - r, "zb-h2": lambda p, r: 2 * (p - r) - 1,
            "zbv": lambda p, r: 2 * p}[schedule.name]
    return [caps(schedule.ranks, r) * sum(sizes[s][0] for s in schedule.stages_of(r))
            / len(schedule.stages_of(r)) for r in range(schedule.ranks)]


def test_a_lean_zbv_by_bytes_runs_a_heavy_w_sooner_and_a_light_one_later() -> None:
    """A V whose last stage's W reads three times its activations (a
    vocabulary head's logits gradient) and whose other stages' W reads a
    third: counted in bytes, no rank holds more than its cap's activations
    but what one I adds past them (its W then runs next), never more than
    the order counted in microbatches holds, less on the head's rank once
    the V is deep enough; and the light W waits longer than the count lets it."""
    from fastpipe.schedules._greedy import peak_bytes

    for p, m in ((2, 8), (3, 12), (4, 16)):
        sizes = [(1.0, 1 / 3)] * (2 * p - 1) + [(1.0, 3.0)]
        counted = build("zbv", p, m, lean=True)
        by_bytes = build("zbv", p, m, lean=True, sizes=sizes)
        by_bytes.validate()
        budget = _lean_budget(by_bytes, sizes)
        over = max(b - a for a, b in sizes)  # one I past the budget before its W
        peaks, counted_peaks = peak_bytes(by_bytes, sizes), peak_bytes(counted, sizes)
        for rank in range(p):
            assert peaks[rank] <= budget[rank] + over, (p, rank, peaks, budget)
            assert peaks[rank] <= counted_peaks[rank], (p, rank, peaks, counted_peaks)
        if p > 2:
            assert peaks[0] < counted_peaks[0], (p, peaks, counted_peaks)  # rank 0 holds the head
        held = by_bytes.simulate(SPLIT_UNIT).peak_held
        assert max(held) > max(counted.simulate(SPLIT_UNIT).peak_held), (p, held)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["zb-h1", "zb-h2", "zbv"]), st.integers(1, 5), st.integers(1, 12),
       st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=10, max_size=10),
       st.booleans())
def test_any_sizes_give_a_valid_lean_order(name, p, m, pairs, by_cost) -> None:
    """Whatever the bytes (zeros, a W far heavier or lighter than its
    forward), the byte-capped list is a valid schedule with every action:
    where the cap would stall every rank it gives way, as the count caps do."""
    stages = p * (2 if name == "zbv" else 1)
    sizes = pairs[:stages] + [(1, 1)] * (stages - len(pairs))
    sched = build(name, p, m, costs=CHEAP_W if by_cost else None, lean=True, sizes=sizes)
    sched.validate()
    assert sum(map(len, sched.actions)) == 3 * stages * m


def test_sizes_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="sizes apply to lean orders only: pass lean=True"):
        build("zbv", 2, 4, sizes=[(1, 1)] * 4)
    with pytest.raises(ValueError, match=r"one pair per stage \(4\), got 3"):
        build("zbv", 2, 4, lean=True, sizes=[(1, 1)] * 3)
    with pytest.raises(ValueError, match=r"finite byte counts >= 0, got \(1.0, -1.0\)"):
        build("zbv", 2, 4, lean=True, sizes=[(1, 1)] * 3 + [(1, -1)])
    with pytest.raises(ValueError, match="one \\(F-to-I bytes, I-to-W bytes\\) pair per stage"):
        build("zb-h1", 2, 4, lean=True, sizes=[1, 2])
    with pytest.raises(ValueError, match="'1f1b' has a fixed order"):
        build("1f1b", 2, 4, lean=True, sizes=[(1, 1)] * 2)


def test_lean_is_for_the_zero_bubble_schedules_and_a_bool() -> None:
    with pytest.raises(ValueError, match="'1f1b' has a fixed order; costs, latency and lean"):
        build("1f1b", 2, 4, lean=True)
    with pytest.raises(ValueError, match="lean must be a bool, got 1"):
        build("zbv", 2, 4, lean=1)


# --- zero-bubble schedules ordered by costs -------------------------------------

CHEAP_W = {"F": 1.0, "I": 1.0, "W": 0.25}  # a transformer layer's W is often a quarter of F


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zbv"])
def test_unit_costs_order_as_the_built_in_schedules(name: str) -> None:
    for p, m in SIZES:
        assert build(name, p, m, costs=SPLIT_UNIT).actions == build(name, p, m).actions


def test_zb_h1_ordered_by_a_cheap_w_is_faster_and_keeps_its_memory() -> None:
    for p in (2, 3, 4):
        fixed = build("zb-h1", p, 8)
        ordered = build("zb-h1", p, 8, costs=CHEAP_W)
        ordered.validate()
        assert ordered.actions != fixed.actions
        assert ordered.simulate(CHEAP_W).makespan < fixed.simulate(CHEAP_W).makespan
        assert ordered.simulate(CHEAP_W).peak_inflight == [p - r for r in range(p)]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["zb-h1", "zb-h2", "zbv"]),
    st.integers(1, 5),
    st.integers(1, 12),
    st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0]), min_size=30, max_size=30),
    st.sampled_from([0.0, 0.1, 0.5]),
)
def test_any_costs_give_a_valid_order(name: str, p: int, m: int, draws: list[float],
                                       latency: float) -> None:
    """Whatever the costs (zero included), the list scheduler finishes: a V
    rank whose cap its first stage's forwards filled lets one forward past
    it rather than stall."""
    stages = 2 * p if name == "zbv" else p
    costs = {"F": [max(0.1, c) for c in draws[:stages]], "I": [max(0.1, c) for c in draws[10:10 + stages]],
             "W": draws[20:20 + stages]}
    schedule = build(name, p, m, costs=costs, latency=latency)
    schedule.validate()
    assert sum(len(row) for row in schedule.actions) == 3 * stages * m
    assert schedule.simulate(costs, latency=latency).makespan > 0


def test_only_list_scheduled_schedules_take_costs() -> None:
    from fastpipe.schedules import orders_by_cost

    assert [n for n in names() if orders_by_cost(n)] == ["zb-h1", "zb-h2", "zbv"]
    with pytest.raises(ValueError, match="'1f1b' has a fixed order.*zb-h1, zb-h2, zbv"):
        build("1f1b", 2, 4, costs=CHEAP_W)
    with pytest.raises(ValueError, match="latency must be a number >= 0, got -1"):
        build("zb-h1", 2, 4, costs=CHEAP_W, latency=-1)
