"""``selective_recompute``: swap memory-saving layers into an ``nn.Sequential`` in place."""

from __future__ import annotations

from torch import nn

from fastpipe.kernels.activation import ActLinear, Deferred
from fastpipe.kernels.dropout import SeededDropout
from fastpipe.kernels.norm import LayerNorm, RMSNorm

__all__ = ["selective_recompute"]


def _activation_name(module: nn.Module) -> str | None:
    if type(module) is nn.ReLU:
        return "relu"
    if type(module) is nn.SiLU:
        return "silu"
    if type(module) is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return None


def _single(module: nn.Module) -> nn.Module | None:
    """The replacement of a layer that is swapped on its own, or None."""
    if type(module) is nn.Dropout:
        return SeededDropout(module.p)
    if type(module) in (nn.LayerNorm, nn.RMSNorm) and len(module.normalized_shape) == 1:
        cls = LayerNorm if type(module) is nn.LayerNorm else RMSNorm
        return cls.from_module(module)
    return None


def selective_recompute(module: nn.Module) -> nn.Module:
    """Replaces, in place, the patterns below in ``module`` and in every
    ``nn.Sequential`` inside it, by layers with the same numerics that save less
    for backward; returns ``module``.

    Patterns (children of an ``nn.Sequential``, matched by exact type):

    * ``nn.ReLU`` / ``nn.SiLU`` / ``nn.GELU`` (either ``approximate``) directly
      followed by ``nn.Linear`` → ``Deferred`` + ``ActLinear``: the activation's
      output is not stored, backward recomputes it from its input;
    * ``nn.Dropout`` → ``SeededDropout``: a seed instead of a mask;
    * ``nn.LayerNorm`` / ``nn.RMSNorm`` over the last dimension → fastpipe's
      ``LayerNorm`` / ``RMSNorm``: input plus one fp32 statistic per row.

    Parameters are shared, not copied (an optimizer built before still works),
    and layer positions are kept (``Deferred`` takes the activation's place), so
    parameter names and ``Pipe`` balances are unchanged. Other layers are left
    alone. Random draws differ from ``nn.Dropout`` (another generator stream),
    so masks are not the same as before the swap.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        >>> selective_recompute(model)[2]
        ActLinear(gelu, in_features=32, out_features=8, bias=True)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"selective_recompute needs an nn.Module, got {type(module).__name__}")
    sequentials = [m for m in module.modules() if isinstance(m, nn.Sequential)]
    for seq in sequentials:
        names = list(seq._modules)
        for i, name in enumerate(names):
            child = seq._modules[name]
            nxt = seq._modules[names[i + 1]] if i + 1 < len(names) else None
            act = _activation_name(child)
            if act is not None and type(nxt) is nn.Linear:
                fused = ActLinear.from_linear(act, nxt).train(nxt.training)
                seq._modules[name] = Deferred(child).train(child.training)
                seq._modules[names[i + 1]] = fused
                continue
            swap = _single(child)
            if swap is not None:
                seq._modules[name] = swap.train(child.training)
    return module
