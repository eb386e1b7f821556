"""The page-aligned zigzag split, SGLang's token split read page by page, and the
compute-owner page order, against direct counts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.pool.allocator import compute_owner_order
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.page_split import page_aligned_split, segment_rank, segment_row_ranges, token_split_page_ranks


def test_zigzag_ranks():
    assert [segment_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [segment_rank(s, 3) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError):
        segment_rank(8, 4)


def test_reference_split():
    # 1,000 tokens after a 100-token prefix, N = 2: pages 1..17 (17 pages, the first shared)
    split = page_aligned_split(100, 1100, PAGE, 2)
    assert split.first_page == 1 and split.num_pages == 17
    assert split.segment_pages == (5, 4, 4, 4)
    assert split.segment_tokens() == [(100, 384), (384, 640), (640, 896), (896, 1100)]
    assert split.page_ranks() == [0] * 5 + [1] * 4 + [1] * 4 + [0] * 4
    assert split.new_page_ranks() == [0] * 4 + [1] * 8 + [0] * 4  # page 1 is shared with the prefix


def test_short_chunks_are_not_split():
    assert page_aligned_split(0, 3 * PAGE, PAGE, 2) is None  # 3 pages < 2N = 4
    assert page_aligned_split(0, 4 * PAGE, PAGE, 2) is not None
    assert page_aligned_split(10, 4 * PAGE, PAGE, 2) is not None  # 10..255: pages 0..3
    assert page_aligned_split(0, 10_000, PAGE, 1) is None  # no CP
    with pytest.raises(ValueError):
        page_aligned_split(5, 5, PAGE, 2)


@settings(max_examples=300, deadline=None)
@given(prefix=st.integers(0, 5000), extend=st.integers(1, 9000), n=st.integers(2, 8))
def test_every_page_has_one_computing_rank(prefix, extend, n):
    split = page_aligned_split(prefix, prefix + extend, PAGE, n)
    if split is None:
        assert (prefix + extend - 1) // PAGE - prefix // PAGE + 1 < 2 * n
        return
    tokens = split.segment_tokens()
    assert tokens[0][0] == prefix and tokens[-1][1] == prefix + extend
    assert all(a[1] == b[0] for a, b in zip(tokens, tokens[1:]))  # contiguous cover of the chunk
    assert all(start < end for start, end in tokens)  # no empty segment
    for start, end in tokens[1:]:
        assert start % PAGE == 0  # boundaries on pages
    assert max(split.segment_pages) - min(split.segment_pages) <= 1
    ranks = split.page_ranks()
    assert len(ranks) == split.num_pages
    for r in range(n):  # each rank computes two segments: one early, one late
        assert ranks.count(r) == split.segment_pages[r] + split.segment_pages[2 * n - 1 - r]
    new = split.new_page_ranks()
    assert len(new) == -(-(prefix + extend) // PAGE) - -(-prefix // PAGE)  # SGLang's get_num_new_pages


def test_token_split_read_page_by_page():
    # N = 2, 512 rows in four 128-row segments: pages 0-1 rank 0, 2-5 rank 1, 6-7 rank 0
    assert token_split_page_ranks(0, 512, [128] * 4, PAGE, 2) == (0, 0, 1, 1, 1, 1, 0, 0)
    # one row short: the last row is SGLang's padding, the last page partial
    assert token_split_page_ranks(0, 511, [128] * 4, PAGE, 2) == (0, 0, 1, 1, 1, 1, 0, 0)
    # after a 128-row prefix: the sequence's pages 2..9
    assert token_split_page_ranks(128, 512, [128] * 4, PAGE, 2) == (0, 0, 1, 1, 1, 1, 0, 0)
    # 500 rows in 125-row segments: page 1 holds rows of ranks 0 and 1
    assert token_split_page_ranks(0, 500, [125] * 4, PAGE, 2) is None
    # a mid-page boundary between segments N-1 and N is inside one rank: still page by page
    assert token_split_page_ranks(0, 448, [128, 96, 96, 128], PAGE, 2) == (0, 0, 1, 1, 1, 0, 0)
    # a prefix ending mid-page: its first page holds history too, but the chunk's rows are rank 0's
    assert token_split_page_ranks(10, 502, [118, 128, 128, 128], PAGE, 2) == (0, 0, 1, 1, 1, 1, 0, 0)
    assert segment_row_ranges([3, 2, 2, 3]) == [(0, 3), (3, 5), (5, 7), (7, 10)]
    with pytest.raises(ValueError):
        token_split_page_ranks(0, 512, [128] * 6, PAGE, 2)  # 2N segments
    with pytest.raises(ValueError):
        token_split_page_ranks(0, 600, [128] * 4, PAGE, 2)  # the segments must cover the chunk


@settings(max_examples=300, deadline=None)
@given(prefix=st.integers(0, 3000), extend=st.integers(1, 5000), pad=st.integers(0, 7), n=st.integers(2, 8))
def test_token_split_page_ranks_against_a_row_by_row_count(prefix, extend, pad, n):
    rows = extend + pad
    base, extra = divmod(rows, 2 * n)
    split = [base + (1 if s < extra else 0) for s in range(2 * n)]  # SGLang's token-balanced cut
    if 0 in split:
        return
    rank_of_row = [segment_rank(s, n) for s, length in enumerate(split) for _ in range(length)]
    by_page = {}
    for row in range(extend):  # padding rows compute nothing a page holds
        by_page.setdefault((prefix + row) // PAGE, set()).add(rank_of_row[row])
    want = tuple(next(iter(r)) for _, r in sorted(by_page.items())) if all(
        len(r) == 1 for r in by_page.values()) else None
    assert token_split_page_ranks(prefix, extend, split, PAGE, n) == want


def _owners(pages, n):
    return CpSharedKVLayout(PAGE, n, 0).owner_for_logical_pages(pages).tolist()


def test_compute_owner_order_on_a_fresh_pool():
    n = 3
    free = torch.arange(1, 61)
    ranks = [0] * 4 + [1] * 3 + [2] * 3 + [2] * 3 + [1] * 3 + [0] * 4
    order = compute_owner_order(free, ranks, n)
    assert sorted(order.tolist()) == free.tolist()  # a permutation of the free list
    taken = order[: len(ranks)]
    assert _owners(taken, n) == ranks
    for r in range(n):  # each rank's pages are consecutive in its pool
        physical = CpSharedKVLayout(PAGE, n, r).logical_pages_to_physical(taken[torch.tensor(ranks) == r])
        assert physical.tolist() == list(range(int(physical[0]), int(physical[0]) + len(physical)))


def test_compute_owner_order_prefers_a_consecutive_run():
    n = 2
    free = torch.tensor([1, 5, 7, 9, 11, 2, 4, 6, 8])  # rank 0's lane: 1 | 5 7 9 11 (physical 1 | 3 4 5 6)
    order = compute_owner_order(free, [0, 0, 0, 1], n)
    assert order[:4].tolist() == [5, 7, 9, 2]
    assert sorted(order.tolist()) == sorted(free.tolist())


def test_a_dry_lane_gives_none():
    free = torch.tensor([1, 3, 5, 2])  # rank 1's lane has one page
    assert compute_owner_order(free, [1, 1], 2) is None
    assert compute_owner_order(free, [], 2) is free
