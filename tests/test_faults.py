"""Reliability: every rank ends with a clear error, fast, and no process is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fastpipe import Pipe

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 10.0  # Pipe(timeout=...) in the workers


def _run(case: dict, tmp: Path, world: int = 2) -> tuple[list[dict | None], list[int]]:
    case = {"timeout": TIMEOUT, **case}
    path = tmp / "case.pt"
    torch.save(case, path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests._fault_worker", str(r), str(world),
                          f"file://{tmp / 'rdv'}", str(path), str(tmp / f"r{r}.pt")],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=3 * TIMEOUT + 30)[0])
    finally:
        for p in procs:  # a hang fails the test instead of blocking CI
            if p.poll() is None:
                p.kill()
                p.wait()
                raise AssertionError("a rank did not exit:\n" + "\n".join(logs))
    out = []
    for r in range(world):
        f = tmp / f"r{r}.pt"
        out.append(torch.load(f, weights_only=False) if f.exists() else None)
        if out[-1] is not None:
            out[-1]["log"] = logs[r]  # what the rank printed, for a failing assertion to show
    return out, [p.returncode for p in procs]


def _failed_fast(res: dict, kind: str, *words: str) -> None:
    assert res is not None and not res["ok"], res
    assert res["type"] == kind, res["trace"]
    for w in words:
        assert w in res["message"], (w, res["message"])
    assert res["elapsed"] < TIMEOUT, res  # the abort notice beats the timeout


# How messages travel: shared-memory rings, gloo with its own sizes, NCCL's rules on gloo.
TRANSPORTS = {"shm": {"shm": True}, "gloo-sizes": {"shm": False},
              "exact-sizes": {"shm": False, "exact": True}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forward_error_on_one_rank_fails_both(tmp_path, transport):
    """At step 1 the capacities are known: exact abort notices take the posted size."""
    (r0, r1), codes = _run({"fault": "forward", "rank": 1, "stage": 1, "at": 1,
                            **TRANSPORTS[transport]}, tmp_path)
    _failed_fast(r1, "ValueError", "boom in forward")
    _failed_fast(r0, "PeerError", "pipeline rank 1 failed", "boom in forward")
    assert len(r0["losses"]) == len(r1["losses"]) == 1  # step 0 went through
    assert codes == [0, 0], [r0["log"], r1["log"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backward_error_on_the_other_rank_fails_both(tmp_path, transport):
    """With exact messages (NCCL's rule) the abort notices are padded too."""
    (r0, r1), _ = _run({"fault": "backward", "rank": 0, "stage": 0, "at": 0,
                        **TRANSPORTS[transport]}, tmp_path)
    _failed_fast(r0, "RuntimeError", "boom in backward")
    _failed_fast(r1, "PeerError", "pipeline rank 0 failed", "boom in backward")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_error_after_the_last_message_fails_the_peer_waiting_for_the_loss(tmp_path, transport):
    """The last stage's rank fails in a W after it sent its last gradient:
    the other rank, done with its own step, waits for the step's loss, and
    fails at once: through the rings their abort reaches it; a broadcast
    carries the failure and its reason instead of the loss."""
    (r0, r1), codes = _run({"fault": "weight", "rank": 1, "stage": 1, "at": 1,
                            **TRANSPORTS[transport]}, tmp_path)
    _failed_fast(r1, "RuntimeError", "boom in W")
    _failed_fast(r0, "PeerError", "pipeline rank 1 failed", "boom in W")
    assert len(r0["losses"]) == len(r1["losses"]) == 1 and r0["losses"] == r1["losses"]
    assert codes == [0, 0], [r0["log"], r1["log"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_error_after_the_last_message_leaves_the_loss_broadcast_whole(tmp_path, transport):
    """The first stage's rank fails in its last W, after its last message:
    it still takes its part of the loss, so the other rank's step ends with
    it, and that rank's next step fails at once, naming it."""
    (r0, r1), codes = _run({"fault": "weight", "rank": 0, "stage": 0, "at": 1,
                            **TRANSPORTS[transport]}, tmp_path)
    _failed_fast(r0, "RuntimeError", "boom in W")
    assert len(r0["losses"]) == 1 and len(r1["losses"]) == 2, (r0, r1)
    _failed_fast(r1, "PeerError", "pipeline rank 0")
    assert codes == [0, 0], [r0["log"], r1["log"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo-sizes"])
def test_an_error_after_the_last_message_reaches_the_tied_sum(tmp_path, transport):
    """With a parameter tied across the ranks, the step's tied sum follows the
    loss: the first stage's rank, failed in its last W, takes part in it
    with a failure flag, so the other rank fails there at once, its .grad
    as before the step."""
    (r0, r1), codes = _run({"fault": "weight", "rank": 0, "stage": 0, "at": 1, "tied": True,
                            **TRANSPORTS[transport]}, tmp_path)
    _failed_fast(r0, "RuntimeError", "boom in W")
    _failed_fast(r1, "PeerError", "pipeline rank 0 failed after its last message")
    assert len(r0["losses"]) == len(r1["losses"]) == 1, (r0, r1)
    assert codes == [0, 0], [r0["log"], r1["log"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,rank,message", [
    ("rows", 0, "cannot be split into chunks=4"),
    ("no_target", 1, "target is None on rank 1, which holds the last stage"),
])
def test_bad_input_on_one_rank_fails_both_at_once(tmp_path, fault, rank, message):
    """Inputs one rank cannot use fail that rank's step with a clear error
    and its peer's at once, naming the reason, instead of a timeout."""
    results, codes = _run({"fault": fault, "rank": rank, "at": 1, "shm": False}, tmp_path)
    bad, peer = results[rank], results[1 - rank]
    _failed_fast(bad, "ValueError", message)
    _failed_fast(peer, "PeerError", f"pipeline rank {rank} failed", message)
    assert codes == [0, 0], [r and r["log"] for r in results]


@pytest.mark.timeout(120)
def test_a_failure_profiling_for_auto_balance_fails_every_rank(tmp_path):
    """balance="auto": the first stage's rank profiles every layer while the
    other waits for the split; a layer that raises there (only on that
    rank's copy) fails that rank with its error and the other, at once,
    with a RuntimeError naming it."""
    res, codes = _run({"fault": "forward", "rank": 0, "stage": 1, "at": 0, "auto": True}, tmp_path)
    _failed_fast(res[0], "ValueError", "boom in forward")
    _failed_fast(res[1], "RuntimeError", 'balance="auto"', "pipeline rank 0", "boom in forward")


@pytest.mark.timeout(120)
def test_auto_balance_leaves_out_a_loss_that_fails_on_the_profiling_rank(tmp_path):
    """A loss that cannot read the first stage's rank's target (given for
    form's sake): the layers are profiled without it and both ranks train."""
    res, codes = _run({"fault": "profile_loss"}, tmp_path)
    assert codes == [0, 0] and all(r is not None and r["ok"] for r in res), res
    assert res[0]["losses"] == res[1]["losses"] and len(res[0]["losses"]) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_in_another_call_fails_its_peer_at_once(tmp_path, transport):
    """Rank 1 (the last stage) runs pipe(x) while rank 0 runs step(): the
    first message tells rank 1, which fails, and rank 0 learns why."""
    (r0, r1), codes = _run({"fault": "mismatch", "rank": 1, "at": 1, **TRANSPORTS[transport]},
                           tmp_path)
    _failed_fast(r1, "CallMismatch", "pipeline rank 0 runs step() while this rank runs pipe(x)")
    _failed_fast(r0, "PeerError", "pipeline rank 1 failed", "every rank must make the same call")
    assert codes == [0, 0], [r0["log"], r1["log"]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "gloo-sizes"])
def test_killed_rank_is_named_by_its_peer(tmp_path, transport):
    (r0, r1), codes = _run({"fault": "kill", "rank": 1, "stage": 1, "at": 1,
                            **TRANSPORTS[transport]}, tmp_path)
    assert r1 is None and codes[1] == -9
    assert r0 is not None and not r0["ok"]
    assert r0["type"] in ("PeerError", "TimeoutError"), r0["trace"]
    assert "rank 1" in r0["message"]
    assert r0["elapsed"] < TIMEOUT + 5


@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_exact_messages_fail_at_construction(tmp_path):
    """Tags on one rank and order on the other would mismatch messages."""
    (r0, r1), _ = _run({"fault": "none", "exact_by_rank": {0: True, 1: False}}, tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert "disagree on exact messages" in res["message"], res["message"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting,values", [("chunks", (4, 2)), ("schedule", ("1f1b", "gpipe")),
                                            ("balance", ([2, 3], [3, 2])), ("shm", (True, False))])
def test_ranks_that_disagree_fail_at_construction(tmp_path, setting, values):
    per_rank = {r: {setting: v} for r, v in enumerate(values)}
    (r0, r1), _ = _run({"fault": "none", "per_rank": per_rank}, tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert f"disagree on {setting}" in res["message"] and "rank 1" in res["message"]
        assert res["losses"] == []  # before any step


@pytest.mark.timeout(120)
def test_ranks_with_two_orders_of_one_schedule_fail_at_construction(tmp_path):
    """Same name, other order (each rank planned on its own): refused, not a hang."""
    from fastpipe.schedules import build

    orders = {0: build("zb-h1", 2, 4), 1: build("zb-h1", 2, 4, costs={"F": 1, "I": 1, "W": 0.25})}
    assert orders[0].actions != orders[1].actions
    (r0, r1), _ = _run({"fault": "none", "per_rank": {r: {"schedule": o} for r, o in orders.items()}},
                       tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert "disagree on schedule's action order" in res["message"], res["message"]


@pytest.mark.timeout(120)
def test_shared_memory_required_but_refused_on_one_rank_fails_every_rank(tmp_path):
    (r0, r1), _ = _run({"fault": "none", "shm": True, "per_rank": {1: {"overlap": True}}}, tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert "cannot use shared memory: rank 1: overlap=True" in res["message"], res["message"]


@pytest.mark.timeout(120)
def test_a_bad_ring_size_on_one_rank_fails_every_rank_and_a_good_one_trains(tmp_path):
    env = {0: {"FASTPIPE_SHM_BYTES": "4096"}, 1: {"FASTPIPE_SHM_BYTES": "lots"}}
    (r0, r1), _ = _run({"fault": "none", "env_by_rank": env}, tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert "rank 1: FASTPIPE_SHM_BYTES must be a number of bytes, got 'lots'" in res["message"]
    env = {r: {"FASTPIPE_SHM_BYTES": "200"} for r in (0, 1)}  # smaller than one message
    (tmp_path / "small").mkdir()
    (r0, r1), _ = _run({"fault": "none", "shm": True, "env_by_rank": env}, tmp_path / "small")
    assert r0["ok"] and r1["ok"] and r0["losses"] == r1["losses"]


@pytest.mark.timeout(120)
def test_a_switch_one_rank_cannot_read_fails_every_rank(tmp_path):
    """Raised on one rank alone, the others would wait in the set-up's collectives."""
    env = {1: {"FASTPIPE_CHAIN": "sometimes"}}
    (r0, r1), _ = _run({"fault": "none", "env_by_rank": env}, tmp_path)
    for res in (r0, r1):
        assert not res["ok"] and res["type"] == "ValueError", res
        assert "rank 1: FASTPIPE_CHAIN must be 1, 0 or python, got 'sometimes'" in res["message"]


@pytest.mark.timeout(120)
def test_nan_loss_is_a_value(tmp_path):
    (r0, r1), _ = _run({"fault": "nan"}, tmp_path)
    assert r0["ok"] and r1["ok"]
    assert all(v != v for v in r0["losses"]) and r0["losses"] == r0["losses"]  # NaN on every step
    assert len(r1["losses"]) == 3


@pytest.mark.timeout(120)
def test_a_stage_may_change_its_tensors_between_steps(tmp_path):
    # Two tensors cross the boundary in step 0, three from step 1 on: each
    # message carries its own layout, so the pipeline neither hangs nor breaks.
    (r0, r1), _ = _run({"fault": "shape", "at": 1}, tmp_path)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["losses"] == pytest.approx(r1["losses"])


# --- local mode ------------------------------------------------------------------


def test_local_keyboard_interrupt_then_the_next_step_works():
    import _thread

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.05)
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), Slow(), nn.Linear(5, 3)).double()
    pipe = Pipe(model, chunks=4, devices=["cpu", "cpu"], balance=[2, 1])
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.step(x, y, nn.functional.mse_loss)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # untouched
        model.zero_grad()
        loss = pipe.step(x, y, nn.functional.mse_loss)
        assert torch.isfinite(loss)
    finally:
        timer.cancel()
        pipe.close()


def test_local_error_reaches_the_caller_and_the_pipe_recovers():
    class Flaky(nn.Module):
        fail = True

        def forward(self, x):
            if Flaky.fail:
                raise ValueError("flaky layer")
            return x

    model = nn.Sequential(nn.Linear(5, 5), Flaky(), nn.Linear(5, 3)).double()
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"], balance=[1, 2])
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    try:
        with pytest.raises(ValueError, match="flaky layer"):
            pipe.step(x, y, nn.functional.mse_loss)
        Flaky.fail = False
        model.zero_grad()
        assert torch.isfinite(pipe.step(x, y, nn.functional.mse_loss))
    finally:
        pipe.close()


def test_interpreter_exits_with_a_lane_stuck_in_a_long_wait():
    code = (
        "import time, fastpipe._C as C\n"
        "r = C.HostRing(2)\n"
        "r.submit(0, lambda: time.sleep(60))\n"
        "time.sleep(0.1)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 15  # a 1 s grace, not the task's 60 s


_ENDS_AFTER_A_STEP = """
import sys
import torch, torch.distributed as dist
from torch import nn
from fastpipe import Pipe
from tests.models import mlp
rank, init, schedule = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
pipe = Pipe(mlp(depth=8, dtype=torch.float32), chunks=8, schedule=schedule, balance=[4, 4])
x, y = torch.randn(16, 5), torch.randn(16, 3)
for _ in range(2):
    pipe.step(x, y, nn.functional.mse_loss)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h2"])
def test_a_script_that_ends_right_after_a_step_exits_cleanly(tmp_path, schedule):
    # The last step's loss broadcast was still held by gloo's worker thread
    # when the interpreter finalized: the worker freed its tensors, asked
    # for the GIL, was ended, and the process aborted ("terminate called
    # without an active exception"), in about 4 of 10 runs.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for attempt in range(5):
        init = f"file://{tmp_path / f'rdv{attempt}'}"
        procs = [subprocess.Popen([sys.executable, "-c", _ENDS_AFTER_A_STEP, str(r), init, schedule],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(2)]
        try:
            logs = [p.communicate(timeout=60)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        assert codes == [0, 0], f"run {attempt}: exit codes {codes}\n" + "\n".join(logs)
