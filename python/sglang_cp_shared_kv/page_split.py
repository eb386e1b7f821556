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

Compute-owner allocation (:class:`~sglang_cp_shared_kv.allocator.CpSharedPagedTokenToKVPoolAllocator`)
hands each *new* page of the chunk to its computing rank; the page the chunk shares with
the prefix (when the prefix ends mid-page) was allocated before and keeps its owner.

Every figure here is a function of ``(prefix_len, seq_len, page_size, cp_size)``, which all
CP ranks hold identically, so every rank makes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


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
