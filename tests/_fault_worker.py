"""Body of the spawned gloo ranks of test_faults: one fault per run, one file per rank."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn


class Fault(nn.Module):
    """Passes its input on, until step ``at`` of ``mode`` on this rank's process."""

    step = 0  # set by the worker before each step

    def __init__(self, mode: str, at: int):
        super().__init__()
        self.mode, self.at = mode, at
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        x = self.lin(x)
        if Fault.step == self.at and self.mode == "forward":
            raise ValueError("boom in forward")
        if Fault.step == self.at and self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "backward" and Fault.step == self.at:
            return _FailBackward.apply(x)
        if self.mode == "shape":  # more tensors from step `at` on: the message describes itself
            return (x, x * 2, x.sum(-1, keepdim=True)) if Fault.step >= self.at else (x, x * 2)
        return x


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


class FailW(nn.Module):
    """``x * weight``, whose deferred W (``FailWRule``) raises for the last
    microbatch of step ``at``: a failure after the rank's last message."""

    calls = 0  # W calls this step (reset by the worker)

    def __init__(self, width: int, at: int, chunks: int):
        super().__init__()
        self.at, self.chunks = at, chunks
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


def _fail_w_rule():
    from fastpipe.runtime.deferred import WeightRule

    class Rule(WeightRule):
        def params(self, m):
            return (m.weight,)

        def forward(self, m, x, detached):
            return x * detached[0], (x.detach(),), m

        def weight_grads(self, kept, meta, targets, g):
            (x,), m = kept, meta
            FailW.calls += 1
            if Fault.step == m.at and FailW.calls == m.chunks:
                raise RuntimeError("boom in W")
            return ((g * x).sum(0),)

    return Rule()


class TiedScale(nn.Module):
    """``x * p`` with another layer's parameter: a tie across stages."""

    def __init__(self, p: nn.Parameter):
        super().__init__()
        self.p = p

    def forward(self, x):
        return x * self.p


class SumAll(nn.Module):
    def forward(self, value):
        return sum(value) if isinstance(value, tuple) else value


def _model(case: dict, rank: int) -> nn.Sequential:
    torch.manual_seed(0)
    mode = case["fault"] if case.get("rank") == rank else "none"
    # stage 0 = [Linear, Fault], stage 1 = [SumAll, Fault, Linear] with balance [2, 3]
    first = Fault(mode if case.get("stage") == 0 else "none", case.get("at", 1))
    second = Fault(mode if case.get("stage") == 1 else "none", case.get("at", 1))
    if case["fault"] == "shape":
        first = Fault("shape", case.get("at", 1))
    if case["fault"] == "weight":  # stage 0's second layer or the last stage's last one
        at = case.get("at", 1) if case.get("rank") == rank else -1
        if case.get("stage") == 0:
            lin = nn.Linear(5, 6)
            tied = [TiedScale(lin.bias)] if case.get("tied") else []  # in stage 1: [3, 4]
            return nn.Sequential(lin, FailW(6, at, 4), first, SumAll(), *tied, second,
                                 nn.Linear(6, 3)).double()
        return nn.Sequential(nn.Linear(5, 6), first, SumAll(), second, nn.Linear(6, 3),
                             FailW(3, at, 4)).double()
    return nn.Sequential(nn.Linear(5, 6), first, SumAll(), second, nn.Linear(6, 3)).double()


def _failing_loss(out, target):
    raise ValueError("the loss cannot read this target")


def run(rank: int, world: int, init: str, case: dict, out_path: str) -> None:
    from fastpipe import Pipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    started = time.monotonic()
    result: dict = {"losses": []}
    try:
        kwargs = dict(chunks=4, schedule="1f1b", balance=[2, 3], timeout=case["timeout"],
                      shm=case.get("shm"))
        if case["fault"] == "weight":
            from fastpipe import register_weight_rule

            register_weight_rule(FailW, _fail_w_rule())
            kwargs["balance"] = [2, 4] if case.get("stage") != 0 else [3, 4] if case.get("tied") \
                else [3, 3]
        if case["fault"] == "profile_loss" or case.get("auto"):  # rank 0 profiles every layer
            kwargs["balance"] = "auto"
        kwargs.update(case.get("per_rank", {}).get(rank, {}))
        exact = case.get("exact_by_rank", {}).get(rank, case.get("exact"))
        os.environ["FASTPIPE_EXACT_MESSAGES"] = "1" if exact else "0"
        os.environ.update(case.get("env_by_rank", {}).get(rank, {}))
        pipe = Pipe(_model(case, rank), **kwargs)
        if case.get("shm") is not None:
            assert pipe.shm == case["shm"]
        x = torch.randn(8, 5, dtype=torch.float64)
        y = torch.randn(8, 3, dtype=torch.float64)
        if case["fault"] == "nan":
            y[0, 0] = float("nan")
        for step in range(case.get("steps", 3)):
            Fault.step, FailW.calls = step, 0
            started = time.monotonic()
            xs, ys = x, y
            if case.get("rank") == rank and step == case.get("at"):
                if case["fault"] == "rows":  # fewer rows than chunks: refused before any action
                    xs = x[:2]
                elif case["fault"] == "no_target":  # on the rank of the last stage
                    ys = None
            if case["fault"] == "mismatch" and case.get("rank") == rank and step == case.get("at"):
                with torch.no_grad():
                    pipe(xs)  # while the other rank trains
                result["losses"].append(None)
                continue
            loss_fn = _failing_loss if case["fault"] == "profile_loss" and rank == 0 \
                else nn.functional.mse_loss
            result["losses"].append(pipe.step(xs, ys, loss_fn).item())
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.update(ok=False, type=type(exc).__name__, message=str(exc),
                      elapsed=time.monotonic() - started, trace=traceback.format_exc())
    torch.save(result, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, init, case_path, out = sys.argv[1:]
    run(int(rank), int(world), init, torch.load(case_path, weights_only=False), out)
