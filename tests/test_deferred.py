"""Deferred weight gradients (fastpipe.runtime.deferred): each rule against autograd.

A forward under ``collecting``, one backward (I: input gradients only),
then ``run_weight`` (W) must leave the gradients a plain backward leaves:
bit for bit with ``fuse=False`` (autograd's own rounding), to rounding with
the fused GEMMs. Layers that cannot defer must fall back, not lose gradients.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime import deferred, weight_rules
from tests import models


def _split(model: nn.Module, x: torch.Tensor, fuse: bool, seed_grad: torch.Tensor | None = None,
           kept: dict | None = None):
    """I then W of one microbatch through ``model`` (``kept``: the plans kept
    between steps, as a stage keeps them); returns the input gradient, the
    Pending's entry count and what .grad held after I."""
    layers = deferred.install(model, kept)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            out = model(x)
        g = seed_grad if seed_grad is not None else torch.ones_like(out)
        (gx,) = deferred.backward_input([out], [g], [x], list(model.parameters()), pending)
        after_i = {n: p.grad is not None for n, p in model.named_parameters()}
        count = len(pending)
        deferred.run_weight(pending.entries, fuse=fuse, calls=pending.calls)
    finally:
        deferred.uninstall(layers)
    return gx, count, after_i


class Conv1DLike(nn.Module):
    """GPT-2's Conv1D as transformers writes it, without transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class RMSNormLike(nn.Module):
    """The Llama family's RMSNorm as transformers writes it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RMSNormScaledInFloat(RMSNormLike):
    """Another formula (the weight applied before the cast back): not the rule's."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


LAYERS = {
    "linear-2d": (lambda: nn.Linear(7, 5), (3, 7)),
    "linear-3d-no-bias": (lambda: nn.Linear(7, 5, bias=False), (2, 3, 7)),
    "layernorm": (lambda: nn.LayerNorm(7), (2, 3, 7)),
    "layernorm-no-bias": (lambda: nn.LayerNorm(7, bias=False), (4, 7)),
    "rmsnorm": (lambda: nn.RMSNorm(7), (2, 3, 7)),
    "hf-conv1d": (lambda: Conv1DLike(5, 7), (2, 3, 7)),
    "hf-rmsnorm": (lambda: RMSNormLike(7), (2, 3, 7)),
}
GATHERED = {"linear-2d", "linear-3d-no-bias", "hf-conv1d"}  # fused: one GEMM, other rounding


@pytest.fixture(params=["native", "python"])
def w_path(request, monkeypatch):
    """W through fastpipe._chain (where built), and through the rules' torch ops."""
    if request.param == "python":
        monkeypatch.setattr(deferred, "native_chain", lambda: None)
    elif deferred.native_chain() is None:
        pytest.skip("fastpipe._chain is not built")
    return request.param


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("name", list(LAYERS) + ["embedding"])
def test_rule_matches_autograd(name, fuse, w_path):
    if name == "embedding":
        _embedding_rule_with_padding_and_frequency_scaling(fuse)
        return
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = nn.Sequential(build(), nn.Tanh()).double()
    ref = copy.deepcopy(layer)
    for step in range(2):  # into a missing .grad, then into an existing one
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        g = torch.randn(shape[:-1] + (layer[0](x).shape[-1],), dtype=torch.float64)
        gx, count, after_i = _split(layer, x, fuse, g)
        assert count == 1  # the layer deferred
        assert step or not any(after_i.values())  # and I left its .grad alone
        xr = x.detach().clone().requires_grad_()
        ref(xr).backward(g)
        torch.testing.assert_close(gx, xr.grad, rtol=0, atol=0)
    exact = {"rtol": 0, "atol": 0} if not fuse or name not in GATHERED else {}
    for (n, p), q in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n, **exact)


