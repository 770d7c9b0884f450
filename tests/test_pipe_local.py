"""Local mode: every schedule reproduces the sequential model's loss and grads."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.schedules import names
from fastpipe._outputs import backward_into_inputs
from tests.models import (amp_model, amp_reference, detached_model, embedding_model, gapped_model, mlp,
                          reference, tied_embedding_model, tied_mlp, tuple_model)

F = nn.functional

# (schedule, ranks, stages_per_rank): V schedules need 2 stages per rank.
SPR = {"interleaved-1f1b": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}


def _check(model_fn, x, y, loss_fn, schedule, ranks, chunks, balance=None, rtol=1e-10, atol=1e-12):
    ref_model = model_fn()
    ref_loss, ref_grads = reference(ref_model, x, y, loss_fn, chunks)
    model = model_fn()
    pipe = Pipe(model, chunks=chunks, schedule=schedule, balance=balance,
                devices=["cpu"] * ranks, stages_per_rank=SPR.get(schedule))
    try:
        loss = pipe.step(x, y, loss_fn)
        torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
        # What the unsplit model leaves without a gradient stays None.
        assert {n for n, p in model.named_parameters() if p.grad is not None} == ref_grads.keys()
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, ref_grads[name], rtol=rtol, atol=atol, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), ref_model(x), rtol=rtol, atol=atol)
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", names())
@pytest.mark.parametrize("ranks,chunks", [(2, 4), (2, 3), (4, 8), (4, 5)])
def test_every_schedule_matches_sequential_fp64(schedule, ranks, chunks):
    stages = ranks * SPR.get(schedule, 1)
    torch.manual_seed(1)
    x, y = torch.randn(11, 5, dtype=torch.float64), torch.randn(11, 3, dtype=torch.float64)
    _check(lambda: mlp(depth=max(stages, 6) + 2), x, y, F.mse_loss, schedule, ranks, chunks)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv"])
def test_fp32_tolerance(schedule):
    torch.manual_seed(2)
    x, y = torch.randn(16, 5), torch.randn(16, 3)
    _check(lambda: mlp(depth=8, dtype=torch.float32), x, y, F.mse_loss, schedule, 2, 4,
           rtol=1e-5, atol=4e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h2", "zbv"])
def test_tuple_between_stages_and_uneven_balance(schedule):
    torch.manual_seed(3)
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    balance = [1, 1, 1, 3] if schedule == "zbv" else [2, 4]
    _check(tuple_model, x, y, F.mse_loss, schedule, 2, 3, balance=balance)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "dualpipev"])
def test_integer_input_embedding_first(schedule):
    torch.manual_seed(4)
    x = torch.randint(0, 11, (8, 4))
    y = torch.randn(8, 4, 3, dtype=torch.float64)
    _check(embedding_model, x, y, F.mse_loss, schedule, 2, 4)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zbv", "dualpipev"])
def test_parameter_shared_by_stages_of_one_rank(schedule, fused):
    # Stages 0 and 3 share a Linear and land on rank 0 with V placement
    # (interleaved and looped put 0 and 2 on rank 0: [2, 3, 2, 1] splits the tie so).
    torch.manual_seed(6)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    balance = [2, 2, 2, 2] if schedule in ("zbv", "dualpipev") else [2, 3, 2, 1]
    ref_model = tied_mlp()
    ref_loss, ref_grads = reference(ref_model, x, y, F.mse_loss, 4)
    model = tied_mlp()
    pipe = Pipe(model, chunks=4, schedule=schedule, balance=balance, devices=["cpu"] * 2,
                stages_per_rank=2, fused_wgrad=fused)
    try:
        if pipe.settings.switches.chains != "off":  # both stages of the tie run as chains (Linear and Tanh only)
            assert all(st.chain is not None for st in pipe._stages[0].values())
        for step in range(2):  # the second step accumulates onto the first's .grad
            loss = pipe.step(x, y, F.mse_loss)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, (step + 1) * ref_grads[name], rtol=1e-10,
                                           atol=1e-12, msg=name)
    finally:
        pipe.close()
    assert model[1] is model[6] and model[1].weight.grad is model[6].weight.grad
    held = {id(p): p for i in (0, 1, 6, 7) for p in model[i].parameters()}  # stages 0 and 3
    if schedule in ("zbv", "dualpipev"):  # the shared Linear counts once
        assert pipe.memory_stats()[0]["params"] == sum(p.numel() * 8 for p in held.values())


def test_tied_embedding_on_one_rank():
    torch.manual_seed(7)
    x, y = torch.randint(0, 11, (6, 4)), torch.randn(6, 4, 3, dtype=torch.float64)
    _check(tied_embedding_model, x, y, F.mse_loss, "zbv", 2, 3, balance=[1, 2, 1, 2])


@pytest.mark.parametrize("schedule,balance,fused", [
    ("gpipe", [2, 4], False), ("1f1b", [2, 4], False), ("1f1b", [2, 4], True),
    ("zb-h1", [2, 4], False), ("zb-h2", [1, 5], True),
    ("interleaved-1f1b", [1, 1, 2, 2], False),  # stage 0 on rank 0, stage 3 (the head) on rank 1
])
def test_embedding_tied_across_local_ranks(schedule, balance, fused):
    """Rank 1 runs the head on a replica of the embedding weight; its
    gradient is added to the parameter's, and the model is left as built."""
    torch.manual_seed(8)
    x, y = torch.randint(0, 11, (8, 3)), torch.randn(8, 3, 3, dtype=torch.float64)
    ref_model = tied_embedding_model()
    model = tied_embedding_model()
    tied = model[0].weight
    pipe = Pipe(model, chunks=4, schedule=schedule, balance=balance, devices=["cpu"] * 2,
                stages_per_rank=SPR.get(schedule), fused_wgrad=fused)
    try:
        for _ in range(2):  # the second step accumulates onto the first's .grad
            ref_loss, ref_grads = reference(ref_model, x, y, F.mse_loss, 4)  # accumulates too
            loss = pipe.step(x, y, F.mse_loss)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
            assert model[0].weight is tied and model[4].weight is tied
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)
            with torch.no_grad():  # an optimizer step: the next call's replica follows it
                tied.add_(0.01)
                ref_model[0].weight.add_(0.01)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), ref_model(x), rtol=1e-10, atol=1e-12)
    finally:
        pipe.close()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("model_fn,schedule,balance", [
    (mlp, "zbv", None), (tied_embedding_model, "1f1b", [2, 4])])
