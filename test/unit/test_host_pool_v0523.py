"""The 0.5.23 KV host pool facade under the flag (``hicache.host_pool_v0523``; pure: a stand-in for
the wrapped SGLang host pool, which the facade only reads the size and page of and delegates to)."""

import types

import pytest
import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.hicache.host_pool_v0523 import CpSharedKVHostPool

PAGE = 64


def _host(n, rank, pages=4):
    inner = types.SimpleNamespace(size=pages * PAGE, page_size=PAGE, size_per_token=1, layout="layer_first",
                                  cleared=0)
    inner.clear = lambda: setattr(inner, "cleared", inner.cleared + 1)
    device = types.SimpleNamespace(cp_layout=CpSharedKVLayout(PAGE, n, rank))
    return CpSharedKVHostPool(inner, device)


def _pages(locs):
    return (locs[::PAGE] // PAGE).tolist()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sizes_stay_a_ranks_and_the_logical_tier_is_n_times(n):
    host = _host(n, 0)
    assert host.size == host.physical_size == 4 * PAGE  # (delegated: what the index-K sidecar copies)
    assert host.logical_size == n * 4 * PAGE == host.free_size() == host.available_size()
    assert host.layout == "layer_first"


def test_allocation_follows_the_lanes_given_and_the_lane_floor_is_the_emptiest_lane():
    host = _host(3, 0)
    with host.pages_in_lanes(torch.tensor([1, 1, 2])):
        locs = host.alloc(3 * PAGE)
    assert [p % 3 for p in _pages(locs)] == [1, 1, 2]
    # lane 1 has 2 of 4 pages left: the floor is 3 lanes x 2 pages, while 9 pages are free in all
    assert host.free_size() == 9 * PAGE and host.available_size() == 3 * 2 * PAGE
    with host.pages_in_lanes(torch.tensor([1, 1, 1])):
        assert host.alloc(3 * PAGE) is None  # a short lane: nothing taken
    assert host.free_size() == 9 * PAGE
    host.free(locs)
    assert host.available_size() == host.free_size() == 12 * PAGE
    host.clear()
    assert host.host_pool.cleared == 1


def test_upstreams_rotation_is_refused():
    with pytest.raises(ValueError, match="start_owner"):
        _host(2, 0).alloc(PAGE, start_owner=1)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_owned_rows_are_this_ranks_pages_in_physical_host_and_device_rows(rank):
    n = 3
    host = _host(n, rank)
    layout = host.cp_layout
    device_pages = torch.tensor([4, 2, 3, 7, 5, 6])  # logical device pages (owner (p - 1) mod 3)
    owners = layout.owner_for_logical_pages(device_pages)
    with host.pages_in_lanes(owners):
        host_locs = host.alloc(device_pages.numel() * PAGE)
    device_locs = (device_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    host_rows, device_rows = host.owned_rows(host_locs, device_locs)
    mine = (owners == rank).repeat_interleave(PAGE)
    assert torch.equal(device_rows, layout.logical_locs_to_physical(device_locs[mine]))
    assert torch.equal(host_rows, (host_locs[mine] // PAGE // n) * PAGE + host_locs[mine] % PAGE)
    assert host.placement.local_mask(host_locs, rank).sum() == mine.sum()
