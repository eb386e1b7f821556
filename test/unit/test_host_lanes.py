"""The host tier's page rule and lane allocator (pure: no SGLang)."""

import pytest
import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.hicache.host_lanes import HostPageLanes, HostPageRule

PAGE = 64


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_each_rank_holds_its_lane_one_to_one_and_the_capacity_is_n_times(n):
    per_rank = 5
    pages = torch.arange(per_rank * n)
    for rank in range(n):
        rule = HostPageRule(CpSharedKVLayout(PAGE, n, rank))
        mine = pages[rule.lanes(pages) == rank]
        # the rank's lane fills its host buffer exactly: physical pages 0 .. per_rank - 1, once each
        assert rule.physical_pages(mine).tolist() == list(range(per_rank))
    lanes = HostPageLanes(HostPageRule(CpSharedKVLayout(PAGE, n, 0)), per_rank)
    assert lanes.logical_pages == n * per_rank == lanes.available_pages()


def test_rows_follow_the_device_layout_shifted_by_one_page():
    n = 3
    layout = CpSharedKVLayout(PAGE, n, 1)
    rule = HostPageRule(layout)
    locs = torch.arange(0, 12 * PAGE, 7)
    # host page h is layout page h + 1: its physical page one less than the layout's
    assert torch.equal(rule.physical_rows(locs), layout.logical_locs_to_physical(locs + PAGE) - PAGE)
    assert torch.equal(rule.lanes(locs // PAGE), (locs // PAGE) % n)


def _lanes(n, rank=0, per_rank=4):
    return HostPageLanes(HostPageRule(CpSharedKVLayout(PAGE, n, rank)), per_rank)


def test_alloc_takes_one_page_of_each_wanted_lane_in_order():
    lanes = _lanes(3)
    want = torch.tensor([2, 0, 2, 1, 0])
    pages = lanes.alloc(want)
    assert torch.equal(pages % 3, want)
    assert len(set(pages.tolist())) == 5
    assert lanes.free_pages_per_lane() == [2, 3, 2]


def test_a_short_lane_allocates_nothing_and_changes_nothing():
    lanes = _lanes(2, per_rank=2)
    before = lanes.free_pages_per_lane()
    assert lanes.alloc(torch.tensor([0, 0, 0])) is None
    assert lanes.free_pages_per_lane() == before


def test_freed_pages_return_to_their_lanes_and_are_taken_again():
    lanes = _lanes(4)
    pages = lanes.alloc(torch.tensor([0, 1, 2, 3, 3]))
    lanes.free(pages[[1, 4]])
    assert lanes.free_pages_per_lane() == [3, 4, 3, 3]
    again = lanes.alloc(torch.tensor([1, 3]))
    assert sorted(again.tolist()) == sorted(pages[[1, 4]].tolist())  # each lane hands out its lowest page


def test_every_rank_decides_the_same():
    """The allocator reads no rank: the same operations give the same pages on every rank."""
    n = 3
    results = []
    for rank in range(n):
        lanes = _lanes(n, rank)
        first = lanes.alloc(torch.tensor([0, 1, 1, 2]))
        lanes.free(first[1:3])
        second = lanes.alloc(lanes.cyclic_lanes(5))
        results.append((first.tolist(), second.tolist(), lanes.free_pages_per_lane()))
    assert results[0] == results[1] == results[2]


def test_cyclic_lanes_start_with_the_freest_lane():
    lanes = _lanes(3, per_rank=3)
    lanes.alloc(torch.tensor([0, 0, 2]))
    assert lanes.cyclic_lanes(4).tolist() == [1, 2, 0, 1]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_an_allocation_of_the_lane_floor_always_fits_and_of_every_free_page_may_not(n):
    """SGLang 0.5.12.post1's storage prefetch sizes its last allocation from the host pool's
    ``available_size()`` and starts the prefetch without checking it got pages: the pools report
    the lane floor (``floor_pages``), which an allocation by ``cyclic_lanes`` always fits, on
    lanes however uneven; every free page would not (two lanes holding 14 and 2 free pages)."""
    per_rank = 16
    generator = torch.Generator().manual_seed(n)
    for trial in range(50):
        lanes = HostPageLanes(HostPageRule(CpSharedKVLayout(PAGE, n, 0)), per_rank)
        taken = torch.randint(0, per_rank + 1, (n,), generator=generator).tolist()
        lanes.alloc(torch.tensor([rank for rank in range(n) for _ in range(taken[rank])], dtype=torch.int64))
        floor = lanes.floor_pages()
        assert floor == n * min(lanes.free_pages_per_lane())
        if floor:
            got = lanes.alloc_locs(floor * PAGE, None)
            assert got is not None and got.numel() == floor * PAGE, (trial, taken)
    uneven = HostPageLanes(HostPageRule(CpSharedKVLayout(PAGE, 2, 0)), per_rank)
    uneven.alloc(torch.tensor([0] * 2 + [1] * 14))
    assert uneven.free_pages_per_lane() == [14, 2] and uneven.floor_pages() == 4
    assert uneven.alloc_locs(uneven.available_pages() * PAGE, None) is None
