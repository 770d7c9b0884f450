"""CSV interop with torch.distributed.pipelining's ``_dump_csv`` / ``_load_csv``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpipe.schedules import Action, build, load_csv, lower, names, save_csv


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.sampled_from(names()), st.integers(1, 6), st.integers(1, 12), st.booleans())
def test_round_trip_is_exact(tmp_path: Path, name: str, p: int, m: int, lowered: bool) -> None:
    schedule = build(name, p, m)
    schedule = lower(schedule) if lowered else schedule
    path = save_csv(schedule, tmp_path / "s.csv")
    again = load_csv(path, name=name)
    assert again == schedule
    assert save_csv(again, tmp_path / "t.csv").read_bytes() == path.read_bytes()


def test_format_is_torchs(tmp_path: Path) -> None:
    path = build("1f1b", 2, 2).save_csv(tmp_path / "one.csv")
    assert path.read_bytes() == b"0F0,0F1,0B0,0B1\r\n1F0,1B0,1F1,1B1\r\n"
    assert load_csv(path).name == "one"


def test_load_infers_sizes_and_placement(tmp_path: Path) -> None:
    path = tmp_path / "v.csv"
    path.write_text("0F0,,3F0,3B0,0B0\n,1F0,2F0,2B0,1B0\n")  # empty cells: torch's idle steps
    s = load_csv(path)
    assert (s.ranks, s.stages, s.microbatches, s.stage_to_rank) == (2, 4, 1, (0, 1, 1, 0))
    s.validate()


def test_load_then_save_keeps_idle_and_overlap_cells(tmp_path: Path) -> None:
    # Idle cells at a row's start, in its middle and at its end, and an overlapped pair.
    text = ",0F0,,3F0,3B0,,0B0,\r\n1F0,,2F0,(2B0;1F1)OVERLAP_F_B,1B0,1B1\r\n"
    path = tmp_path / "idle.csv"
    path.write_bytes(text.encode())
    loaded = load_csv(path)
    assert [str(a) for a in loaded.actions[1]] == ["1F0", "2F0", "2B0", "1F1", "1B0", "1B1"]
    assert save_csv(loaded, tmp_path / "again.csv").read_bytes() == text.encode()


def test_rows_without_their_layout_get_one_action_per_cell(tmp_path: Path) -> None:
    path = tmp_path / "idle.csv"
    path.write_text(",0F0,,0B0\n,1F0,1B0,\n")
    loaded = load_csv(path)
    loaded.actions[1].append(Action.parse("1F1"))  # resized: its cells no longer say where
    assert save_csv(loaded, tmp_path / "t.csv").read_bytes() == b",0F0,,0B0\r\n1F0,1B0,1F1\r\n"
    lowered = save_csv(lower(load_csv(path)), tmp_path / "l.csv").read_text()
    assert ",," not in lowered and not lowered.startswith(",")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0,0X0\n", r"row 0 \(rank 0\), column 1: invalid action string '0X0'"),
        ("0F0,0B0\n1F0,0B1\n", r"stage 0 has actions on ranks 0 and 1"),
        ("0F0,0B0\n2F0,2B0\n", r"stages \[1\] have no actions"),
        ("", r"no rows"),
        ("\n\n", r"no actions"),
        ("0F0,1UNSHARD\n", r"invalid action string '1UNSHARD'"),
    ],
)
def test_load_errors_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_csv(path)


# torch's schedules build their whole pipeline order on construction; they read
# only these attributes of their stages, so no process group is needed.
class _MockStage:
    def __init__(self, index: int, stages: int, ranks: int) -> None:
        import torch

        self.stage_index, self.num_stages = index, stages
        self.group_size, self.group_rank = ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)


def _torch_schedule(kind: str, p: int, m: int):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "interleaved-zb": schedules.ScheduleInterleavedZeroBubble,
        "zbv": schedules.ScheduleZBVZeroBubble,
        "dualpipev": schedules.ScheduleDualPipeV,
        "looped-bfs": schedules.ScheduleLoopedBFS,
    }[kind]
    local = [0, 2 * p - 1] if kind in ("zbv", "dualpipev") else [0, p]
    stages = [_MockStage(s, 2 * p, p) for s in local]
    return cls(stages, m, loss_fn=lambda out, target: out)


@pytest.mark.parametrize(
    ("kind", "p", "m"),
    [
        ("interleaved-1f1b", 4, 8),
        ("interleaved-zb", 4, 8),
        ("zbv", 4, 8),
        ("dualpipev", 3, 8),
        ("looped-bfs", 2, 3),
    ],
)
def test_torch_made_csv_loads_validates_and_simulates(
    tmp_path: Path, kind: str, p: int, m: int
) -> None:
    theirs = _torch_schedule(kind, p, m)
    path = tmp_path / f"{kind}.csv"
    theirs._dump_csv(str(path), format="compute_only")
    ours = load_csv(path)
    ours.validate()
    sim = ours.simulate()
    assert (ours.ranks, ours.stages, ours.microbatches) == (p, 2 * p, m)
    mapping = theirs.stage_index_to_group_rank
    assert ours.stage_to_rank == tuple(mapping[s] for s in range(2 * p))
    for rank, row in theirs.pipeline_order.items():
        flat = []
        for a in row:  # torch pads with None; DualPipeV nests overlapped pairs
            if a is not None:
                flat += [str(x) for x in a.sub_actions] if a.sub_actions else [str(a)]
        assert [str(a) for a in ours.actions[rank]] == flat
    assert 0 <= sim.bubble_ratio < 0.5
    assert save_csv(ours, tmp_path / "again.csv").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("name", ["zbv", "interleaved-1f1b"])
def test_torch_accepts_our_csv_and_lowers_it_like_we_do(tmp_path: Path, name: str) -> None:
    p, m = 4, 8
    ours = build(name, p, m)
    theirs = _torch_schedule("zbv" if name == "zbv" else "interleaved-1f1b", p, m)
    theirs._load_csv(str(save_csv(ours, tmp_path / "ours.csv")), format="compute_only")
    assert {s: theirs.stage_index_to_group_rank[s] for s in range(2 * p)} == dict(
        enumerate(ours.stage_to_rank)
    )
    comm_kinds = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    for rank in range(p):
        torch_comm = Counter(
            str(a)
            for a in theirs.pipeline_order_with_comms[rank]
            if a is not None and a.computation_type.value in comm_kinds
        )
        our_comm = Counter(str(a) for a in lower(ours).actions[rank] if not a.kind.is_compute)
        assert torch_comm == our_comm
