"""The executor on the IR alone, and the I/W split of one stage's backward."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from fastpipe._microbatch import TENSOR, needs_grad
from fastpipe.runtime._backward import backward_full, backward_input, backward_weight
from tests.models import mlp, tuple_model


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_input_then_weight_equals_full_backward():
    torch.manual_seed(0)
    for build in (mlp, tuple_model):
        full, split = build(), build()
        x = torch.randn(7, 5, dtype=torch.float64)
        out = full(x.clone().requires_grad_())
        g = torch.randn_like(out)
        xa = x.clone().requires_grad_()
        out = full(xa)
        backward_full([out], [g])
        xb = x.clone().requires_grad_()
        out_b = split(xb)
        grads, work = backward_input([out_b], [g], [xb], list(split.parameters()))
        # I alone touched no parameter gradient.
        assert all(p.grad is None for p in split.parameters())
        backward_weight(work)
        torch.testing.assert_close(grads[0], xa.grad)
        for a, b in zip(_grads(full), _grads(split)):
            torch.testing.assert_close(a, b)


def test_weight_gradients_through_the_workspace_are_bit_identical(monkeypatch):
    """W with a workspace (a reused buffer per weight shape, accumulated by
    autograd from the AccumulateGrad nodes) gives the same bits as W
    restarting autograd at each Linear, microbatch after microbatch: Linears
    with and without bias and on a 3-D input. A weight with a tensor hook,
    and the first accumulation (no .grad yet), keep the restart; the hook
    still runs once per microbatch."""
    def build():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6, bias=False),
                             nn.Unflatten(1, (2, 3)), nn.Linear(3, 3), nn.Flatten(1),
                             nn.Linear(6, 3)).double()

    from fastpipe.runtime import _backward

    monkeypatch.setattr(_backward, "_WORKSPACE_MIN_BYTES", 0)  # these weights are tiny
    torch.manual_seed(4)
    batches = [(torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
               for _ in range(3)]
    results, used = [], []
    for workspace in (None, {}):
        model = build()
        calls = []
        model[6].weight.register_hook(lambda g: calls.append(1))
        for x, g in batches:
            x = x.requires_grad_()
            grads, work = backward_input([model(x)], [g], [x], list(model.parameters()))
            backward_weight(work, workspace=workspace)
        results.append(([p.grad for p in model.parameters()], grads[0]))
        used.append(sorted(k[0] for k in workspace) if workspace is not None else None)
        assert len(calls) == len(batches)
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][1], results[1][1])
    assert used[1] == [(3, 3), (6, 5), (6, 6)]  # not the hooked (3, 6) weight


def test_small_weights_keep_the_restart():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    workspace: dict = {}
    for _ in range(2):
        x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
        _, work = backward_input([model(x)], [torch.ones(4, 3, dtype=torch.float64)], [x],
                                 list(model.parameters()))
        backward_weight(work, workspace=workspace)
    assert workspace == {}


def test_first_stage_without_input_grad_runs_all_in_w():
    torch.manual_seed(1)
    model, ref = mlp(), mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    g = torch.randn(4, 3, dtype=torch.float64)
    backward_full([ref(x)], [g])
    grads, work = backward_input([model(x)], [g], [x], list(model.parameters()))
    assert grads == [None]
    backward_weight(work)
    for a, b in zip(_grads(ref), _grads(model)):
        torch.testing.assert_close(a, b)


class _TwoOut(torch.autograd.Function):
    """A node with two inputs in backward, one of which gets no gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w, x * 2

    @staticmethod
    def backward(ctx, a, b):
        x, w = ctx.saved_tensors
        gx = a @ w.t() if a is not None else None
        if b is not None:
            gx = gx + 2 * b if gx is not None else 2 * b
        return gx, x.t() @ a if a is not None else None


class _TwoOutLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))

    def forward(self, x):
        y, _unused = _TwoOut.apply(x, self.w)
        return torch.tanh(y)


