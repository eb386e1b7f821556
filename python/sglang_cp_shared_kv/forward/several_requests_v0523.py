"""A prefill batch of several requests on a shared-KV rank (SGLang 0.5.23's interleave CP;
0.5.12.post1's in-seq split takes one request per batch).

Two things differ from one request:

* **Which pages.** Interleave's ``init_forward_metadata`` keeps in a rank's page tables only
  the requests the rank holds query tokens of (``InterleaveCPStrategy.shard_per_request``: a
  request shorter than the CP group has none on some ranks). The dense map sizes the
  all-gathers, so it must not come from those rows: :func:`batch_pages` lists every request's
  pages from the batch's request table (``req_to_token``), the same on every rank -- every
  request's history pages (those holding a token before its prefix), then every request's
  current-only pages. A radix prefix two requests share is listed once per request and placed
  once (``build_dense_page_map(..., repeats=True)``); current-only pages are fresh per request.
* **Which rows.** :func:`dense_rows` translates the backend's tables row by row, whatever
  requests this rank's rows are: each entry through the batch's page inverse, entries past
  the row's length (``cache_seqlens_int32``) to the dummy page, ``page_table_1_flattened``
  (the rows' concatenation) entry by entry. No host synchronisation.

:func:`check_rows` is the debug mode's check of both.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import torch



def batch_pages(backend, forward_batch, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                page_size: int) -> Tuple[torch.Tensor, int]:
    """(the batch's logical pages -- every request's history pages, then every request's
    current-only pages, each in sequence order -- and how many history entries lead). From
    the request table the attention backend reads (``backend.req_to_token_pool``), which
    every CP rank holds identically."""
    seq_lens = [prefix + extend for prefix, extend in zip(prefix_lens, extend_lens)]
    table = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, : max(seq_lens)]
    page_heads = table[:, ::page_size]  # the first location of each page of each request
    history = [-(-prefix // page_size) for prefix in prefix_lens]
    pages = [-(-seq_len // page_size) for seq_len in seq_lens]
    listed = ([page_heads[i, : history[i]] for i in range(len(seq_lens))]
              + [page_heads[i, history[i]: pages[i]] for i in range(len(seq_lens))])
    return torch.cat(listed).to(torch.int64) // page_size, sum(history)


def _past_row_ends(width: int, row_ends: torch.Tensor) -> torch.Tensor:
    """(rows, width) mask of the entries at or past each row's end."""
    return torch.arange(width, device=row_ends.device)[None, :] >= row_ends[:, None]


def dense_rows(metadata, state):
    """``metadata`` (the DSA backend's) with its page tables translated to the dense scratch,
    row by row; entries past a row's length set to the dummy page."""
    page_size, remap, inverse = state.layout.page_size, state.kernels.remap_locs, state.page_inverse
    row_lens = metadata.cache_seqlens_int32.to(torch.int64)
    table = remap(metadata.page_table_1, inverse, page_size)
    table = table.masked_fill(_past_row_ends(table.shape[1], row_lens), 0)
    real = remap(metadata.real_page_table, inverse, 1)
    real = real.masked_fill(_past_row_ends(real.shape[1], -(-row_lens // page_size)), 0)
    replaced = dict(page_table_1=table, real_page_table=real)
    if metadata.page_table_1_flattened is not None:
        replaced["page_table_1_flattened"] = remap(metadata.page_table_1_flattened, inverse, page_size)
    return dataclasses.replace(metadata, **replaced)


def check_rows(state, metadata, dense, pool) -> None:
    """Debug-mode invariants of a batch of several requests (synchronise the device): every
    page the batch lists is in the logical range, each has one dense page and distinct pages
    distinct ones; each chunk row's dense location is its page's; every entry a kernel can
    read through the translated tables (within its row's length) addresses a page of the
    dense map, at the same offset in the page as its logical location."""
    page_size, page_map = state.layout.page_size, state.page_map
    listed = state.seq_pages.to(torch.int64)
    if bool((listed <= 0).any()) or bool((listed > pool.size // page_size).any()):
        raise AssertionError("the batch lists a page outside the logical page range")
    placed = {}
    for page, where in zip(listed.tolist(), page_map.dense_page.tolist()):
        if placed.setdefault(page, where) != where:
            raise AssertionError(f"logical page {page} has two dense pages in one batch")
    if len(set(placed.values())) != len(placed):
        raise AssertionError("two logical pages of the batch share a dense page")
    chunk_rows = sum(state.extend_lens)
    chunk = state.out_cache_loc[:chunk_rows].to(torch.int64)
    expected = torch.tensor([placed.get(int(page), -1) for page in (chunk // page_size).tolist()],
                            dtype=torch.int64) * page_size + (chunk % page_size).cpu()
    if not torch.equal(state.dense_out_locs[:chunk_rows].to(torch.int64).cpu(), expected):
        raise AssertionError("a chunk row's dense location is not its page's dense page")
    row_lens = metadata.cache_seqlens_int32.to(torch.int64)
    within = ~_past_row_ends(metadata.page_table_1.shape[1], row_lens)
    logical = metadata.page_table_1.to(torch.int64)[within]
    translated = dense.page_table_1.to(torch.int64)[within]
    want = torch.tensor([placed.get(int(page), -1) for page in (logical // page_size).tolist()],
                        dtype=torch.int64) * page_size + (logical % page_size).cpu()
    if bool((want < 0).any()) or not torch.equal(translated.cpu(), want):
        raise AssertionError("a page table row reads a page the batch's dense map does not hold")
