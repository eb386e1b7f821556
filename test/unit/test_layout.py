"""cp_shared_kv_layout: the reference values (docs/design.md#reference-values) and the map's properties."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.cp_shared_kv_layout import (
    DUMMY_PAGE,
    NO_OWNER,
    CpSharedKVLayout,
    logical_tokens_for,
    physical_tokens_for,
)
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE


def layout(rank, n=4, page=PAGE):
    return CpSharedKVLayout(page_size=page, cp_size=n, cp_rank=rank)


# ---------------------------------------------------------------- reference values
def test_reference_owners_and_physical_pages():
    pages = [0, 1, 2, 3, 4, 5, 8, 9]
    for rank in range(4):
        lay = layout(rank)
        assert lay.owner_for_logical_pages(torch.tensor(pages)).tolist() == [-1, 0, 1, 2, 3, 0, 3, 0]
        assert lay.logical_pages_to_physical(torch.tensor(pages)).tolist() == [0, 1, 1, 1, 1, 2, 2, 3]
        assert lay.owner_for_logical_pages_np(pages).tolist() == [-1, 0, 1, 2, 3, 0, 3, 0]
        assert lay.logical_pages_to_physical_np(pages).tolist() == [0, 1, 1, 1, 1, 2, 2, 3]


def test_reference_rank2_owned_locs():
    lay = layout(2)
    locs = torch.tensor([0, 64, 128, 192, 256, 320, 384])
    owned = lay.owned_by_this_rank(locs)
    assert owned.tolist() == [False, False, False, True, False, False, False]
    assert lay.logical_locs_to_physical(locs[owned]).tolist() == [64]


def test_reference_filter_rank1_positions_10_to_18():
    phys, pos = layout(1).filter_owned_pages_np(np.arange(1, 10), np.arange(10, 19))
    assert phys.tolist() == [1, 2] and pos.tolist() == [11, 15]


def test_reference_filter_rank2_chunk_from_page_8():
    # docs/design.md#reference-values: pages 9..14 of a chunk starting at request page 8 -> [3] at [10]
    phys, pos = layout(2).filter_owned_pages_np(np.arange(9, 15), np.arange(8, 14))
    assert phys.tolist() == [3] and pos.tolist() == [10]


def test_reference_capacity_n4():
    assert logical_tokens_for(128, PAGE, 4) == 512
    assert physical_tokens_for(512, PAGE, 4) == 128
    assert layout(0).logical_tokens(128) == 512


def test_user_capacity_cp8():
    assert logical_tokens_for(237_312, PAGE, 8) == 1_898_496


def test_capacity_floors_partial_page():
    assert logical_tokens_for(130, PAGE, 4) == 512
    with pytest.raises(ValueError, match="not a multiple"):
        physical_tokens_for(500, PAGE, 4)


# --------------------------------------------------------------------- dummy page
def test_dummy_page_has_no_owner_and_maps_to_itself():
    for rank in range(3):
        lay = layout(rank, n=3)
        assert lay.owner_for_logical_pages(torch.tensor([DUMMY_PAGE])).item() == NO_OWNER
        assert not lay.owned_pages_mask(torch.tensor([0])).item()
        assert lay.logical_pages_to_physical(torch.tensor([0])).item() == 0
        locs = torch.arange(PAGE)
        assert not lay.owned_by_this_rank(locs).any()
        assert torch.equal(lay.logical_locs_to_physical(locs), locs)
        assert lay.physical_pages_to_logical(torch.tensor([0])).item() == 0


def test_torch_and_numpy_forms_agree():
    pages = np.arange(0, 200)
    for n in (1, 2, 3, 5, 8):
        for rank in range(n):
            lay = layout(rank, n=n)
            t = torch.from_numpy(pages)
            assert lay.owner_for_logical_pages(t).numpy().tolist() == lay.owner_for_logical_pages_np(pages).tolist()
            assert lay.logical_pages_to_physical(t).numpy().tolist() == lay.logical_pages_to_physical_np(pages).tolist()
            assert lay.owned_pages_mask(t).numpy().tolist() == lay.owned_pages_mask_np(pages).tolist()


def test_works_on_int32_and_keeps_dtype():
    lay = layout(1, n=3)
    pages = torch.arange(1, 10, dtype=torch.int32)
    assert lay.logical_pages_to_physical(pages).dtype == torch.int32
    assert lay.owner_for_logical_pages(pages).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_validate_false_skips_the_host_check():
    lay = layout(0)
    # No exception: hot paths skip validation; the arithmetic itself is unchanged.
    assert lay.logical_pages_to_physical(torch.tensor([5]), validate=False).item() == 2


# ------------------------------------------------------------------ properties
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), physical_pages=st.integers(1, 40))
def test_bijection_logical_pages_to_rank_and_physical_page(n, physical_pages):
    logical = np.arange(1, physical_pages * n + 1)
    seen = set()
    for rank in range(n):
        lay = layout(rank, n=n)
        owned = logical[lay.owned_pages_mask_np(logical)]
        phys = lay.logical_pages_to_physical_np(owned)
        assert phys.min() >= 1 and phys.max() <= physical_pages
        assert len(owned) == physical_pages  # every rank holds exactly P pages
        assert lay.physical_pages_to_logical_np(phys).tolist() == owned.tolist()
        # torch inverse agrees
        assert lay.physical_pages_to_logical(torch.from_numpy(phys)).tolist() == owned.tolist()
        seen.update((rank, int(p)) for p in phys)
    assert len(seen) == len(logical) == n * physical_pages


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), page=st.sampled_from([1, 4, 16, 64]),
       locs=st.lists(st.integers(0, 5000), min_size=0, max_size=200))
def test_owned_locs_of_all_ranks_partition_the_input(n, page, locs):
    locs_t = torch.tensor(locs, dtype=torch.int64)
    masks = [layout(r, n=n, page=page).owned_by_this_rank(locs_t) for r in range(n)]
    covered = torch.stack(masks).sum(0) if masks and len(locs) else torch.zeros(len(locs), dtype=torch.int64)
    in_dummy = locs_t // page == 0
    # each non-dummy loc is owned by exactly one rank; dummy-page locs by none
    assert torch.equal(covered, (~in_dummy).to(covered.dtype))
    # physical locs of different ranks' owned rows never collide within a rank
    for r, mask in enumerate(masks):
        phys = layout(r, n=n, page=page).logical_locs_to_physical(locs_t[mask])
        assert len(set(phys.tolist())) == len(set(locs_t[mask].tolist()))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 8), start=st.integers(0, 30), count=st.integers(0, 40))
def test_filter_positions_are_request_absolute(n, start, count):
    pages = np.arange(1 + start * 7, 1 + start * 7 + count)
    positions = np.arange(start, start + count)
    total = 0
    for rank in range(n):
        lay = layout(rank, n=n)
        phys, pos = lay.filter_owned_pages_np(pages, positions)
        total += len(pos)
        # each kept position points back at a page this rank owns
        assert lay.physical_pages_to_logical_np(phys).tolist() == pages[pos - start].tolist()
    assert total == count


# ------------------------------------------------------------- invalid arguments
@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=64, cp_size=0, cp_rank=0), "cp_size must be > 0"),
    (dict(page_size=64, cp_size=-2, cp_rank=0), "cp_size must be > 0"),
    (dict(page_size=64, cp_size=4, cp_rank=4), r"cp_rank must be in \[0, cp_size=4\)"),
    (dict(page_size=64, cp_size=4, cp_rank=-1), r"cp_rank must be in \[0, cp_size=4\)"),
    (dict(page_size=0, cp_size=4, cp_rank=0), "page_size must be > 0"),
    (dict(page_size=-64, cp_size=4, cp_rank=0), "page_size must be > 0"),
    (dict(page_size=64.0, cp_size=4, cp_rank=0), "page_size must be an int"),
    (dict(page_size=64, cp_size=True, cp_rank=0), "cp_size must be an int"),
])
def test_invalid_layout_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CpSharedKVLayout(**kwargs)


def test_layout_is_frozen():
    lay = layout(0)
    with pytest.raises(Exception):
        lay.cp_rank = 1


@pytest.mark.parametrize("call", [
    lambda lay: lay.owned_by_this_rank(torch.tensor([64, -1])),
    lambda lay: lay.logical_locs_to_physical(torch.tensor([-64])),
    lambda lay: lay.owner_for_logical_pages(torch.tensor([-3])),
    lambda lay: lay.logical_pages_to_physical_np([1, -2]),
    lambda lay: lay.owner_for_logical_pages_np([-1]),
    lambda lay: lay.filter_owned_pages_np([1, 2], [0, -1]),
    lambda lay: lay.physical_pages_to_logical_np([-1]),
])
def test_negative_locations_and_pages_raise(call):
    with pytest.raises(ValueError, match="must be >= 0"):
        call(layout(1))


def test_filter_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="equal length"):
        layout(0).filter_owned_pages_np([1, 2, 3], [0, 1])


def test_inverse_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank must be in"):
        layout(0).physical_pages_to_logical_np([1], rank=4)
