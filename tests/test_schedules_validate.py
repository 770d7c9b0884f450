"""The validator catches real mistakes and shows where they are."""

from __future__ import annotations

import dataclasses

import pytest

from fastpipe.schedules import Action, Schedule, ScheduleError, build, lower


def _schedule(
    rows: list[str], stages: int, microbatches: int, place: tuple[int, ...], name: str = "hand"
) -> Schedule:
    actions = [[Action.parse(t) for t in row.split()] for row in rows]
    return Schedule(name, len(rows), stages, microbatches, place, actions)


def _edited(schedule: Schedule, rank: int, row: list[str]) -> Schedule:
    actions = [list(r) for r in schedule.actions]
    actions[rank] = [Action.parse(t) for t in row]
    return dataclasses.replace(schedule, actions=actions)


def _fails(schedule: Schedule, problem: str, marked: list[str]) -> ScheduleError:
    with pytest.raises(ScheduleError, match=problem) as info:
        schedule.validate()
    err = info.value
    assert isinstance(err, ValueError)
    assert err.grid in str(err) and "rank 0" in err.grid and "rank 1" in err.grid
    for text in marked:
        assert f">{text}<" in err.grid
    return err


TWO_RANK_1F1B = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


def test_a_correct_hand_written_schedule_passes() -> None:
    _schedule(TWO_RANK_1F1B, 2, 2, (0, 1)).validate()
    _schedule(["0F0 0I0 0W0", "1F0 1I0 1W0"], 2, 1, (0, 1)).validate()


def test_missing_w() -> None:
    s = _schedule(["0F0 0I0 0W0", "1F0 1I0"], 2, 1, (0, 1))
    _fails(s, r"stage 1 microbatch 0 \(rank 1\) has 1I0 but no 1W0 \(missing W\)", ["1I0"])


def test_b_before_f() -> None:
    s = _schedule(["0F0 0F1 0B0 0B1", "1F0 1B0 1B1 1F1"], 2, 2, (0, 1))
    _fails(s, r"1B1 on rank 1 runs before 1F1", ["1B1", "1F1"])


def test_w_before_i() -> None:
    s = _schedule(["0F0 0W0 0I0", "1F0 1I0 1W0"], 2, 1, (0, 1))
    _fails(s, r"0W0 on rank 0 runs before 0I0", ["0W0"])


def test_backward_on_the_wrong_rank() -> None:
    s = _schedule(["0F0 0B0 1B0", "1F0"], 2, 1, (0, 1))
    _fails(s, r"1B0 is on rank 0 but stage 1 lives on rank 1", ["1B0"])


def test_deadlock_between_two_ranks() -> None:
    # Rank 0 waits for microbatch 0's gradient before sending microbatch 1's
    # activations; rank 1 wants microbatch 1's activations before it sends it.
    s = _schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], 2, 2, (0, 1))
    err = _fails(s, r"deadlock: no rank can progress", ["0B0", "1F1"])
    assert "rank 0 waits at 0B0 for 1SEND_B0 from rank 1" in err.problem
    assert "rank 1 waits at 1F1 for 0SEND_F1 from rank 0" in err.problem


def test_deadlock_in_a_lowered_schedule_marks_the_receives() -> None:
    good = lower(_schedule(TWO_RANK_1F1B, 2, 2, (0, 1)))
    good.validate()
    bad = lower(_schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], 2, 2, (0, 1)))
    _fails(bad, "deadlock", ["0RECV_B0", "1RECV_F1"])


def test_duplicate_action() -> None:
    s = _schedule(["0F0 0F0 0B0", "1F0 1B0"], 2, 1, (0, 1))
    _fails(s, r"0F0 appears twice on rank 0", ["0F0"])


def test_missing_forward_and_missing_backward() -> None:
    _fails(
        _schedule(["0F0 0B0", "1B0"], 2, 1, (0, 1)), r"stage 1 microbatch 0 .* has no F", ["1B0"]
    )
    _fails(_schedule(["0F0 0B0", "1F0"], 2, 1, (0, 1)), r"has no backward", ["1F0"])


def test_b_and_i_together() -> None:
    s = _schedule(["0F0 0B0 0I0 0W0"], 1, 1, (0,))
    _fails_one_rank(s, r"has both B and I/W", ["0B0", "0I0", "0W0"])


def _fails_one_rank(schedule: Schedule, problem: str, marked: list[str]) -> None:
    with pytest.raises(ScheduleError, match=problem) as info:
        schedule.validate()
    for text in marked:
        assert f">{text}<" in info.value.grid


def test_out_of_range_indices() -> None:
    _fails(
        _schedule(["0F0 0B0 0F1 0B1", "1F0 1B0"], 2, 1, (0, 1)),
        r"0F1 on rank 0: microbatch outside range\(1\)",
        ["0F1"],
    )
    _fails(
        _schedule(["0F0 0B0 2F0", "1F0 1B0"], 2, 1, (0, 1)),
        r"2F0 on rank 0: stage outside range\(2\)",
        ["2F0"],
    )


def test_same_rank_stage_order_in_a_v() -> None:
    # ZB-V with p = 2: stages 1 and 2 share rank 1; 2F0 needs 1F0 first.
    schedule = build("zbv", 2, 1)
    row = [str(a) for a in schedule.actions[1]]
    i, j = row.index("1F0"), row.index("2F0")
    row[i], row[j] = row[j], row[i]
    _fails(_edited(schedule, 1, row), r"2F0 on rank 1 runs before 1F0", ["2F0", "1F0"])


def test_lowered_schedule_missing_a_receive() -> None:
    lowered = lower(build("1f1b", 2, 2))
    row = [str(a) for a in lowered.actions[1] if str(a) != "1RECV_F1"]
    _fails(_edited(lowered, 1, row), r"rank 1 lacks 1RECV_F1, which 1F1 needs", ["1F1"])


def test_lowered_schedule_with_a_send_before_its_compute() -> None:
    lowered = lower(build("1f1b", 2, 2))
    row = [str(a) for a in lowered.actions[0]]
    i = row.index("0SEND_F0")
    row.insert(0, row.pop(i))
    _fails(_edited(lowered, 0, row), r"0SEND_F0 on rank 0 must come after 0F0", ["0SEND_F0", "0F0"])


def test_lowered_schedule_with_an_extra_send() -> None:
    lowered = lower(build("1f1b", 2, 1))
    row = [str(a) for a in lowered.actions[1]] + ["1SEND_F0"]
    _fails(
        _edited(lowered, 1, row), r"1SEND_F0 on rank 1 matches no cross-rank transfer", ["1SEND_F0"]
    )


def test_every_lowered_generator_output_validates() -> None:
    for name in ("interleaved-1f1b", "zbv", "dualpipev", "zb-h2"):
        lower(build(name, 3, 5)).validate()


def test_simulating_a_deadlock_raises_the_validator_error() -> None:
    s = _schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], 2, 2, (0, 1))
    with pytest.raises(ScheduleError, match="deadlock"):
        s.simulate()
    with pytest.raises(ScheduleError, match="deadlock"):
        s.render_text()  # time mode needs a simulation
    assert ">" not in s.render_text(by="list")


def test_error_message_is_problem_then_grid() -> None:
    err = ScheduleError("bad", "grid")
    assert isinstance(err, ValueError)
    assert (str(err), err.problem, err.grid) == ("bad\ngrid", "bad", "grid")
