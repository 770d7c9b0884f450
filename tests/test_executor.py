"""The executor on the IR alone, and the I/W split of one stage's backward."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn

from fastpipe._microbatch import TENSOR, needs_grad, to_device
from fastpipe.runtime import deferred
from fastpipe.runtime._backward import backward_full
from tests.models import mlp, tuple_model


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _split(model, x, g, keep_graph=False, roots=None):
    """I then W of one microbatch, as a split schedule runs them
    (fastpipe.runtime.deferred): returns the input gradients, and what
    .grad held after I (by parameter name)."""
    layers = deferred.install(model)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            out = model(x)
        grads = deferred.backward_input([out] if roots is None else roots, [g], [x],
                                        list(model.parameters()), pending, keep_graph)
        after_i = {n: p.grad is not None for n, p in model.named_parameters()}
        deferred.run_weight(pending.entries, calls=pending.calls)
    finally:
        deferred.uninstall(layers)
    return grads, after_i


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
        grads, after_i = _split(split, xb, g)
        assert not any(after_i.values())  # I alone touched no parameter gradient
        torch.testing.assert_close(grads[0], xa.grad)
        for a, b in zip(_grads(full), _grads(split)):
            torch.testing.assert_close(a, b)


def test_first_stage_without_input_grad_runs_all_in_w():
    torch.manual_seed(1)
    model, ref = mlp(), mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    g = torch.randn(4, 3, dtype=torch.float64)
    backward_full([ref(x)], [g])
    grads, after_i = _split(model, x, g)
    assert grads == [None] and not any(after_i.values())
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
    grads, after_i = _split(split, xb, g)
    # The custom Function's weight has no rule: autograd's, in I; the Linears' wait for W.
    assert after_i == {"0.weight": False, "0.bias": False, "1.w": True, "2.weight": False,
                       "2.bias": False}
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
    layers = deferred.install(model) if split else []
    pending = deferred.Pending()
    with deferred.collecting(pending) if split else contextlib.nullcontext():
        out = model(x)
    deferred.uninstall(layers)
    roots, grads = [torch.autograd.graph.get_gradient_edge(out)], [torch.ones_like(out)]
    del out
    if split:
        got = deferred.backward_input(roots, grads, [x], list(model.parameters()), pending,
                                      keep_graph=True)
        assert all(r() is not None for r in refs)
        deferred.run_weight(pending.entries, calls=pending.calls)
        assert all(r() is not None for r in refs)  # W's work went, the roots not yet
    else:
        backward_full(roots, grads, keep_graph=True)
        got = [x.grad]
        assert all(r() is not None for r in refs)
    del roots
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
    """I and W add into existing ``.grad`` and fire post-accumulate hooks once
    per parameter, as ``loss.backward()`` does (optimizer-in-backward relies
    on it): a watched parameter keeps autograd's path, so they fire in I."""
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
    _split(model, x, g)
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
    grads, _ = _split(model, xb, g)
    torch.testing.assert_close(grads[0], expected[0])
    for p, e in zip(model.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.parametrize("spec", [True, (3, "x", TENSOR, None, TENSOR, TENSOR, TENSOR, TENSOR)])
def test_packed_message_round_trip_keeps_dtypes_shapes_grad_flags_and_values(spec):
    from fastpipe.runtime.packing import Layout, pack_into
    from fastpipe.runtime.transport.wire import encode_head, prefixed, read_head, received, write_head

    tensors = [
        torch.randn(3, 5, requires_grad=True),
        torch.arange(7, dtype=torch.int64),
        torch.ones(2, 2, dtype=torch.bool),
        torch.empty(0, 4, dtype=torch.float16),
        torch.randn(6, 4).t(),  # non-contiguous
    ]
    layout = Layout.plan(tensors)
    head = encode_head(layout, spec, [needs_grad(t) for t in tensors])
    start = prefixed(head)
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
            holds_buffer = False

            def wait(self):
                transport.on_recv(key)
                shape = transport.sent[("F", 1, key[2])][0].shape
                return [torch.ones(shape, dtype=torch.float64)], False

            def release(self):
                pass

        return Pending()

    def finish(self):
        pass


@pytest.mark.parametrize("fused", [True, False])
def test_stage_output_is_freed_once_sent(fused):
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
    ex = RankExecutor(0, schedule, {0: stage}, transport, fused_wgrad=fused)
    inputs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    ex.run(inputs, None, None, train=True)
    assert alive_at_backward == [False, False]
    assert layer.weight.grad is not None


def test_a_batch_moves_to_the_device_as_a_whole_with_its_structure():
    """Pipe.step moves x and target once, on the caller's thread
    (``to_device``): tensors move, other tuple members stay as they are."""
    x, mask = torch.randn(4, 3), torch.ones(4, dtype=torch.bool)
    moved = to_device((x, mask, 7), torch.device("meta"))
    assert [type(v) for v in moved] == [torch.Tensor, torch.Tensor, int] and moved[2] == 7
    assert all(v.device.type == "meta" for v in moved[:2]) and moved[1].dtype == torch.bool
    assert to_device(x, torch.device("cpu")) is x and to_device([x], torch.device("meta")) == [x]
