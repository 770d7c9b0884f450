"""The schedule IR: action strings, the Schedule container, placement and the registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.schedules import Action, Kind, Schedule, build, names
from fastpipe.schedules._placement import loop_placement, v_placement

KINDS = list(Kind)


@pytest.mark.parametrize(
    ("action", "text"),
    [
        (Action(1, Kind.F, 0), "1F0"),
        (Action(0, Kind.I, 3), "0I3"),
        (Action(2, Kind.W, 1), "2W1"),
        (Action(3, Kind.B, 12), "3B12"),
        (Action(0, Kind.SEND_F, 1), "0SEND_F1"),
        (Action(1, Kind.RECV_B, 2), "1RECV_B2"),
        (Action(10, Kind.RECV_F, 0), "10RECV_F0"),
        (Action(4, Kind.SEND_B, 7), "4SEND_B7"),
    ],
)
def test_action_string_matches_torch_format(action: Action, text: str) -> None:
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(f"  {text} ") == action


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 999), st.sampled_from(KINDS), st.integers(0, 999))
def test_parse_inverts_str(stage: int, kind: Kind, microbatch: int) -> None:
    action = Action(stage, kind, microbatch)
    assert Action.parse(str(action)) == action


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 99), st.sampled_from(KINDS), st.integers(0, 99))
def test_strings_agree_with_torch(stage: int, kind: Kind, microbatch: int) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    ours = Action(stage, kind, microbatch)
    theirs = schedules._Action.from_str(str(ours))
    assert (theirs.stage_index, theirs.computation_type.value, theirs.microbatch_index) == (
        stage,
        kind.value,
        microbatch,
    )
    assert Action.parse(str(theirs)) == ours


@pytest.mark.parametrize(
    "text", ["", "F0", "1X0", "1F", "a1F0", "1F0 2", "1UNSHARD", "-1F0", "1f0", "1F0;2B0"]
)
def test_parse_rejects_bad_strings_naming_them(text: str) -> None:
    with pytest.raises(ValueError, match="invalid action string") as info:
        Action.parse(text)
    assert repr(text) in str(info.value)


def test_kind_is_a_string_enum() -> None:
    assert Kind("F") is Kind.F and Kind.F == "F" and str(Kind.SEND_B) == "SEND_B"
    assert [k.is_compute for k in KINDS] == [True] * 4 + [False] * 4
    assert {k for k in KINDS if k.is_backward} == {Kind.B, Kind.I}


def test_action_is_frozen_and_hashable() -> None:
    a = Action(0, Kind.F, 0)
    with pytest.raises(AttributeError):
        a.stage = 1  # type: ignore[misc]
    assert len({a, Action(0, Kind.F, 0), Action(0, Kind.F, 1)}) == 2


def test_schedule_checks_sizes() -> None:
    acts = [[Action(0, Kind.F, 0), Action(0, Kind.B, 0)]]
    with pytest.raises(ValueError, match=r"len\(stage_to_rank\): 2, stages: 1"):
        Schedule("x", 1, 1, 1, (0, 0), acts)
    with pytest.raises(ValueError, match=r"len\(actions\): 1, ranks: 2"):
        Schedule("x", 2, 1, 1, (0,), acts)
    with pytest.raises(ValueError, match=r"outside range\(1\): \[3\]"):
        Schedule("x", 1, 1, 1, (3,), acts)


def test_stages_of_and_placements() -> None:
    assert loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)
    assert build("interleaved-1f1b", 3, 3, 2).stages_of(1) == [1, 4]
    assert build("zbv", 3, 3).stages_of(0) == [0, 5]
    assert build("dualpipev", 4, 8).stages_of(3) == [3, 4]


def test_registry_names() -> None:
    assert names() == [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "zbv",
        "dualpipev",
    ]


@pytest.mark.parametrize(
    ("name", "v"),
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("zb-h1", 1),
        ("zb-h2", 1),
        ("interleaved-1f1b", 2),
        ("looped-bfs", 2),
        ("zbv", 2),
        ("dualpipev", 2),
    ],
)
def test_default_stages_per_rank(name: str, v: int) -> None:
    schedule = build(name, 3, 4)
    assert (schedule.name, schedule.ranks, schedule.stages, schedule.microbatches) == (
        name,
        3,
        3 * v,
        4,
    )
    assert build(name, 3, 4, stages_per_rank=v) == schedule


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zb-h3'") as info:
        build("zb-h3", 2, 2)
    for name in names():
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gpipe", 0, 4), r"ranks must be an int >= 1, got 0"),
        (("1f1b", 2, 0), r"microbatches must be an int >= 1, got 0"),
        (("1f1b", 2, 2.0), r"microbatches must be an int >= 1, got 2.0"),
        (("1f1b", True, 2), r"ranks must be an int >= 1, got True"),
        (("gpipe", 2, 4, 2), r"'gpipe' has exactly 1 stage\(s\) per rank, got stages_per_rank=2"),
        (("zb-h2", 2, 4, 3), r"'zb-h2' has exactly 1 stage\(s\) per rank, got stages_per_rank=3"),
        (("zbv", 2, 4, 1), r"'zbv' has exactly 2 stage\(s\) per rank, got stages_per_rank=1"),
        (("dualpipev", 2, 4, 4), r"'dualpipev' has exactly 2 stage\(s\)"),
        (("interleaved-1f1b", 2, 4, 0), r"stages_per_rank must be an int >= 1, got 0"),
    ],
)
def test_impossible_parameters_name_value_and_rule(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build(*args)
