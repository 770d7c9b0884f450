"""Stages of Linears and elementwise activations, run without autograd's graph.

When every layer of a stage is one this module knows (exact types:
``nn.Linear``, ``nn.GELU``, ``nn.ReLU``, ``nn.SiLU``, ``nn.Tanh``,
``nn.Sigmoid``, ``nn.Identity``, nested plain ``nn.Sequential``), the
executor runs it as a :class:`Chain`:

    forward (no graph):  x ─► Linear ─► GELU ─► Linear ─► ... ─► out
                         saves each op's input (or output, where its
                         backward formula reads that), as autograd would
    I:  g ─► ... ─► g·W ─► gelu_backward ─► g·W ─► grad of x
        keeping (Linear, g, x) of each trained Linear for W

The ops are the ones autograd's formulas run, with the same operand layouts,
so the input gradients are bit-identical to the eager path
(tests/test_chain.py; the native chain's GELU is ATen's CPU kernel, not
oneDNN's: bit-identical with oneDNN off). W is the executor's deferred
weight-gradient work (``fastpipe.runtime.deferred``), as for any other stage.
:meth:`Chain.ready` (once a step) and :meth:`Chain.accepts` (per
microbatch) send the stage down the eager path wherever a chain could differ
from autograd; the executor keeps eager for autocast and checkpointing.
``FASTPIPE_CHAIN=0`` turns chains off (``Stage.chains``); ``fastpipe._chain``
(``csrc/chain/chain.cpp``) runs them without the GIL where it was built, and
the ops are issued from Python otherwise.

Why: on narrow layers a stage's time is framework overhead, not arithmetic
(``docs/design/iw-split.md``, "Chains").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastpipe._ext import native_chain
from fastpipe.runtime import deferred
from fastpipe.runtime.eager_checks import (
    accumulator_hooked, global_hooks, graph_modes, module_hooked, originals, param_hooked, patched,
)
from fastpipe.runtime.memory import span

__all__ = ["Chain"]

_aten = torch.ops.aten

# Op codes (csrc/chain/chain.cpp uses the same numbers).
_LINEAR, _GELU, _SILU, _RELU, _TANH, _SIGMOID = range(6)
_KINDS = {nn.Linear: _LINEAR, nn.GELU: _GELU, nn.SiLU: _SILU, nn.ReLU: _RELU, nn.Tanh: _TANH,
          nn.Sigmoid: _SIGMOID}
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# What eager calls, as it was at import: a layer's forward, nn.Module's call,
# the functions those forwards call. Patched (by a quantization library, a
# test, a profiler), the eager path is what runs the patch.
_ORIGINALS = originals([(cls, "forward") for cls in _KINDS] + [
    (nn.Module, "__call__"), (nn.Module, "_call_impl"), (F, "linear"), (F, "gelu"), (F, "silu"),
    (F, "relu"), (torch, "relu"), (torch, "tanh"), (torch, "sigmoid")])


class Chain:
    """A stage's layers as a flat list of ops with hand-written backward.

    Build it with :meth:`of`, which returns None for a stage it cannot run.
    """

    def __init__(self, ops: list[tuple[int, nn.Module]], others: list[nn.Module],
                 native: bool = True) -> None:
        self.ops = ops
        # Every module whose hooks would change what the stage does.
        self._modules = [m for _, m in ops] + others
        # The containers' layers as they were: a container changed in place
        # since (a layer swapped or appended) sends the stage down the eager path.
        self._layout = [(c, tuple(c._modules.values())) for c in others if type(c) is nn.Sequential]
        self._linears = [m for k, m in ops if k == _LINEAR]
        self._first_linear = next(i for i, (k, _) in enumerate(ops) if k == _LINEAR)
        self._dtype: torch.dtype | None = None  # set by ready(): the step's dtype
        self.trains = True  # set by ready(): some parameter wants a gradient
        self._lib = native_chain() if native else None
        # The native Program: its parameters bound for one step (ready .. unbind).
        self._program = self._lib.Program([k for k, _ in ops]) if self._lib is not None else None
        self._bound = False
        # Each trained Linear's share of every W entry this step (by op
        # index; deferred.linear_work), made by ready(), dropped by unbind().
        self._work: dict[int, tuple] = {}

    @property
    def native(self) -> bool:
        """Whether the passes run in C++ (``fastpipe._chain``), without the GIL."""
        return self._lib is not None

    def _bind(self) -> None:
        """Binds the native Program to the layers as they are now, and to
        each Linear's W this step (``self._work``)."""
        self._program.bind(
            [m.weight if k == _LINEAR else None for k, m in self.ops],
            [m.bias if k == _LINEAR else None for k, m in self.ops],
            [m.approximate if k == _GELU else "" for k, m in self.ops],
            [self._work[i][2] for i, (k, _) in enumerate(self.ops) if k == _LINEAR],
        )
        self._bound = True

    def unbind(self) -> None:
        """Lets the native Program drop its references to the parameters, so
        that between steps nothing but the model holds
        them (``torch.utils.swap_tensors``, as ``module.to()`` and
        ``load_state_dict`` may use, refuses tensors referenced elsewhere).
        The executor calls it at the end of every step."""
        if self._bound:
            self._program.unbind()
            self._bound = False
        self._dtype = None
        self._work = {}

    @classmethod
    def of(cls, module: nn.Module, native: bool = True) -> Chain | None:
        """The chain of ``module``, or None unless every layer is a known one
        (and at least one is a Linear: without weights there is nothing to win).

        ``native``: run the passes in C++ where ``fastpipe._chain`` loads;
        False issues the same ops from Python."""
        ops: list[tuple[int, nn.Module]] = []
        others: list[nn.Module] = []  # containers and Identity layers

        def walk(m: nn.Module) -> bool:
            t = type(m)
            if t is nn.Sequential or t is nn.Identity:
                others.append(m)
                return all(walk(c) for c in m._modules.values() if c is not None)
            kind = _KINDS.get(t)
            if kind is None:
                return False
            if kind == _LINEAR and m.weight.dim() != 2:
                return False
            if kind == _GELU and m.approximate not in ("none", "tanh"):
                return False
            ops.append((kind, m))
            return True

        if not walk(module) or not any(k == _LINEAR for k, _ in ops):
            return None
        return cls(ops, others, native)

    # --- when the chain may run -------------------------------------------------

    def usable(self, x: torch.Tensor) -> bool:
        """True when running ``x`` through the chain does exactly what
        autograd would: ``ready() and accepts(x)``."""
        return self.ready() and self.accepts(x)

    def ready(self) -> bool:
        """What does not change between the microbatches of a step, checked
        once a step, not per microbatch (on a narrow stage they cost a share
        of the native forward: docs/benchmarks.md, "Chains and the
        backward"): no hooks anywhere they could run
        (module, global, parameter, its AccumulateGrad node, saved-tensor),
        no torch function or dispatch mode, no anomaly detection, no
        patched forward, the layers as they were, no parameter used by two
        Linears, leaf CPU parameters of one real floating dtype, dense and
        contiguous, with ``.grad`` None or alike. Then binds the native
        program to the layers as they are (``unbind`` drops it)."""
        self.unbind()
        if global_hooks() or patched(_ORIGINALS) or graph_modes():
            return False
        if any(module_hooked(m) for m in self._modules):
            return False
        for c, layers in self._layout:
            if tuple(c._modules.values()) != layers:
                return False
        for k, m in self.ops:
            if k == _GELU and m.approximate not in ("none", "tanh"):
                return False
        params = [p for m in self._linears for p in (m.weight, m.bias)]
        present = [p for p in params if p is not None]
        if len({id(p) for p in present}) != len(present):
            # A weight two Linears share: autograd sums its two gradients
            # before adding them to .grad, a chain would add them in turn.
            return False
        dtype = self._linears[0].weight.dtype
        if dtype not in _DTYPES:
            return False  # complex weights: autograd's formulas conjugate
        for p in present:
            # CPU only: the GPU path of chains has not run yet (eager there).
            if (type(p) is not nn.Parameter and type(p) is not torch.Tensor) or not p.is_leaf \
                    or p.dtype != dtype or not p.is_cpu or not p.is_contiguous() \
                    or p.layout != torch.strided:
                return False
            if p.requires_grad and param_hooked(p):
                return False
            g = p.grad
            if g is not None and (g.dtype != dtype or not g.is_cpu or g.shape != p.shape
                                  or g.layout != torch.strided or g.requires_grad):
                return False
        if accumulator_hooked(present):
            return False
        self._work = {i: deferred.linear_work(m) for i, (k, m) in enumerate(self.ops) if k == _LINEAR}
        if self._program is not None:
            self._bind()
        self._dtype = dtype
        self.trains = any(p.requires_grad for p in present)
        return True

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether the chain takes this microbatch, after ``ready()`` said
        True this step: a plain, dense, contiguous 2-D CPU tensor of the
        weights' dtype (the layouts the ops above reproduce exactly)."""
        return (type(x) is torch.Tensor and x.dtype is self._dtype and x.dim() == 2
                and x.is_cpu and x.layout is torch.strided and x.is_contiguous())

    # --- the passes ---------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage's output for ``x`` and what backward reads, without a graph."""
        if self._bound:
            return self._program.forward(x)
        saved = []
        with torch.no_grad():
            h = x
            for kind, m in self.ops:
                if kind == _LINEAR:
                    saved.append(h)
                    h = F.linear(h, m.weight, m.bias)
                elif kind == _GELU:
                    saved.append(h)
                    h = F.gelu(h, approximate=m.approximate)
                elif kind == _SILU:
                    saved.append(h)
                    h = F.silu(h)
                else:
                    h = torch.relu(h) if kind == _RELU else torch.tanh(h) if kind == _TANH \
                        else torch.sigmoid(h)
                    saved.append(h)
        return h, saved

    def saved_bytes(self, saved: Sequence[torch.Tensor]) -> int:
        """Bytes held for backward, counted as ``fastpipe.runtime.memory``
        counts autograd's (a tensor two ops save counts once), so memory
        stats and the planner's profile read the same whichever path ran."""
        if self._bound:
            return self._program.saved_bytes(saved)
        return sum(n for _, n in set(map(span, saved)))

    def backward_input(self, saved: list[torch.Tensor], grad: torch.Tensor, need_input: bool
                       ) -> tuple[torch.Tensor | None, deferred.Pending]:
        """I: the gradient of the stage input (None unless ``need_input``),
        and W's share of every trained Linear (its incoming gradient and
        input): one native ``Calls`` block where the Program is bound, else
        an entry per Linear. ``saved`` is emptied: it cannot serve twice."""
        if self._bound:  # W's share as one native block of calls
            gx, calls = self._program.backward_input(saved, grad, need_input)
            return gx, deferred.Pending(calls=[calls] if len(calls) else [])
        items = []
        g = grad
        with torch.no_grad():
            for i in range(len(self.ops) - 1, -1, -1):
                kind, m = self.ops[i]
                s = saved[i]
                if kind == _LINEAR:
                    if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
                        items.append((i, g, s))
                    if i == self._first_linear and not need_input:
                        break  # what lies below only leads to the input
                    g = _input_grad(g, m.weight, s)
                elif kind == _GELU:
                    g = _aten.gelu_backward(g, s, approximate=m.approximate)
                elif kind == _SILU:
                    g = _aten.silu_backward(g, s)
                elif kind == _RELU:
                    g = _aten.threshold_backward(g, s, 0)
                elif kind == _TANH:
                    g = _aten.tanh_backward(g, s)
                else:
                    g = _aten.sigmoid_backward(g, s)
        saved.clear()
        return (g if need_input else None), self._pending(items)

    def _pending(self, items) -> deferred.Pending:
        """W's entries of (op index, output gradient, input) items (the Python path)."""
        ops, work = self.ops, self._work
        return deferred.Pending([deferred.linear_entry(ops[i][1], g, x, work.get(i)) for i, g, x in items])


def _input_grad(g: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``mm_mat1_backward`` for ``x @ w.t()``: a column-major input gets its
    gradient computed (and laid out) column-major."""
    if x.stride(0) == 1 and x.stride(1) == x.shape[0]:
        return w.t().mm(g.t()).t()
    return g.mm(w)
