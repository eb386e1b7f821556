"""Page pack: gather a rank's send pages of its shard into the all-gather send buffer.

``out[k] = page_words[send_pages[k]]``: each page is a row of int64 words (an MLA layer
buffer of 64 x 656 or 64 x 1152 bytes per page, or an index buffer of 64 x 132 bytes per
page, viewed as words). It replaces ``index_select`` of the send pages in the
materialize path. ``out`` may be any (len(send_pages), words) int64 view, e.g. this
rank's slice of the all-gather output (NCCL all-gathers in place when the send buffer
is that slice, as FSDP2 does).

There is no unpack: the dense scratch is owner-major, so the all-gather output *is* the
scratch and every reader addresses it through remapped page tables.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

TILE_WORDS = 1024  # 8 KiB per program


@triton.jit
def _pack_pages_kernel(src_ptr, dst_ptr, pages_ptr, num_chunks, src_stride, dst_stride,
                       CHUNK: tl.constexpr, CHUNKS_PER_PAGE: tl.constexpr, BLOCK_CHUNKS: tl.constexpr):
    # Pages are cut into chunks of CHUNK words (the largest power of two dividing the page
    # width), so every tile row is a contiguous, aligned run the compiler moves as 16-byte
    # vectors, whatever the page width (index pages are 1056 words = 33 x 32).
    c = tl.program_id(0).to(tl.int64) * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS)
    live = c < num_chunks
    k, j = c // CHUNKS_PER_PAGE, c % CHUNKS_PER_PAGE
    page = tl.load(pages_ptr + k, mask=live, other=0).to(tl.int64)
    w = tl.arange(0, CHUNK)
    words = tl.load(src_ptr + (page * src_stride + j * CHUNK)[:, None] + w[None, :], mask=live[:, None])
    tl.store(dst_ptr + (k * dst_stride + j * CHUNK)[:, None] + w[None, :], words, mask=live[:, None])


def _chunk_words(words: int) -> int:
    return min(words & -words, TILE_WORDS)  # largest power of two dividing `words`


def _check(page_words, send_pages, out) -> None:
    if page_words.dim() != 2 or page_words.stride(1) != 1:
        raise ValueError(f"page_words must be (pages, words) with unit word stride, got {tuple(page_words.shape)}")
    if out is not None and (out.shape != (send_pages.numel(), page_words.shape[1]) or out.stride(1) != 1
                            or out.dtype != page_words.dtype):
        raise ValueError(f"out must be ({send_pages.numel()}, {page_words.shape[1]}) {page_words.dtype} "
                         f"with unit word stride, got {tuple(out.shape)} {out.dtype}")


def pack_pages(page_words: torch.Tensor, send_pages: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[k] = page_words[send_pages[k]]``; returns ``out`` (allocated when None)."""
    _check(page_words, send_pages, out)
    if out is None:
        out = page_words.new_empty((send_pages.numel(), page_words.shape[1]))
    if send_pages.numel() == 0 or page_words.shape[1] == 0:
        return out
    words = page_words.shape[1]
    chunk = _chunk_words(words)
    num_chunks = send_pages.numel() * (words // chunk)
    block_chunks = TILE_WORDS // chunk
    _pack_pages_kernel[(triton.cdiv(num_chunks, block_chunks),)](
        page_words, out, send_pages, num_chunks, page_words.stride(0), out.stride(0),
        CHUNK=chunk, CHUNKS_PER_PAGE=words // chunk, BLOCK_CHUNKS=block_chunks, num_warps=4,
    )
    return out


def pack_pages_reference(page_words: torch.Tensor, send_pages: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference of :func:`pack_pages`."""
    _check(page_words, send_pages, out)
    if out is None:
        return page_words.index_select(0, send_pages)
    out.copy_(page_words.index_select(0, send_pages))
    return out