def test_split_backward_through_a_node_whose_second_output_is_unused():
    torch.manual_seed(4)
    full, split = (nn.Sequential(nn.Linear(5, 5).double(), _TwoOutLayer(), nn.Linear(5, 5).double())
                   for _ in range(2))
    split.load_state_dict(full.state_dict())
    x = torch.randn(3, 5, dtype=torch.float64)
    g = torch.randn(3, 5, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    backward_full([full(xa)], [g])
    grads, work = backward_input([split(xb)], [g], [xb], list(split.parameters()))
    assert all(p.grad is None for p in split.parameters())
    backward_weight(work)
    torch.testing.assert_close(grads[0], xa.grad)
    for a, b in zip(_grads(full), _grads(split)):
        torch.testing.assert_close(a, b)


class _Watched(nn.Module):
    """A layer that keeps a weak reference to each tensor it saves for backward."""

    def __init__(self, refs):
        super().__init__()
        self.lin, self.refs = nn.Linear(5, 5).double(), refs

    def forward(self, x):
        h = self.lin(x)
        self.refs.append(weakref.ref(h))
        return h * h  # mul saves h itself (its own Python object)


@pytest.mark.parametrize("split", [False, True])
def test_kept_graph_frees_saved_tensors_with_its_roots(split):
    """keep_graph=True (local mode): the engine frees nothing, so the saved
    tensors stay until the roots go, and then go at once (no leak)."""
    refs = []
    model = nn.Sequential(_Watched(refs), _Watched(refs))
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad(model(x).sum(), [x] + list(model.parameters()))
    refs.clear()
    out = model(x)
    roots, grads = [torch.autograd.graph.get_gradient_edge(out)], [torch.ones_like(out)]
    del out
    if split:
        got, work = backward_input(roots, grads, [x], list(model.parameters()), keep_graph=True)
        assert all(r() is not None for r in refs)
        backward_weight(work, keep_graph=True)
        assert all(r() is not None for r in refs)  # the edges of W went, the roots not yet
    else:
        backward_full(roots, grads, keep_graph=True)
        got = [x.grad]
        assert all(r() is not None for r in refs)
    del roots
    if split:
        del work
    assert [r() for r in refs] == [None, None]
    torch.testing.assert_close(got[0], ref[0])
    for p, g in zip(model.parameters(), ref[1:]):
        torch.testing.assert_close(p.grad, g)


def test_backward_frees_as_it_goes_by_default():
    refs = []
    model = _Watched(refs)
    out = model(torch.randn(3, 5, dtype=torch.float64))
    roots = [torch.autograd.graph.get_gradient_edge(out)]
    grads = [torch.ones_like(out)]
    del out
    backward_full(roots, grads)
    assert refs[0]() is None


def test_local_step_leaves_no_graph_alive():
    """Local mode keeps graphs through backward; after the step none is left."""
    from fastpipe import Pipe

    refs = []
    model = nn.Sequential(_Watched(refs), _Watched(refs), _Watched(refs), _Watched(refs))
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    for schedule, checkpoint, forwards in (("1f1b", "never", 16), ("zb-h1", "never", 16),
                                           ("1f1b", "always", 32)):  # recomputed: twice
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"],
                    checkpoint=checkpoint)
        pipe.step(x, y, nn.functional.mse_loss)
        pipe.close()
        assert len(refs) == forwards
        assert all(r() is None for r in refs), (schedule, checkpoint)
        refs.clear()


@pytest.mark.parametrize("input_grad", [True, False])
def test_weight_backward_accumulates_like_a_plain_backward(input_grad):
    """W adds into existing ``.grad`` and fires post-accumulate hooks once per
    parameter, as ``loss.backward()`` does (optimizer-in-backward relies on it)."""
    torch.manual_seed(3)
    model, ref = mlp(), mlp()
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=input_grad)
    g = torch.randn(4, 3, dtype=torch.float64)
    backward_full([ref(x)], [g])
    _, work = backward_input([model(x)], [g], [x], list(model.parameters()))
    assert not fired  # I touches no parameter
    backward_weight(work)
    assert sorted(fired) == sorted(id(p) for p in model.parameters())
    for a, b in zip(_grads(ref), _grads(model)):
        torch.testing.assert_close(a, b)


