"""In-seq CP re-range: the all-gathered zigzag blocks back in sequence order, in one copy.

With in-seq-split CP over N ranks, a sequence is cut into 2N blocks and rank r holds
blocks r and 2N-1-r. SGLang all-gathers each rank's (padded) rows into one buffer and
then re-orders it with torch ``split`` / ``cat`` twice (drop each rank's padding, then
put the blocks in sequence order): two full copies and ~4N small launches.

Here the re-order is a list of row segments ``(src_row, dst_row, rows)`` derived once
per batch from SGLang's ``ContextParallelMetadata`` (:func:`in_seq_segments`), and
:func:`rerange_rows` copies every segment in one launch, rows moved as wide words.
"""

from __future__ import annotations

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from sglang_cp_shared_kv_kernel._words import rows_as_words

Segment = Tuple[int, int, int]  # (first source row, first destination row, rows)


def in_seq_segments(max_rank_len: Sequence[int], per_rank_actual_token: Sequence[int],
                    reverse_split_len: Sequence[int], cp_reverse_index: Sequence[int]) -> List[Segment]:
    """Row segments of the re-order SGLang's in-seq-split all-gather path performs.

    The gathered buffer holds rank r's rows in a block of ``max_rank_len[r]`` rows, of
    which the first ``per_rank_actual_token[r]`` are real. Concatenating the real rows
    gives a *compact* sequence; cut into pieces of ``reverse_split_len`` rows, its pieces
    taken in ``cp_reverse_index`` order are the output.
    """
    block_starts = [0, *accumulate(max_rank_len)]
    compact_starts = [0, *accumulate(per_rank_actual_token)]
    # compact rows [compact_starts[r], compact_starts[r+1]) come from block r
    piece_starts = [0, *accumulate(reverse_split_len)]
    segments: List[Segment] = []
    dst = 0
    for piece in cp_reverse_index:
        lo, hi = piece_starts[piece], piece_starts[piece] + reverse_split_len[piece]
        for rank, rows in enumerate(per_rank_actual_token):
            first, end = max(lo, compact_starts[rank]), min(hi, compact_starts[rank] + rows)
            if first < end:
                segments.append((block_starts[rank] + first - compact_starts[rank], dst + first - lo, end - first))
        dst += hi - lo
    return segments


def segment_table(segments: Sequence[Segment], device) -> torch.Tensor:
    """(S, 3) int64 device table of ``segments``, copied without a host synchronisation."""
    host = torch.tensor(segments or [(0, 0, 0)], dtype=torch.int64).reshape(-1, 3)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


BLOCK_WORDS = 4096  # 32 KiB per program


@triton.jit
def _rerange_rows_kernel(src_ptr, dst_ptr, seg_ptr, row_words, BLOCK: tl.constexpr):
    # A segment's rows are one contiguous run in the source and in the destination, so
    # each segment is a flat copy of rows * row_words words: BLOCK-word tiles of it on
    # axis 0 (up to 2**31 programs), segments on axis 1.
    seg = tl.program_id(1)
    src_row0 = tl.load(seg_ptr + seg * 3)
    dst_row0 = tl.load(seg_ptr + seg * 3 + 1)
    rows = tl.load(seg_ptr + seg * 3 + 2)
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = w < rows * row_words
    words = tl.load(src_ptr + src_row0 * row_words + w, mask=m)
    tl.store(dst_ptr + dst_row0 * row_words + w, words, mask=m)


def _out_for(gathered: torch.Tensor, total_rows: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    shape = (total_rows, *gathered.shape[1:])
    if out is None:
        return gathered.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != gathered.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {gathered.dtype} tensor, got {tuple(out.shape)}")
    return out


def rerange_rows(gathered: torch.Tensor, table: torch.Tensor, max_segment_rows: int, total_rows: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[dst:dst+n] = gathered[src:src+n]`` for every row of ``table`` (``segment_table``).

    ``max_segment_rows``: the longest segment; ``total_rows``: rows of the output, which
    the segments must cover exactly.
    """
    out = _out_for(gathered, total_rows, out)
    if total_rows == 0 or gathered.numel() == 0:
        return out
    src = rows_as_words(gathered.contiguous(), gathered.shape[0])
    dst = out.view(total_rows, -1).view(src.dtype)
    words = src.shape[1]
    block = min(BLOCK_WORDS, triton.next_power_of_2(max_segment_rows * words))
    grid = (triton.cdiv(max_segment_rows * words, block), table.shape[0])
    _rerange_rows_kernel[grid](src, dst, table, words, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


def rerange_in_seq(gathered: torch.Tensor, max_rank_len, per_rank_actual_token, reverse_split_len,
                   cp_reverse_index, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One-call form of :func:`in_seq_segments` + :func:`rerange_rows` (builds the table
    each call; a caller running it every layer builds the table once per batch)."""
    segments = in_seq_segments(max_rank_len, per_rank_actual_token, reverse_split_len, cp_reverse_index)
    total = sum(reverse_split_len[i] for i in cp_reverse_index)
    longest = max((n for _, _, n in segments), default=0)
    return rerange_rows(gathered, segment_table(segments, gathered.device), longest, total, out=out)


def rerange_in_seq_reference(gathered: torch.Tensor, max_rank_len, per_rank_actual_token, reverse_split_len,
                             cp_reverse_index, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference: the split/cat re-order (drop each block's padding, then order the
    pieces), SGLang's own re-order; into ``out`` when given."""
    real_rows = [block[:rows] for block, rows in zip(gathered.split(list(max_rank_len)), per_rank_actual_token)]
    pieces = torch.cat(real_rows).split(list(reverse_split_len))
    result = torch.cat([pieces[i] for i in cp_reverse_index])
    return result if out is None else out.copy_(result)
