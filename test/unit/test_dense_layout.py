"""dense_layout: the owner-major dense placement of a sequence's pages."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.dense_layout import DENSE_DUMMY_PAGES, build_dense_page_map
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE


def _simulate_gather(n, seq_pages, history, full_view, repeats=False):
    """Fill a dense scratch the way the collective does: every rank's pool page q holds
    the logical page id stored there; rank r's send list -- or, when its pages form a run,
    the pages of the run straight from its pool -- goes to block r of a region."""
    maps = [build_dense_page_map(CpSharedKVLayout(PAGE, n, r), torch.tensor(seq_pages), history, repeats=repeats)
            for r in range(n)]
    ref = maps[0]
    dense = torch.full((ref.num_dense_pages,), -1, dtype=torch.int64)
    regions = [("history_region", "history_send", "history_run", ref.history_pad)]
    if full_view:
        regions.append(("current_region", "current_send", "current_run", ref.current_pad))
    for region, send, run, pad in regions:
        start, _ = getattr(ref, region)
        for r, m in enumerate(maps):
            lay = CpSharedKVLayout(PAGE, n, r)
            first = getattr(m, run)
            sent = torch.arange(first, first + pad) if first >= 0 else getattr(m, send)
            # logical page held at each physical page the rank sends (0 for the padding)
            dense[start + r * pad: start + (r + 1) * pad] = lay.physical_pages_to_logical(sent)
    return maps, dense


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 8), num_pages=st.integers(1, 40), data=st.data())
def test_gather_fills_every_page_where_the_map_says(n, num_pages, data):
    # arbitrary distinct logical pages: radix reuse and frees make ownership uneven
    seq_pages = data.draw(st.lists(st.integers(1, 400), min_size=num_pages, max_size=num_pages, unique=True))
    history = data.draw(st.integers(0, num_pages))
    maps, dense = _simulate_gather(n, seq_pages, history, full_view=True)
    for m in maps:  # every rank computes the same placement and the same sizes
        assert torch.equal(m.dense_page, maps[0].dense_page)
        assert (m.history_pad, m.current_pad) == (maps[0].history_pad, maps[0].current_pad)
    place = maps[0].dense_page
    assert len(set(place.tolist())) == num_pages  # distinct dense pages
    assert place.min() >= DENSE_DUMMY_PAGES and place.max() < maps[0].num_dense_pages
    assert dense[place].tolist() == seq_pages  # each dense page holds the page the map says
    lo, hi = maps[0].history_region
    assert all(lo <= p < hi for p in place[:history].tolist())
    lo, hi = maps[0].current_region
    assert all(lo <= p < hi for p in place[history:].tolist())


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 8), data=st.data())
def test_a_batch_listing_shared_pages_twice_places_each_page_once(n, data):
    # several requests: their history pages first (a radix prefix they share listed once per
    # request), then their current-only pages, fresh per request
    requests = data.draw(st.integers(2, 4))
    pool = data.draw(st.lists(st.integers(1, 400), min_size=requests + 1, max_size=60, unique=True))
    shared = pool[: data.draw(st.integers(0, len(pool) - requests - 1))]
    rest = pool[len(shared):]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rest)), min_size=requests - 1, max_size=requests - 1)))
    own = [rest[a:b] for a, b in zip([0, *cuts], [*cuts, len(rest)])]
    history = [shared[: data.draw(st.integers(0, len(shared)))] + own[i][: data.draw(st.integers(0, len(own[i])))]
               for i in range(requests)]
    current = [[p for p in own[i] if p not in history[i]] for i in range(requests)]
    listed = [p for h in history for p in h] + [p for c in current for p in c]
    h = sum(len(x) for x in history)
    maps, dense = _simulate_gather(n, listed, h, full_view=True, repeats=True)
    for m in maps:
        assert torch.equal(m.dense_page, maps[0].dense_page)
        assert (m.history_pad, m.current_pad) == (maps[0].history_pad, maps[0].current_pad)
    place = maps[0].dense_page.tolist()
    first_place = {}
    for page, where in zip(listed, place):  # a page keeps one dense page, its first listing's
        assert first_place.setdefault(page, where) == where
    assert len(set(first_place.values())) == len(first_place)  # distinct pages, distinct dense pages
    assert dense[maps[0].dense_page].tolist() == listed  # each dense page holds the page the map says
    distinct = list(dict.fromkeys(listed))
    # the blocks hold the distinct pages only: as many as without the repeats
    alone = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), torch.tensor(distinct),
                                 len(dict.fromkeys(listed[:h])))
    assert (maps[0].history_pad, maps[0].current_pad) == (alone.history_pad, alone.current_pad)


def test_first_listings():
    from sglang_cp_shared_kv.forward.dense_layout import first_listings

    assert first_listings(torch.tensor([5, 3, 5, 9, 3, 5])).tolist() == [0, 1, 0, 3, 1, 0]
    assert first_listings(torch.tensor([], dtype=torch.int64)).tolist() == []


def test_a_rank_whose_pages_are_consecutive_in_its_pool_sends_them_without_a_pack():
    n = 3
    fresh = torch.arange(1, 13)  # owners 0 1 2 0 1 2 ...: every rank's pages are its physical 1, 2, 3, 4
    for r in range(n):
        m = build_dense_page_map(CpSharedKVLayout(PAGE, n, r), fresh, history_pages=6)
        assert (m.history_run, m.current_run) == (1, 3), r
        assert m.history_send.tolist() == [1, 2] and m.current_send.tolist() == [3, 4]
    # out of sequence order in the pool (a radix prefix on reused pages): packed
    m = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), torch.tensor([4, 1, 7, 2, 3]), history_pages=3)
    assert m.history_send.tolist() == [2, 1, 3] and m.history_run == -1
    # a gap in the pool: packed; a rank owning nothing of a region: packed (page 0 padding)
    m = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), torch.tensor([1, 7, 2, 3]), history_pages=2)
    assert m.history_send.tolist() == [1, 3] and m.history_run == -1 and m.current_run == -1


def test_block_sizes_are_the_largest_owner_counts():
    lay = CpSharedKVLayout(PAGE, 4, 0)
    # pages 1, 5, 9, 13 are all rank 0's: one block of 4, the others padding
    m = build_dense_page_map(lay, torch.tensor([1, 5, 9, 13, 2, 3]), history_pages=4)
    assert (m.history_pad, m.current_pad) == (4, 1)
    assert m.history_send.tolist() == [1, 2, 3, 4]
    assert m.current_send.tolist() == [0]  # rank 0 owns no current page: it sends page 0
    assert m.num_dense_pages == 1 + 4 * 4 + 4 * 1


def test_balanced_sequence_needs_ceil_pages_over_n():
    for n in (2, 3, 4, 8):
        pages = torch.arange(1, 101)
        m = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), pages, history_pages=60)
        assert m.history_pad == -(-60 // n) and m.current_pad == -(-40 // n)


def test_dense_token_table_and_positions():
    lay = CpSharedKVLayout(PAGE, 2, 1)
    m = build_dense_page_map(lay, torch.tensor([7, 8, 3]), history_pages=1)
    table = m.dense_token_table(seq_len=150, width=160)
    positions = torch.arange(150)
    assert torch.equal(table[:150], m.dense_page[positions // PAGE] * PAGE + positions % PAGE)
    assert table[150:].eq(0).all()


def test_no_history_means_no_history_region():
    m = build_dense_page_map(CpSharedKVLayout(PAGE, 3, 2), torch.tensor([4, 5, 6, 7]), history_pages=0)
    assert m.history_pad == 0 and m.history_region[0] == m.history_region[1]
    assert m.history_send.numel() == 0


def test_bad_history_count_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="history_pages"):
        build_dense_page_map(CpSharedKVLayout(PAGE, 2, 0), torch.tensor([1, 2]), history_pages=3)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 8), num_pages=st.integers(1, 200), data=st.data())
def test_the_planners_scratch_bounds_the_dense_view_of_consecutive_pages(n, num_pages, data):
    # The planner's "materialize scratch/layer" (freshly allocated consecutive pages, i.e.
    # balanced ownership) must not be below what the view really takes, at any chunk boundary.
    from sglang_cp_shared_kv.pool.kv_geometry import NsaModelShape
    from sglang_cp_shared_kv.pool.planner import plan_capacity

    start = data.draw(st.integers(1, 50))
    history = data.draw(st.integers(0, num_pages))
    view = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), torch.arange(start, start + num_pages), history)
    plan = plan_capacity(NsaModelShape.load("glm-5"), n, "bf16", kv_tokens_per_rank=1 << 20,
                         context_len=num_pages * PAGE).request
    assert view.num_dense_pages <= DENSE_DUMMY_PAGES + n * plan.scratch_pages_per_rank
    assert plan.scratch_index_bytes_per_layer == (DENSE_DUMMY_PAGES + n * plan.scratch_pages_per_rank) * PAGE * 132
