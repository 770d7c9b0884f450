"""Would eager differ? The checks every path that skips a module's
``__call__`` or autograd's graph makes first (chains, the known losses,
deferred weight gradients): where one says yes, that path steps aside and
eager runs, so hooks, patches and modes see what they would see without
fastpipe."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

from fastpipe._ext import native_chain

__all__ = ["accumulator_hooked", "global_hooks", "graph_modes", "module_hooked", "originals", "param_hooked",
           "patched"]

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")

Originals = list[tuple[Any, str, Any]]


def originals(pairs: Iterable[tuple[Any, str]]) -> Originals:
    """``(owner, name, what it is now)`` of each pair: taken at import, what
    a fast path calls in place of eager's calls."""
    return [(owner, name, getattr(owner, name)) for owner, name in pairs]


def patched(taken: Originals) -> bool:
    """Some function of ``taken`` was replaced since (by a quantization
    library, a profiler, a test): eager is what runs the patch."""
    return any(getattr(owner, name) is not original for owner, name, original in taken)


def global_hooks() -> bool:
    """A global module hook is registered (``nn.modules.module.register_module_*_hook``)."""
    return any(getattr(_module, name) for name in _GLOBAL_HOOKS)


def module_hooked(m: nn.Module) -> bool:
    """``m`` has a forward, forward-pre, backward or backward-pre hook."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def param_hooked(p: torch.Tensor) -> bool:
    """``p`` has a tensor hook or a post-accumulate-grad hook."""
    return bool(p._backward_hooks) or p._post_accumulate_grad_hooks is not None


def accumulator_hooked(params: list[torch.Tensor]) -> bool:
    """The live AccumulateGrad node of one of ``params`` carries hooks (as
    DDP-style ``p.expand_as(p).grad_fn.next_functions[0][0].register_hook``
    puts there): only autograd's own accumulation runs them. Python cannot
    list a node's hooks; without ``fastpipe._chain`` the answer is False."""
    chain = native_chain()
    return chain is not None and chain.accumulator_hooked(params)


def graph_modes() -> bool:
    """Something sees autograd's graph or eager's ops: default saved-tensor
    hooks, a torch-function or dispatch mode (FlopCounterMode, fake
    tensors), anomaly detection (it checks each node's outputs)."""
    return (torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())
            or torch.is_anomaly_enabled())
