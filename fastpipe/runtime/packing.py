"""Send-buffer packing: many tensors in one flat byte buffer, one P2P message.

    pack([a, b, c], wire_dtype=None) -> (flat, layout)

    flat:  [ a ........ | pad | b .... | pad | c ... ]     uint8, slots 16-byte aligned
    layout: Layout(slots=(Slot(dtype, shape, offset, wire), ...), nbytes)

``unpack(flat, layout)`` returns the tensors: views into ``flat`` (no copy)
unless a wire dtype was used. With ``wire_dtype`` (bf16, fp16 or
float8_e4m3fn) floating tensors wider than it travel cast, rounded to
nearest even, and come back as ``x.to(wire).to(x.dtype)``; integer, bool,
complex and narrower floating tensors are never cast.

The layout is small, hashable, comparable (a shape change shows as an
unequal layout) and serializes to a few bytes (``to_bytes``/``from_bytes``):
it is what a receiver needs to read the buffer.

CUDA tensors are packed by one Triton launch (``fastpipe.kernels.pack``)
whose work is the buffer cut into equal tiles, so it streams at copy speed
whether the message holds one tensor or hundreds; the kernel's tables
depend on the layout alone, so each layout builds them once
(``Layout._kernel_plan``) and a call costs one launch, with no wait for the
device. Unpacking with a wire dtype is one launch the same way, into one
fresh buffer that the returned tensors are slices of. Contiguous CPU
tensors are packed by one native memcpy pass with the GIL released, the
rest (non-contiguous, cast) with ``torch._foreach_copy_`` into views.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from fastpipe.kernels import _dispatch

if TYPE_CHECKING:
    from fastpipe.kernels.pack import TilePlan

__all__ = [
    "Layout", "Slot", "WIRE_DTYPES", "aligned", "check_wire", "pack", "pack_into", "unpack",
    "wire_roundtrip",
]

ALIGN = 16
WIRE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)
_CODE = {d: i for i, d in enumerate(DTYPES)}
_NO_WIRE = 255
_HEAD = struct.Struct("<BHQ")  # version, slots, nbytes
_SLOT = struct.Struct("<BBBQ")  # dtype, wire, ndim, offset
_VERSION = 1


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the buffer, and as what."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    wire: torch.dtype | None = None  # the dtype in the buffer when cast

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (self.wire or self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Slots of a packed buffer and its total size in bytes."""

    slots: tuple[Slot, ...]
    nbytes: int

    @classmethod
    def plan(cls, tensors: Sequence[torch.Tensor], wire_dtype: torch.dtype | None = None) -> Layout:
        """The layout ``pack`` would use for these tensors (no data touched).

        Layouts are cached by (dtypes, shapes, wire dtype): a pipeline sends
        the same few layouts over and over.

        Raises:
            TypeError: an element is not a tensor, or its dtype cannot travel.
            ValueError: ``wire_dtype`` is not one of ``WIRE_DTYPES``.
        """
        try:
            key = (wire_dtype, *map(_META, tensors))
        except AttributeError:
            key = None  # not all tensors: _plan names the culprit
        layout = _PLANS.get(key) if key is not None else None
        if layout is None:
            layout = cls._plan(tensors, wire_dtype)
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = layout
        return layout

    @classmethod
    def _plan(cls, tensors: Sequence[torch.Tensor], wire_dtype: torch.dtype | None) -> Layout:
        check_wire(wire_dtype)
        slots, offset = [], 0
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pack needs tensors, got {type(t).__name__} at position {i}")
            if t.dtype not in _CODE:
                raise TypeError(f"cannot pack a tensor of dtype {t.dtype} (position {i})")
            slot = Slot(t.dtype, tuple(t.shape), offset, _wire_for(t.dtype, wire_dtype))
            slots.append(slot)
            offset += aligned(slot.nbytes)
        return cls(tuple(slots), offset)

    # Per-layout plans, computed once: a pipeline packs and unpacks the same
    # few layouts every microbatch, and per-slot Python was most of the cost
    # of a many-tensor boundary (docs/benchmarks.md, "Transports").

    @functools.cached_property
    def _regions(self) -> tuple[tuple[int, ...], list[int], list[int], bool]:
        """(indices, offsets, sizes) of the non-empty slots, and whether no
        slot is cast (then a contiguous CPU pack is one native copy and an
        unpack returns views only)."""
        used = tuple(i for i, s in enumerate(self.slots) if s.numel)
        return (used, [self.slots[i].offset for i in used], [self.slots[i].nbytes for i in used],
                all(s.wire is None for s in self.slots))

    @functools.cached_property
    def _cast(self) -> tuple[int, ...]:
        """Indices of the slots that travel cast."""
        return tuple(i for i, s in enumerate(self.slots) if s.wire is not None)

    @functools.cached_property
    def _kernel_plan(self) -> _KernelPlan:
        """How the Triton kernels move this layout's slots (CUDA buffers):
        the tables are the same for every buffer and every call, so they are
        built once, here, and kept on the device by ``TilePlan``."""
        from fastpipe.kernels.pack import COPY, FLOAT_CODES, TilePlan

        packed, rows, by_torch = [], [], []
        for i, s in enumerate(self.slots):
            if s.wire is not None and not _kernel_casts(s):
                by_torch.append(i)
            elif s.numel:
                packed.append(i)
                rows.append((s.offset, s.numel, FLOAT_CODES[s.dtype]) if s.wire is not None
                            else (s.offset, s.nbytes, COPY))
        # Unpack decodes into one fresh buffer laid out like a layout of its own.
        decoded = tuple(i for i in self._cast if _kernel_casts(self.slots[i]))
        out_slots, offset = [], 0
        for i in decoded:
            s = self.slots[i]
            out_slots.append(Slot(s.dtype, s.shape, offset))
            offset += aligned(s.numel * s.dtype.itemsize)
        out = Layout(tuple(out_slots), offset)
        wire = next((s.wire for s in self.slots if s.wire is not None), None)
        moved = [(i, o) for i, o in zip(decoded, out.slots) if o.numel]
        unpack = TilePlan([(self.slots[i].offset, o.numel, FLOAT_CODES[o.dtype]) for i, o in moved], wire,
                          offsets=[o.offset for _, o in moved])
        return _KernelPlan(tuple(packed), len(packed) == len(self.slots), tuple(by_torch),
                           TilePlan(rows, wire), decoded, out, unpack)

    @functools.cached_property
    def _splits(self) -> tuple[bool, list[tuple[torch.dtype, list[int], tuple[int, ...],
                                              operator.itemgetter | None]],
                               tuple[tuple[int, tuple[int, ...]], ...]]:
        """How ``_views`` cuts a buffer into slots with few tensor creations:
        ``(single, groups, shaped)``.

        ``groups``, one per stored dtype: the dtype, the element counts that
        cut a typed view of the buffer into its slots and the gaps between
        them (one ``split_with_sizes`` yields every slot of that dtype as a
        1-D view), the slot indices, and an ``itemgetter`` picking their
        pieces (None when the pieces are exactly the slots, no gaps).
        ``single``: one dtype whose pieces are every slot in order (then the
        pieces are the result). ``shaped``: the slots to view as their shape
        (those not 1-D)."""
        groups: dict[torch.dtype, tuple[list[int], list[int], list[int]]] = {}
        cursors: dict[torch.dtype, int] = {}
        for index, s in enumerate(self.slots):
            stored = s.wire or s.dtype
            sizes, indices, positions = groups.setdefault(stored, ([], [], []))
            start, cursor = s.offset // stored.itemsize, cursors.get(stored, 0)
            if start > cursor:
                sizes.append(start - cursor)
            sizes.append(s.numel)
            cursors[stored] = start + s.numel
            indices.append(index)
            positions.append(len(sizes) - 1)
        out = []
        for stored, (sizes, indices, positions) in groups.items():
            rest = self.nbytes // stored.itemsize - cursors[stored]
            if rest:
                sizes.append(rest)
            exact = len(sizes) == len(positions)  # no gap pieces: piece k is slot k
            out.append((stored, sizes, tuple(indices),
                        None if exact else operator.itemgetter(*positions, *positions[:1])))
        shaped = tuple((i, s.shape) for i, s in enumerate(self.slots) if len(s.shape) != 1)
        single = len(out) == 1 and out[0][3] is None
        return single, out, shaped

    def to_bytes(self) -> bytes:
        """The layout as bytes for a message's head (``from_bytes`` reads it):
        a version, the slot count and size, then each slot's dtypes, rank,
        offset and shape."""
        parts = [_HEAD.pack(_VERSION, len(self.slots), self.nbytes)]
        for s in self.slots:
            wire = _CODE[s.wire] if s.wire is not None else _NO_WIRE
            parts.append(_SLOT.pack(_CODE[s.dtype], wire, len(s.shape), s.offset))
            parts.append(struct.pack(f"<{len(s.shape)}q", *s.shape))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> tuple[Layout, int]:
        """Inverse of ``to_bytes``; returns the layout and the bytes it took."""
        version, n, nbytes = _HEAD.unpack_from(data, 0)
        if version != _VERSION:
            raise ValueError(f"unknown layout version {version}")
        pos, slots = _HEAD.size, []
        for _ in range(n):
            dtype, wire, ndim, offset = _SLOT.unpack_from(data, pos)
            pos += _SLOT.size
            shape = struct.unpack_from(f"<{ndim}q", data, pos)
            pos += 8 * ndim
            slots.append(Slot(DTYPES[dtype], tuple(shape), offset,
                              None if wire == _NO_WIRE else DTYPES[wire]))
        return cls(tuple(slots), nbytes), pos


