"""Chains: stages of Linears and activations run without autograd's graph,
bit for bit what autograd computes, and the eager path wherever they could differ.

The native chain runs GELU through ATen's own CPU kernel, where eager fp32
goes to oneDNN (csrc/chain/chain.cpp says why): its reference is autograd
with oneDNN off (``reference``)."""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe._args import Switches, switches
from fastpipe._ext import native_chain
from fastpipe.runtime import deferred
from fastpipe.runtime.chain import Chain
from fastpipe.schedules import names

# Both ways of running a chain; the native one must be built where the suite runs.
NATIVE = [pytest.param(True, id="native"), pytest.param(False, id="python")]
ACTIVATIONS = [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.SiLU(), nn.Tanh(),
               nn.Sigmoid(), nn.Identity()]


def chain_model(dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    """Every activation a chain knows, Linears with and without bias, nesting."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, act in enumerate(ACTIVATIONS):
        layers += [nn.Linear(12, 12, bias=i % 3 != 1), type(act)(**_kwargs(act))]
    layers.append(nn.Sequential(nn.Linear(12, 6), nn.Sequential(nn.ReLU())))
    layers.append(nn.Linear(6, 4))
    return nn.Sequential(*layers).to(dtype)


def _kwargs(act: nn.Module) -> dict:
    return {"approximate": act.approximate} if isinstance(act, nn.GELU) else {}


@contextmanager
def reference(use_native: bool):
    """Where eager autograd computes what a chain of this kind computes, bit for bit."""
    lib = native_chain()
    before = torch._C._get_mkldnn_enabled()
    if use_native and lib is not None and lib.aten_gelu:
        torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(before)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_like_sequential(model, ref, x, y, loss_fn=nn.functional.mse_loss, chunks=2):
    """``model``'s gradients after a step are those of ``ref`` run unsplit (fp64)."""
    sum(loss_fn(ref(a), b) for a, b in zip(x.chunk(chunks), y.chunk(chunks))).div(chunks).backward()
    for a, b in zip(_grads(ref), _grads(model)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_native_chain_is_built():
    assert native_chain() is not None, "fastpipe._chain did not load: rebuild with torch installed"
    assert Chain.of(chain_model()).native and not Chain.of(chain_model(), native=False).native


@pytest.mark.parametrize("use_native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grads_exist", [False, True])
def test_chain_is_bit_identical_to_autograd(dtype, grads_exist, use_native):
    eager, native = chain_model(dtype), chain_model(dtype)
    chain = Chain.of(native, use_native)
    assert chain is not None and chain.native == use_native
    x = torch.randn(5, 12, dtype=dtype)
    g = torch.randn(5, 4, dtype=dtype)
    if grads_exist:
        for a, b in zip(eager.parameters(), native.parameters()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
    xe = x.clone().requires_grad_()
    with reference(use_native):
        out_e = eager(xe)
        out_e.backward(g)
    assert chain.usable(x)
    out, saved = chain.forward(x)
    assert torch.equal(out, out_e.detach())
    gx, work = chain.backward_input(saved, g, need_input=True)
    assert torch.equal(gx, xe.grad)
    with pytest.raises(RuntimeError if use_native else IndexError):
        chain.backward_input(saved, g, need_input=True)  # I consumed what F saved
    assert all(p.grad is None for p in native.parameters()) or grads_exist  # nothing before W
    deferred.run_weight(work.entries, False, work.calls)  # W: autograd's rounding
    for a, b in zip(_grads(eager), _grads(native)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_native", NATIVE)
def test_frozen_weights_get_no_gradient_and_the_rest_is_exact(use_native):
    eager, native = chain_model(torch.float64), chain_model(torch.float64)
    for m in (eager, native):
        m[0].weight.requires_grad_(False)
        m[4].bias.requires_grad_(False)
    x, g = torch.randn(3, 12, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    eager(x).backward(g)
    chain = Chain.of(native, use_native)
    assert chain.usable(x)
    out, saved = chain.forward(x)
    gx, work = chain.backward_input(saved, g, need_input=False)
    assert gx is None
    deferred.run_weight(work.entries, False, work.calls)
    assert native[0].weight.grad is None and native[4].bias.grad is None
    for a, b in zip(_grads(eager), _grads(native)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("use_native", NATIVE)
def test_fused_weight_gradients_match_within_rounding(use_native):
    eager, native = chain_model(torch.float64), chain_model(torch.float64)
    x, g = torch.randn(6, 12, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    for _ in range(2):  # None first, then accumulated into
        eager(x).backward(g)
        chain = Chain.of(native, use_native)
        assert chain.usable(x)
        out, saved = chain.forward(x)
        _, work = chain.backward_input(saved, g, need_input=False)
        deferred.run_weight(work.entries, True, work.calls)
    for a, b in zip(_grads(eager), _grads(native)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),  # a layer it does not know
    nn.Sequential(nn.ReLU(), nn.Tanh()),  # no weights: nothing to win
    nn.Sequential(type("MyLinear", (nn.Linear,), {})(4, 4)),  # a subclass may override forward
    nn.Sequential(nn.Linear(4, 4), nn.Dropout()),
])
def test_stages_it_cannot_run_have_no_chain(model):
    assert Chain.of(model) is None


def _hooked_layer(model):
    model[0].register_forward_hook(lambda *a: None)


def _hooked_param(model):
    model[2].weight.register_hook(lambda g: g)


def _accumulate_hook(model):
    model[2].weight.register_post_accumulate_grad_hook(lambda p: None)


def _swapped_layer(model):
    model[-2][0] = nn.Linear(12, 6)


@pytest.mark.parametrize("change", [_hooked_layer, _hooked_param, _accumulate_hook, _swapped_layer])
def test_what_would_change_the_result_sends_the_stage_to_autograd(change):
    model = chain_model()
    chain = Chain.of(model)
    x = torch.randn(2, 12)
    assert chain.usable(x)
    change(model)
    assert not chain.usable(x)


@pytest.mark.parametrize("x", [
    torch.randn(2, 3, 12),  # 3-D
    torch.randn(12, 2).t(),  # not contiguous
    torch.randn(2, 12, dtype=torch.float64),  # not the weights' dtype
])
def test_inputs_it_does_not_take(x):
    assert not Chain.of(chain_model()).usable(x)


def test_global_hooks_and_saved_tensor_hooks_rule_it_out():
    chain = Chain.of(chain_model())
    x = torch.randn(2, 12)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not chain.usable(x)
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert not chain.usable(x)
    finally:
        handle.remove()
    assert chain.usable(x)


@pytest.fixture
def chains(monkeypatch):
    """``chains(mode)`` sets how the Pipes built next run their chain stages:
    "native" (the default), "python" (ops from Python, forced on in local
    mode too, so the executor code of distributed ranks runs without
    processes) or "eager" (no chains: autograd); ``gather``: W gathered over
    microbatches (the default outside these tests; off, each W is exactly
    autograd's). Returns the list that counts chain forwards."""
    calls = []
    forward = Chain.forward

    def counted(self, x):
        calls.append(self)
        return forward(self, x)

    monkeypatch.setattr(Chain, "forward", counted)

    def set_mode(mode: str, gather: bool = False) -> list:
        monkeypatch.setenv("FASTPIPE_CHAIN", {"eager": "0", "python": "python", "native": "1"}[mode])
        monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "1" if gather else "0")
        calls.clear()
        return calls

    return set_mode


@pytest.mark.parametrize("schedule", names())
def test_every_schedule_through_chains_is_bit_identical(schedule, chains):
    x, y = torch.randn(12, 12), torch.randn(12, 4)
    results = {}
    runs = [("eager", "python"), ("python", "python"), ("eager", "native"), ("native", "native")]
    for mode, kernels in runs:
        calls = chains(mode)
        model = chain_model()
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"])
        with reference(kernels == "native"):
            losses = [pipe.step(x, y, nn.functional.mse_loss) for _ in range(2)]
            out = pipe(x)
        results[mode, kernels] = (losses, _grads(model), out)
        stages = len(pipe.schedule.stage_to_rank)
        assert len(calls) == (0 if mode == "eager" else 3 * 4 * stages)  # every F ran as one
        assert all(c.native == (mode == "native") for c in calls)
    for mode in ("python", "native"):
        la, ga, oa = results["eager", mode]
        lb, gb, ob = results[mode, mode]
        assert all(torch.equal(a, b) for a, b in zip(la, lb)), mode
        assert all(torch.equal(a, b) for a, b in zip(ga, gb)), mode
        assert torch.equal(oa, ob), mode


@pytest.mark.parametrize("schedule", names())
def test_every_schedule_with_gathered_w_matches_autograd(schedule, chains, monkeypatch):
    """Gathered W sums microbatches inside one GEMM: other rounding than
    autograd's, the same in both chain paths, and .grad complete on return."""
    x, y = torch.randn(12, 12, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    grads = {}
    gathered = []
    run = deferred.run_weight

    def counted(entries, fuse=True, calls=()):  # microbatches gathered: entries of one Linear
        layers = [e.layer for e in entries]  # (native blocks: one a microbatch)
        gathered.append(max((layers.count(k) for k in layers), default=len(calls)))
        run(entries, fuse, calls)

    monkeypatch.setattr(deferred, "run_weight", counted)
    for mode in ("eager", "python", "native"):
        chains(mode, gather=True)
        gathered.clear()
        model = chain_model(torch.float64)
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # accumulated into, as a backward does
        pipe = Pipe(model, chunks=4, schedule=schedule, devices=["cpu", "cpu"])
        with reference(mode == "native"):
            pipe.step(x, y, nn.functional.mse_loss)
            pipe.step(x, y, nn.functional.mse_loss)
        grads[mode] = _grads(model)
        if mode != "eager":
            assert all(not st.weights.holds and st.weights.nbytes == 0
                       for sts in pipe._stages.values() for st in sts.values())
            assert max(gathered) == 2  # 3 rows each; the 12x6 Linear lets 4 wait
    for a, b in zip(grads["eager"], grads["native"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b, c in zip(grads["python"], grads["native"], grads["eager"]):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
        assert torch.equal(a, b)  # the same ops, in order (fp64: one GELU kernel)


def test_switches_are_read_from_the_environment_when_a_pipe_is_built(monkeypatch):
    for name in ("FASTPIPE_CHAIN", "FASTPIPE_CHAIN_GATHER", "FASTPIPE_COPY_LANES",
                 "FASTPIPE_SWITCH_INTERVAL", "FASTPIPE_SHM_BYTES", "FASTPIPE_EXACT_MESSAGES", "FASTPIPE_SHM",
                 "FASTPIPE_KNOWN_LOSS"):
        monkeypatch.delenv(name, raising=False)
    assert switches() == Switches(chains="on", gather_w=True, known_losses=True, shm_bytes="", copies=None,
                                  switch_interval=None, exact_messages=False, shm_off=False, problem=None)
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "0")
    monkeypatch.setenv("FASTPIPE_CHAIN", "python")
    pipe = Pipe(chain_model(), chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    monkeypatch.setenv("FASTPIPE_CHAIN_GATHER", "1")  # read once: this Pipe keeps what it read
    assert not pipe.settings.switches.gather_w and pipe.settings.switches.chains == "python"
    assert all(not st.chain.native for held in pipe._stages.values() for st in held.values())
    for name, value in (("FASTPIPE_CHAIN", "yes"), ("FASTPIPE_SWITCH_INTERVAL", "-1"),
                        ("FASTPIPE_SWITCH_INTERVAL", "soon")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be .*got '{value}'"):
            Pipe(chain_model(), chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
        monkeypatch.delenv(name)


def test_gathered_w_is_on_the_timeline(chains):
    chains("native", gather=True)
    # 3 rows a microbatch, 6 may wait: two are gathered in the loop, one at the end.
    model = nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU())
    pipe = Pipe(model, chunks=3, schedule="gpipe", devices=["cpu", "cpu"], balance=[2, 2])
    _, sim = pipe.step_with_timeline(torch.randn(9, 12), torch.randn(9, 12), nn.functional.mse_loss)
    flushes = [r for r in sim.timeline if r.action.kind.name == "W"]
    assert sorted(r.rank for r in flushes) == [0, 1]  # gpipe has no W: these are the gathered ones
    assert all(r.end >= r.start for r in flushes)


def test_gathered_w_stacks_microbatches_up_to_the_limit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8))  # limit: 8*24/32 = 6 rows
    chain = Chain.of(model)
    x = torch.randn(2, 8)
    assert chain.usable(x)
    flushed = []
    run = deferred.run_weight
    deferred.run_weight = lambda entries, fuse=True, calls=(): (
        flushed.append(len(entries) // 2 + len(calls)), run(entries, fuse, calls))
    queue = deferred.WeightQueue()
    try:
        for _ in range(4):
            _, saved = chain.forward(x)
            _, work = chain.backward_input(saved, torch.ones(2, 8), need_input=False)
            queue.add(work)
        assert flushed == [3]  # 6 rows: three microbatches, then one left waiting
        assert queue.nbytes == 2 * (8 + 24 + 24 + 8) * 4
        queue.flush()
        assert queue.nbytes == 0 and flushed == [3, 1]
    finally:
        deferred.run_weight = run


@pytest.mark.parametrize("mode", ["python", "native"])
def test_chain_stage_falls_back_per_step_and_hooks_run(chains, mode):
    calls = chains(mode)
    model = chain_model(torch.float64)
    ref = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    seen = []
    model[2].weight.register_hook(lambda g: seen.append(1))
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, y, nn.functional.mse_loss)
    assert len(seen) == 2  # once per microbatch, as autograd does
    assert len(calls) == 2  # the stage without the hooked weight still ran as a chain
    _assert_like_sequential(model, ref, x, y)


def test_a_replaced_parameter_is_the_one_that_trains(chains):
    chains("native")
    model = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="gpipe", devices=["cpu", "cpu"])
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, y, nn.functional.mse_loss)
    old = model[0].weight
    model[0].weight = nn.Parameter(torch.zeros_like(old))
    out = pipe(x)
    ref = chain_model(torch.float64)
    ref[0].weight = nn.Parameter(torch.zeros_like(old))
    assert torch.equal(out, torch.cat([ref(a) for a in x.chunk(2)]).detach())
    pipe.step(x, y, nn.functional.mse_loss)
    assert model[0].weight.grad is not None


@pytest.mark.parametrize("mode", ["python", "native"])
def test_chain_output_is_freed_once_sent(chains, mode, monkeypatch):
    chains(mode)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # no op saves the first output
    pipe = Pipe(model, chunks=2, schedule="gpipe", devices=["cpu", "cpu"])
    first = pipe._stages[0][0].chain
    outputs: list[weakref.ref] = []
    alive_at_backward: list[bool] = []
    forward, backward_input = Chain.forward, Chain.backward_input

    def keep(self, x):
        out, saved = forward(self, x)
        if self is first:
            outputs.append(weakref.ref(out))
        return out, saved

    def check(self, saved, grad, need_input):
        if self is first:
            alive_at_backward.append(any(r() is not None for r in outputs))
        return backward_input(self, saved, grad, need_input)

    monkeypatch.setattr(Chain, "forward", keep)
    monkeypatch.setattr(Chain, "backward_input", check)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert len(outputs) == 2 and alive_at_backward == [False, False]


def test_a_patched_forward_or_an_active_mode_runs_eager(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    chain = Chain.of(chain_model())
    x = torch.randn(2, 12)
    with FlopCounterMode(display=False):
        assert not chain.usable(x)
    monkeypatch.setattr(nn.Linear, "forward", lambda self, inp: inp)
    assert not chain.usable(x)
    monkeypatch.undo()
    monkeypatch.setattr(nn.functional, "gelu", lambda inp, approximate="none": inp)
    assert not chain.usable(x)
    monkeypatch.undo()
    assert chain.usable(x)


def test_a_weight_two_linears_share_runs_eager():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    chain = Chain.of(model)
    assert not chain.usable(torch.randn(2, 4))
    shared = nn.Linear(4, 4)
    assert not Chain.of(nn.Sequential(shared, nn.ReLU(), shared)).usable(torch.randn(2, 4))


@pytest.mark.parametrize("mode", ["python", "native"])
def test_frozen_first_stage_sends_no_gradient_back(chains, mode):
    calls = chains(mode)
    model = chain_model(torch.float64)
    ref = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    first = pipe._stages[0][0].module
    for m in (first, ref[: len(first)]):
        m.requires_grad_(False)
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, y, nn.functional.mse_loss)
    assert len(calls) == 4  # both stages ran as chains
    _assert_like_sequential(model, ref, x, y)
    assert all(p.grad is None for p in first.parameters())


def test_what_a_chain_would_get_wrong_is_refused():
    x = torch.randn(2, 4)
    complex_model = nn.Sequential(nn.Linear(4, 3, dtype=torch.complex64))
    assert not Chain.of(complex_model).usable(x.to(torch.complex64))  # autograd conjugates
    derived = nn.Sequential(nn.Linear(4, 3))
    base = nn.Parameter(torch.randn(3, 4))
    del derived[0].weight
    derived[0].weight = base * 1.0  # not a leaf: its gradient belongs to `base`
    assert not Chain.of(derived).usable(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
        with torch.autograd.detect_anomaly(check_nan=True):
            assert not Chain.of(chain_model()).usable(torch.randn(2, 12))


def test_hooks_on_an_accumulate_grad_node_keep_autograd(chains):
    calls = chains("native")
    model = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="gpipe", devices=["cpu", "cpu"])
    acc = model[0].weight.expand_as(model[0].weight).grad_fn.next_functions[0][0]
    fired = []
    acc.register_hook(lambda *args: fired.append(1))
    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, y, nn.functional.mse_loss)
    assert fired == [1, 1]  # the engine ran them, once per microbatch
    assert {c for c in calls} == {pipe._stages[1][1].chain}  # only the other stage was a chain


def test_gelu_mode_changed_between_steps_is_followed(chains):
    chains("native")
    model = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="gpipe", devices=["cpu", "cpu"])
    x = torch.randn(4, 12, dtype=torch.float64)
    pipe(x)
    model[1].approximate = "tanh"
    assert torch.equal(pipe(x), torch.cat([model(a) for a in x.chunk(2)]).detach())


def test_parameters_can_be_swapped_after_a_step(chains):
    chains("native")
    model = chain_model(torch.float32)
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"])
    x, y = torch.randn(4, 12), torch.randn(4, 4)
    pipe.step(x, y, nn.functional.mse_loss)
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            p.grad = None
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().double()))
    pipe.step(x.double(), y.double(), nn.functional.mse_loss)
    assert model[0].weight.grad.dtype == torch.float64


def test_loss_fn_may_change_its_input_in_place(chains):
    calls = chains("native")
    model = chain_model(torch.float64)
    ref = chain_model(torch.float64)
    pipe = Pipe(model, chunks=2, schedule="1f1b", devices=["cpu", "cpu"])

    def loss_fn(out, target):
        out.mul_(2.0)  # fine after a Linear in eager autograd
        return nn.functional.mse_loss(out, target)

    x, y = torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    pipe.step(x, y, loss_fn)
    assert len(calls) == 4
    _assert_like_sequential(model, ref, x, y, loss_fn)
