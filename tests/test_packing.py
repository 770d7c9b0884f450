"""Send-buffer packing: fastpipe.pack / unpack, wire dtypes, and the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Layout, Pipe, pack, unpack
from fastpipe.kernels import backend
from fastpipe.runtime.packing import WIRE_DTYPES
from tests.models import five_model, mlp, reference

# The interpreter's numpy casts warn where torch's saturate or overflow to inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _make(dtype: torch.dtype, shape: tuple[int, ...], transpose: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 50).to(dtype)
    else:
        t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    return t.transpose(0, -1) if transpose and t.dim() >= 2 else t


_tensor = st.builds(
    _make,
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.booleans(),
    st.integers(0, 10_000),
)


def _expected(t: torch.Tensor, wire) -> torch.Tensor:
    cast = wire is not None and t.dtype.is_floating_point and t.dtype.itemsize > wire.itemsize
    return t.to(wire).to(t.dtype) if cast else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN (torch's own casts do not
    agree on NaN payloads across code paths)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype.is_floating_point:
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=150, deadline=None)
@given(st.lists(_tensor, max_size=8))
def test_round_trip_is_bit_exact_and_zero_copy(tensors):
    flat, layout = pack(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    out = unpack(flat, layout)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
    for t, o in zip(tensors, out):
        assert _same(t.contiguous(), o)
        if o.numel():
            assert lo <= o.data_ptr() < hi  # a view into the buffer
    assert all(s.offset % 16 == 0 for s in layout.slots)


@settings(max_examples=100, deadline=None)
@given(st.lists(_tensor, max_size=6), st.sampled_from(WIRE_DTYPES))
def test_wire_dtype_equals_torch_cast(tensors, wire):
    flat, layout = pack(tensors, wire)
    out = unpack(flat, layout)
    for t, o in zip(tensors, out):
        assert _same(_expected(t, wire).contiguous(), o)


@settings(max_examples=25, deadline=None)
@given(st.lists(_tensor, min_size=1, max_size=5), st.sampled_from([None, *WIRE_DTYPES]))
def test_triton_kernel_matches_cpu_path(tensors, wire):
    flat, layout = pack(tensors, wire)
    with backend("triton"):
        flat_k, layout_k = pack(tensors, wire)
        out_k = unpack(flat_k, layout_k)
    assert layout_k == layout
    for t, o in zip(unpack(flat, layout), out_k):
        assert _same(t, o)


@pytest.mark.parametrize("wire", WIRE_DTYPES)
def test_wire_rounding_edge_cases_in_the_kernel(wire):
    # Ties, subnormals, saturation, infinities and NaN: where truncating or
    # carry-dropping casts (the interpreter's) would differ from torch.
    eps = 2.0 ** -8
    x = torch.tensor([1 + eps + eps / 2, 1 + eps / 2, 1 + 3 * eps / 2, 2 ** -10, 3 * 2 ** -10,
                      5 * 2 ** -11, 440.0, 464.0, 470.0, 1e6, float("inf"), -float("inf"),
                      float("nan"), -0.0, 65504.0, 7e4, 1e-8])
    for src in (x, x.to(torch.bfloat16), x.to(torch.float16)):
        with backend("triton"):
            flat, layout = pack([src], wire)
            (got,) = unpack(flat, layout)
        if not _expected(src, wire).dtype == got.dtype:
            raise AssertionError((src.dtype, got.dtype))
        assert _same(_expected(src, wire), got), (src.dtype, wire, got, _expected(src, wire))


def _odd_tensors(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` tensors for the kernel: odd sizes (some empty), mixed dtypes
    (fp64 is cast by torch, the rest by the kernel), values past fp8's range,
    strided views, and sources one element off a 16-byte boundary."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.bool,
              torch.float64, torch.int8]
    out = []
    for i in range(n):
        size = int(torch.randint(0, 300, (), generator=g))
        t = _make(dtypes[i % len(dtypes)], (size + 1,), False, seed * 1000 + i) * (
            1 if dtypes[i % len(dtypes)] == torch.bool else 7)
        t = t[1:] if i % 5 == 4 else t[:size]  # off a 16-byte boundary, or not
        out.append(t[: size // 2 * 2].view(2, -1).t() if i % 6 == 5 and size >= 2 else t)
    return out


def _round_trip_on_the_kernel(tensors, wire):
    with backend("triton"):
        flat, layout = pack(tensors, wire)
        out = unpack(flat, layout)
    assert flat.numel() == layout.nbytes
    for t, o in zip(tensors, out):
        assert _same(_expected(t, wire).contiguous(), o), (t.dtype, tuple(t.shape), wire)
    return flat, layout, out


@pytest.mark.parametrize("n", [1, 7, 64, 131])
@pytest.mark.parametrize("wire", [None, *WIRE_DTYPES])
def test_kernel_packs_many_odd_tensors_like_torch(n, wire):
    _, _, out = _round_trip_on_the_kernel(_odd_tensors(n, n), wire)
    for o in out:
        if o.is_floating_point():
            o.requires_grad_()  # decoded slices, like views of the buffer, are not autograd views


@pytest.mark.parametrize("wire", [None, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("offset", [0, 1])
def test_kernel_tiles_split_rows_and_their_tails(wire, offset):
    # Rows several tiles long, ending mid-tile, mid-word and mid-vector;
    # offset 1 puts every source off a 16-byte boundary (the byte path).
    from fastpipe.kernels.pack import CAST_BLOCK, TILE

    g = torch.Generator().manual_seed(offset)
    sizes = [(torch.float32, TILE // 4 * 2 + 3), (torch.uint8, TILE + 5), (torch.float32, CAST_BLOCK * 2 + 1),
             (torch.bfloat16, CAST_BLOCK + 7), (torch.int16, TILE // 2), (torch.float16, 3 * CAST_BLOCK)]
    tensors = [(torch.randn(size + offset, generator=g) * 300).to(dtype)[offset:] for dtype, size in sizes]
    _round_trip_on_the_kernel(tensors, wire)


def test_kernel_tiles_follow_the_rows():
    from fastpipe.kernels.pack import CAST_BLOCK, COPY, TILE, TilePlan

    plan = TilePlan([(0, TILE + 1, COPY), (TILE + 16, 5, 2), (2 * TILE + 32, CAST_BLOCK, 4)], torch.bfloat16)
    assert (plan.tiles, plan.copies, plan.cast) == (2 + 1 + 1, True, -1)
    rows, _, tile_row = plan.tables(torch.device("cpu"), None)
    assert tile_row.tolist() == [0, 0, 1, 2]
    assert rows.view(-1, 4)[:, 2].tolist() == [0, 2, 3]  # each row's first tile
    with pytest.raises(AssertionError, match="16-byte aligned"):
        TilePlan([(8, 4, COPY)], None)


def test_kernel_tables_are_kept_while_the_addresses_stay():
    tensors = [torch.randn(100), torch.arange(7), torch.randn(33, dtype=torch.float16)]
    flat, layout = pack(tensors, torch.float8_e4m3fn)
    plan = layout._kernel_plan
    with backend("triton"):
        for _ in range(3):
            pack(tensors, torch.float8_e4m3fn, out=flat)
            unpack(flat, layout)
        tables, addresses = dict(plan.pack._tables), dict(plan.pack._addresses)
        assert len(tables) == 1 and len(addresses) == 1 and len(plan.unpack._tables) == 1
        moved = [t.clone() for t in tensors]  # same layout, new addresses: one more table
        pack(moved, torch.float8_e4m3fn, out=flat)
        assert plan.pack._tables == tables and len(plan.pack._addresses) == 2
        assert all(_same(_expected(t, torch.float8_e4m3fn), o) for t, o in zip(tensors, unpack(flat, layout)))


def test_layout_is_small_comparable_and_serializable():
    a = [torch.randn(4, 8), torch.arange(3), torch.ones(2, 2, dtype=torch.bool)]
    layout = Layout.plan(a)
    data = layout.to_bytes()
    assert len(data) <= 16 + 3 * 40
    again, used = Layout.from_bytes(data)
    assert again == layout and used == len(data) and hash(again) == hash(layout)
    assert Layout.plan([torch.randn(5, 8), *a[1:]]) != layout  # a shape change shows
    assert Layout.plan(a, torch.bfloat16) != layout
    assert Layout.plan(a, torch.bfloat16).nbytes < layout.nbytes


def test_integer_and_bool_slots_are_never_cast():
    layout = Layout.plan([torch.arange(4), torch.ones(2, dtype=torch.bool), torch.randn(3),
                          torch.randn(3, dtype=torch.bfloat16)], torch.bfloat16)
    assert [s.wire for s in layout.slots] == [None, None, torch.bfloat16, None]


def test_bad_input_names_the_value():
    with pytest.raises(TypeError, match="position 1"):
        pack([torch.ones(2), [1, 2]])
    with pytest.raises(ValueError, match="wire_dtype"):
        pack([torch.ones(2)], torch.int8)
    with pytest.raises(ValueError, match="one device"):
        pack([torch.ones(2), torch.ones(2, device="meta")])
    flat, layout = pack([torch.ones(8)])
    with pytest.raises(ValueError, match="at least 32 bytes"):
        unpack(flat[:16], layout)
    with pytest.raises(ValueError, match="out must be"):
        pack([torch.ones(8)], out=torch.empty(4, dtype=torch.uint8))


@pytest.mark.parametrize("schedule,balance", [("1f1b", [2, 3]), ("zbv", [2, 1, 1, 1]),
                                              ("gpipe", [2, 3])])
def test_plain_values_and_five_tensors_cross_local_boundaries(schedule, balance):
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    ref_loss, ref_grads = reference(five_model(), x, y, nn.functional.mse_loss, 4)
    model = five_model()
    pipe = Pipe(model, chunks=4, schedule=schedule, balance=balance, devices=["cpu", "cpu"],
                stages_per_rank=2 if schedule == "zbv" else None)
    try:
        torch.testing.assert_close(pipe.step(x, y, nn.functional.mse_loss), ref_loss)
    finally:
        pipe.close()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], msg=name)


def test_local_wire_dtype_rounds_what_crosses():
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    losses = []
    for wire in (None, torch.bfloat16):
        model = mlp(dtype=torch.float32)
        pipe = Pipe(model, chunks=4, devices=["cpu", "cpu"], wire_dtype=wire, grad_wire_dtype=wire)
        try:
            losses.append(pipe.step(x, y, nn.functional.mse_loss))
        finally:
            pipe.close()
    assert losses[0] != losses[1]
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=1e-3)
    with pytest.raises(ValueError, match="wire_dtype"):
        Pipe(mlp(), chunks=2, devices=["cpu", "cpu"], wire_dtype=torch.float64)
