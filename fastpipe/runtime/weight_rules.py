"""The built-in weight rules: ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm``
and ``nn.Embedding``, and two layers of Hugging Face models, GPT-2's
``Conv1D`` and the Llama family's RMSNorm, compute only their input
gradient in I and leave their weight gradients to W
(``fastpipe.runtime.deferred`` runs both halves). Each keeps what autograd
would keep, in the dtype autograd would use under autocast, and registers
itself when this module is imported (``deferred`` imports it). The Hugging
Face layers are recognised by their ``forward``'s code
(``deferred.rule_for``), so transformers is never imported here and a
release that changes their formula falls back to the plain backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastpipe.runtime.deferred import WeightRule, _register_by_code, register_weight_rule

__all__ = ["Conv1DRule", "EmbeddingRule", "LayerNormRule", "LinearRule", "RMSNormRule",
           "ScaledRMSNormRule"]

_aten = torch.ops.aten


def _amp_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None."""
    if not torch._C._is_any_autocast_enabled():  # one call where autocast is off
        return None
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class LinearRule(WeightRule):
    """``y = x Wᵀ + b`` over any leading dimensions: W ``gᵀ x`` and ``Σ g``.

    Under autocast the input is cast first, as autocast casts it (linear is
    on its lower-precision list), so W keeps the copy autograd would keep.
    """

    transposed = False  # the weight stored (in, out): W is x^T g (Conv1DRule)

    def params(self, m):
        return (m.weight, m.bias)

    def forward(self, m, x, detached):
        low = _amp_dtype(x)
        if low is not None and x.dtype != low and x.is_floating_point():
            x = x.to(low)
        # Kept as it came (rows2d at W): a reshape per call is felt in F.
        return F.linear(x, *detached), (x.detach(),), None

    def weight_grads(self, kept, meta, targets, g):
        g2, x2 = _rows2d(g), _rows2d(kept[0])
        pw, pb = targets
        return (torch.mm(*_factors(g2, x2, self.transposed)) if pw is not None else None,
                g2.sum(0) if pb is not None else None)

    def rows(self, kept, meta):
        x = kept[0]
        return x.numel() // x.shape[-1]

    def native(self, targets, meta, chain):
        return chain.WeightLayer(0, list(targets), [], [], 0.0)

    def _fast(self, m):
        return 0, ["weight", "bias"], [], None

    def gather(self, entries):
        if len(entries) == 1:
            e = entries[0]
            return _linear_grads(e.params, _rows2d(e.g), _rows2d(e.saved[0]), self.transposed)
        g = torch.cat([_rows2d(e.g) for e in entries])
        x = torch.cat([_rows2d(e.saved[0]) for e in entries])
        return _linear_grads(entries[0].params, g, x, self.transposed)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _factors(g2: torch.Tensor, x2: torch.Tensor, transposed: bool):
    """The weight gradient's GEMM operands: ``gᵀ, x``, or ``xᵀ, g`` for a
    weight stored (in, out); the orders autograd's linear and addmm use."""
    return (x2.t(), g2) if transposed else (g2.t(), x2)


def _linear_grads(targets, g2: torch.Tensor, x2: torch.Tensor, transposed: bool = False):
    """``gᵀx`` (``xᵀg``) and ``Σg`` over rows; the weight's added straight
    into an existing ``.grad`` of the computation's dtype (``addmm_``: no
    fresh matrix, one pass over ``.grad``; other rounding than autograd's
    ``mm`` then ``add_``)."""
    pw, pb = targets
    gw = None
    if pw is not None:
        if pw.grad is not None and pw.grad.dtype == g2.dtype == x2.dtype and pw.grad.is_contiguous():
            pw.grad.addmm_(*_factors(g2, x2, transposed))
        else:
            gw = torch.mm(*_factors(g2, x2, transposed))
    return gw, (g2.sum(0) if pb is not None else None)


