"""Bad input at the public boundary: a built-in exception naming the value and the rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from tests.models import mlp

F = nn.functional
CPU2 = ["cpu", "cpu"]


def _tied():
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.ReLU(), nn.Linear(4, 4), shared)


def _meta_last():
    """mlp() whose last layer has no data, as a free_remote Pipe leaves it."""
    from fastpipe._stages import to_meta

    model = mlp()
    to_meta(model[5])
    return model


def _step(pipe_kwargs: dict, x, y, loss_fn=F.mse_loss, model=None):
    pipe = Pipe(model if model is not None else mlp(), **pipe_kwargs)
    try:
        return pipe.step(x, y, loss_fn)
    finally:
        pipe.close()


X, Y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

CONSTRUCTION = [
    # (id, kwargs for Pipe (model=... overrides mlp()), exception, message pattern)
    ("not-sequential", {"model": nn.Linear(2, 2)}, TypeError, "nn.Sequential, got Linear"),
    ("empty", {"model": nn.Sequential()}, ValueError, "at least one layer"),
    ("chunks-zero", {"chunks": 0}, ValueError, "chunks must be >= 1, got 0"),
    ("chunks-negative", {"chunks": -3}, ValueError, "got -3"),
    ("chunks-float", {"chunks": 2.5}, TypeError, r"chunks must be an int, got float \(2.5\)"),
    ("chunks-bool", {"chunks": True}, TypeError, "chunks must be an int, got bool"),
    ("balance-sum", {"balance": [2, 3]}, ValueError, r"module: 6, sum of balance: 5"),
    ("balance-zero", {"balance": [0, 6]}, ValueError, r"positive int, got \[0, 6\]"),
    ("balance-length", {"balance": [2, 2, 2]}, ValueError, r"3 entries but the schedule has 2 stages"),
    ("balance-length-v", {"balance": [3, 3], "schedule": "zbv"}, ValueError, "2 entries but the schedule has 4"),
    ("balance-word", {"balance": "fast"}, ValueError, "'fast'"),
    ("ranks-over-layers", {"devices": ["cpu"] * 4, "model": nn.Sequential(nn.Linear(2, 2), nn.ReLU())},
     ValueError, "2 layers but the schedule has 4 stages"),
    ("schedule-unknown", {"schedule": "2f2b"}, ValueError, "unknown schedule '2f2b'; valid names"),
    ("spr-unsupported", {"schedule": "1f1b", "stages_per_rank": 2}, ValueError, "stages_per_rank"),
    ("device-unknown", {"devices": ["cpu", "tpu:0"]}, ValueError, "unknown device 'tpu:0'"),
    ("devices-empty", {"devices": []}, ValueError, "non-empty list"),
    *([("devices-cuda-without-cuda", {"devices": ["cuda:0", "cuda:0"]}, RuntimeError,
        r"names CUDA devices, but torch has no usable CUDA")] if not torch.cuda.is_available() else []),
    ("devices-string", {"devices": "cpu"}, ValueError, "non-empty list, one per pipeline rank, got 'cpu'"),
    ("timeout", {"timeout": 0}, ValueError, "timeout must be a number of seconds > 0, got 0"),
    ("overlap", {"overlap": "yes"}, TypeError, r"overlap must be a bool or None, got str \(.yes.\)"),
    ("shm-type", {"shm": 1}, TypeError, r"shm must be a bool or None, got int \(1\)"),
    ("shm-local", {"shm": True}, ValueError, r"shm=True applies to distributed mode"),
    ("free-remote-type", {"free_remote": 1}, TypeError, r"free_remote must be a bool, got int \(1\)"),
    ("free-remote-local", {"free_remote": True}, ValueError, r"free_remote=True applies to distributed mode"),
    ("meta-layer", {"model": _meta_last()}, ValueError,
     r"layer 5 \(Linear\) has tensors on the meta device"),
    ("checkpoint", {"checkpoint": "sometimes"}, ValueError, "checkpoint must be one of"),
    ("recompute", {"recompute": "all"}, ValueError, "recompute must be 'none' or 'selective', got 'all'"),
    ("wire-dtype", {"wire_dtype": torch.int8}, ValueError, "wire_dtype must be None or one of"),
    ("tied-weights", {"model": _tied(), "balance": [2, 2]}, ValueError, 
     r"parameter '0.weight' belongs to one Linear module that stages on ranks 0 and 1 both run"),
    ("plan-type", {"plan": "fast"}, TypeError, "plan must be a fastpipe.Plan"),
]


@pytest.mark.parametrize("case", CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION])
def test_construction_errors(case):
    _, kwargs, exc, pattern = case
    kwargs = dict(kwargs)
    model = kwargs.pop("model", None)
    kwargs.setdefault("devices", CPU2)
    kwargs.setdefault("chunks", 2)
    with pytest.raises(exc, match=pattern):
        Pipe(model if model is not None else mlp(), **kwargs)


STEP = [
    ("batch-smaller-than-chunks", {"chunks": 4}, (X[:3], Y[:3]), ValueError,
     r"batch of 3 rows cannot be split into chunks=4"),
    ("batch-mismatch", {"chunks": 2}, (X, Y[:6]), ValueError, "different batch sizes: 8 and 6"),
    ("input-not-tensor", {"chunks": 2}, ([1.0, 2.0], Y), TypeError, "tensor or a non-empty tuple of tensors, got list"),
    ("tuple-member-sizes", {"chunks": 2}, ((X, X[:4]), Y), ValueError, r"different batch sizes: \[4, 8\]"),
    ("target-not-tensor", {"chunks": 2}, (X, Y.tolist()), TypeError,
     "target: expected a tensor or a non-empty tuple of tensors, got list"),
    ("target-none", {"chunks": 2}, (X, None), ValueError,
     "target is None on rank 1, which holds the last stage"),
]


@pytest.mark.parametrize("case", STEP, ids=[c[0] for c in STEP])
def test_step_input_errors(case):
    _, kwargs, (x, y), exc, pattern = case
    with pytest.raises(exc, match=pattern):
        _step({"devices": CPU2, **kwargs}, x, y)


def test_balance_auto_refuses_a_layer_without_data():
    """balance="auto" splits at the first step, after profiling every layer."""
    with pytest.raises(ValueError, match=r"layer 5 \(Linear\) has tensors on the meta device"):
        _step({"devices": CPU2, "chunks": 2, "balance": "auto"}, X, Y, model=_meta_last())


def test_a_layer_replaced_after_wrapping_is_refused():
    model = mlp()
    pipe = Pipe(model, chunks=2, devices=CPU2)
    pipe.step(X, Y, F.mse_loss)
    model[0] = nn.Linear(5, 8).double()
    with pytest.raises(ValueError, match=r"layers changed after the Pipe was built \(layer 0 of 6"):
        pipe.step(X, Y, F.mse_loss)
    with pytest.raises(ValueError, match="build a new Pipe"):
        pipe(X)
    pipe.close()


def test_a_pipe_is_not_copied_or_pickled():
    import copy
    import pickle

    pipe = Pipe(mlp(), chunks=2, devices=CPU2)
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled: copy the model"):
            attempt(pipe)
    pipe.close()


def test_backward_through_the_inference_output_points_to_step():
    pipe = Pipe(mlp(), chunks=2, devices=CPU2)
    out = pipe(X)
    assert out.requires_grad  # as a module's output in grad mode
    with pytest.raises(RuntimeError, match=r"output of pipe\(x\) has no graph.*pipe.step"):
        out.sum().backward()
    with torch.no_grad():
        assert not pipe(X).requires_grad
    pipe(X).add_(1)  # in place on the output, as on a module's
    pipe.close()


def test_loss_fn_that_is_not_a_scalar():
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got \(4, 3\)"):
        _step({"devices": CPU2, "chunks": 2}, X, Y, loss_fn=lambda out, t: (out - t) ** 2)


def test_loss_fn_not_callable():
    with pytest.raises(TypeError, match="loss_fn must be callable, got str"):
        _step({"devices": CPU2, "chunks": 2}, X, Y, loss_fn="mse")


def test_step_inside_no_grad():
    pipe = Pipe(mlp(), chunks=2, devices=CPU2)
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"inside torch.no_grad\(\)"):
            pipe.step(X, Y, F.mse_loss)
        with torch.inference_mode(), pytest.raises(RuntimeError,
                                                   match=r"inside torch.inference_mode\(\)"):
            pipe.step(X, Y, F.mse_loss)
    finally:
        pipe.close()


def test_stage_that_returns_something_else():
    class Bad(nn.Module):
        def forward(self, x):
            return {"h": x}

    model = nn.Sequential(nn.Linear(5, 5), Bad(), nn.Linear(5, 3)).double()
    with pytest.raises(TypeError, match="a stage must return a tensor or a tuple.*got dict"):
        _step({"devices": CPU2, "chunks": 2, "balance": [2, 1]}, X, Y, model=model)


def test_failed_step_leaves_parameters_as_they_were():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError):
        _step({"devices": CPU2, "chunks": 2}, X, Y, loss_fn=lambda out, t: out, model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _FailsIn(nn.Module):
    """Raises ``exc`` in forward or, through a Function, in backward."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase

    def forward(self, x):
        if self.phase == "forward":
            raise KeyError("broken forward")
        return _BackwardFails.apply(x)


