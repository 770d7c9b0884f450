"""Triton kernels that gather many tensors into one buffer, and back, in one launch.

A launch's work is the rows' data cut into tiles of equal size, ``TILE``
bytes of a row copied as it is or ``CAST_BLOCK`` elements of a row cast,
one program a tile. However many tensors there are, the programs are many
and equal and every SM streams (one program per tensor left a one-tensor
launch on a handful of SMs and a many-tensor one waiting on its largest
tensor). A tile never straddles two rows, so a program finds its row with
one lookup, not a search:

    TILE_ROW[k] = r                      the row tile k belongs to
    ROWS[r]     = (flat offset, count, first tile, code)
    ADDR[r]     = pack: the source's address   unpack: the offset in OUT

    flat:  [ a: tiles 0 1 2 3 | pad | b: 4 5 | pad | c: 6 ]
    code 0: copy ``count`` bytes
         2 / 3 / 4: cast ``count`` fp32 / fp16 / bf16 elements → the wire dtype   (pack)
         2 / 3 / 4: cast ``count`` wire elements → fp32 / fp16 / bf16           (unpack)

Only a row's last tile is partial. Full tiles load and store unmasked, and
with 16-byte-aligned addresses (slots are; ``ALIGNED`` says every source
is) the compiler moves 16 bytes an access, which a mask built from a count
read at run time would forbid; bytes are copied as 4-byte words, as a byte
takes a register of its own. The last tile masks; a launch with an
unaligned source copies bytes, in a loop of small blocks. Tiles are small
for the same reason: a block's elements live in registers, and a block
that spills moves at a fraction of the copy's speed. A launch compiles
only the paths its rows take (``COPIES``, ``CAST``): a kernel holds the
registers of its heaviest path.

The tables depend on the layout alone (the sources' addresses aside), so
``TilePlan`` builds them once and keeps them on each device and stream it
runs on; the sources' addresses are kept too, keyed by the addresses, and
uploaded (pinned, asynchronously) only when they change. A call then
costs one launch and no wait for the device.

Casts go through fp32 and round to nearest even explicitly (bf16 and
float8_e4m3fn), matching ``x.to(wire).to(x.dtype)`` in torch bit for bit,
where the interpreter's own conversions truncate or drop the carry
(float8_e4m3fn saturates at ±448 as torch does from 2.13; earlier torch
gives NaN from 480 on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fastpipe.kernels._triton import to_bf16_rne

__all__ = ["CAST_BLOCK", "COPY", "FLOAT_CODES", "TILE", "TilePlan", "pack_triton", "unpack_triton"]

TILE = 8192  # bytes per program of a row copied as it is
CAST_BLOCK = 2048  # elements per program of a row cast
COPY_WARPS = 4  # warps per program of a launch that only copies
CAST_WARPS = {0: 4, 1: 4, 2: 8}  # of one that casts, by wire code: fp8's encoding is ALU-bound
WIRE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}
FLOAT_CODES = {torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}
COPY = 0  # the code of a row copied bytewise
MIXED = -1  # a launch's cast rows have several source dtypes (codes)
_ADDRESS_TABLES = 8  # source-address tables a plan keeps (the latest sets of addresses)


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
    """Tile ``k`` of a row of ``count`` bytes, copied as they are: by 4-byte
    words from an aligned source (16 bytes an access), else byte by byte."""
    if ALIGNED:
        offs = k * (TILE // 4) + tl.arange(0, TILE // 4)
        src = _source(addr, tl.int32, ALIGNED)
        out = dst.to(tl.pointer_type(tl.int32), bitcast=True)
        if k * TILE + TILE <= count:
            tl.store(out + offs, tl.load(src + offs))
        else:
            words = count // 4
            mask = offs < words
            tl.store(out + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)
            tail = words * 4 + tl.arange(0, 4)  # the row's last count % 4 bytes
            mask = tail < count
            tl.store(dst + tail, tl.load(addr.to(tl.pointer_type(tl.uint8)) + tail, mask=mask, other=0), mask=mask)
    else:
        # A loop, not one block: a byte a register, a whole tile would spill.
        src = addr.to(tl.pointer_type(tl.uint8))
        for part in range(0, TILE // 1024):
            offs = k * TILE + part * 1024 + tl.arange(0, 1024)
            mask = offs < count
            tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0), mask=mask)


@triton.jit
def _encode_from(addr, dst, offs, mask, SRC: tl.constexpr, WIRE: tl.constexpr, ALIGNED: tl.constexpr,
                 MASKED: tl.constexpr):
    if SRC == 2:
        x = _load(_source(addr, tl.float32, ALIGNED), offs, mask, MASKED)
    elif SRC == 3:
        x = _load(_source(addr, tl.float16, ALIGNED), offs, mask, MASKED).to(tl.float32)
    else:
        x = _load(_source(addr, tl.bfloat16, ALIGNED), offs, mask, MASKED).to(tl.float32)
    _store(_wire_ptr(dst, WIRE), offs, _encode(x, WIRE), mask, MASKED)


@triton.jit
def _encode_block(addr, dst, offs, mask, code, CAST: tl.constexpr, WIRE: tl.constexpr, ALIGNED: tl.constexpr,
                  MASKED: tl.constexpr):
    if CAST != -1:  # one source dtype in the launch: no branch
        _encode_from(addr, dst, offs, mask, CAST, WIRE, ALIGNED, MASKED)
    elif code == 2:
        _encode_from(addr, dst, offs, mask, 2, WIRE, ALIGNED, MASKED)
    elif code == 3:
        _encode_from(addr, dst, offs, mask, 3, WIRE, ALIGNED, MASKED)
    else:
        _encode_from(addr, dst, offs, mask, 4, WIRE, ALIGNED, MASKED)


@triton.jit
def _encode_tile(addr, dst, k, count, code, CAST: tl.constexpr, WIRE: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Tile ``k`` of a row of ``count`` elements, cast to the wire dtype."""
    offs = k * BLOCK + tl.arange(0, BLOCK)
    if k * BLOCK + BLOCK <= count:
        _encode_block(addr, dst, offs, offs, code, CAST, WIRE, ALIGNED, False)
    else:
        _encode_block(addr, dst, offs, offs < count, code, CAST, WIRE, ALIGNED, True)


