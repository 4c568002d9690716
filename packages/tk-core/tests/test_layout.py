"""Scale-factor layouts and alignment helpers: exact round trips and the documented strides."""

import pytest
import torch

from tk_core import layout
from tk_core.formats import pow2


def test_alignment_helpers():
    assert [layout.ceil_div(x, 4) for x in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert [layout.align(x, 4) for x in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [layout.is_power_of_two(x) for x in (0, 1, 2, 3, 64, 96)] == [False, True, True, False, True, False]
    assert layout.tma_aligned_size(5, 4) == 8 and layout.tma_aligned_size(5, 1) == 16


@pytest.mark.parametrize("nm,nk", [(1, 1), (5, 3), (8, 4), (13, 57), (0, 5)])
@pytest.mark.parametrize("name", layout.SF_LAYOUTS)
def test_sf_layout_round_trip(nm, nk, name):
    sf = pow2(torch.randint(-30, 30, (nm, nk)))
    out = layout.sf_to_layout(sf, name)
    assert layout.sf_layout_of(out) == name or (name == "col" and nk == 1 or nm <= 1)
    assert torch.equal(layout.sf_to_row_major(out, nk), sf)


@pytest.mark.parametrize("nm,nk", [(5, 3), (13, 57)])
def test_sf_layout_strides(nm, nk):
    col = layout.alloc_sf(nm, nk, "col", "cpu")
    assert col.shape == (nm, nk) and col.stride() == (1, layout.align(nm, 4)) and col.dtype == torch.float32
    packed = layout.alloc_sf(nm, nk, "packed", "cpu")
    assert packed.shape == (nm, layout.ceil_div(nk, 4)) and packed.stride() == (1, layout.align(nm, 4))
    assert packed.dtype == torch.int32
    row = layout.alloc_sf(nm, nk, "row", "cpu")
    assert row.is_contiguous() and row.shape == (nm, nk)


def test_packed_byte_positions_and_zero_padding():
    nm, nk = 3, 6
    sf = pow2(torch.arange(nm * nk).view(nm, nk) - 9)
    out = layout.sf_to_layout(sf, "packed")
    storage = out.t().as_strided((2, 4), (4, 1)).contiguous().view(torch.uint8)  # (ceil(nk/4), 4 * align(nm, 4))
    for m in range(nm):
        for k in range(nk):
            assert storage[k // 4, 4 * m + k % 4].item() == (m * nk + k - 9) + 127
    assert storage[1, 4 * 0 + 2].item() == 0 and storage[:, 4 * nm :].eq(0).all()


def test_col_major_padding_is_zero():
    out = layout.sf_to_layout(torch.ones(5, 2), "col")
    storage = out.t().as_strided((2, 8), (8, 1))
    assert storage[:, 5:].eq(0).all() and storage[:, :5].eq(1).all()


def test_row_major_column_vector_is_not_col_major():
    assert layout.sf_layout_of(torch.ones(7, 1)) == "row"
    assert layout.sf_layout_of(layout.alloc_sf(7, 1, "col", "cpu")) == "col"


@pytest.mark.parametrize(
    "col,packed,round_sf,want",
    [(False, False, False, "row"), (True, False, True, "col"), (True, True, True, "packed")],
)
def test_sf_layout_flags(col, packed, round_sf, want):
    assert layout.sf_layout("op", col, packed, round_sf) == want


def test_sf_layout_rejects_broken_combinations():
    with pytest.raises(ValueError, match="op: use_packed_ue8m0 must come with use_tma_aligned_col_major_sf"):
        layout.sf_layout("op", False, True, True)
    with pytest.raises(ValueError, match="op: use_packed_ue8m0 must come with round_sf=True"):
        layout.sf_layout("op", True, True, False)
    with pytest.raises(ValueError, match="layout must be one of"):
        layout.alloc_sf(1, 1, "diagonal", "cpu")


def test_vector_aligned_keeps_aligned_views_and_copies_the_rest():
    buf = torch.zeros(64, 72, dtype=torch.bfloat16)
    aligned = buf[:, :64]  # row stride 144 bytes, base aligned
    assert layout.vector_aligned(aligned) is aligned
    one_row = buf.view(-1).as_strided((1, 64), (72, 1))  # a size-1 dimension's stride is never used
    assert layout.vector_aligned(one_row) is one_row
    # ... but view(dtype) checks it: an odd one becomes the contiguous stride, in a view of the same memory
    odd = buf.view(-1).as_strided((1, 64), (67, 1))
    fixed = layout.vector_aligned(odd)
    assert fixed.data_ptr() == odd.data_ptr() and fixed.stride() == (64, 1) and torch.equal(fixed, odd)
    assert torch.equal(fixed.view(torch.int32).view(torch.bfloat16), odd)  # odd.view(torch.int32) raises
    bytes_row = torch.zeros(2, 26, dtype=torch.uint8)[:1, :24]  # one e5m6-sized row of a buffer with 26-byte rows
    assert layout.vector_aligned(bytes_row, 8).view(torch.int32).shape == (1, 6)
    for bad in (buf.view(-1)[1:4097].view(64, 64), buf[:, 1:65], buf.view(-1)[: 64 * 67].view(64, 67)):
        fixed = layout.vector_aligned(bad)  # misaligned base, or a row stride that is not 16 bytes
        assert fixed is not bad and fixed.is_contiguous() and fixed.data_ptr() % 16 == 0
        assert torch.equal(fixed, bad)
    row = buf.view(-1)[1:65].view(1, 64)  # one row at a misaligned base
    assert layout.vector_aligned(row) is not row
    rows8 = buf.view(-1)[4:4 + 64 * 68].view(64, 68)  # 8-byte aligned base and row stride
    assert layout.vector_aligned(rows8, 8) is rows8 and layout.vector_aligned(rows8, 16) is not rows8
    with pytest.raises(ValueError, match="vector_aligned: nbytes must be a positive int, got 0"):
        layout.vector_aligned(rows8, 0)


def test_layout_helpers_reject_bad_arguments():
    sf = torch.ones(3, 2)
    with pytest.raises(ValueError, match="sf_to_layout: layout must be one of .*, got 'bogus'"):
        layout.sf_to_layout(sf, "bogus")
    with pytest.raises(ValueError, match=r"sf_to_layout: sf must be 2-D, got shape \(6,\)"):
        layout.sf_to_layout(sf.flatten(), "col")
    for name in layout.SF_LAYOUTS:
        with pytest.raises(ValueError, match=r"alloc_sf: \(nm, nk\) must be non-negative, got \(-1, 3\)"):
            layout.alloc_sf(-1, 3, name, "cpu")