def _embedding_rule_with_padding_and_frequency_scaling(fuse: bool):
    """Into a missing .grad (autograd's table), then into an existing one
    (fused: the rows added in place, a padding row's gradient masked), with
    one microbatch or two gathered."""
    torch.manual_seed(0)
    for kwargs in ({}, {"padding_idx": 2}, {"scale_grad_by_freq": True}):
        emb = nn.Embedding(9, 4, **kwargs).double()
        ref = copy.deepcopy(emb)
        batches = [torch.tensor([[1, 2, 2, 5], [2, 8, 1, 0]]), torch.tensor([[2, 3, 3, 8]]),
                   torch.tensor([[0, 2, 7, 7], [1, 1, 2, 6]])]
        layers = deferred.install(emb)
        try:
            for group in (batches[:1], batches[1:]):
                entries, blocks = [], []
                for ids in group:
                    pending = deferred.Pending()
                    with deferred.collecting(pending):
                        out = emb(ids)
                    loss = out.pow(2).sum()
                    before = None if emb.weight.grad is None else emb.weight.grad.clone()
                    deferred.backward_input([loss], [None], [ids], [emb.weight], pending)
                    assert len(pending) == 1  # all of it is W's
                    torch.testing.assert_close(emb.weight.grad, before, rtol=0, atol=0)
                    entries += pending.entries
                    blocks += pending.calls
                deferred.run_weight(entries, fuse=fuse, calls=blocks)
        finally:
            deferred.uninstall(layers)
        for ids in batches:
            ref(ids).pow(2).sum().backward()
        exact = {"rtol": 0, "atol": 0} if not fuse else {}
        torch.testing.assert_close(emb.weight.grad, ref.weight.grad, **exact)
        if "padding_idx" in kwargs:
            assert not emb.weight.grad[2].any()


@pytest.mark.parametrize("name", ["hf-conv1d", "hf-rmsnorm"])
def test_recognised_layers_defer_under_autocast_as_autograd_computes(name):
    """bf16 autocast: the deferring forward's output, the input gradient and
    the weight gradients (W per microbatch) are the plain layer's bit for bit."""
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = build()
    ref = copy.deepcopy(layer)
    xs = [torch.randn(shape, requires_grad=True) for _ in range(2)]
    layers = deferred.install(layer)
    outs, gxs = [], []
    try:
        for x in xs:
            pending = deferred.Pending()
            with deferred.collecting(pending), torch.autocast("cpu", torch.bfloat16):
                out = layer(x)
            outs.append(out)
            before = [p.grad for p in layer.parameters()]
            gxs += deferred.backward_input([out], [torch.ones_like(out)], [x],
                                           list(layer.parameters()), pending)
            assert len(pending) == 1
            assert all(p.grad is b for p, b in zip(layer.parameters(), before))
            # One microbatch at a time, as the executor runs W under autocast.
            deferred.run_weight(pending.entries, fuse=True, calls=pending.calls)
    finally:
        deferred.uninstall(layers)
    for x, out, gx in zip(xs, outs, gxs):
        xr = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            want = ref(xr)
        want.backward(torch.ones_like(want))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(gx, xr.grad, rtol=0, atol=0)
    for p, q in zip(layer.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_layers_are_recognised_by_their_forwards_code():
    """A class is deferred when its forward is the reference formula, under
    any name; an edited formula keeps the plain backward."""
    assert isinstance(deferred.rule_for(Conv1DLike), weight_rules.Conv1DRule)
    assert isinstance(deferred.rule_for(RMSNormLike), weight_rules.ScaledRMSNormRule)
    assert deferred.rule_for(RMSNormScaledInFloat) is None
    assert deferred.rule_for(nn.GELU) is None
    layer = nn.Sequential(RMSNormScaledInFloat(4), Conv1DLike(3, 4))
    x = torch.randn(2, 4, requires_grad=True)
    _, count, after_i = _split(layer, x, fuse=True)
    assert count == 1 and after_i == {"0.weight": True, "1.weight": False, "1.bias": False}


class InitLinear(nn.Linear):
    """A Linear that only initialises differently: it inherits the forward."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.5)
        nn.init.zeros_(self.bias)


def test_subclasses_that_keep_the_forward_defer_and_parametrized_weights_do_not():
    """A subclass inheriting the registered forward defers; a parametrized
    Linear (its weight computed from others: no leaf) keeps autograd, and
    its gradients reach the parametrization's own parameters."""
    assert isinstance(deferred.rule_for(InitLinear), weight_rules.LinearRule)
    assert isinstance(deferred.rule_for(nn.modules.linear.NonDynamicallyQuantizableLinear),
                      weight_rules.LinearRule)
    torch.manual_seed(0)
    model = nn.Sequential(InitLinear(4, 4), nn.Tanh(),
                          nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))).double()
    assert isinstance(deferred.rule_for(type(model[2])), weight_rules.LinearRule)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    _, count, after_i = _split(model, x, fuse=False)
    assert count == 1 and not after_i["0.weight"] and after_i["2.parametrizations.weight.original0"]
    ref(x.detach().requires_grad_()).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_transformers_layers_are_recognised():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    assert isinstance(deferred.rule_for(transformers.pytorch_utils.Conv1D), weight_rules.Conv1DRule)
    for norm in (LlamaRMSNorm, Qwen2RMSNorm):
        assert isinstance(deferred.rule_for(norm), weight_rules.ScaledRMSNormRule), norm
    assert deferred.rule_for(GemmaRMSNorm) is None  # (1 + weight), scaled in float32
    block = models.hf_gpt2_lm().transformer.h[0]
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    layers = deferred.install(block)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            block(x)
        # 4 Conv1Ds and 2 LayerNorms of the block defer their weight
        # gradients (native W: in a block of calls, not entries).
        deferring = [m.weight for m in block.modules() if type(m).__name__ in ("Conv1D", "LayerNorm")]
        assert len(deferring) == 6 and not pending.entries
        assert [id(w) for c in pending.calls for w in c.weights] == [id(w) for w in deferring]
    finally:
        deferred.uninstall(layers)


