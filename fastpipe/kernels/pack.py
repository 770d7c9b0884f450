"""Triton kernels that gather many tensors into one buffer, and back, in one launch.

The work of a launch is the packed buffer's bytes, cut into tiles of
``TILE`` bytes; one program moves one tile. However many tensors there are,
the programs are many and equal, so every SM streams (one program per
tensor left a one-tensor launch on a handful of SMs and a many-tensor one
waiting on its largest tensor). A tile never straddles two tensors, so a
program finds its tensor with one lookup, not a search:

    TILE_ROW[k] = r                      the row tile k belongs to
    ROWS[r]     = (flat offset, count, first tile, code)
    ADDR[r]     = pack: the source's address   unpack: the offset in OUT

    flat:  [ a: tiles 0 1 2 3 | pad | b: 4 5 | pad | c: 6 ]   tile = TILE bytes of flat
    code 0: copy ``count`` bytes
         2 / 3 / 4: cast ``count`` fp32 / fp16 / bf16 elements → the wire dtype   (pack)
         2 / 3 / 4: cast ``count`` wire elements → fp32 / fp16 / bf16           (unpack)

Only a tensor's last tile is partial. Full tiles load and store unmasked:
with 16-byte-aligned addresses (slots are, and ``ALIGNED`` promises the
sources are) the compiler then moves 16 bytes per access, which a mask
built from a count read at run time would forbid. The last tile masks.

The tables depend on the layout alone (the sources' addresses aside), so
``TilePlan`` builds them once and keeps them on each device and stream it
runs on; the sources' addresses are kept too, keyed by the addresses, and
re-uploaded (pinned, asynchronously) only when they change. A call then
costs one launch and no host synchronization.

Casts go through fp32 and round to nearest even explicitly (bf16 and
float8_e4m3fn), matching ``x.to(wire).to(x.dtype)`` in torch bit for bit,
where the interpreter's own conversions truncate or drop the carry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastpipe.kernels._triton import to_bf16_rne

TILE = 16384  # bytes of the packed buffer per program
NUM_WARPS = 8
WIRE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}
FLOAT_CODES = {torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
COPY = 0  # the code of a row copied bytewise
_ADDRESS_TABLES = 8  # source-address tables kept per plan and stream


@triton.jit
def _to_e4m3fn_bits(x):
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even, like torch:
    anything above 448 in magnitude (inf included) saturates to ±448, NaN is 0x7F."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = bits & 0x7FFFFFFF
    ax = mag.to(tl.float32, bitcast=True)
    # normal range: drop 20 mantissa bits with RNE, then rebias 127 -> 7
    rounded = mag + ((mag >> 20) & 1) + 0x7FFFF
    normal = ((rounded >> 20) - (120 << 3)).to(tl.uint8)
    # subnormal range (|x| < 2**-6): steps of 2**-9, RNE by the 2**23 trick
    small = tl.where(ax < 0.015625, ax, 0.0)  # keeps inf and NaN out of the cast below
    steps = (small * 512.0 + 8388608.0) - 8388608.0
    sub = steps.to(tl.uint8)
    out = tl.where(ax < 0.015625, sub, normal)
    out = tl.where(mag > 0x43E00000, 0x7E, out)  # above 448
    out = tl.where(mag > 0x7F800000, 0x7F, out)  # NaN
    return out | sign


@triton.jit
def _from_e4m3fn_bits(b):
    """float8_e4m3fn bits (uint8) -> fp32, exactly."""
    b32 = b.to(tl.uint32)
    sign = (b32 & 0x80) << 24
    exp = (b32 >> 3) & 0xF
    mant = b32 & 0x7
    normal = (sign | ((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * 0.001953125
    sub = tl.where(sign != 0, -sub, sub)
    out = tl.where(exp == 0, sub, normal)
    return tl.where((b32 & 0x7F) == 0x7F, float("nan"), out)


@triton.jit
def _encode(x, WIRE: tl.constexpr):
    if WIRE == 0:
        return to_bf16_rne(x).to(tl.uint16, bitcast=True)
    elif WIRE == 1:
        return x.to(tl.float16).to(tl.uint16, bitcast=True)
    else:
        return _to_e4m3fn_bits(x)


@triton.jit
def _decode(raw, WIRE: tl.constexpr):
    if WIRE == 0:
        return raw.to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif WIRE == 1:
        return raw.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return _from_e4m3fn_bits(raw)


@triton.jit
def _wire_ptr(ptr, WIRE: tl.constexpr):
    """``ptr`` (into the packed buffer) as a pointer to the wire dtype's bits."""
    if WIRE == 2:
        return ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    else:
        return ptr.to(tl.pointer_type(tl.uint16), bitcast=True)


