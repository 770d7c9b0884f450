"""Splitting a batch into microbatches and flattening stage values to tensors.

A stage receives exactly what ``nn.Sequential`` would pass its first layer:
one tensor, or one tuple (of tensors and plain values). Between ranks that
value travels as a flat list of tensors plus its structure (``Spec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "Spec", "TENSOR", "Value", "batch_size", "flatten", "gather", "needs_grad", "split",
    "to_device", "unflatten",
]

Value = Any  # a tensor or a tuple of tensors: what one layer passes the next


def split(batch: Value, chunks: int) -> list[Value]:
    """Splits ``batch`` (a tensor or tuple of tensors) along dim 0 into ``chunks`` parts.

    Sizes differ by at most one, like ``torch.tensor_split``, so there are always
    exactly ``chunks`` microbatches (``torch.chunk`` may return fewer).

    Raises:
        TypeError: ``batch`` is neither a tensor nor a tuple of tensors.
        ValueError: the batch has fewer rows than ``chunks``, or tuple members
            disagree on the batch size.
    """
    if isinstance(batch, torch.Tensor):
        _check_rows(batch.shape[0] if batch.dim() else 0, chunks)
        return list(torch.tensor_split(batch, chunks, dim=0))
    if isinstance(batch, tuple) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        rows = {t.shape[0] if t.dim() else 0 for t in batch}
        if len(rows) != 1:
            raise ValueError(f"tuple members have different batch sizes: {sorted(rows)}")
        _check_rows(rows.pop(), chunks)
        parts = [torch.tensor_split(t, chunks, dim=0) for t in batch]
        return [tuple(p[i] for p in parts) for i in range(chunks)]
    raise TypeError(
        f"expected a tensor or a non-empty tuple of tensors, got {type(batch).__name__}"
    )


def to_device(batch: Value, device: torch.device) -> Value:
    """``batch``'s tensors on ``device`` (the rest as they are), once for the
    whole batch on the caller's thread and stream.

    Why here: a blocking copy from host memory to a GPU waits for the stream
    to drain, and a rank's thread moving each microbatch would stall its
    stream's queue every time. From pageable memory the copy is queued
    without blocking: CUDA stages pageable memory before the call returns, so
    the caller may change its tensor at once. Pinned memory is copied as
    ``.to()`` copies it (the copy could otherwise still read it after the
    step returned).
    """
    if isinstance(batch, torch.Tensor):
        return _moved(batch, device)
    if isinstance(batch, tuple):
        return tuple(_moved(t, device) if isinstance(t, torch.Tensor) else t for t in batch)
    return batch


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    staged = device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned()
    return t.to(device, non_blocking=staged)


def _check_rows(rows: int, chunks: int) -> None:
    if rows < chunks:
        raise ValueError(
            f"batch of {rows} rows cannot be split into chunks={chunks} microbatches "
            "(need at least one row per microbatch)"
        )


def batch_size(batch: Value) -> int:
    """Rows along dim 0 of a tensor, or of the first member of a tuple."""
    first = batch[0] if isinstance(batch, tuple) else batch
    return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 0


class _TensorMark:
    """Stands for "the next tensor" in a stage value's structure; pickles by name."""

    def __repr__(self) -> str:
        return "TENSOR"

    def __reduce__(self) -> str:
        return "TENSOR"


TENSOR = _TensorMark()
_PLAIN = (int, float, bool, str, bytes, type(None))

# The structure of a stage value: False for one tensor, True for a tuple of
# tensors, or a tuple with TENSOR where a tensor goes and plain values
# (int, float, bool, str, bytes, None) elsewhere, which travel as they are.
Spec = Any


def flatten(value: Value) -> tuple[list[torch.Tensor], Spec]:
    """Returns (tensors, spec) for a stage output.

    Raises:
        TypeError: the value holds something other than tensors and plain values.
    """
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, tuple):
        if all(isinstance(t, torch.Tensor) for t in value):
            return list(value), True
        if all(isinstance(v, (torch.Tensor, *_PLAIN)) for v in value):
            tensors = [v for v in value if isinstance(v, torch.Tensor)]
            return tensors, tuple(TENSOR if isinstance(v, torch.Tensor) else v for v in value)
    kind = type(value).__name__
    if isinstance(value, tuple):
        kind = "tuple of " + ", ".join(type(v).__name__ for v in value)
    raise TypeError(
        "a stage must return a tensor or a tuple of tensors and plain values "
        f"(int, float, bool, str, bytes, None), got {kind}"
    )


def unflatten(tensors: Sequence[torch.Tensor], spec: Spec) -> Value:
    """Inverse of ``flatten``."""
    if spec is False:
        return tensors[0]
    if spec is True:
        return tuple(tensors)
    it = iter(tensors)
    return tuple(next(it) if v is TENSOR else v for v in spec)


def gather(outputs: Sequence[Value]) -> Value:
    """Concatenates microbatch outputs along dim 0 (tuples member-wise)."""
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat([o[i] for o in outputs]) for i in range(len(outputs[0])))
    return torch.cat(list(outputs))


def needs_grad(t: torch.Tensor) -> bool:
    """Whether a tensor crossing a boundary carries a gradient back."""
    return t.requires_grad and (t.is_floating_point() or t.is_complex())