def _norm_input(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The input a norm computed on: autocast may run norms in float32
    (CUDA) or leave a low-precision input as it is (CPU); the output's
    gradient has the dtype of that computation."""
    return x.to(g.dtype) if g.dtype != x.dtype and g.dtype == torch.float32 else x


class LayerNormRule(WeightRule):
    """``nn.LayerNorm``: W recomputes the statistics (one pass over the
    input) and runs ATen's own backward for the weight and bias only."""

    def params(self, m):
        return (m.weight, m.bias)

    def forward(self, m, x, detached):
        w, b = detached
        out = F.layer_norm(x, m.normalized_shape, w, b, m.eps)
        return out, (x.detach(),), (tuple(m.normalized_shape), m.eps, w, b)

    def native(self, targets, meta, chain):
        shape, eps, w, b = meta
        return chain.WeightLayer(1, list(targets), [w, b], list(shape), eps)

    def _fast(self, m):
        return 1, ["weight", "bias"], list(m.normalized_shape), m.eps

    def weight_grads(self, kept, meta, targets, g):
        shape, eps, w, b = meta
        x = _norm_input(kept[0], g)
        if w is not None and w.dtype != x.dtype and x.dtype == torch.float32:
            w, b = w.float(), (b.float() if b is not None else None)
        _, mean, rstd = torch.native_layer_norm(x, shape, w, b, eps)
        pw, pb = targets
        _, gw, gb = _aten.native_layer_norm_backward(
            g, x, shape, mean, rstd, w, b, [False, pw is not None, pb is not None])
        return gw, gb


class RMSNormRule(WeightRule):
    """``nn.RMSNorm``: W is ``Σ g · x̂`` with ``x̂ = x · rstd`` recomputed."""

    def params(self, m):
        return (m.weight,)

    def forward(self, m, x, detached):
        out = F.rms_norm(x, m.normalized_shape, detached[0], m.eps)
        return out, (x.detach(),), (len(m.normalized_shape), m.eps)

    def _fast(self, m):
        return 3, ["weight"], list(m.normalized_shape), m.eps

    def weight_grads(self, kept, meta, targets, g):
        if targets[0] is None:
            return (None,)
        dims, eps = meta
        x = _norm_input(kept[0], g)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        reduce = tuple(range(-dims, 0))
        eps = eps if eps is not None else torch.finfo(x.dtype).eps
        xhat = (xf * torch.rsqrt(xf.pow(2).mean(reduce, keepdim=True) + eps)).to(x.dtype)
        return ((g * xhat).sum(tuple(range(g.dim() - dims))),)


class EmbeddingRule(WeightRule):
    """``nn.Embedding`` (dense, no ``max_norm``): W adds each looked-up row's
    gradient into the table's.

    Autograd's backward (``embedding_dense_backward``) makes a fresh table of
    zeros the size of the weight for every call, scatters into it and adds it
    to ``.grad``: two passes over the whole table for a few rows, and on CPUs
    a weight-sized allocation that faults its pages in every time. Fused, the
    rows of one or several microbatches go into an existing ``.grad`` with
    one ``index_add_`` (other rounding order; a padding row's gradient is
    masked to zero, as autograd leaves it). Frequency scaling, a missing
    ``.grad`` and deterministic CUDA algorithms (``index_add_`` accumulates
    with atomics there) keep autograd's op, per microbatch.
    """

    def params(self, m):
        return (m.weight,)

    def accepts(self, m):
        return m.max_norm is None and not m.sparse

    def forward(self, m, ids, detached):
        out = F.embedding(ids, detached[0], m.padding_idx, None, 2.0, m.scale_grad_by_freq, False)
        pad = m.padding_idx if m.padding_idx is not None else -1
        return out, (ids.detach(),), (detached[0].shape[0], pad, m.scale_grad_by_freq)

    def native(self, targets, meta, chain):
        num, pad, freq = meta
        return chain.WeightLayer(2, list(targets), [], [num, pad, int(freq)], 0.0)

    def _fast(self, m):
        return 2, ["weight"], [m.padding_idx if m.padding_idx is not None else -1,
                               int(m.scale_grad_by_freq)], None

    def weight_grads(self, kept, meta, targets, g):
        num, pad, freq = meta
        return (_aten.embedding_dense_backward(g, kept[0], num, pad, freq),)

    def rows(self, kept, meta):
        return None if meta[2] else kept[0].numel()  # frequency scaling counts per call

    def gather(self, entries):
        num, pad, _ = entries[0].meta
        w = entries[0].params[0]
        ids = torch.cat([e.saved[0].reshape(-1) for e in entries])
        g = torch.cat([e.g.reshape(-1, e.g.shape[-1]) for e in entries])
        if w is None:
            return (None,)
        grad = w.grad
        if (grad is None or grad.dtype != g.dtype or not grad.is_contiguous()
                or (grad.is_cuda and torch.are_deterministic_algorithms_enabled())):
            return (_aten.embedding_dense_backward(g, ids, num, pad, False),)
        if pad >= 0:
            g = g.masked_fill((ids == pad).unsqueeze(1), 0)
        grad.index_add_(0, ids, g)
        return (None,)


class Conv1DRule(LinearRule):
    """Hugging Face's ``Conv1D`` (GPT-2): ``addmm(b, x, W)`` with ``W`` stored
    (in, out), a Linear's weight transposed. W is ``xᵀg`` and ``Σ g``, what
    autograd's ``addmm`` backward computes for a row-major weight; otherwise
    a Linear's rule (gathered over microbatches; in C++ where
    ``fastpipe._chain`` is built, forward and W alike)."""

    transposed = True

    def forward(self, m, x, detached):
        w, b = detached
        x2 = x.view(-1, x.size(-1))
        low = _amp_dtype(x)
        if low is not None and x2.dtype != low and x2.is_floating_point():
            x2 = x2.to(low)  # cast as autocast's addmm casts it: W keeps what autograd keeps
        return torch.addmm(b, x2, w).view(x.size()[:-1] + (m.nf,)), (x2.detach(),), None

    def native(self, targets, meta, chain):
        return chain.WeightLayer(4, list(targets), [], [], 0.0)

    def _fast(self, m):
        return 4, ["weight", "bias"], [m.nf], None


class ScaledRMSNormRule(WeightRule):
    """The Llama family's RMSNorm (``LlamaRMSNorm`` and the classes copied
    from it): normalised in float32, cast back to the input's dtype, then
    scaled by the weight. Keeps the normalised input autograd keeps for the
    weight; W is ``Σ g · x̂``."""

    def params(self, m):
        return (m.weight,)

    def forward(self, m, x, detached):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
        xhat = h.to(dtype)
        return detached[0] * xhat, (xhat.detach(),), None

    def weight_grads(self, kept, meta, targets, g):
        if targets[0] is None:
            return (None,)
        grad = g * kept[0]
        return (grad.sum(tuple(range(grad.dim() - 1))),)


# The forwards the Hugging Face rules stand for, as transformers writes them:
# only their code is compared (deferred.rule_for), they never run.

def _conv1d_forward(self, x):
    size_out = x.size()[:-1] + (self.nf,)
    x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
    x = x.view(size_out)
    return x


def _llama_rms_norm_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


register_weight_rule(nn.Linear, LinearRule())
register_weight_rule(nn.LayerNorm, LayerNormRule())
register_weight_rule(nn.Embedding, EmbeddingRule())
if hasattr(nn, "RMSNorm"):
    register_weight_rule(nn.RMSNorm, RMSNormRule())
_register_by_code(_conv1d_forward, Conv1DRule())
_register_by_code(_llama_rms_norm_forward, ScaledRMSNormRule())
