"""Page-inverse remap: logical token locations -> dense-scratch locations.

Once per batch, :func:`build_page_inverse` scatters each sequence page's *index* into a
logical-page-indexed table (``table[seq_pages[i]] = i``). Then :func:`remap_locs`
translates any tensor of logical locations -- a page table (``page_table_1``), fused
top-k indices, ``out_cache_loc`` -- with one table lookup per element:
``i = table[loc // P]``, and the location is ``dense_page[i] * P + loc % P`` when
``seq_pages[i]`` really is that page. Negative entries (the -1 padding of top-k indices)
are kept as they are; every other location whose page is not in the sequence (the
dummy page 0, a stray page, a page past the table) maps into the dense dummy page 0
(same offset within the page). With
``page_size=1`` it remaps page-level tables (``real_page_table``).

Why the check instead of a zeroed table: only the sequence's entries are ever written,
and a lookup is trusted only when it points back at its own page. The table therefore
never needs clearing (one launch and a memset fewer per batch), and it may be reused or
freshly allocated uninitialised: a stale or arbitrary entry either fails the check or
names the right sequence page.

This replaces a token-level ``sort`` + ``searchsorted`` of the locations against the
sequence's pages.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


class PageInverse(NamedTuple):
    """A built inverse: the logical-page table and the two sequence-order lists it indexes."""

    table: torch.Tensor  # (num_logical_pages,) int32: index into seq_pages where written, anything elsewhere
    seq_pages: torch.Tensor  # (P,) logical pages of the sequence, distinct, never 0
    dense_page: torch.Tensor  # (P,) dense page of each

    def as_dense_table(self) -> torch.Tensor:
        """(num_logical_pages,) dense page of every logical page, 0 off the sequence
        (materialised, for checks)."""
        pages = torch.arange(self.table.numel(), device=self.table.device)
        return remap_locs_reference(pages, self, 1)


@triton.jit
def _scatter_inverse_kernel(inv_ptr, pages_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    page = tl.load(pages_ptr + i, mask=live, other=0)
    tl.store(inv_ptr + page, i.to(inv_ptr.dtype.element_ty), mask=live)


def _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out):
    if seq_pages.shape != dense_page.shape or seq_pages.dim() != 1:
        raise ValueError(f"seq_pages {tuple(seq_pages.shape)} and dense_page {tuple(dense_page.shape)} "
                         "must be 1-D and of equal length")
    if out is not None and (out.dim() != 1 or out.numel() != num_logical_pages or not out.is_contiguous()
                            or out.dtype != torch.int32):
        raise ValueError(f"out must be a contiguous ({num_logical_pages},) int32 table, got "
                         f"{tuple(out.shape)} {out.dtype}")


def _new_table(num_logical_pages, device, out):
    return torch.empty(num_logical_pages, dtype=torch.int32, device=device) if out is None else out


def build_page_inverse(seq_pages: torch.Tensor, dense_page: torch.Tensor, num_logical_pages: int,
                       out: Optional[torch.Tensor] = None) -> PageInverse:
    """The inverse of the sequence's pages (``seq_pages``, distinct, never 0, all <
    num_logical_pages) onto their ``dense_page``; ``out``: a table to reuse (its old
    contents do not matter)."""
    _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out)
    table = _new_table(num_logical_pages, seq_pages.device, out)
    n = seq_pages.numel()
    if n:
        _scatter_inverse_kernel[(triton.cdiv(n, BLOCK),)](table, seq_pages, n, BLOCK=BLOCK)
    return PageInverse(table, seq_pages, dense_page)


def build_page_inverse_reference(seq_pages, dense_page, num_logical_pages, out=None) -> PageInverse:
    """Torch reference of :func:`build_page_inverse`."""
    _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out)
    table = _new_table(num_logical_pages, seq_pages.device, out)
    table[seq_pages.long()] = torch.arange(seq_pages.numel(), dtype=torch.int32, device=seq_pages.device)
    return PageInverse(table, seq_pages, dense_page)


@triton.jit
def _remap_locs_kernel(locs_ptr, out_ptr, inv_ptr, seq_pages_ptr, dense_ptr, n, num_pages, seq_len,
                       PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    loc = tl.load(locs_ptr + i, mask=live, other=0).to(tl.int64)
    page = loc // PAGE_SIZE
    in_table = live & (loc >= 0) & (page < num_pages)
    k = tl.load(inv_ptr + page, mask=in_table, other=-1).to(tl.int64)
    named = in_table & (k >= 0) & (k < seq_len)
    known = named & (tl.load(seq_pages_ptr + k, mask=named, other=-1).to(tl.int64) == page)
    dense = tl.load(dense_ptr + k, mask=known, other=0).to(tl.int64)
    out = tl.where(loc < 0, loc, dense * PAGE_SIZE + loc % PAGE_SIZE)
    tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=live)


def _check_remap(locs, out):
    if out is not None and (out.shape != locs.shape or out.dtype != locs.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(locs.shape)} {locs.dtype} tensor")


def remap_locs(locs: torch.Tensor, inverse: PageInverse, page_size: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense locations of logical ``locs`` (any shape, int32/int64; negatives kept)."""
    _check_remap(locs, out)
    table, seq_pages, dense_page = inverse
    src = locs.contiguous()
    out = torch.empty_like(src) if out is None else out
    n = src.numel()
    if n:
        _remap_locs_kernel[(triton.cdiv(n, BLOCK),)](src, out, table, seq_pages, dense_page, n, table.numel(),
                                                     seq_pages.numel(), PAGE_SIZE=page_size, BLOCK=BLOCK)
    return out


def remap_locs_reference(locs, inverse: PageInverse, page_size: int, out=None):
    """Torch reference of :func:`remap_locs`."""
    _check_remap(locs, out)
    table, seq_pages, dense_page = inverse
    loc = locs.long()
    page = loc // page_size
    in_table = (loc >= 0) & (page < table.numel())
    k = torch.where(in_table, table.long()[torch.where(in_table, page, 0)], -1)
    named = in_table & (k >= 0) & (k < seq_pages.numel())
    k = torch.where(named, k, 0)
    known = named & (seq_pages.long()[k] == page) if seq_pages.numel() else named
    dense = torch.where(known, dense_page.long()[k], 0) if seq_pages.numel() else torch.zeros_like(loc)
    result = torch.where(loc < 0, loc, dense * page_size + loc % page_size).to(locs.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