NATIVE_FORWARD_LAYERS = {  # the rules with a C++ forward (WeightRule._fast)
    **{name: layer for name, layer in LAYERS.items() if name != "hf-rmsnorm"},
    "embedding": (lambda: nn.Embedding(9, 7), None),
    "embedding-padding": (lambda: nn.Embedding(9, 7, padding_idx=2), None),
    "embedding-frequency": (lambda: nn.Embedding(9, 7, scale_grad_by_freq=True), None),
}


def _calls(name: str, autocast: bool, path: str, monkeypatch) -> tuple[list, list, list, int]:
    """Three microbatches through one layer (+ Tanh) under ``collecting``,
    deferred by the native forward or the Python one; returns the outputs,
    the input gradients after I, the parameter gradients after W, and how
    many calls the Python forward ran."""
    build, shape = NATIVE_FORWARD_LAYERS[name]
    torch.manual_seed(0)
    layer = nn.Sequential(build(), nn.Tanh())
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 9, (2, 5), generator=gen) if shape is None else
          torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3)]
    slow = []
    real = deferred._Forward.__call__
    with monkeypatch.context() as m:
        if path == "python":
            m.setattr(deferred, "native_chain", lambda: None)
        m.setattr(deferred._Forward, "__call__", lambda self, *a, **k: slow.append(1) or real(self, *a, **k))
        layers = deferred.install(layer)
        outs, gxs, entries, blocks = [], [], [], []
        try:
            for x in xs:
                pending = deferred.Pending()
                with deferred.collecting(pending), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    out = layer(x)
                outs.append(out.detach())
                leaves = [x] if x.requires_grad else []
                gxs += deferred.backward_input([out], [torch.ones_like(out)], leaves,
                                               list(layer.parameters()), pending)
                assert len(pending) == 1
                entries += pending.entries
                blocks += pending.calls
            deferred.run_weight(entries, fuse=False, calls=blocks)
        finally:
            deferred.uninstall(layers)
    return outs, gxs, [p.grad for p in layer.parameters()], len(slow)


@pytest.mark.skipif(deferred.native_chain() is None, reason="fastpipe._chain is not built")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("name", list(NATIVE_FORWARD_LAYERS))
def test_native_forward_is_the_python_forward_bit_for_bit(name, autocast, monkeypatch):
    """The C++ deferring forward runs every call after a step's first (which
    makes its plan) and gives the Python forward's outputs, input gradients
    and weight gradients exactly, under bf16 autocast too."""
    native = _calls(name, autocast, "native", monkeypatch)
    python = _calls(name, autocast, "python", monkeypatch)
    assert native[3] == 1 and python[3] == 3
    for a, b in zip(native[:3], python[:3]):
        for u, v in zip(a, b):
            assert (u is None) == (v is None)
            if u is not None:
                torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.skipif(deferred.native_chain() is None, reason="fastpipe._chain is not built")
