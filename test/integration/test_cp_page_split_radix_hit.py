"""Which CP rank sends which page of a radix hit: stock SGLang 0.5.12.post1's every-CP-rank
transfer against the plugin's owner filter.

Found on one H200 (docs/results/pd_radix_hit_page_checksums_cp2_h200.json): with
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` and the flag off, decode answered a
radix-hit prompt from 16 pages no CP rank had sent. Stock splits a chunk among the ranks
by *page id* range from the chunk's smallest id, which partitions the chunk's positions
only when its page ids are one run; a radix hit's cached pages and its new pages are not.
The flag replaces that split (``transfer.hooks.filter_owned_pages``): every position by
exactly one rank, its owner.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.transfer.pages import filter_chunk

#: a 64-page cached prefix (an earlier request's pages) and 16 new pages at lower ids
RADIX_HIT_PAGES = np.array(list(range(100, 164)) + list(range(20, 36)), dtype=np.int64)


def _stock_positions(pages, cp_rank, cp_size):
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_cp_rank

    kv_mgr = SimpleNamespace(attn_cp_rank=cp_rank, attn_cp_size=cp_size)
    _, index_slice = filter_kv_indices_for_cp_rank(kv_mgr, pages, slice(0, len(pages)))
    return set(range(index_slice.start, index_slice.stop))


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_stock_split_by_page_id_leaves_radix_hit_pages_unsent(cp_size):
    sent = [_stock_positions(RADIX_HIT_PAGES, r, cp_size) for r in range(cp_size)]
    unsent = set(range(len(RADIX_HIT_PAGES))) - set().union(*sent)
    assert unsent, "stock 0.5.12.post1 splits by page id: some positions of a radix hit reach no rank"
    # a fresh request's pages are one run of ids: there the stock split is a partition
    fresh = np.arange(20, 100, dtype=np.int64)
    assert set().union(*(_stock_positions(fresh, r, cp_size) for r in range(cp_size))) == set(range(80))


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_the_owner_filter_sends_every_radix_hit_page_once(cp_size):
    positions = []
    for rank in range(cp_size):
        physical, owned = filter_chunk(CpSharedKVLayout(64, cp_size, rank), RADIX_HIT_PAGES,
                                       slice(0, len(RADIX_HIT_PAGES)))
        assert owned.problem is None and len(physical) == len(owned)
        positions.extend(int(p) for p in owned)
    assert sorted(positions) == list(range(len(RADIX_HIT_PAGES)))
