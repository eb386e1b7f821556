"""Who computes each page: SGLang's own in-seq split against the plugin's allocator.

SGLang (0.5.12.post1) splits a CP chunk token-balanced: ``prepare_context_parallel_metadata``
cuts ``len(input_ids)`` into 2N segments and ``cp_split_and_rebuild_position`` gives rank r
segments r and 2N - 1 - r. The plugin's allocator hands each new page of a chunk to the
rank that computes it under the *page-aligned* split (``page_split``). The two agree
exactly when the chunk starts on a page boundary and its length is a multiple of
2N x 64 tokens -- every full chunk of a chunked prefill with SGLang's default chunk size
8,192 for N = 2, 4, 8 (and any radix-cache prefix, which SGLang matches by whole pages).
Then every page of the chunk has exactly one computing rank and it is the page's owner.
Other chunks (a prompt's last, shorter chunk) are split token-balanced by SGLang, so a
page on a segment boundary is computed by two ranks; the write path does not depend on
it (each rank copies its owned rows out of the dense view, see docs/design.md).

SGLang's metadata is built by its own function on CPU
(``testing.support.sglang_cp_utils_on_cpu``); the pages come from the plugin's real
allocator (``testing.allocation.request_pages``).
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.page_split import page_aligned_split
from sglang_cp_shared_kv_testing.allocation import request_pages
from sglang_cp_shared_kv_testing.support import sglang_cp_utils_on_cpu


@pytest.fixture
def cp_utils(monkeypatch):
    return sglang_cp_utils_on_cpu(monkeypatch)


def sglang_positions_by_rank(cp_utils, prefix_len: int, extend_len: int, n: int):
    """The sequence positions each CP rank computes, by SGLang's own split."""
    positions = torch.arange(prefix_len, prefix_len + extend_len)
    out = []
    for rank in range(n):
        metadata = cp_utils.prepare_context_parallel_metadata(extend_len, rank, n, [prefix_len + extend_len])
        out.append(cp_utils.cp_split_and_rebuild_position(SimpleNamespace(attn_cp_metadata=metadata), positions))
    return out


def computing_ranks_of_pages(positions_by_rank, prefix_len: int, extend_len: int):
    """{sequence page index: set of ranks computing a token of it}."""
    ranks = {}
    for rank, positions in enumerate(positions_by_rank):
        for page in set((positions // PAGE).tolist()):
            ranks.setdefault(page, set()).add(rank)
    assert sorted(ranks) == list(range(prefix_len // PAGE, (prefix_len + extend_len - 1) // PAGE + 1))
    return ranks


ALIGNED = [(n, prefix_pages, multiple) for n in (2, 3, 4, 8) for prefix_pages in (0, 5) for multiple in (1, 3)]


@pytest.mark.parametrize("n,prefix_pages,multiple", ALIGNED)
def test_an_aligned_chunk_is_computed_page_by_page_by_the_pages_owners(cp_utils, n, prefix_pages, multiple):
    prefix_len, extend_len = prefix_pages * PAGE, multiple * 2 * n * PAGE
    by_rank = sglang_positions_by_rank(cp_utils, prefix_len, extend_len, n)
    # SGLang's token-balanced segments are the page-aligned ones
    split = page_aligned_split(prefix_len, prefix_len + extend_len, PAGE, n)
    for rank, positions in enumerate(by_rank):
        mine = [s for s in range(2 * n) if s in (rank, 2 * n - 1 - rank)]
        want = torch.cat([torch.arange(*split.segment_tokens()[s]) for s in mine])
        assert torch.equal(positions, want), rank
    # one computing rank per page, and the allocator gave the page to it
    computing = computing_ranks_of_pages(by_rank, prefix_len, extend_len)
    chunk_ends = [prefix_len, prefix_len + extend_len] if prefix_len else [extend_len]
    pages, stats = request_pages(n, physical_pages=4 * (prefix_pages + extend_len // PAGE), chunk_ends=chunk_ends)
    layout = CpSharedKVLayout(PAGE, n, 0)
    owners = layout.owner_for_logical_pages(torch.tensor(pages)).tolist()
    for page in range(prefix_pages, len(pages)):
        assert computing[page] == {owners[page]}, (page, computing[page], owners[page])
    assert stats.lane_fallbacks == 0
    assert stats.compute_owner_chunks == 1 + (prefix_pages >= 2 * n)  # the prefix chunk too, when it is long


@pytest.mark.parametrize("n,extend_len", [(2, 8192 + 100), (3, 1000), (4, 4 * 2 * 64 + 64), (8, 5000)])
def test_an_unaligned_chunk_has_pages_computed_by_two_ranks(cp_utils, n, extend_len):
    """SGLang's token-balanced boundaries fall inside pages: the case the page-aligned split
    would change, and which the owner-filtered write path handles (docs/design.md)."""
    computing = computing_ranks_of_pages(sglang_positions_by_rank(cp_utils, 0, extend_len, n), 0, extend_len)
    assert any(len(ranks) > 1 for ranks in computing.values())
    assert page_aligned_split(0, extend_len, PAGE, n) is not None  # the allocator still splits it by pages
