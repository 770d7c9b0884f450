"""What the tests and the benchmarks share beside the models: a loss that
fails on cue, malloc's bytes in use, and spawning gloo ranks (and what a
spawned rank saves)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class FailsOnce:
    """``loss_fn``, except that its ``at``-th call raises: a step that fails
    with earlier microbatches' backwards done and messages in flight."""

    def __init__(self, loss_fn, at: int) -> None:
        self.loss_fn, self.at, self.calls = loss_fn, at, 0

    def __call__(self, out, target):
        self.calls += 1
        if self.calls == self.at:
            raise ValueError("loss failed once")
        return self.loss_fn(out, target)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: arena
    chunks in use plus mmapped chunks). Unlike resident memory it does not move
    when the allocator keeps or returns free pages, so a steady state reads the
    same from step to step and a leak shows as growth. None without glibc 2.33+."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def spawn_ranks(worker: str, world: int, cases: list, tmp: Path, timeout: float = 240,
                env: dict | None = None) -> list:
    """Runs ``python -m worker RANK WORLD INIT CASES OUT`` for every rank and
    returns each rank's ``"ok"`` result (the worker saves ``{"ok": ...}`` or
    ``{"error": traceback}`` to OUT). A rank that hangs is killed after
    ``timeout`` seconds, so a hang fails the test instead of blocking CI.
    """
    cases_path = tmp / "cases.pt"
    import torch

    torch.save(cases, cases_path)
    init = f"file://{tmp / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", worker, str(r), str(world), init, str(cases_path),
             str(tmp / f"rank{r}.pt")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for r in range(world):
        path = tmp / f"rank{r}.pt"
        assert path.exists(), f"rank {r} wrote nothing:\n" + "\n".join(logs)
        res = torch.load(path, weights_only=False)
        assert "ok" in res, res.get("error")
        out.append(res["ok"])
    return out


@contextmanager
def rank_results(out_path: str):
    """A spawned rank's body (``spawn_ranks``): yields the list the rank
    fills with its cases' results and saves it as ``{"ok": results}`` to
    ``out_path``, or ``{"error": traceback}`` if the body raises (then
    re-raised); the process group is destroyed either way."""
    import torch
    import torch.distributed as dist

    results: list = []
    try:
        yield results
        torch.save({"ok": results}, out_path)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out_path)
        raise
    finally:
        dist.destroy_process_group()