@triton.jit
def _source(addr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """The address ``addr`` as a pointer to ``dtype``, 16-byte aligned if ``ALIGNED``
    (the launcher checked; the compiler cannot see through a loaded address)."""
    ptr = addr.to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _tile(ROWS, TILE_ROW):
    """This program's row, the row's count and code, and the index of this
    program's tile within the row."""
    tile = tl.program_id(0).to(tl.int64)
    row = tl.load(TILE_ROW + tile)
    count = tl.load(ROWS + row * 4 + 1)
    k = tile - tl.load(ROWS + row * 4 + 2)
    return row, count, k, tl.load(ROWS + row * 4 + 3)


@triton.jit
def _copy_tile(addr, dst, k, count, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    """Tile ``k`` of a row of ``count`` bytes copied as they are."""
    offs = k * TILE + tl.arange(0, TILE)
    src = _source(addr, tl.uint8, ALIGNED)
    if k * TILE + TILE <= count:
        tl.store(dst + offs, tl.load(src + offs))
    else:
        mask = offs < count
        tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)


@triton.jit
def _encode_block(addr, dst, offs, mask, code, WIRE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    out = _wire_ptr(dst, WIRE)
    if code == 2:
        x32 = _load(_source(addr, tl.float32, ALIGNED), offs, mask, MASKED)
        _store(out, offs, _encode(x32, WIRE), mask, MASKED)
    elif code == 3:
        x16 = _load(_source(addr, tl.float16, ALIGNED), offs, mask, MASKED).to(tl.float32)
        _store(out, offs, _encode(x16, WIRE), mask, MASKED)
    else:
        xb16 = _load(_source(addr, tl.bfloat16, ALIGNED), offs, mask, MASKED).to(tl.float32)
        _store(out, offs, _encode(xb16, WIRE), mask, MASKED)


@triton.jit
def _encode_tile(addr, dst, k, count, code, WIRE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``k`` of a row of ``count`` elements cast to the wire dtype."""
    offs = k * BLOCK + tl.arange(0, BLOCK)
    if k * BLOCK + BLOCK <= count:
        _encode_block(addr, dst, offs, offs, code, WIRE, ALIGNED, False)
    else:
        _encode_block(addr, dst, offs, offs < count, code, WIRE, ALIGNED, True)


@triton.jit
def _pack_kernel(
    FLAT,
    ADDR,
    ROWS,
    TILE_ROW,
    WIRE: tl.constexpr,
    ALIGNED: tl.constexpr,
    TILE: tl.constexpr,
    CAST_BLOCK: tl.constexpr,
):
    row, count, k, code = _tile(ROWS, TILE_ROW)
    # Hints go on single-result operations here, in the kernel: a hint is an
    # attribute of an operation, so on one of a helper's several results it
    # would hold for all of them (and a count "divisible by 16" would let the
    # compiler widen the masked accesses of the last tile past its end).
    dst = FLAT + tl.multiple_of(tl.load(ROWS + row * 4), 16)  # slots are 16-byte aligned
    addr = tl.load(ADDR + row)
    # No value leaves a run-time branch: each loads and stores in itself, so
    # the unmasked path keeps the wide layout its accesses were given.
    if code == 0:
        _copy_tile(addr, dst, k, count, ALIGNED, TILE)
    else:
        _encode_tile(addr, dst, k, count, code, WIRE, ALIGNED, CAST_BLOCK)


@triton.jit
def _decode_block(src, dst, offs, mask, code, WIRE: tl.constexpr, MASKED: tl.constexpr):
    x = _decode(_load(_wire_ptr(src, WIRE), offs, mask, MASKED), WIRE)
    if code == 2:
        _store(dst.to(tl.pointer_type(tl.float32), bitcast=True), offs, x, mask, MASKED)
    elif code == 3:
        _store(dst.to(tl.pointer_type(tl.float16), bitcast=True), offs, x.to(tl.float16), mask, MASKED)
    else:
        _store(dst.to(tl.pointer_type(tl.bfloat16), bitcast=True), offs, to_bf16_rne(x), mask, MASKED)


@triton.jit
def _unpack_kernel(
    FLAT,
    OUT,
    ADDR,
    ROWS,
    TILE_ROW,
    WIRE: tl.constexpr,
    CAST_BLOCK: tl.constexpr,
):
    row, count, k, code = _tile(ROWS, TILE_ROW)
    # 16-byte aligned: the slots, and TilePlan's offsets (hints as in _pack_kernel).
    src = FLAT + tl.multiple_of(tl.load(ROWS + row * 4), 16)
    dst = OUT + tl.multiple_of(tl.load(ADDR + row), 16)
    offs = k * CAST_BLOCK + tl.arange(0, CAST_BLOCK)
    if k * CAST_BLOCK + CAST_BLOCK <= count:
        _decode_block(src, dst, offs, offs, code, WIRE, False)
    else:
        _decode_block(src, dst, offs, offs < count, code, WIRE, True)


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without waiting for the
    device: a pageable copy would wait for everything the stream has queued
    (the caching host allocator keeps the pinned block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _stream(device: torch.device) -> int | None:
    """The current stream on ``device`` (None off CUDA): tables are kept per
    stream, so each is allocated on the stream that reads it and the caching
    allocator never recycles one under a kernel of another stream."""
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentRawStream(device.index)


def _on(device: torch.device):
    """Triton launches on the current device: make it ``device`` for the launch,
    whatever device the calling thread had."""
    if device.type != "cuda" or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class TilePlan:
    """One launch's rows and tiles: fixed by a layout, so built once per layout.

    Args:
        rows: per tensor, ``(flat offset, count, code)``: where its bytes sit
            in the packed buffer (16-byte aligned), how many bytes (code 0)
            or elements (codes 2-4) it has, and ``code`` (see the module).
            Rows with a zero count are left out by the caller.
        wire: the wire dtype of the cast rows (None if there are none).
        offsets: for unpack, each row's byte offset in the output buffer
            (16-byte aligned); None for pack, whose addresses come per call.
    """

    def __init__(self, rows: Sequence[tuple[int, int, int]], wire: torch.dtype | None,
                 offsets: Sequence[int] | None = None) -> None:
        if any(off % 16 for off, _, _ in rows) or any(off % 16 for off in offsets or ()):
            raise AssertionError(f"offsets must be 16-byte aligned, got rows {rows}, offsets {offsets}")
        self.wire = wire
        self.wire_code = WIRE_CODES.get(wire, 0)
        # No row casts without a wire dtype: sized as for bf16, such a launch
        # shares the bf16 one's compiled kernel.
        self.cast_block = TILE // (wire.itemsize if wire is not None else 2)
        table, tile_row, first = [], [], 0
        for r, (off, count, code) in enumerate(rows):
            tiles = triton.cdiv(count * (1 if code == COPY else wire.itemsize), TILE)
            table += (off, count, first, code)
            tile_row += [r] * tiles
            first += tiles
        self.tiles = first
        self._host = table + list(offsets or ()) + tile_row
        self._rows = len(rows)
        self._has_offsets = offsets is not None
        self._tables: dict = {}  # stream -> (rows, offsets or None, tile rows), on the device
        self._addresses: dict = {}  # (stream, addresses) -> (table, aligned)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(ROWS, offsets, TILE_ROW)`` on ``device``, uploaded on first use."""
        key = (device, _stream(device))
        found = self._tables.get(key)
        if found is None:
            table, n = _upload(self._host, device), 4 * self._rows
            offsets = table[n : n + self._rows] if self._has_offsets else None
            found = self._tables[key] = (table[:n], offsets, table[len(self._host) - self.tiles :])
        return found

    def addresses(self, device: torch.device, addresses: list[int]) -> tuple[torch.Tensor, bool]:
        """The sources' addresses on ``device``, and whether all are 16-byte
        aligned; re-uploaded only for addresses not seen lately."""
        key = (device, _stream(device), *addresses)
        found = self._addresses.get(key)
        if found is None:
            if len(self._addresses) >= _ADDRESS_TABLES:
                del self._addresses[next(iter(self._addresses))]
            aligned = not any(a % 16 for a in addresses)
            found = self._addresses[key] = (_upload(addresses, device), aligned)
        return found


def pack_triton(flat: torch.Tensor, addresses: list[int], plan: TilePlan) -> None:
    """One launch: row ``r`` of ``plan`` from the contiguous memory at
    ``addresses[r]`` (on ``flat``'s device, alive until the launch is done)
    into ``flat``, cast to the wire dtype where its code says so."""
    if len(addresses) != plan._rows:
        raise AssertionError(f"{len(addresses)} addresses for a plan of {plan._rows} rows")
    if not plan.tiles:
        return
    rows, _, tile_row = plan.tables(flat.device)
    addr, aligned = plan.addresses(flat.device, addresses)
    with _on(flat.device):
        _pack_kernel[(plan.tiles,)](flat, addr, rows, tile_row, WIRE=plan.wire_code, ALIGNED=aligned,
                                    TILE=TILE, CAST_BLOCK=plan.cast_block, num_warps=NUM_WARPS)


def unpack_triton(flat: torch.Tensor, out: torch.Tensor, plan: TilePlan) -> None:
    """One launch: row ``r`` of ``plan``, wire-dtype data in ``flat``, cast into
    ``out`` (uint8, 16-byte aligned) at the plan's offset of that row."""
    if not plan.tiles:
        return
    rows, offsets, tile_row = plan.tables(flat.device)
    with _on(flat.device):
        _unpack_kernel[(plan.tiles,)](flat, out, offsets, rows, tile_row, WIRE=plan.wire_code,
                                      CAST_BLOCK=plan.cast_block, num_warps=NUM_WARPS)