def test_weight_shared_inside_a_stage_counts_both_uses():
    torch.manual_seed(2)
    shared = nn.Linear(4, 4).double()
    model = nn.Sequential(shared, nn.Tanh(), shared)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    expected = torch.autograd.grad(model(x), [x, *model.parameters()], g)
    xb = x.detach().requires_grad_()
    grads, work = backward_input([model(xb)], [g], [xb], list(model.parameters()))
    backward_weight(work)
    torch.testing.assert_close(grads[0], expected[0])
    for p, e in zip(model.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("spec", [True, (3, "x", TENSOR, None, TENSOR, TENSOR, TENSOR, TENSOR)])
def test_packed_message_round_trip_keeps_dtypes_shapes_grad_flags_and_values(spec):
    from fastpipe.runtime.packing import Layout, pack_into
    from fastpipe.runtime.transport import encode_head, read_head, received, write_head, _prefixed

    tensors = [
        torch.randn(3, 5, requires_grad=True),
        torch.arange(7, dtype=torch.int64),
        torch.ones(2, 2, dtype=torch.bool),
        torch.empty(0, 4, dtype=torch.float16),
        torch.randn(6, 4).t(),  # non-contiguous
    ]
    layout = Layout.plan(tensors)
    head = encode_head(layout, spec, [needs_grad(t) for t in tensors])
    start = _prefixed(head)
    buf = torch.empty(start + layout.nbytes, dtype=torch.uint8)
    write_head(buf, head)
    pack_into(buf[start:], tensors, layout)
    # The receiver may post a larger buffer than the message: trailing bytes are ignored.
    bigger = torch.cat([buf, torch.zeros(64, dtype=torch.uint8)])
    got_start, flags, got_layout, got_spec, grads = read_head(bigger)
    assert (got_start, flags, got_layout, got_spec) == (start, 0, layout, spec)
    assert read_head(buf)[2] is got_layout  # decoded once per distinct head
    out = received(bigger, start, got_layout, grads)
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.detach(), b)
        assert b.requires_grad == (a.requires_grad and a.is_floating_point())


class _CopyTransport:
    """Stands in for rank 1: keeps copies of what is sent, answers with unit gradients."""

    posts_ahead = False

    def __init__(self, on_recv):
        self.sent, self.on_recv = {}, on_recv

    def begin(self, actions):
        pass

    def send(self, tensors, is_tuple, dst, key):
        self.sent[key] = [t.detach().clone() for t in tensors]

    def recv(self, src, key):
        transport = self

        class Pending:
            def wait(self):
                transport.on_recv(key)
                shape = transport.sent[("F", 1, key[2])][0].shape
                return [torch.ones(shape, dtype=torch.float64)], False

            def release(self):
                pass

        return Pending()

    def finish(self):
        pass


def test_stage_output_is_freed_once_sent():
    import weakref

    from fastpipe.runtime.executor import RankExecutor, Stage
    from fastpipe.schedules import build, lower

    layer = nn.Linear(4, 4).double()  # addmm does not save its output for backward
    outputs: dict[int, weakref.ref] = {}

    def keep_ref(module, args, out):
        outputs[len(outputs)] = weakref.ref(out)

    layer.register_forward_hook(keep_ref)
    alive_at_backward = []
    transport = _CopyTransport(lambda key: alive_at_backward.append(outputs[key[2]]() is not None))
    stage = Stage(0, nn.Sequential(layer), torch.device("cpu"))
    schedule = lower(build("gpipe", 2, 2))
    ex = RankExecutor(0, schedule, {0: stage}, transport)
    inputs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    ex.run(inputs, None, None, train=True)
    assert alive_at_backward == [False, False]
    assert layer.weight.grad is not None