class _KernelPlan(NamedTuple):
    """A layout's work for the Triton kernels (``Layout._kernel_plan``)."""

    packed: tuple[int, ...]  # the slots the pack kernel moves (not empty, not cast by torch)
    every: bool  # packed is every slot, in order
    by_torch: tuple[int, ...]  # cast slots the kernels do not cast (fp64): torch's copy_ / .to()
    pack: TilePlan
    decoded: tuple[int, ...]  # the cast slots the unpack kernel decodes
    out: Layout  # where the decoded slots lie in the unpack's output buffer
    unpack: TilePlan


_META = operator.attrgetter("dtype", "shape")
_CPU = torch.device("cpu")
_PLANS: dict = {}
_PLANS_MAX = 1024


def check_wire(wire_dtype: torch.dtype | None) -> None:
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype must be None or one of {[str(d) for d in WIRE_DTYPES]}, got {wire_dtype!r}"
        )


def _wire_for(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype | None:
    """Only floating tensors wider than the wire dtype are cast."""
    if wire is None or not dtype.is_floating_point or dtype.itemsize <= wire.itemsize:
        return None
    return wire


def wire_roundtrip(t: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """What ``t`` becomes after travelling in ``wire_dtype`` (``t`` itself if not cast)."""
    if _wire_for(t.dtype, wire_dtype) is None:
        return t
    return t.to(wire_dtype).to(t.dtype)


def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    stored = slot.wire or slot.dtype
    return flat[slot.offset : slot.offset + slot.nbytes].view(stored).view(slot.shape)


def _views(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Every slot as a tensor on ``flat``'s memory: per stored dtype, one
    ``unsafe_split_with_sizes`` of a typed view of the buffer, then a ``view``
    to the shape where it is not 1-D.

    The unsafe split skips autograd's view bookkeeping (a quarter of the cost
    of a 64-slot unpack). That is sound here: the slots never overlap, so an
    in-place write to one cannot change another, and the uint8 buffer itself
    is never part of an autograd graph."""
    single, groups, shaped = layout._splits
    if flat.numel() != layout.nbytes:
        flat = flat[: layout.nbytes]
    if single:
        stored, sizes, _, _ = groups[0]
        out = list(flat.view(stored).unsafe_split_with_sizes(sizes))
    else:
        out = [None] * len(layout.slots)
        for stored, sizes, indices, pick in groups:
            pieces = flat.view(stored).unsafe_split_with_sizes(sizes)
            # The getter was built with one extra position so it always returns a tuple.
            for index, piece in zip(indices, pieces if pick is None else pick(pieces)):
                out[index] = piece
    for index, shape in shaped:
        out[index] = out[index].view(shape)
    return out


def _kernel_casts(slot: Slot) -> bool:
    """Whether the Triton kernel does this slot's cast (fp64 goes through torch)."""
    return slot.wire is not None and slot.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _triton_for(flat: torch.Tensor, on_cpu: bool) -> bool:
    """Whether this buffer is packed by the Triton kernel: CUDA buffers, or any
    buffer while ``fastpipe.kernels.backend("triton")`` forces it (tests)."""
    return (not on_cpu or _dispatch._choice == "triton") and _dispatch.use_triton(flat)


# map() over these runs the per-tensor checks without a Python frame per tensor.
_IS_CPU = operator.attrgetter("is_cpu")
_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_GET_DEVICE = torch.Tensor.get_device


@functools.cache
def _copy_regions():
    from fastpipe._ext import native

    return native()._copy_regions


def pack(
    tensors: Sequence[torch.Tensor],
    wire_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Layout]:
    """Copies ``tensors`` into one contiguous ``uint8`` buffer.

    Args:
        tensors: any tensors (mixed dtypes, non-contiguous, zero-size, any
            rank), all on one device.
        wire_dtype: cast floating tensors wider than this to it on the way in.
        out: a ``uint8`` buffer of at least ``layout.nbytes`` bytes to pack
            into (a buffer-ring slot); a new one by default.

    Returns:
        ``(flat, layout)``; ``flat`` has exactly ``layout.nbytes`` bytes.

    Raises:
        TypeError / ValueError: bad tensors, wire dtype or ``out``.

    Example:
        >>> flat, layout = pack([torch.ones(3), torch.arange(4)])
        >>> [t.tolist() for t in unpack(flat, layout)]
        [[1.0, 1.0, 1.0], [0, 1, 2, 3]]
    """
    layout = Layout.plan(tensors, wire_dtype)
    on_cpu = all(map(_IS_CPU, tensors))
    if on_cpu:
        device = _CPU
    else:
        device = tensors[0].device
        if not all(t.device == device for t in tensors):
            raise ValueError(f"pack needs tensors on one device, got {sorted({str(t.device) for t in tensors})}")
    if out is None:
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.nbytes:
            raise ValueError(
                f"out must be a 1-D uint8 tensor of at least {layout.nbytes} bytes, got "
                f"{out.dtype} of shape {tuple(out.shape)}"
            )
        flat = out if out.numel() == layout.nbytes else out[: layout.nbytes]
    _pack_into(flat, tensors, layout, on_cpu and flat.is_cpu, flat.device == device)
    return flat, layout


def pack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], layout: Layout,
              on_cpu: bool | None = None) -> None:
    """Copies ``tensors`` into ``flat`` at the slots of ``layout`` (from ``Layout.plan``).

    ``on_cpu``: the caller already knows whether ``flat`` and every tensor
    are on the CPU (None: check here)."""
    if on_cpu is None:
        on_cpu = flat.is_cpu and all(map(_IS_CPU, tensors))
    _pack_into(flat, tensors, layout, on_cpu, None)