@triton.jit
def _pack_kernel(
    FLAT,
    ADDR,
    ROWS,
    TILE_ROW,
    WIRE: tl.constexpr,
    ALIGNED: tl.constexpr,
    COPIES: tl.constexpr,
    CAST: tl.constexpr,
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
    # A launch compiles only the paths its rows take (COPIES, CAST): the
    # registers a kernel holds are those of its heaviest path. No value
    # leaves a run-time branch: each loads and stores in itself, so the
    # unmasked path keeps the wide layout its accesses were given.
    if CAST == 0:
        _copy_tile(addr, dst, k, count, ALIGNED, TILE)
    elif not COPIES:
        _encode_tile(addr, dst, k, count, code, CAST, WIRE, ALIGNED, CAST_BLOCK)
    elif code == 0:
        _copy_tile(addr, dst, k, count, ALIGNED, TILE)
    else:
        _encode_tile(addr, dst, k, count, code, CAST, WIRE, ALIGNED, CAST_BLOCK)


@triton.jit
def _decode_to(src, dst, offs, mask, DST: tl.constexpr, WIRE: tl.constexpr, MASKED: tl.constexpr):
    x = _decode(_load(_wire_ptr(src, WIRE), offs, mask, MASKED), WIRE)
    if DST == 2:
        _store(dst.to(tl.pointer_type(tl.float32), bitcast=True), offs, x, mask, MASKED)
    elif DST == 3:
        _store(dst.to(tl.pointer_type(tl.float16), bitcast=True), offs, x.to(tl.float16), mask, MASKED)
    else:
        _store(dst.to(tl.pointer_type(tl.bfloat16), bitcast=True), offs, to_bf16_rne(x), mask, MASKED)


@triton.jit
def _decode_block(src, dst, offs, mask, code, CAST: tl.constexpr, WIRE: tl.constexpr, MASKED: tl.constexpr):
    if CAST != -1:
        _decode_to(src, dst, offs, mask, CAST, WIRE, MASKED)
    elif code == 2:
        _decode_to(src, dst, offs, mask, 2, WIRE, MASKED)
    elif code == 3:
        _decode_to(src, dst, offs, mask, 3, WIRE, MASKED)
    else:
        _decode_to(src, dst, offs, mask, 4, WIRE, MASKED)


@triton.jit
def _unpack_kernel(
    FLAT,
    OUT,
    ADDR,
    ROWS,
    TILE_ROW,
    WIRE: tl.constexpr,
    CAST: tl.constexpr,
    CAST_BLOCK: tl.constexpr,
):
    row, count, k, code = _tile(ROWS, TILE_ROW)
    # 16-byte aligned: the slots, and TilePlan's offsets (hints as in _pack_kernel).
    src = FLAT + tl.multiple_of(tl.load(ROWS + row * 4), 16)
    dst = OUT + tl.multiple_of(tl.load(ADDR + row), 16)
    offs = k * CAST_BLOCK + tl.arange(0, CAST_BLOCK)
    if k * CAST_BLOCK + CAST_BLOCK <= count:
        _decode_block(src, dst, offs, offs, code, CAST, WIRE, False)
    else:
        _decode_block(src, dst, offs, offs < count, code, CAST, WIRE, True)


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
        casts = {code for _, _, code in rows if code != COPY}
        self.wire_code = WIRE_CODES.get(wire, 0)
        self.copies = any(code == COPY for _, _, code in rows)
        self.cast = casts.pop() if len(casts) == 1 else (MIXED if casts else 0)
        self.tile, self.cast_block = TILE, CAST_BLOCK
        self.num_warps = CAST_WARPS[self.wire_code] if self.cast else COPY_WARPS
        table, tile_row = [], []
        for r, (off, count, code) in enumerate(rows):
            tiles = triton.cdiv(count, self.tile if code == COPY else self.cast_block)
            table += (off, count, len(tile_row), code)
            tile_row += [r] * tiles
        self.rows, self.tiles = len(rows), len(tile_row)
        self._host = table + list(offsets or ()) + tile_row
        self._has_offsets = offsets is not None
        self._tables: dict = {}  # (device, stream) -> (ROWS, offsets or None, TILE_ROW) on the device
        self._addresses: dict = {}  # (device, stream, *addresses) -> (ADDR on the device, aligned)

    def tables(self, device: torch.device, stream: int | None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                       torch.Tensor]:
        """``(ROWS, offsets, TILE_ROW)`` on ``device`` for ``stream``, uploaded on first use."""
        found = self._tables.get((device, stream))
        if found is None:
            table, n = _upload(self._host, device), 4 * self.rows
            offsets = table[n : n + self.rows] if self._has_offsets else None
            found = self._tables[device, stream] = (table[:n], offsets, table[len(self._host) - self.tiles :])
        return found

    def addresses(self, device: torch.device, stream: int | None, addresses: list[int]) -> tuple[torch.Tensor, bool]:
        """The sources' addresses on ``device`` for ``stream``, and whether all
        are 16-byte aligned; uploaded only for addresses not seen lately."""
        key = (device, stream, *addresses)
        found = self._addresses.get(key)
        if found is None:
            if len(self._addresses) >= _ADDRESS_TABLES:
                self._addresses.clear()  # one step under the GIL: ranks' threads share plans
            aligned = not any(a % 16 for a in addresses)
            found = self._addresses[key] = (_upload(addresses, device), aligned)
        return found


def pack_triton(flat: torch.Tensor, addresses: list[int], plan: TilePlan) -> None:
    """One launch: row ``r`` of ``plan`` from the contiguous memory at
    ``addresses[r]`` (on ``flat``'s device, alive until the launch is done)
    into ``flat``, cast to the wire dtype where its code says so."""
    if len(addresses) != plan.rows:
        raise AssertionError(f"{len(addresses)} addresses for a plan of {plan.rows} rows")
    if not plan.tiles:
        return
    device = flat.device
    stream = _stream(device)
    rows, _, tile_row = plan.tables(device, stream)
    addr, aligned = plan.addresses(device, stream, addresses)
    aligned = aligned and not flat.data_ptr() % 16  # words are stored at flat + offset too
    with _on(device):
        _pack_kernel[(plan.tiles,)](flat, addr, rows, tile_row, WIRE=plan.wire_code, ALIGNED=aligned,
                                    COPIES=plan.copies, CAST=plan.cast, TILE=plan.tile,
                                    CAST_BLOCK=plan.cast_block, num_warps=plan.num_warps)


def unpack_triton(flat: torch.Tensor, out: torch.Tensor, plan: TilePlan) -> None:
    """One launch: row ``r`` of ``plan``, wire-dtype data in ``flat``, cast into
    ``out`` (uint8, 16-byte aligned) at the plan's offset of that row."""
    if not plan.tiles:
        return
    device = flat.device
    rows, offsets, tile_row = plan.tables(device, _stream(device))
    with _on(device):
        _unpack_kernel[(plan.tiles,)](flat, out, offsets, rows, tile_row, WIRE=plan.wire_code, CAST=plan.cast,
                                      CAST_BLOCK=plan.cast_block, num_warps=plan.num_warps)
