"""The eight generators: every one validates over its whole parameter range."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.schedules import Kind, build, names
from fastpipe.schedules._placement import loop_placement, v_placement

VARIABLE_V = ("interleaved-1f1b", "looped-bfs")
V_SHAPED = ("zbv", "dualpipev")
SPLIT = ("zb-h1", "zb-h2", "zbv")


def _stages_per_rank(name: str, v: int) -> int:
    if name in VARIABLE_V:
        return v
    return 2 if name in V_SHAPED else 1


def _check(name: str, p: int, m: int, v: int) -> None:
    spr = _stages_per_rank(name, v)
    schedule = build(name, p, m, spr)
    schedule.validate()
    assert (schedule.ranks, schedule.stages, schedule.microbatches) == (p, p * spr, m)
    expected = v_placement(p) if name in V_SHAPED else loop_placement(p, spr)
    assert schedule.stage_to_rank == expected
    assert not schedule.is_lowered
    kinds = Counter(a.kind for row in schedule.actions for a in row)
    assert kinds[Kind.F] == p * spr * m
    assert kinds[Kind.B] + kinds[Kind.I] == p * spr * m
    assert kinds[Kind.I] == kinds[Kind.W]
    if name in SPLIT:
        assert kinds[Kind.B] == 0
    elif name != "dualpipev":
        assert kinds[Kind.I] == kinds[Kind.W] == 0


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(names()), st.integers(1, 8), st.integers(1, 32), st.integers(1, 4))
def test_every_generator_validates(name: str, p: int, m: int, v: int) -> None:
    _check(name, p, m, v)


# The edges, where warm-up counts run out or groups go short, for every
# generator: one rank, m < p, m around p and 2p, the largest sizes.
EDGES = [
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 3),
    (3, 2),
    (3, 4),
    (3, 7),
    (4, 3),
    (4, 5),
    (4, 9),
    (5, 4),
    (5, 9),
    (5, 11),
    (7, 13),
    (8, 1),
    (8, 7),
    (8, 9),
    (8, 15),
    (8, 17),
    (8, 32),
]


@pytest.mark.parametrize("name", names())
def test_every_generator_validates_at_the_edges(name: str) -> None:
    for p, m in EDGES:
        for v in (1, 2, 3, 4) if name in VARIABLE_V else (1,):
            _check(name, p, m, v)


def test_gpipe_runs_all_forwards_first() -> None:
    for row in build("gpipe", 3, 4).actions:
        assert [a.kind for a in row] == [Kind.F] * 4 + [Kind.B] * 4
        assert [a.microbatch for a in row] == [0, 1, 2, 3] * 2


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (1, 3)])
def test_1f1b_warmup_is_p_minus_1_minus_r(p: int, m: int) -> None:
    for r, row in enumerate(build("1f1b", p, m).actions):
        warmup = min(p - 1 - r, m)
        first_b = next(i for i, a in enumerate(row) if a.kind is Kind.B)
        assert first_b == warmup + (1 if m > warmup else 0)
        steady = row[warmup : warmup + 2 * (m - warmup)]
        assert [a.kind for a in steady] == [Kind.F, Kind.B] * (m - warmup)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for p, m in [(4, 8), (3, 2), (5, 7)]:
        assert build("interleaved-1f1b", p, m, 1).actions == build("1f1b", p, m).actions


def test_interleaved_order_is_megatrons() -> None:
    # p = 2, v = 2, m = 4: groups of two microbatches through chunk 0, then chunk 1.
    row = [str(a) for a in build("interleaved-1f1b", 2, 4, 2).actions[0]]
    assert row[:4] == ["0F0", "0F1", "2F0", "2F1"]  # warm-up 2 (p - 1) + (v - 1) p = 4
    assert row[4:8] == ["0F2", "2B0", "0F3", "2B1"]


def test_looped_bfs_runs_stage_by_stage() -> None:
    row = [str(a) for a in build("looped-bfs", 2, 2, 2).actions[1]]
    assert row == ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]


def test_dualpipev_mixes_full_and_split_backwards() -> None:
    kinds = Counter(a.kind for row in build("dualpipev", 4, 16).actions for a in row)
    assert kinds[Kind.B] > 0 and kinds[Kind.I] == kinds[Kind.W] > 0


def test_generators_are_deterministic() -> None:
    for name in names():
        assert build(name, 4, 6) == build(name, 4, 6)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(names()), st.integers(1, 8), st.integers(1, 16))
def test_each_stage_takes_microbatches_in_order(name: str, p: int, m: int) -> None:
    # What an executor may rely on for generated schedules: per stage, the
    # forwards, the backwards (B or I) and the W each run microbatches
    # 0, 1, 2, ... in that order.
    schedule = build(name, p, m)
    for row in schedule.actions:
        for kinds in ((Kind.F,), (Kind.B, Kind.I), (Kind.W,)):
            for stage in {a.stage for a in row}:
                seen = [a.microbatch for a in row if a.stage == stage and a.kind in kinds]
                assert seen == sorted(seen)