def _pack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor], layout: Layout, on_cpu: bool,
               local: bool | None) -> None:
    """``pack_into``; ``local``: whether every tensor is on ``flat``'s device
    (None: not known)."""
    if _triton_for(flat, on_cpu):
        _pack_by_kernel(flat, tensors, layout, local)
        return
    # Contiguous, uncast CPU tensors: one native memcpy pass (GIL released).
    # The rest through torch: copy_ casts with round-to-nearest-even like .to().
    used, offsets, sizes, plain = layout._regions
    if plain and on_cpu and all(map(_CONTIGUOUS, tensors)):
        if offsets:
            chosen = tensors if len(used) == len(tensors) else map(tensors.__getitem__, used)
            _copy_regions()(flat.data_ptr(), list(map(_DATA_PTR, chosen)), offsets, sizes)
        return
    srcs, offsets, sizes, rest = [], [], [], []
    for t, s in zip(tensors, layout.slots):
        if not s.numel:
            continue
        if s.wire is None and t.device.type == "cpu" and t.is_contiguous():
            srcs.append(t.data_ptr())
            offsets.append(s.offset)
            sizes.append(s.nbytes)
        else:
            rest.append((_view(flat, s), t.detach()))
    if srcs:
        _copy_regions()(flat.data_ptr(), srcs, offsets, sizes)
    if rest:
        torch._foreach_copy_([d for d, _ in rest], [t for _, t in rest])


