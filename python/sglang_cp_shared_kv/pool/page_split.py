"""The page-aligned zigzag split of a prefill chunk (pure; no SGLang, no torch).

SGLang's in-seq-split CP cuts a chunk of T tokens into 2N segments of about T / 2N
tokens and gives rank r segments ``r`` and ``2N - 1 - r`` (zigzag: an early and a late
segment, so every rank attends over a similar number of keys). This module cuts the same
chunk on **page boundaries** instead, so that every page the chunk touches falls in
exactly one segment and so has exactly one computing rank:

* the chunk ``[prefix_len, seq_len)`` touches pages ``first = prefix_len div P`` to
  ``last = (seq_len - 1) div P``, ``M = last - first + 1`` of them;
* segment ``s`` (0 ≤ s < 2N) takes ``M div 2N`` consecutive pages, one more for the first
  ``M mod 2N`` segments (SGLang gives its extra tokens to the first segments too);
* segment ``s`` is computed by rank ``s`` if ``s < N``, else by rank ``2N - 1 - s``;
* a chunk that touches fewer than 2N pages cannot be split this way (some segment would
  be empty): it keeps SGLang's token-balanced split, and its pages keep interleaved owners.

SGLang itself keeps its token-balanced split for every chunk (the plugin does not change
it; docs/design.md says why). :func:`token_split_page_ranks` reads that split page by page:
a chunk that starts on a page boundary and is a multiple of 2N x 64 rows long -- every full
chunk of a chunked prefill at SGLang's default 8,192 tokens for N = 2, 4, 8 -- is cut on
page boundaries by SGLang too, into the very segments of the page-aligned split above, so
compute-owner allocation made each of its pages the computing rank's
(``forward.local_writes_v0512`` then stores each row where it was computed).

Compute-owner allocation (:class:`~sglang_cp_shared_kv.pool.allocator.CpSharedPagedTokenToKVPoolAllocator`)
hands each *new* page of the chunk to its computing rank; the page the chunk shares with
the prefix (when the prefix ends mid-page) was allocated before and keeps its owner.

Every figure here is a function of ``(prefix_len, seq_len, page_size, cp_size)``, which all
CP ranks hold identically, so every rank makes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


def segment_rank(segment: int, cp_size: int) -> int:
    """The rank that computes zigzag segment ``segment`` of ``2 * cp_size``."""
    if not 0 <= segment < 2 * cp_size:
        raise ValueError(f"segment {segment} outside [0, {2 * cp_size})")
    return segment if segment < cp_size else 2 * cp_size - 1 - segment


@dataclass(frozen=True)
class PageAlignedSplit:
    """The page-aligned zigzag split of one chunk."""

    prefix_len: int
    seq_len: int
    page_size: int
    cp_size: int
    first_page: int  #: sequence page index (0-based) of the chunk's first page
    segment_pages: Tuple[int, ...]  #: pages of each of the 2N segments, in sequence order

    @property
    def num_pages(self) -> int:
        """Pages the chunk touches (its first one may be shared with the prefix)."""
        return sum(self.segment_pages)

    def segment_tokens(self) -> List[Tuple[int, int]]:
        """[start, end) sequence positions of each segment (the first and last are clipped
        to the chunk)."""
        out, page = [], self.first_page
        for count in self.segment_pages:
            start = max(self.prefix_len, page * self.page_size)
            end = min(self.seq_len, (page + count) * self.page_size)
            out.append((start, end))
            page += count
        return out

    def page_ranks(self) -> List[int]:
        """The computing rank of each page the chunk touches, in sequence order."""
        return [segment_rank(s, self.cp_size) for s, count in enumerate(self.segment_pages) for _ in range(count)]

    def new_page_ranks(self) -> List[int]:
        """The computing rank of each page allocated for this chunk (the pages after the one
        it shares with the prefix, when the prefix ends mid-page)."""
        ranks = self.page_ranks()
        return ranks[1:] if self.prefix_len % self.page_size else ranks


def page_aligned_split(prefix_len: int, seq_len: int, page_size: int, cp_size: int) -> Optional[PageAlignedSplit]:
    """The split of the chunk ``[prefix_len, seq_len)``, or None when it touches fewer than
    ``2 * cp_size`` pages (it then keeps SGLang's token-balanced split)."""
    if page_size < 1 or cp_size < 1:
        raise ValueError(f"page_size={page_size} and cp_size={cp_size} must be >= 1")
    if not 0 <= prefix_len < seq_len:
        raise ValueError(f"the chunk [{prefix_len}, {seq_len}) is empty or negative")
    first, last = prefix_len // page_size, (seq_len - 1) // page_size
    num_pages, segments = last - first + 1, 2 * cp_size
    if cp_size < 2 or num_pages < segments:
        return None
    base, extra = divmod(num_pages, segments)
    counts = tuple(base + (1 if s < extra else 0) for s in range(segments))
    return PageAlignedSplit(prefix_len, seq_len, page_size, cp_size, first, counts)


# ------------------------------------------------------ SGLang's token-balanced split
def page_by_page_chunk_unit(cp_size: int, page_size: int) -> int:
    """Chunk lengths SGLang's token-balanced split cuts page by page (from a page boundary):
    the multiples of 2N pages (2 x 4 x 64 = 512 tokens at CP4)."""
    return 2 * cp_size * page_size


def segment_row_ranges(split_list: Sequence[int]) -> List[Tuple[int, int]]:
    """[start, end) chunk rows of each segment of SGLang's in-seq split ``split_list`` (the
    2N segment lengths of ``ContextParallelMetadata.split_list``, in sequence order)."""
    out, start = [], 0
    for length in split_list:
        out.append((start, start + int(length)))
        start += int(length)
    return out


def token_split_page_ranks(prefix_len: int, extend_len: int, split_list: Sequence[int], page_size: int,
                           cp_size: int) -> Optional[Tuple[int, ...]]:
    """The one rank computing each page the chunk ``[prefix_len, prefix_len + extend_len)``
    touches when SGLang cuts its rows into the segments of ``split_list`` (rows past
    ``extend_len`` are SGLang's padding: they compute nothing a page holds), or None when
    some page has rows computed by two ranks.

    SGLang cuts ``len(input_ids)`` rows token-balanced; the chunk is computed page by page
    whenever every boundary between two ranks' segments falls on a page boundary."""
    if len(split_list) != 2 * cp_size:
        raise ValueError(f"split_list has {len(split_list)} segments, in-seq split with cp_size={cp_size} has "
                         f"{2 * cp_size}")
    if extend_len < 1 or sum(split_list) < extend_len:
        raise ValueError(f"split_list {list(split_list)} does not cover the chunk's {extend_len} rows")
    first = prefix_len // page_size
    ranks: List[Optional[int]] = [None] * ((prefix_len + extend_len - 1) // page_size - first + 1)
    for segment, (start, end) in enumerate(segment_row_ranges(split_list)):
        end = min(end, extend_len)
        if end <= start:
            continue
        rank = segment_rank(segment, cp_size)
        for page in range((prefix_len + start) // page_size - first, (prefix_len + end - 1) // page_size - first + 1):
            if ranks[page] is not None and ranks[page] != rank:
                return None
            ranks[page] = rank
    return tuple(ranks)  # every page has a rank: the segments cover every real row