def test_native_forward_lets_other_threads_run_during_its_op():
    """The C++ deferring forward runs its op without the GIL, as torch's own
    bindings do: local ranks are threads of one interpreter, and one rank's
    kernel must not stop the other's Python. A thread that wakes every
    millisecond gets to run while a long Linear is inside the native call."""
    import threading
    import time

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the call's length does not depend on the cores
    lin = nn.Linear(1024, 1024)
    rows = 256
    while True:  # a call long enough that the margins below leave a window (at most 128 MiB)
        x = torch.randn(rows, 1024)
        start = time.perf_counter()
        nn.functional.linear(x, lin.weight, lin.bias)
        if time.perf_counter() - start > 0.15 or rows >= 1 << 15:
            break
        rows *= 2
    layers = deferred.install(lin)
    stamps, stop = [], threading.Event()

    def wake():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    waker = threading.Thread(target=wake)
    try:
        with deferred.collecting(deferred.Pending()):
            lin(x[:2])  # the first call makes the plan; the next is native
            assert lin.__dict__["forward"].planned
            waker.start()
            time.sleep(0.01)
            start = time.perf_counter()
            lin(x)
            end = time.perf_counter()
    finally:
        stop.set()
        if waker.is_alive():
            waker.join()
        deferred.uninstall(layers)
        torch.set_num_threads(threads)
    # With the GIL held for the whole call the thread could run only in the
    # few milliseconds of Python around it (one switch interval, 5 ms).
    margin = 0.03
    assert end - start > 3 * margin
    inside = [t for t in stamps if start + margin < t < end - margin]
    assert inside, f"no wake-up inside a {end - start:.3f} s call"


