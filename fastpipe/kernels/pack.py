"""Triton kernels that gather many tensors into one buffer, and back, in one launch.

A pointer table row per tensor says where to read, where to write and how:

    table[t] = (src address, dst address, elements, code)
    code 0: copy bytes   1: copy 4-byte words
         2 / 3 / 4: cast fp32 / fp16 / bf16 → the wire dtype   (pack)
         2 / 3 / 4: cast the wire dtype → fp32 / fp16 / bf16   (unpack)

Program (b, t) handles block b of tensor t (blocks on the grid's first axis,
which has room for 2**31 - 1 of them; the second holds 65535, a few tensors'
worth); blocks past a tensor's end do nothing.
Casts go through fp32 and round to nearest even explicitly (bf16 and
float8_e4m3fn), matching ``x.to(wire).to(x.dtype)`` in torch bit for bit,
where the interpreter's own conversions truncate or drop the carry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastpipe.kernels._triton import to_bf16_rne

PACK_BLOCK = 1024
WIRE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 2}
FLOAT_CODES = {torch.float32: 2, torch.float16: 3, torch.bfloat16: 4}


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
def _wire_ptr(addr, WIRE: tl.constexpr):
    if WIRE == 2:
        return addr.to(tl.pointer_type(tl.uint8))
    else:
        return addr.to(tl.pointer_type(tl.uint16))


@triton.jit
def _table_row(TABLE, BLOCK: tl.constexpr):
    """This program's block (axis 0) of its tensor (axis 1): the tensor's
    table row, element offsets and mask."""
    t = tl.program_id(1)
    n = tl.load(TABLE + t * 4 + 2)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return tl.load(TABLE + t * 4), tl.load(TABLE + t * 4 + 1), tl.load(TABLE + t * 4 + 3), offs, offs < n


@triton.jit
def _pack_kernel(
    TABLE,
    WIRE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src_addr, dst_addr, code, offs, mask = _table_row(TABLE, BLOCK)
    if code == 0:
        v = tl.load(src_addr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask)
        tl.store(dst_addr.to(tl.pointer_type(tl.uint8)) + offs, v, mask=mask)
    elif code == 1:
        w = tl.load(src_addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask)
        tl.store(dst_addr.to(tl.pointer_type(tl.int32)) + offs, w, mask=mask)
    else:
        if code == 2:
            x = tl.load(src_addr.to(tl.pointer_type(tl.float32)) + offs, mask=mask)
        elif code == 3:
            x = tl.load(src_addr.to(tl.pointer_type(tl.float16)) + offs, mask=mask).to(tl.float32)
        else:
            x = tl.load(src_addr.to(tl.pointer_type(tl.bfloat16)) + offs, mask=mask).to(tl.float32)
        tl.store(_wire_ptr(dst_addr, WIRE) + offs, _encode(x, WIRE), mask=mask)


@triton.jit
def _unpack_kernel(
    TABLE,
    WIRE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    src_addr, dst_addr, code, offs, mask = _table_row(TABLE, BLOCK)
    x = _decode(tl.load(_wire_ptr(src_addr, WIRE) + offs, mask=mask), WIRE)
    if code == 2:
        tl.store(dst_addr.to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)
    elif code == 3:
        tl.store(dst_addr.to(tl.pointer_type(tl.float16)) + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(dst_addr.to(tl.pointer_type(tl.bfloat16)) + offs, to_bf16_rne(x), mask=mask)


_MAX_ROWS = 65535  # tensors per launch: the grid's second axis


def _launch(kernel, rows: list[tuple[int, int, int, int]], wire: torch.dtype | None, device) -> None:
    if len(rows) > _MAX_ROWS:  # rare (a message of that many tensors): several launches
        for start in range(0, len(rows), _MAX_ROWS):
            _launch(kernel, rows[start : start + _MAX_ROWS], wire, device)
        return
    if not rows:
        return
    device = torch.device(device)
    table = torch.tensor(rows, dtype=torch.int64)
    blocks = max(triton.cdiv(max(r[2], 1), PACK_BLOCK) for r in rows)
    if device.type != "cuda":
        kernel[(blocks, len(rows))](table, WIRE=WIRE_CODES.get(wire, 0), BLOCK=PACK_BLOCK)
        return
    # Pinned and asynchronous: a pageable copy would wait for everything the
    # stream has queued (the caching host allocator keeps the pinned block
    # until the copy is done). Triton launches on the current device: make
    # it the buffer's, whatever device the calling thread had.
    with torch.cuda.device(device):
        table = table.pin_memory().to(device, non_blocking=True)
        kernel[(blocks, len(rows))](table, WIRE=WIRE_CODES.get(wire, 0), BLOCK=PACK_BLOCK)


def pack_triton(sources: list[torch.Tensor], dests: list[int], wires: list[bool],
                wire: torch.dtype | None, device) -> None:
    """One launch: ``sources[i]`` (contiguous) to address ``dests[i]``, cast to
    ``wire`` where ``wires[i]``, copied bytewise (or by words) elsewhere."""
    rows = []
    for src, dst, cast in zip(sources, dests, wires):
        if src.numel() == 0:
            continue
        if cast:
            rows.append((src.data_ptr(), dst, src.numel(), FLOAT_CODES[src.dtype]))
            continue
        nbytes = src.numel() * src.element_size()
        if src.data_ptr() % 4 == 0 and dst % 4 == 0 and nbytes % 4 == 0:
            rows.append((src.data_ptr(), dst, nbytes // 4, 1))
        else:
            rows.append((src.data_ptr(), dst, nbytes, 0))
    _launch(_pack_kernel, rows, wire, device)


def unpack_triton(srcs: list[int], dests: list[torch.Tensor], wire: torch.dtype, device) -> None:
    """One launch: the wire-dtype data at ``srcs[i]`` cast into ``dests[i]``."""
    rows = [(src, dst.data_ptr(), dst.numel(), FLOAT_CODES[dst.dtype])
            for src, dst in zip(srcs, dests) if dst.numel()]
    _launch(_unpack_kernel, rows, wire, device)