def unpack(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The tensors of a packed buffer: views into ``flat`` where no wire dtype was
    used, fresh tensors of the original dtype where one was (on the Triton
    path, slices of one fresh buffer, which lives while any of them does).

    The views share ``flat``'s memory (writing to one writes the buffer) but
    autograd does not track them as views of it (their ``_base`` is not
    ``flat``): the buffer is a transfer area, never part of a graph.

    Raises:
        ValueError: ``flat`` is smaller than the layout.
    """
    if flat.dtype != torch.uint8 or flat.numel() < layout.nbytes:
        raise ValueError(
            f"flat must be a uint8 tensor of at least {layout.nbytes} bytes, got {flat.dtype} "
            f"with {flat.numel()} elements"
        )
    if not layout._cast:
        return _views(flat, layout)
    if _triton_for(flat, flat.is_cpu):
        return _unpack_by_kernel(flat, layout)
    out = _views(flat, layout)
    for i in layout._cast:
        out[i] = out[i].to(layout.slots[i].dtype)
    return out


def _pack_by_kernel(flat: torch.Tensor, tensors: Sequence[torch.Tensor], layout: Layout,
                    local: bool | None) -> None:
    """``pack_into`` on the Triton kernel: one launch for every slot but those
    torch casts (fp64)."""
    from fastpipe.kernels.pack import pack_triton

    plan = layout._kernel_plan
    srcs = tensors if plan.every else [tensors[i] for i in plan.packed]
    if local is None:
        local = all(map(flat.get_device().__eq__, map(_GET_DEVICE, srcs)))
    if not (local and all(map(_CONTIGUOUS, srcs))):
        # A tensor elsewhere (the host, another GPU) or strided is brought
        # over first: the kernel reads contiguous memory on flat's device.
        srcs = [t.detach().to(flat.device).contiguous() for t in srcs]
    for i in plan.by_torch:
        _view(flat, layout.slots[i]).copy_(tensors[i].detach())
    pack_triton(flat, list(map(_DATA_PTR, srcs)), plan.pack)


def _unpack_by_kernel(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """``unpack`` of a cast layout on the Triton kernel: one launch decodes
    every kernel-cast slot into one new buffer; the tensors returned are
    slices of it (not autograd views, like the uncast ones of ``flat``)."""
    from fastpipe.kernels.pack import unpack_triton

    plan = layout._kernel_plan
    if not plan.decoded:
        out = _views(flat, layout)
    else:
        buf = torch.empty(plan.out.nbytes, dtype=torch.uint8, device=flat.device)
        unpack_triton(flat, buf, plan.unpack)
        # Cut after the launch: on a GPU, the host makes the views while it runs.
        decoded = _views(buf, plan.out)
        if len(decoded) == len(layout.slots):  # every slot decoded, in order
            return decoded
        out = _views(flat, layout)
        for i, d in zip(plan.decoded, decoded):
            out[i] = d
    for i in plan.by_torch:
        out[i] = out[i].to(layout.slots[i].dtype)
    return out