class _Mixed(nn.Module):
    """A stage whose I has every kind of output: a deferred Linear, a
    parameter used outside any layer (autograd's gradient in I), a weight
    also used outside its layer, an input that needs no gradient and a
    leaf parameter nothing reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.scale = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.unused = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale
        return self.lin(h) + h @ self.lin.weight + y


def _input_backward(monkeypatch, path: str, root_as_edge: bool):
    torch.manual_seed(0)
    stage = _Mixed()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, dtype=torch.float64)
    with monkeypatch.context() as m:
        if path == "python":
            m.setattr(deferred, "native_chain", lambda: None)
        layers = deferred.install(stage)
        try:
            pending = deferred.Pending()
            with deferred.collecting(pending):
                out = stage(x, y)
            g = torch.randn_like(out)
            root = torch.autograd.graph.get_gradient_edge(out) if root_as_edge else out
            grads = deferred.backward_input([root], [g], [x, y], list(stage.parameters()), pending)
            after_i = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
            gs = [e.g for e in pending.entries] + [g for c in pending.calls for g in c.grads]
            deferred.run_weight(pending.entries, fuse=False, calls=pending.calls)
        finally:
            deferred.uninstall(layers)
    return grads, after_i, gs, [p.grad for p in stage.parameters()]


@pytest.mark.skipif(deferred.native_chain() is None, reason="fastpipe._chain is not built")
@pytest.mark.parametrize("root_as_edge", [False, True])
def test_native_input_backward_is_the_python_one(root_as_edge, monkeypatch):
    """I made in C++ gives what the Python engine call gives, bit for bit:
    input gradients (None where none is wanted), the gradients autograd
    brings to parameters in I, each entry's output gradient, and W after."""
    native = _input_backward(monkeypatch, "native", root_as_edge)
    python = _input_backward(monkeypatch, "python", root_as_edge)
    # .grad after I, in parameters() order (weight, bias, scale, unused): the
    # weight used outside its layer and scale from autograd, bias in W.
    assert [g is not None for g in native[1]] == [True, False, True, False]
    assert native[0][1] is None  # y wants none
    assert len(native[2]) == 2
    for a, b in zip(native, python):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert (u is None) == (v is None)
            if u is not None:
                torch.testing.assert_close(u, v, rtol=0, atol=0)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_input_backward_from_a_python_functions_edge():
    """A root whose node is a Python autograd.Function's (the stage ends in
    one) takes torch's own call: the same gradients as a plain backward."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    ref = copy.deepcopy(lin)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    layers = deferred.install(lin)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            # Twice: the first call makes the plan, the second is the native
            # forward's; both go to a native block, whose edges the Python
            # call takes too.
            out = _Twice.apply(lin(x) + 0.5 * lin(x))
        assert not pending.entries and len(pending) == 2
        root = torch.autograd.graph.get_gradient_edge(out)
        (gx,) = deferred.backward_input([root], [g], [x], list(lin.parameters()), pending)
        deferred.run_weight(pending.entries, fuse=False, calls=pending.calls)
    finally:
        deferred.uninstall(layers)
    xr = x.detach().clone().requires_grad_()
    (_Twice.apply(ref(xr) + 0.5 * ref(xr))).backward(g)
    torch.testing.assert_close(gx, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=0, atol=0)


@pytest.mark.skipif(deferred.native_chain() is None, reason="fastpipe._chain is not built")
def test_native_input_backward_raises_a_hooks_own_exception():
    """An exception raised inside the engine (here a tensor hook's) leaves
    the native I as itself, as it leaves torch's own call."""
    lin = nn.Linear(4, 4).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    layers = deferred.install(lin)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            out = lin(x)

        def refuse(grad):
            raise KeyError("refused in a hook")

        out.register_hook(refuse)
        with pytest.raises(KeyError, match="refused in a hook"):
            deferred.backward_input([out], [torch.ones_like(out)], [x], list(lin.parameters()),
                                    pending)
    finally:
        deferred.uninstall(layers)


@pytest.mark.skipif(deferred.native_chain() is None, reason="fastpipe._chain is not built")
def test_native_forward_steps_aside():
    """Calls the plan does not cover go to the Python forward: a swapped-in
    parameter (deferred into the new one), a keyword argument, a
    torch-function mode, a tensor subclass, grad mode off."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    layers = deferred.install(lin)
    try:
        fast = lin.__dict__["forward"]
        pending = deferred.Pending()
        with deferred.collecting(pending):
            lin(x)
            assert fast.planned
            new = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
            lin.weight = new  # the plan no longer matches: re-planned for it
            out = lin(x)
            assert pending.calls[-1].weights[-1] is new
            torch.testing.assert_close(out, x @ new.T + lin.bias, rtol=0, atol=0)

            class Sub(torch.Tensor):
                pass

            class Seen(torch.overrides.TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    seen.append(func)
                    return func(*args, **(kwargs or {}))

            n, seen = len(pending), []
            torch.testing.assert_close(lin(input=x), out, rtol=0, atol=0)
            with Seen():
                lin(x)
            assert torch._C._nn.linear in seen  # the mode saw the op: Python ran it
            lin(x.as_subclass(Sub))
            with torch.no_grad():
                lin(x)  # not deferred at all
            assert len(pending) == n + 2
        assert len(pending.entries) == len(pending.edges)
        with deferred.collecting(deferred.Pending()):
            pass
        lin(x)  # outside collecting: the plain forward, nothing appended
        assert len(pending) == n + 2
    finally:
        deferred.uninstall(layers)
    assert "forward" not in lin.__dict__


def test_frozen_parameters_and_hooks_keep_autograd():
    """A frozen weight gets nothing; a watched weight's layer takes the plain
    path (its hook runs, in I); the rest defers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    seen = []
    model[2].weight.register_hook(lambda g: seen.append(g))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    _, count, after_i = _split(model, x, fuse=False)
    assert count == 2  # model[0] (its bias) and model[3]; model[2] kept autograd
    assert after_i["2.weight"] and after_i["2.bias"] and not after_i["3.weight"]
    assert len(seen) == 1 and model[0].weight.grad is None
    ref(x.detach().requires_grad_()).backward(torch.ones(3, 2, dtype=torch.float64))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("kept", [False, True])
def test_what_a_layer_defers_is_read_again_each_step_and_for_a_swapped_parameter(kept):
    """A layer's plan (which parameters train, hooks), kept between steps or
    not: a hook or a freeze between steps is seen by the next one, and
    another parameter object put into the layer mid-step gets W of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    plans = {} if kept else None
    _, count, _ = _split(model, x.clone().requires_grad_(), fuse=False, kept=plans)
    assert count == 2
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g))
    model[2].weight.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    _, count, after_i = _split(model, x.clone().requires_grad_(), fuse=False, kept=plans)
    assert count == 1 and after_i["0.weight"] and len(seen) == 1  # model[2]: bias only
    assert model[2].weight.grad is None and model[2].bias.grad is not None

    layer = nn.Linear(4, 4).double()
    replica = nn.Parameter(layer.weight.detach().clone())
    original = layer.weight
    layers = deferred.install(layer)
    try:
        pending = deferred.Pending()
        with deferred.collecting(pending):
            a = layer(x)
            layer._parameters["weight"] = replica  # as local ties swap a replica in
            b = layer(x)
            layer._parameters["weight"] = original
        deferred.backward_input([a, b], [torch.ones_like(a), 2 * torch.ones_like(b)], [],
                                [original, replica, layer.bias], pending)
        deferred.run_weight(pending.entries, fuse=False, calls=pending.calls)
    finally:
        deferred.uninstall(layers)
    torch.testing.assert_close(replica.grad, 2 * original.grad, rtol=0, atol=0)


def _plans(kept: dict) -> list:
    return [getattr(held, "slow", held).plan for held in kept.values()]


@pytest.mark.parametrize("path", ["native", "python"])
def test_plans_are_kept_between_steps_while_their_layers_are_as_planned(path, monkeypatch):
    """A stage's plans live from step to step (making them is on the first
    F's critical path); whatever would make one wrong is seen at the next
    step's ``install`` (in C++ for native plans, ``_chain.plan_holds``): the
    parameters' memory swapped (``p.data = ...``, as ``module.to()`` does),
    a flag of the layer changed, a parameter object replaced, a hook added.
    Forwards and gradients stay autograd's throughout."""
    if path == "native" and deferred.native_chain() is None:
        pytest.skip("fastpipe._chain is not built")
    if path == "python":
        monkeypatch.setattr(deferred, "native_chain", lambda: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh(),
                          nn.Linear(6, 3)).double()
    ids = torch.randint(0, 11, (2, 5))
    kept: dict = {}

    def step_matches_autograd():
        ref = copy.deepcopy(model)
        model.zero_grad(set_to_none=True)
        layers = deferred.install(model, kept)
        try:
            pending = deferred.Pending()
            with deferred.collecting(pending):
                out = model(ids)
            deferred.backward_input([out], [torch.ones_like(out)], [], list(model.parameters()),
                                    pending)
            deferred.run_weight(pending.entries, fuse=False, calls=pending.calls)
        finally:
            deferred.uninstall(layers)
        expect = ref(ids)
        expect.backward(torch.ones_like(expect))
        torch.testing.assert_close(out, expect, rtol=0, atol=0)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
        return _plans(kept)

    first = step_matches_autograd()
    assert len(first) == 4 and all(p is not None for p in first)
    again = step_matches_autograd()
    assert all(a is b for a, b in zip(first, again))  # kept: nothing changed

    with torch.no_grad():
        model[2].weight.data = model[2].weight.data * 2  # new memory, same Parameter
    model[1].eps = 1e-3
    new = model[4].bias = nn.Parameter(torch.ones(3, dtype=torch.float64))
    changed = step_matches_autograd()
    # The Python forward reads a layer's flags (eps) at each call: its plan stays.
    assert [a is b for a, b in zip(again, changed)] == [True, path == "python", False, False]
    assert changed[3][0][1] is new

    accumulated = []
    model[0].weight.register_post_accumulate_grad_hook(accumulated.append)
    hooked = step_matches_autograd()
    assert [a is b for a, b in zip(changed, hooked)] == [False, True, True, True]
    assert [p is model[0].weight for p in accumulated].count(True) == 1
    model[2].weight.requires_grad_(False)
    frozen = step_matches_autograd()
    # the hooked Embedding does not defer: its plan is decided afresh each step
    assert [a is b for a, b in zip(hooked, frozen)] == [False, True, False, True]
    model[2].weight.requires_grad_(True)

    model.float()  # every parameter's memory swapped, to float32
    floats = step_matches_autograd()
    assert not any(a is b for a, b in zip(changed, floats))

    model[2] = nn.Linear(6, 6)  # a layer replaced: its old forward is let go
    step_matches_autograd()
    held = kept[id(model[2])]
    assert len(kept) == 4 and getattr(held, "slow", held).module is model[2]


@pytest.mark.parametrize("keep", [False, True])
def test_deferring_forwards_leave_no_cycle(keep):
    """A layer's deferring forward and its plan (which holds the parameters)
    go when the layer's slot and the stage's ``kept`` let them go, without
    waiting for the garbage collector: the native forward holds the Python
    one, which refers back weakly."""
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    kept = {} if keep else None
    refs = []
    for _ in range(3):
        layers = deferred.install(model, kept)
        refs += [weakref.ref(deferred._installed(m)) for m in model]
        with deferred.collecting(deferred.Pending()):
            model(torch.randn(2, 4, requires_grad=True))
        deferred.uninstall(layers)
    if keep:
        assert len({id(r()) for r in refs}) == 2  # one per layer, for every step
        kept.clear()
    assert all(r() is None for r in refs)


class Scale(nn.Module):
    """``x * w``: a user's layer with a weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight


class ScaleRule(deferred.WeightRule):
    def params(self, m):
        return (m.weight,)

    def forward(self, m, x, detached):
        return x * detached[0], (x.detach(),), None

    def weight_grads(self, kept, meta, targets, g):
        return ((g * kept[0]).sum(0),)


def test_a_registered_rule_defers_a_users_layer(monkeypatch):
    monkeypatch.setattr(deferred, "_RULES", dict(deferred._RULES))
    deferred.register_weight_rule(Scale, ScaleRule())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Scale(3)).double()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    _, count, after_i = _split(model, x, fuse=True)
    assert count == 2 and not any(after_i.values())
    ref(x.detach().requires_grad_()).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_forward_patched_on_the_class_is_what_runs(monkeypatch):
    """A forward patched on a rule's class since registration (a profiler, a
    quantization library, a test) is what runs: the layer keeps autograd."""
    real = nn.Linear.forward
    seen = []
    layer = nn.Linear(3, 2)
    with monkeypatch.context() as m:
        m.setattr(nn.Linear, "forward", lambda self, x: seen.append(1) or real(self, x))
        assert deferred.rule_for(nn.Linear) is None
        assert deferred.rule_for(torch.nn.modules.linear.NonDynamicallyQuantizableLinear) is None
        assert deferred.install(layer) == []
        pending = deferred.Pending()
        with deferred.collecting(pending):
            layer(torch.randn(4, 3))
        assert seen == [1] and len(pending) == 0
    assert isinstance(deferred.rule_for(nn.Linear), deferred.LinearRule)


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("name", ["linear", "embedding"])
def test_an_output_whose_input_wants_no_gradient_is_not_kept_alive(name, path, monkeypatch):
    """A deferring layer's output where the input wants no gradient (an
    Embedding's ids, a stage's first input) is no leaf, which its
    AccumulateGrad node would hold until I: it goes when dropped, as
    autograd's would, and I still hands W its gradient."""
    if path == "native" and deferred.native_chain() is None:
        pytest.skip("fastpipe._chain is not built")
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double() if name == "linear" else nn.Embedding(7, 3).double()
    ref = copy.deepcopy(layer)
    if path == "python":
        monkeypatch.setattr(deferred, "native_chain", lambda: None)
    xs = [torch.randn(5, 4, dtype=torch.float64) if name == "linear" else torch.randint(0, 7, (5,))
          for _ in range(3)]
    layers = deferred.install(layer)
    entries, blocks = [], []
    try:
        for x in xs:  # the first call makes the plan, the others run natively where built
            pending = deferred.Pending()
            with deferred.collecting(pending):
                out = layer(x)
            assert out.grad_fn is not None
            loss = out.sum()  # saves nothing of out
            alive = weakref.ref(out)
            del out
            assert alive() is None
            deferred.backward_input([loss], [None], [], list(layer.parameters()), pending)
            entries += pending.entries
            blocks += pending.calls
        held = list(blocks)
        deferred.run_weight(entries, fuse=False, calls=blocks)
        # What W read goes with it (native blocks emptied in C++, without the GIL).
        assert not entries and not blocks and all(len(b) == 0 for b in held)
        assert bool(held) == (path == "native")
    finally:
        deferred.uninstall(layers)
    for x in xs:
        ref(x).sum().backward()
    for p, q in zip(layer.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_registration_refuses_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module subclass, got 3"):
        deferred.register_weight_rule(3, ScaleRule())
    with pytest.raises(TypeError, match="WeightRule, got str"):
        deferred.register_weight_rule(Scale, "rule")


def test_install_skips_compiled_modules_and_users_forward():
    inner = nn.Linear(2, 2)
    compiled = torch.compile(nn.Sequential(inner))
    own = nn.Linear(2, 2)
    own.forward = lambda x: x  # the user's own forward on the instance
    plain = nn.Linear(2, 2)
    root = nn.Sequential(compiled, own, plain)
    layers = deferred.install(root)
    assert layers == [plain]
    assert "forward" not in inner.__dict__
    twice = deferred.install(root)  # a second stage over the same layer
    deferred.uninstall(layers)
    assert "forward" in plain.__dict__  # still used by the second
    deferred.uninstall(twice)
    assert "forward" not in plain.__dict__ and own.forward(5) == 5


def _weight_gemms(entries) -> int:
    """Matrix products W runs for ``entries`` (gathered, with fusion)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        deferred.run_weight(entries, fuse=True)
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::addmm_"))


def test_a_linears_calls_are_gathered_into_one_gemm():
    """Several microbatches' entries of one Linear (a chain stage makes each
    with its own WeightLayer) are one GEMM in W, and give the sum of their
    weight gradients; another Linear's stay apart."""
    torch.manual_seed(0)
    lins = [nn.Linear(4, 3).double(), nn.Linear(4, 3).double()]
    xs = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    gs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    entries = [deferred.linear_entry(lin, g, x) for lin in lins for g, x in zip(gs, xs)]
    for lin in lins:
        lin.weight.grad = torch.zeros_like(lin.weight)
    gemms = _weight_gemms(entries)
    want = sum(g.T @ x for g, x in zip(gs, xs))
    for lin in lins:
        torch.testing.assert_close(lin.weight.grad, want)
        torch.testing.assert_close(lin.bias.grad, sum(g.sum(0) for g in gs))
    assert gemms == 2  # one a Linear


