"""Compute-owner allocation decided on the device: ``compute_owner_order_on_device`` equals
the readable reference ``compute_owner_order`` (which reads the device per rank) for any free
list, and the allocator counts and logs its decisions once they are made -- it never waits
for the device to make them, except in debug mode or when its ``stats`` are read."""

import logging
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.pool.allocator import (
    CpSharedPagedTokenToKVPoolAllocator,
    compute_owner_order,
    compute_owner_order_on_device,
)
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.page_split import page_aligned_split
from sglang_cp_shared_kv_testing.allocation import allocation_standins


@st.composite
def free_lists_and_ranks(draw):
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    page_limit = draw(st.integers(2, 160))
    pages = draw(st.lists(st.integers(1, page_limit - 1), unique=True, max_size=page_limit - 1))
    if draw(st.booleans()):
        pages.sort()  # SGLang's free list after merge_and_sort_free
    ranks = draw(st.lists(st.integers(0, cp_size - 1), max_size=min(48, len(pages) + 4)))
    if draw(st.booleans()):
        ranks.sort()
    return torch.tensor(pages, dtype=torch.int64), ranks, cp_size, page_limit


@settings(max_examples=400, deadline=None)
@given(free_lists_and_ranks())
def test_the_device_decision_equals_the_reference(case):
    free, ranks, cp_size, page_limit = case
    want = compute_owner_order(free, ranks, cp_size)
    order, found = compute_owner_order_on_device(free, ranks, cp_size, page_limit)
    assert bool(found) == (want is not None)
    assert torch.equal(order, free if want is None else want)


def test_the_zigzag_chunks_of_a_long_prompt_take_the_same_pages():
    """A 300-page pool per rank, four 8K-token chunks at N = 2 and 4 and a 512-token tail:
    the pages the device decision hands out are the reference's, chunk after chunk."""
    for cp_size in (2, 4):
        free = torch.arange(1, 300 * cp_size + 1)
        prefix = 0
        for end in (8192, 16384, 24576, 32768, 33280):
            split = page_aligned_split(prefix, end, 64, cp_size)
            ranks = split.new_page_ranks() if split else []
            want = compute_owner_order(free, ranks, cp_size)
            order, found = compute_owner_order_on_device(free, ranks, cp_size, 300 * cp_size + 1)
            assert bool(found) and torch.equal(order, want)
            free, prefix = order[len(ranks) if ranks else -(-(end - prefix) // 64):], end


def _allocator(cp_size: int, pages_per_rank: int):
    layout = CpSharedKVLayout(64, cp_size, 0)
    kvcache = SimpleNamespace(cp_layout=layout, physical_size=pages_per_rank * 64)
    return CpSharedPagedTokenToKVPoolAllocator(pages_per_rank * 64 * cp_size, 64, torch.bfloat16, "cpu",
                                               kvcache, True)


def test_a_lane_fallback_is_counted_and_warned_once(caplog):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    allocator = _allocator(2, 12)
    # leave rank 1's lane a single free page, so no 4-page chunk can be compute-owner
    allocator.free_pages = allocator.free_pages[(allocator.free_pages % 2 == 1) | (allocator.free_pages == 2)]
    with allocation_standins(), caplog.at_level(logging.DEBUG, logger="sglang_cp_shared_kv.pool.allocator"):
        first = allocator.alloc_extend(t(0), t(0), t(256), t(256), t(-1), 256)
        second = allocator.alloc_extend(t(0), t(0), t(256), t(256), t(-1), 256)
        stats = allocator.stats  # reads (and logs) the decisions not yet read
    assert first is not None and second is not None  # interleaved pages, never out of memory
    assert (stats.compute_owner_chunks, stats.lane_fallbacks) == (0, 2)
    fallbacks = [r for r in caplog.records if "too few free pages for a 4-page chunk" in r.getMessage()]
    assert [r.levelno for r in fallbacks] == [logging.WARNING, logging.DEBUG]


def test_a_pool_out_of_pages_is_sglangs_out_of_memory_not_a_lane_fallback(caplog):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    allocator = _allocator(2, 2)  # 4 free pages in all
    with allocation_standins(), caplog.at_level(logging.DEBUG, logger="sglang_cp_shared_kv.pool.allocator"):
        assert allocator.alloc_extend(t(0), t(0), t(320), t(320), t(-1), 320) is None  # 5 pages
        stats = allocator.stats
    assert (stats.compute_owner_chunks, stats.lane_fallbacks) == (0, 0)
    assert "too few free pages" not in caplog.text
    assert allocator.free_pages.numel() == 4  # nothing taken


def test_a_load_back_takes_pages_of_its_host_lanes_or_none():
    """HiCache's load-back (``pages_in_lanes``): page i goes to rank ``lanes[i]``; a lane short
    of pages gives None (SGLang then evicts) and leaves the free list as it was."""
    allocator = _allocator(3, 4)
    lanes = torch.tensor([2, 0, 0, 1])
    with allocator.pages_in_lanes(lanes):
        out = allocator.alloc(4 * 64)
    pages = out[::64] // 64
    assert torch.equal(allocator.cp_layout.owner_for_logical_pages(pages), lanes)
    assert torch.equal(out, (pages[:, None] * 64 + torch.arange(64)).reshape(-1))
    before = allocator.free_pages.clone()
    with allocator.pages_in_lanes(torch.tensor([1, 1, 1, 1])):  # rank 1's lane has 3 free pages left
        assert allocator.alloc(4 * 64) is None
    assert torch.equal(allocator.free_pages, before)
    assert allocator.alloc(64) is not None  # outside the block: SGLang's own order again
