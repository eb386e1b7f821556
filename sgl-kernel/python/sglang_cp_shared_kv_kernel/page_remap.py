"""Page-inverse remap: logical token locations -> dense-scratch locations.

Once per batch, :func:`build_page_inverse` scatters the sequence's dense placement into
a logical-page-indexed table (``page_inverse[seq_pages[i]] = dense_page[i]``; every other
page, the dummy page 0 included, maps to the dense dummy page 0). Then
:func:`remap_locs` translates any tensor of logical locations -- a page table
(``page_table_1``), fused top-k indices, ``out_cache_loc`` -- with one table lookup per
element: ``page_inverse[loc // P] * P + loc % P``. Negative entries (the -1 padding of
top-k indices) are kept as they are. With ``page_size=1`` it remaps page-level tables
(``real_page_table``).

This replaces a token-level ``sort`` + ``searchsorted`` of the locations against the
sequence's pages. Locations whose page lies outside the table read the dummy page, so a
stray entry never addresses memory outside the scratch.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _scatter_inverse_kernel(inv_ptr, pages_ptr, dense_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    page = tl.load(pages_ptr + i, mask=live, other=0)
    dense = tl.load(dense_ptr + i, mask=live, other=0)
    tl.store(inv_ptr + page, dense.to(inv_ptr.dtype.element_ty), mask=live)


def _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out):
    if seq_pages.shape != dense_page.shape or seq_pages.dim() != 1:
        raise ValueError(f"seq_pages {tuple(seq_pages.shape)} and dense_page {tuple(dense_page.shape)} "
                         "must be 1-D and of equal length")
    if out is not None and (out.dim() != 1 or out.numel() != num_logical_pages or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous ({num_logical_pages},) table, got {tuple(out.shape)}")


def build_page_inverse(seq_pages: torch.Tensor, dense_page: torch.Tensor, num_logical_pages: int,
                       out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Table of ``num_logical_pages`` entries: the dense page of each page of the sequence
    (``seq_pages``, never 0, all < num_logical_pages; a page listed twice, as a radix prefix
    two requests of a batch share, has the same dense page in both listings), 0 everywhere
    else."""
    _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out)
    out = torch.zeros(num_logical_pages, dtype=dtype, device=seq_pages.device) if out is None else out.zero_()
    n = seq_pages.numel()
    if n:
        _scatter_inverse_kernel[(triton.cdiv(n, BLOCK),)](out, seq_pages, dense_page, n, BLOCK=BLOCK)
    return out


def build_page_inverse_reference(seq_pages, dense_page, num_logical_pages, out=None, dtype=torch.int32):
    """Torch reference of :func:`build_page_inverse`."""
    _check_inverse_inputs(seq_pages, dense_page, num_logical_pages, out)
    out = torch.zeros(num_logical_pages, dtype=dtype, device=seq_pages.device) if out is None else out.zero_()
    out.index_copy_(0, seq_pages.long(), dense_page.to(out.dtype))
    return out


@triton.jit
def _remap_locs_kernel(locs_ptr, out_ptr, inv_ptr, n, num_pages, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    loc = tl.load(locs_ptr + i, mask=live, other=0).to(tl.int64)
    page = loc // PAGE_SIZE
    known = live & (loc >= 0) & (page < num_pages)
    dense = tl.load(inv_ptr + page, mask=known, other=0).to(tl.int64)
    out = tl.where(loc < 0, loc, dense * PAGE_SIZE + loc % PAGE_SIZE)
    tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=live)


def _check_remap(locs, out):
    if out is not None and (out.shape != locs.shape or out.dtype != locs.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(locs.shape)} {locs.dtype} tensor")


def remap_locs(locs: torch.Tensor, page_inverse: torch.Tensor, page_size: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense locations of logical ``locs`` (any shape, int32/int64; negatives kept)."""
    _check_remap(locs, out)
    src = locs.contiguous()
    out = torch.empty_like(src) if out is None else out
    n = src.numel()
    if n:
        _remap_locs_kernel[(triton.cdiv(n, BLOCK),)](src, out, page_inverse, n, page_inverse.numel(),
                                                     PAGE_SIZE=page_size, BLOCK=BLOCK)
    return out


def remap_locs_reference(locs, page_inverse, page_size: int, out=None):
    """Torch reference of :func:`remap_locs`."""
    _check_remap(locs, out)
    loc = locs.long()
    page = loc // page_size
    known = (loc >= 0) & (page < page_inverse.numel())
    dense = page_inverse.long()[torch.where(known, page, 0)]
    dense = torch.where(known, dense, 0)
    result = torch.where(loc < 0, loc, dense * page_size + loc % page_size).to(locs.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