def test_waiting_work_owns_what_the_executor_hands_back(w_path):
    """Gathered W waits past its action: what it reads from a received
    buffer is cloned, so the buffer's next use changes nothing."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).double()  # limit: 32 rows wait
    ref = copy.deepcopy(lin)
    queue = deferred.WeightQueue()
    layers = deferred.install(lin)
    buffers = [torch.randn(5, 64, dtype=torch.float64) for _ in range(3)]
    for buf in buffers:
        x = buf[1:]  # the stage input: a view into a received buffer
        pending = deferred.Pending()
        with deferred.collecting(pending):
            out = lin(x)
        g = torch.randn_like(out)
        deferred.backward_input([out], [g], [x], list(lin.parameters()), pending)
        pending.borrowed = deferred.borrowed_ranges([x, g])
        queue.add(pending)
        ref(x.clone()).backward(g.clone())
        buf.fill_(7.0)  # handed back and reused
        g.fill_(-3.0)
    assert queue.holds and lin.weight.grad is None  # all three wait
    queue.flush()
    deferred.uninstall(layers)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_split_schedule_defers_and_leaves_no_cycles():
    """zbv on the GPT: W runs the deferred entries (none is left for .grad
    in I), and nothing of the step survives it in a reference cycle."""
    model = models.gpt()
    ids, tg = models.gpt_batch(8)
    ran = []
    real = deferred.run_weight

    def counted(entries, fuse=True, calls=()):
        ran.append(len(entries) + len(calls))
        return real(entries, fuse, calls)

    deferred.run_weight = counted
    try:
        pipe = Pipe(model, chunks=4, schedule="zbv", devices=["cpu", "cpu"], stages_per_rank=2,
                    balance=[2, 1, 1, 2])
        gc.collect()
        gc.disable()
        try:
            pipe.step(ids, tg, models.lm_loss)
            assert gc.collect() == 0
        finally:
            gc.enable()

        def forwards():
            return sum(isinstance(o, deferred._Forward) for o in gc.get_objects())

        once = forwards()
        pipe.step(ids, tg, models.lm_loss)
        pipe.step(ids, tg, models.lm_loss)
        assert forwards() == once > 0  # one per deferring layer, kept, none left behind
        pipe.close()
    finally:
        deferred.run_weight = real
    assert sum(ran) > 0
    assert all("forward" not in m.__dict__ for m in model.modules())  # uninstalled after the step


def test_compiled_blocks_keep_the_plain_backward_and_the_gradients():
    """A block the user compiled runs as Dynamo traced it (its layers' class
    forward, no deferral inside); the rest of the stage defers; the
    gradients are the unsplit model's."""
    model = models.gpt(blocks=2)
    ref = copy.deepcopy(model)
    model[1] = torch.compile(model[1], backend="aot_eager")
    ids, tg = models.gpt_batch(8)
    pipe = Pipe(model, chunks=4, schedule="zb-h1", devices=["cpu", "cpu"], balance=[2, 2])
    try:
        loss = pipe.step(ids, tg, models.lm_loss)
    finally:
        pipe.close()
    ref_loss, ref_grads = models.reference(ref, ids, tg, models.lm_loss, 4)
    torch.testing.assert_close(loss, ref_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name.replace("_orig_mod.", "")], msg=name)


def test_public_names():
    import fastpipe

    assert fastpipe.register_weight_rule is deferred.register_weight_rule
    assert fastpipe.WeightRule is deferred.WeightRule
