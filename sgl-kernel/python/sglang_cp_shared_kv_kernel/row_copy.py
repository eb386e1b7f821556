"""Owner copy: a rank's owned rows of the current chunk, from the dense view into its shard.

The current chunk is quantised and stored once per layer, into the layer's dense view
(the view the stock kernels read). The rows whose page this rank owns are then copied,
byte for byte, from there into this rank's shard:

    dst[dst_locs[i]] = src[src_locs[i]]        (one token row, every byte of it)

so no row is quantised twice, and the gathered chunk is read once per layer, not twice.

A token row may be split in parts inside a page. For one part of ``row_bytes`` bytes
that starts ``base_bytes`` into each page of ``page_bytes`` bytes, token location ``loc``
is at byte

    (loc div P) * page_bytes + base_bytes + (loc mod P) * row_bytes

* MLA rows (:func:`copy_mla_rows`): one part, ``row_bytes`` = the row (656 packed fp8,
  1152 bf16), ``page_bytes = P * row_bytes``, base 0 -- i.e. ``loc * row_bytes``;
* NSA index rows (:func:`copy_index_rows`), SGLang's page layout ``[P x 128 fp8 K |
  P x 4 fp32 scale]``: the K part (128 bytes, base 0) and the scale part (4 bytes, base
  ``P * 128``), in one launch.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM, PAGE_SIZE

MAX_CHUNK_WORDS = 16  # 128 bytes of int64 words per tile line
# NOTE: 1,024 words per program, as page_pack: with fewer than two words per thread
# (e.g. 64 lines of 2 words over 128 threads) Triton gives each thread one word and the
# 16-byte accesses are lost (test_kernel_ptx checks the packed fp8 row, 82 int64 words).
TILE_WORDS = 1024


@triton.jit
def _row_start(loc, PAGE: tl.constexpr, PAGE_WORDS: tl.constexpr, BASE_WORDS: tl.constexpr,
               ROW_WORDS: tl.constexpr):
    if PAGE == 1:  # rows back to back (MLA)
        start = loc * ROW_WORDS
    else:
        start = (loc // PAGE) * PAGE_WORDS + BASE_WORDS + (loc % PAGE) * ROW_WORDS
    return start


@triton.jit
def _copy_row_parts_kernel(dst_ptr, src_ptr, dst_locs_ptr, src_locs_ptr, num_lines,
                           PAGE: tl.constexpr, PAGE_WORDS: tl.constexpr, BASE_WORDS: tl.constexpr,
                           ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_LINES: tl.constexpr,
                           TAIL_BASE_WORDS: tl.constexpr, TAIL_WORDS: tl.constexpr):
    # The first part of a row is cut into ROW_WORDS // CHUNK lines of CHUNK words (the
    # largest power of two dividing it, at most 16): no mask varies along a line, so each
    # line moves as aligned vectors whatever the row width (82 words for a packed fp8 MLA
    # row). A second, small part (TAIL_WORDS > 0, a power of two: the index scale) moves
    # with the row's first line, so an index row takes one launch, not two.
    LINES: tl.constexpr = ROW_WORDS // CHUNK
    line = tl.program_id(0).to(tl.int64) * BLOCK_LINES + tl.arange(0, BLOCK_LINES)
    live = line < num_lines
    i, part = line // LINES, line % LINES
    src_loc = tl.load(src_locs_ptr + i, mask=live, other=0).to(tl.int64)
    dst_loc = tl.load(dst_locs_ptr + i, mask=live, other=0).to(tl.int64)
    src = _row_start(src_loc, PAGE, PAGE_WORDS, BASE_WORDS, ROW_WORDS) + part * CHUNK
    dst = _row_start(dst_loc, PAGE, PAGE_WORDS, BASE_WORDS, ROW_WORDS) + part * CHUNK
    w = tl.arange(0, CHUNK)
    words = tl.load(src_ptr + src[:, None] + w[None, :], mask=live[:, None])
    tl.store(dst_ptr + dst[:, None] + w[None, :], words, mask=live[:, None])
    if TAIL_WORDS > 0:
        first = live & (part == 0)
        tail_src = _row_start(src_loc, PAGE, PAGE_WORDS, TAIL_BASE_WORDS, TAIL_WORDS)
        tail_dst = _row_start(dst_loc, PAGE, PAGE_WORDS, TAIL_BASE_WORDS, TAIL_WORDS)
        t = tl.arange(0, TAIL_WORDS)
        tail = tl.load(src_ptr + tail_src[:, None] + t[None, :], mask=first[:, None])
        tl.store(dst_ptr + tail_dst[:, None] + t[None, :], tail, mask=first[:, None])


def _word_dtype(*byte_counts: int) -> torch.dtype:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(b % size == 0 for b in byte_counts):
            return dtype
    return torch.uint8


def _flat_bytes(buffer: torch.Tensor, what: str) -> torch.Tensor:
    if not buffer.is_contiguous():
        raise ValueError(f"the {what} buffer must be contiguous, got strides {buffer.stride()}")
    return buffer.reshape(-1).view(torch.uint8)


def _check_locs(dst_locs: torch.Tensor, src_locs: torch.Tensor) -> int:
    if dst_locs.shape != src_locs.shape or dst_locs.dim() != 1:
        raise ValueError(f"dst_locs {tuple(dst_locs.shape)} and src_locs {tuple(src_locs.shape)} must be "
                         "1-D and of one length")
    return dst_locs.numel()


Parts = Tuple[Tuple[int, int], ...]  # (base_bytes, row_bytes) of each part of a token row


def copy_row_parts(dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor, src_locs: torch.Tensor, *,
                   page_size: int, page_bytes: int, parts: Parts) -> None:
    """Copy the parts of each token row (the module docstring's formula) of ``src`` at
    ``src_locs`` to ``dst`` at ``dst_locs``; both buffers contiguous, any dtype; one part,
    or two whose second is a power-of-two number of words (one launch either way)."""
    n = _check_locs(dst_locs, src_locs)
    if n == 0:
        return
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"one or two row parts, got {len(parts)}")
    word = _word_dtype(page_bytes, *(b for part in parts for b in part))
    size = torch.empty((), dtype=word).element_size()
    (base, row_bytes), tail = parts[0], (parts[1] if len(parts) == 2 else (0, 0))
    tail_words = tail[1] // size
    if tail_words & (tail_words - 1):
        raise ValueError(f"the second part must be a power of two of {size}-byte words, got {tail[1]} bytes")
    dst_words, src_words = _flat_bytes(dst, "destination").view(word), _flat_bytes(src, "source").view(word)
    row_words = row_bytes // size
    chunk = min(row_words & -row_words, MAX_CHUNK_WORDS)
    num_lines, block_lines = n * (row_words // chunk), TILE_WORDS // chunk
    _copy_row_parts_kernel[(triton.cdiv(num_lines, block_lines),)](
        dst_words, src_words, dst_locs, src_locs, num_lines, PAGE=page_size, PAGE_WORDS=page_bytes // size,
        BASE_WORDS=base // size, ROW_WORDS=row_words, CHUNK=chunk, BLOCK_LINES=block_lines,
        TAIL_BASE_WORDS=tail[0] // size, TAIL_WORDS=tail_words, num_warps=4,
    )


def copy_row_parts_reference(dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor, src_locs: torch.Tensor,
                             *, page_size: int, page_bytes: int, parts: Parts) -> None:
    """Torch reference of :func:`copy_row_parts`."""
    if _check_locs(dst_locs, src_locs) == 0:
        return
    dst_bytes, src_bytes = _flat_bytes(dst, "destination"), _flat_bytes(src, "source")
    for base, row_bytes in parts:
        columns = torch.arange(row_bytes, device=dst_locs.device)

        def byte_index(locs):
            locs = locs.long()
            start = (locs // page_size) * page_bytes + base + (locs % page_size) * row_bytes
            return (start[:, None] + columns).reshape(-1)

        dst_bytes[byte_index(dst_locs)] = src_bytes[byte_index(src_locs)]


# ------------------------------------------------------------------- the two pools
def _mla_row_bytes(dst: torch.Tensor, src: torch.Tensor) -> int:
    row_bytes = dst.shape[-1] * dst.element_size()
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"MLA rows differ: {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
    return row_bytes


def _mla_part(dst: torch.Tensor, src: torch.Tensor) -> dict:
    row_bytes = _mla_row_bytes(dst, src)
    return dict(page_size=1, page_bytes=row_bytes, parts=((0, row_bytes),))


def copy_mla_rows(dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor, src_locs: torch.Tensor) -> None:
    """``dst[dst_locs[i]] = src[src_locs[i]]`` for MLA buffers of one row format
    ((slots, 1, 576) bf16/fp16, or (slots, 1, 656) uint8 packed fp8)."""
    copy_row_parts(dst, dst_locs, src, src_locs, **_mla_part(dst, src))


def copy_mla_rows_reference(dst, dst_locs, src, src_locs) -> None:
    """Torch reference of :func:`copy_mla_rows`."""
    copy_row_parts_reference(dst, dst_locs, src, src_locs, **_mla_part(dst, src))


def _index_parts(dst: torch.Tensor, src: torch.Tensor, page_size: int) -> dict:
    page_bytes = page_size * (NSA_INDEX_HEAD_DIM + 4)
    for buffer in (dst, src):
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != page_bytes:
            raise ValueError(f"index buffers are (pages, {page_bytes}) uint8, got {tuple(buffer.shape)} "
                             f"{buffer.dtype}")
    # the fp8 K (128 bytes at the page start), then the fp32 scale (4 bytes after P x 128)
    return dict(page_size=page_size, page_bytes=page_bytes,
                parts=((0, NSA_INDEX_HEAD_DIM), (page_size * NSA_INDEX_HEAD_DIM, 4)))


def copy_index_rows(dst: torch.Tensor, dst_locs: torch.Tensor, src: torch.Tensor, src_locs: torch.Tensor,
                    page_size: int = PAGE_SIZE) -> None:
    """The fp8 K and fp32 scale of token ``src_locs[i]`` of index buffer ``src`` to token
    ``dst_locs[i]`` of ``dst`` (SGLang's paged layout, (pages, P x 132) uint8), one launch."""
    copy_row_parts(dst, dst_locs, src, src_locs, **_index_parts(dst, src, page_size))


def copy_index_rows_reference(dst, dst_locs, src, src_locs, page_size: int = PAGE_SIZE) -> None:
    """Torch reference of :func:`copy_index_rows`."""
    copy_row_parts_reference(dst, dst_locs, src, src_locs, **_index_parts(dst, src, page_size))