class _BackwardFails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("broken backward")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("phase,kinds,exc", [("forward", ("F",), KeyError),
                                             ("backward", ("B", "I"), ArithmeticError)])
def test_an_exception_in_a_stage_says_where_and_keeps_its_type(schedule, phase, kinds, exc):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), _FailsIn(phase), nn.Linear(4, 4))
    pipe = Pipe(model, chunks=2, schedule=schedule, balance=[2, 3], devices=["cpu", "cpu"])
    with pytest.raises(exc) as info:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    notes = [n for n in getattr(info.value, "__notes__", []) if n.startswith("fastpipe:")]
    assert len(notes) == 1, notes
    kind = next(k for k in kinds if f" in {k} of stage 1 " in notes[0])
    assert f"rank 1 in {kind} of stage 1 (layers 2-4 of the model: Linear, _FailsIn, Linear)" in notes[0]
    assert "microbatch " in notes[0]


def test_compiling_the_pipe_or_wrapping_a_compiled_model_is_refused_with_a_hint():
    model = mlp(depth=4)
    with pytest.raises(TypeError, match=r"OptimizedModule.*model\[i\] = torch.compile\(model\[i\]\)"):
        Pipe(torch.compile(model), chunks=2, devices=["cpu", "cpu"])
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"])
    with pytest.raises(NotImplementedError, match="only pipe\\(x\\), not step"):
        pipe.compile()
    pipe.close()


def test_step_refuses_a_scaler_that_is_not_one():
    pipe = Pipe(mlp(depth=4), chunks=2, devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler, got float"):
        pipe.step(torch.randn(4, 5), torch.randn(4, 3), nn.functional.mse_loss, scaler=2.0)
    pipe.close()


def test_a_plain_grad_scaler_is_refused_in_distributed_mode_with_the_fix():
    from fastpipe._args import loss_scale

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(TypeError, match="must be a torch.distributed.fsdp.sharded_grad_scaler."
                                        "ShardedGradScaler, got GradScaler"):
        loss_scale(scaler, None, True, torch.device("cpu"))
    assert loss_scale(scaler, None, False, torch.device("cpu")) == 8.0
    assert loss_scale(None, None, True, torch.device("cpu")) is None
    # GradScaler(enabled=use_fp16) with fp16 off scales nothing: accepted anywhere
    assert loss_scale(torch.amp.GradScaler("cpu", enabled=False), None, True, torch.device("cpu")) is None


def test_an_exception_note_is_kept_where_add_note_is_missing():
    from fastpipe.runtime.executor import _add_note

    exc = KeyError("k")
    _add_note(exc, "first")
    _add_note(exc, "second")
    assert exc.__notes__ == ["first", "second"]