def test_clip_grad_norm_matches_torch(model_fn, schedule, balance, norm_type):
    torch.manual_seed(9)
    if model_fn is mlp:
        x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    else:
        x, y = torch.randint(0, 11, (8, 3)), torch.randn(8, 3, 3, dtype=torch.float64)
    ref_model, model = model_fn(), model_fn()
    reference(ref_model, x, y, F.mse_loss, 4)
    expected = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05, norm_type)
    assert expected > 0.05
    pipe = Pipe(model, chunks=4, schedule=schedule, balance=balance, devices=["cpu"] * 2,
                stages_per_rank=SPR.get(schedule))
    try:
        pipe.step(x, y, F.mse_loss)
        torch.testing.assert_close(pipe.clip_grad_norm_(0.05, norm_type), expected)
    finally:
        pipe.close()
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, msg=name)


def test_clip_grad_norm_rejects_bad_arguments():
    pipe = Pipe(mlp(), chunks=2, devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="max_norm must be a number, got str"):
        pipe.clip_grad_norm_("1")
    with pytest.raises(TypeError, match="norm_type must be a number, got NoneType"):
        pipe.clip_grad_norm_(1.0, None)
    x = torch.randn(4, 5, dtype=torch.float64)
    pipe.step(x, torch.full((4, 3), float("nan"), dtype=torch.float64), F.mse_loss)
    with pytest.raises(RuntimeError, match="non-finite"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_module_run_by_two_local_ranks_is_refused():
    with pytest.raises(ValueError, match=r"parameter '1.weight' belongs to one Linear module that "
                                         r"stages on ranks 0 and 1 both run: in local mode"):
        Pipe(tied_mlp(), chunks=2, schedule="1f1b", devices=["cpu", "cpu"])


def _input_grads(schedule, chunks, fused=False, checkpoint="never"):
    """(x.grad, upstream.grad) after one step of ``Pipe`` and of the unsplit model
    on ``x * upstream``: x a leaf, ``upstream`` a parameter before the pipe."""
    torch.manual_seed(6)
    x0, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    up0 = torch.randn(5, dtype=torch.float64)
    out = []
    for piped in (False, True):
        model = mlp(depth=10)
        x, up = x0.clone().requires_grad_(), up0.clone().requires_grad_()
        if piped:
            pipe = Pipe(model, chunks=chunks, schedule=schedule, devices=["cpu", "cpu"],
                        stages_per_rank=SPR.get(schedule), fused_wgrad=fused, checkpoint=checkpoint)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "non-leaf .grad accessed" on the way
                pipe.step(x * up, y, F.mse_loss)
            pipe.close()
        else:
            reference(model, x * up, y, F.mse_loss, chunks)
        out.append((x.grad, up.grad))
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("schedule", names())
def test_input_gradient_reaches_the_callers_tensors(schedule, fused):
    """The input's gradient goes on into the caller's graph, for every
    schedule: split (I/W) and chain stages included, not only full B."""
    (ref_x, ref_up), (x_grad, up_grad) = _input_grads(schedule, 4, fused)
    assert x_grad is not None and up_grad is not None
    torch.testing.assert_close(x_grad, ref_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(up_grad, ref_up, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_input_gradient_with_checkpointing(schedule):
    (ref_x, ref_up), (x_grad, up_grad) = _input_grads(schedule, 3, checkpoint="always")
    torch.testing.assert_close(x_grad, ref_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(up_grad, ref_up, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chains", ["1", "0"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", names())
@pytest.mark.parametrize("model_fn", [gapped_model, detached_model])
def test_what_no_gradient_reaches_keeps_grad_none(model_fn, schedule, checkpoint, chains,
                                                  monkeypatch):
    """A boundary member no later layer reads, and a stage that starts with
    a detach: the layers before them keep ``.grad`` None, as in the unsplit
    model, and so does the caller's input where nothing reaches it. Chain
    stages (Linear, Tanh) and autograd's."""
    monkeypatch.setenv("FASTPIPE_CHAIN", chains)
    torch.manual_seed(8)
    x0, y = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    balance = [1, 1, 2, 2] if SPR.get(schedule) else [2, 4]
    ref_model, model = model_fn(), model_fn()
    ref_x, x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    _, ref_grads = reference(ref_model, ref_x, y, F.mse_loss, 3)
    pipe = Pipe(model, chunks=3, schedule=schedule, balance=balance, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule), checkpoint=checkpoint)
    try:
        for step in (1, 2):  # the second step adds to .grad where there is one
            pipe.step(x, y, F.mse_loss)
            assert {n for n, p in model.named_parameters() if p.grad is not None} == ref_grads.keys()
            for name, g in ref_grads.items():
                torch.testing.assert_close(model.get_parameter(name).grad, step * g, rtol=1e-10,
                                           atol=1e-12, msg=name)
            if ref_x.grad is None:
                assert x.grad is None
            else:
                torch.testing.assert_close(x.grad, step * ref_x.grad, rtol=1e-10, atol=1e-12)
    finally:
        pipe.close()
    assert model[0].weight.grad is None if model_fn is detached_model else model[1].side.weight.grad is None


def test_input_rows_no_gradient_reached_get_zeros_beside_the_others():
    x = torch.zeros(4, 2, requires_grad=True)
    g = torch.ones(2, 2)
    backward_into_inputs(x, {0: [None], 1: [g]}, 2)
    assert torch.equal(x.grad, torch.tensor([[0.0, 0], [0, 0], [1, 1], [1, 1]]))
    y = torch.zeros(4, 2, requires_grad=True)
    backward_into_inputs(y, {0: [None], 1: [None]}, 2)
    assert y.grad is None


def test_grads_accumulate_like_backward():
    torch.manual_seed(5)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    model = mlp()
    pipe = Pipe(model, chunks=2, schedule="zb-h1", devices=["cpu", "cpu"])
    pipe.step(x, y, F.mse_loss)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    pipe.step(x, y, F.mse_loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * once[n])
    pipe.close()


def test_keeps_user_parameters():
    model = mlp()
    before = [id(p) for p in model.parameters()]
    pipe = Pipe(model, chunks=2, devices=["cpu", "cpu"])
    assert [id(p) for p in model.parameters()] == before
    assert [id(p) for p in pipe.parameters()] == before
    pipe.close()


def test_stage_error_reaches_caller_with_its_type():
    class Boom(nn.Module):
        def forward(self, x):
            raise ArithmeticError("layer 3 cannot divide")

    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), Boom(), nn.Linear(5, 3))
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"], timeout=10)
    with pytest.raises(ArithmeticError, match="layer 3 cannot divide"):
        pipe.step(torch.randn(4, 5), torch.randn(4, 3), F.mse_loss)
    pipe.close()


def _omp_max_threads():
    import ctypes

    try:
        return ctypes.CDLL(None).omp_get_max_threads
    except AttributeError:
        return None


class _ThreadCount(nn.Module):
    """Records the OpenMP thread count of the thread its forward runs on."""

    def __init__(self, seen):
        super().__init__()
        self.seen, self.query = seen, _omp_max_threads()

    def forward(self, x):
        self.seen.append(self.query())
        return x * 2


@pytest.mark.skipif(_omp_max_threads() is None, reason="torch is not built with OpenMP here")
def test_ranks_use_the_callers_intra_op_thread_count():
    # A lane thread keeps OpenMP's default (one thread per core) unless the
    # caller's torch.set_num_threads reaches it: a count above the default
    # tells the two apart on any machine.
    wanted = torch.get_num_threads()
    seen = []
    pipe = Pipe(nn.Sequential(_ThreadCount(seen), nn.Linear(4, 4), _ThreadCount(seen)), chunks=2,
                devices=["cpu", "cpu"], balance=[2, 1], overlap=True)
    try:
        for n in (wanted + 2, 1):
            torch.set_num_threads(n)
            seen.clear()
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
            assert seen and set(seen) == {n}
    finally:
        torch.set_num_threads(wanted)
        pipe.close()


@pytest.mark.parametrize("schedule,checkpoint", [("1f1b", "never"), ("zb-h1", "never"),
                                                 ("gpipe", "always")])
def test_step_under_autocast_matches_the_amp_loop(schedule, checkpoint):
    # Autocast is thread-local: the ranks' lanes get the caller's region for
    # forwards (and recomputation) and run backward outside it.
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    ref = amp_model()
    dtypes = amp_reference(ref, x, y, 4)
    assert set(dtypes) == {torch.bfloat16}  # the region does change the arithmetic
    model = amp_model()
    pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"], checkpoint=checkpoint)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(x, y, F.mse_loss)
            out = pipe(x)
        assert out.dtype == torch.bfloat16
        assert pipe(x).dtype == torch.float32  # and nothing of it stays behind
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        pipe.close()


def test_meta_swap_keeps_shapes_sharing_and_buffers():
    """What free_remote does to another rank's layer: every parameter and
    buffer becomes a meta tensor of the same shape, dtype and requires_grad;
    a parameter used twice in the layer stays one parameter."""
    from fastpipe._stages import to_meta

    lin = nn.Linear(3, 3)
    layer = nn.Sequential(lin, nn.BatchNorm1d(3), lin).double()
    layer[1].weight.requires_grad_(False)
    before = {n: (t.shape, t.dtype, t.requires_grad) for n, t in layer.state_dict(keep_vars=True).items()}
    to_meta(layer)
    after = layer.state_dict(keep_vars=True)
    assert {n: (t.shape, t.dtype, t.requires_grad) for n, t in after.items()} == before
    assert all(t.is_meta for t in after.values())
    assert layer[0].weight is layer[2].weight and isinstance(layer[0].weight, nn.Parameter)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_model_built_on_meta_is_made_on_the_devices_and_refused_until_written(schedule):
    """Built under torch.device("meta"): the stages' tensors are made on their
    devices in place (the model's Parameter objects with their attributes, a
    tie inside one rank kept), a step or a forward before they are written
    names them, also after what rewrites memory without loading it (DCP's
    optimizer-state set-up steps AdamW at lr 0, a dtype cast), and once
    loaded the step is the unsplit model's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tests.models import gpt, gpt_batch, lm_loss, tied_embedding_model

    x, y = gpt_batch(8)
    with torch.device("meta"):
        model = gpt()
    params = list(model.parameters())
    params[0].no_decay = True  # a tag an optimizer's groups may read
    balance = [1, 2, 2, 1] if schedule == "zbv" else [3, 3]
    pipe = Pipe(model, chunks=4, schedule=schedule, balance=balance, devices=["cpu", "cpu"],
                stages_per_rank=SPR.get(schedule))
    try:
        assert list(model.parameters()) == params and all(p.device.type == "cpu" for p in params)
        assert params[0].no_decay and type(params[0]) is nn.Parameter
        get_state_dict(pipe, torch.optim.AdamW(pipe.parameters()))
        model.float().double()  # new memory, still NaN
        for call in (lambda: pipe.step(x, y, lm_loss), lambda: pipe(x)):
            with pytest.raises(ValueError, match=r"^0\.tokens\.weight and \d+ more came from the meta "
                                                 r"device and nothing has written them"):
                call()
        ref = gpt()
        pipe.load_state_dict(ref.state_dict())
        loss = pipe.step(x, y, lm_loss)
        ref_loss, ref_grads = reference(ref, x, y, lm_loss, 4)
        torch.testing.assert_close(loss, ref_loss)
        for name, g in ref_grads.items():
            torch.testing.assert_close(model.get_parameter(name).grad, g, msg=name)
    finally:
        pipe.close()
    with torch.device("meta"):
        tied = tied_embedding_model()
    pipe = Pipe(tied, chunks=2, schedule="zbv", balance=[1, 2, 1, 2], devices=["cpu", "cpu"])
    try:
        assert tied[4].weight is tied[0].weight and not tied[0].weight.is_meta
        with torch.no_grad():  # an initialization in place counts as written
            for layer in tied:
                if hasattr(layer, "reset_parameters"):
                    layer.reset_parameters()
        pipe.step(torch.randint(0, 11, (4, 3)), torch.randn(4, 3, 3, dtype=torch.float64), F.mse_loss)
    finally:
        pipe.close()
    with torch.device("meta"):  # the tie across the two ranks (a replica on rank 1)
        tied = tied_embedding_model()
    pipe = Pipe(tied, chunks=2, schedule="1f1b", balance=[2, 4], devices=["cpu", "cpu"])
    try:
        ref = tied_embedding_model()
        pipe.load_state_dict(ref.state_dict())
        x, y = torch.randint(0, 11, (4, 3)), torch.randn(4, 3, 3, dtype=torch.float64)
        loss = pipe.step(x, y, F.mse_loss)
        ref_loss, ref_grads = reference(ref, x, y, F.mse_loss, 2)
        torch.testing.assert_close(loss, ref_loss)
        for name, g in ref_grads.items():
            torch.testing.assert_close(tied.get_parameter(name).grad, g, msg=name)
    finally:
        pipe.close()


def test_a_second_pipe_over_an_unwritten_meta_model_refuses_too():
    with torch.device("meta"):
        model = mlp()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for balance in ([2, 4], [5, 1]):  # the second Pipe finds nothing on meta any more
        pipe = Pipe(model, chunks=2, schedule="1f1b", balance=balance, devices=["cpu", "cpu"])
        with pytest.raises(ValueError, match="came from the meta device and nothing has written"):
            pipe.step(x, y, F.mse_loss)
        pipe.close()
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    pipe.load_state_dict(mlp().state_dict())
    pipe.step(x, y, F.mse_loss)
    pipe.close()
    assert not any(hasattr(p, "_fastpipe_made") for p in model.parameters())  # checked once


def test_a_model_on_meta_needs_a_balance():
    from fastpipe import plan

    with torch.device("meta"):
        model = mlp()
    message = r"layer 0 \(Linear\) is on the meta device \(no data\): balance='auto' and fastpipe.plan"
    pipe = Pipe(model, chunks=2, schedule="1f1b", balance="auto", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match=message):
        pipe.step(torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
                  F.mse_loss)
    pipe.close()
    with pytest.raises(ValueError, match=message):
        plan(model, torch.randn(4, 5, dtype=torch.float64), ranks=2, chunks=[2])


@pytest.mark.parametrize("copies", [False, True], ids=["handover", "copy-lanes"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
def test_a_step_leaves_no_reference_cycles(schedule, copies, monkeypatch):
    """What a step leaves behind is freed when the step returns, not when the
    garbage collector next runs: on a GPU a cycle through the executor kept
    each step's inputs and results alive for several steps."""
    import gc

    monkeypatch.setenv("FASTPIPE_CHAIN", "0")  # autograd's path, as on a GPU
    monkeypatch.setenv("FASTPIPE_COPY_LANES", "1" if copies else "0")  # 1: the GPU's copy path, on host lanes
    torch.manual_seed(0)
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    pipe = Pipe(mlp(depth=8), chunks=4, schedule=schedule, devices=["cpu"] * 2,
                stages_per_rank=SPR.get(schedule))
    assert pipe._runner.copies == copies
    try:
        for _ in range(2):
            pipe.step(x, y, F.mse_loss)
        gc.collect()
        gc.disable()
        try:
            for _ in range(2):
                pipe.step(x, y, F.mse_loss)
                with torch.no_grad():
                    pipe(x)
            assert gc.collect() == 0
        finally:
            gc.enable()
    finally:
        pipe.close()


def test_a_local_step_can_run_under_a_shorter_switch_interval(monkeypatch):
    """FASTPIPE_SWITCH_INTERVAL (a measured lead, off by default) applies only
    while the ranks run, and the interpreter's own value is back afterwards."""
    import sys

    from fastpipe.runtime import threads

    seen = []
    real = threads.switch_interval

    def spy(seconds):
        seen.append(seconds)
        return real(seconds)

    monkeypatch.setattr("fastpipe._local_run.switch_interval", spy)
    default = sys.getswitchinterval()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    inside = []
    for interval in (None, threads.SHORT_SWITCH_INTERVAL):
        if interval is not None:
            monkeypatch.setenv("FASTPIPE_SWITCH_INTERVAL", str(interval))
        pipe = Pipe(mlp(depth=6), chunks=2, schedule="1f1b", devices=["cpu"] * 2)
        try:
            assert pipe.settings.switches.switch_interval == interval
            if interval is not None:
                pipe._stages[0][0].module.register_forward_hook(
                    lambda *a: inside.append(sys.getswitchinterval()))
            pipe.step(x, y, F.mse_loss)
        finally:
            pipe.close()
    assert seen == [None, threads.SHORT_SWITCH_INTERVAL]
    assert inside and all(abs(v - threads.SHORT_SWITCH_INTERVAL) < 1e-6 for v in inside)
    assert sys.getswitchinterval() == default
    with threads.switch_interval(default * 2):  # never raised
        assert sys.getswitchinterval() == default


def test_the_profiler_sees_every_action():
    """Under torch.profiler each action is a range named after it. Local
    ranks are threads of their own: the profiler records them when told to
    record every thread."""
    from torch.profiler import profile

    pipe = Pipe(mlp(), chunks=2, schedule="zb-h1", devices=["cpu", "cpu"])
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    try:
        with profile(experimental_config=every_thread) as prof:
            pipe.step(x, y, F.mse_loss)
        names = {e.name for e in prof.events() if e.name.startswith("fastpipe.")}
        assert {"fastpipe.F stage=0 mb=0", "fastpipe.I stage=1 mb=1", "fastpipe.W stage=0 mb=1",
                "fastpipe.SEND_F stage=0 mb=1", "fastpipe.RECV_B stage=0 mb=0"} <= names
        assert len([n for n in names if n.startswith("fastpipe.F ")]) == 4  # 2 stages x 2 microbatches
    finally:
        pipe.close()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_grad_scaler_scales_the_backward_and_not_the_loss(schedule):
    """step(scaler=): .grad holds scale × the gradients, the loss comes back
    unscaled, and scaler.step/update then train as in the usual AMP loop."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    ref_loss, ref_grads = reference(mlp(depth=8), x, y, F.mse_loss, 4)
    model = mlp(depth=8)
    pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu"] * 2, stages_per_rank=SPR.get(schedule))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    try:
        loss = pipe.step(x, y, F.mse_loss, scaler=scaler)
        torch.testing.assert_close(loss, ref_loss)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name] * 1024.0, msg=name)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.step(opt)  # unscales, finds no inf, steps
        scaler.update()
        assert scaler.get_scale() == 1024.0  # grows only after growth_interval steps without inf
        disabled = torch.amp.GradScaler("cpu", enabled=False)
        model.zero_grad()
        torch.testing.assert_close(pipe.step(x, y, F.mse_loss, scaler=disabled),
                                   pipe.step(x, y, F.mse_loss))
    finally:
        pipe.close()
