"""The logical page allocator of a CP shared-KV group, handing each page to the rank that
computes it.

Every CP rank runs the same scheduler decisions on the same requests, so a stock
``PagedTokenToKVPoolAllocator`` over the *logical* capacity already hands out identical
logical pages on every rank; the layout then makes page ``p`` rank ``(p - 1) mod N``'s
(interleaved). This subclass adds:

* **compute-owner allocation** (phase 5): for a one-request extend whose chunk touches at
  least 2N pages, :mod:`~sglang_cp_shared_kv.pool.page_split` names the rank that computes each
  new page; the allocator moves to the front of ``free_pages`` one free page of that
  rank's *lane* (the logical pages ``p`` with ``(p - 1) mod N = r``) per new page, in
  sequence order, each rank's pages consecutive in its pool where its lane has such a run.
  SGLang's own ``alloc_extend`` then takes them in that order. A rank's pages of a chunk
  thus form one run per zigzag segment, on its side and on decode's: a PD transfer sends a
  few contiguous runs instead of one descriptor per page per layer;
* a **deterministic fallback**: when a lane has fewer free pages than the chunk needs of
  it while the pool as a whole has room, the chunk takes interleaved pages (the free list
  untouched) -- never out-of-memory while the logical pool has room. Every decision reads
  only the free list and the request's lengths, which are the same on every rank;
* invariant: ``size == pool.physical_size * cp_size`` (checked at construction);
* under interleave CP (0.5.23) no page has a computing rank:
  :class:`CpSharedInterleavedPagesAllocator` leaves compute-owner allocation out;
* with ``SGLANG_DEBUG_CP_SHARED_KV=1``, every allocation is checked to stay inside the
  logical range and off the dummy page 0, and compute-owner pages to be owned by their
  computing rank (this syncs the device).

The constructor signature stays SGLang's because ``_init_pools`` calls it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Deque, Optional, Sequence, Tuple

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, debug_enabled
from sglang_cp_shared_kv.cp_shared_kv_layout import owner_counts
from sglang_cp_shared_kv.pool.page_split import page_aligned_split
from sglang_cp_shared_kv.scoped import attributes_set

logger = logging.getLogger(__name__)


@dataclass
class AllocationStats:
    """What the allocator decided, cumulative (one per allocator, so per process)."""

    compute_owner_chunks: int = 0  #: chunks whose new pages went to their computing ranks
    short_chunks: int = 0  #: chunks touching fewer than 2N pages: interleaved
    lane_fallbacks: int = 0  #: chunks whose lanes ran dry: interleaved


def _first_run(lane: torch.Tensor, count: int, cp_size: int) -> int:
    """Index of the first ``count`` pages of ``lane`` (sorted logical pages of one rank)
    that are consecutive in that rank's pool (logical pages ``cp_size`` apart); 0 when no
    such run exists."""
    if count <= 1 or lane.numel() == count:
        return 0
    span = lane[count - 1:] - lane[: lane.numel() - count + 1]
    consecutive = span == (count - 1) * cp_size
    return int(consecutive.to(torch.int8).argmax()) if bool(consecutive.any()) else 0


def compute_owner_order(free_pages: torch.Tensor, ranks: Sequence[int], cp_size: int) -> Optional[torch.Tensor]:
    """``free_pages`` reordered so that its first ``len(ranks)`` pages are owned by
    ``ranks`` (in order); None when some rank's lane has too few free pages.

    The readable reference (it reads the device several times per rank); the allocator runs
    :func:`compute_owner_order_on_device`, which the tests hold equal to it."""
    if not ranks:
        return free_pages
    lanes = (free_pages - 1) % cp_size
    take = torch.empty(len(ranks), dtype=free_pages.dtype, device=free_pages.device)
    for rank, count in sorted(Counter(ranks).items()):
        lane = torch.sort(free_pages[lanes == rank]).values
        if lane.numel() < count:
            return None
        start = _first_run(lane, count, cp_size)
        slots = torch.tensor([i for i, r in enumerate(ranks) if r == rank], device=free_pages.device)
        take[slots] = lane[start: start + count]
    rest = free_pages[~torch.isin(free_pages, take)]
    return torch.cat([take, rest])


def compute_owner_order_on_device(free_pages: torch.Tensor, ranks: Sequence[int], cp_size: int,
                                  page_limit: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_owner_order` without a host synchronisation: ``(order, found)``, where
    ``found`` is a device bool and ``order`` is ``free_pages`` itself where some lane has too
    few free pages (the reference's None). ``page_limit``: every page is below it.

    NOTE: the allocator runs in the scheduler, which under SGLang's overlap schedule prepares
    the next batch while the current forward runs; a host read here would make it wait for
    that forward. So every size below comes from host data (the ranks, the free list's
    length): one sort of the free pages by (lane, page) replaces the per-lane masks, each
    rank's first run is a masked minimum, the pages not taken are compacted with
    ``nonzero_static`` (their number is known), and the fallback is a ``torch.where``.
    """
    device, count = free_pages.device, free_pages.numel()
    if not ranks:
        return free_pages, torch.ones((), dtype=torch.bool, device=device)
    if count < len(ranks):
        return free_pages, torch.zeros((), dtype=torch.bool, device=device)
    pages = free_pages.to(torch.int64)
    lanes = (pages - 1) % cp_size
    by_lane = torch.sort(lanes * page_limit + pages).values % page_limit  # each lane's pages, ascending
    lane_sizes = owner_counts(lanes, cp_size)
    lane_starts = torch.cumsum(lane_sizes, 0) - lane_sizes
    found = torch.ones((), dtype=torch.bool, device=device)
    picked, slots = [], []
    for rank, need in sorted(Counter(ranks).items()):
        start, size = lane_starts[rank], lane_sizes[rank]
        found = found & (size >= need)
        first = torch.arange(count - need + 1, device=device)  # window [first, first + need) of by_lane
        span = by_lane[need - 1:] - by_lane[: count - need + 1]
        is_run = (span == (need - 1) * cp_size) & (first >= start) & (first + need <= start + size)
        begin = torch.where(is_run, first, count).min()
        begin = torch.where(begin < count, begin, start)  # no run: the lane's first pages
        picked.append(by_lane[(begin + torch.arange(need, device=device)).clamp(max=count - 1)])
        slots += [i for i, r in enumerate(ranks) if r == rank]
    slots = torch.tensor(slots)
    if device.type == "cuda":  # NOTE: a pageable host-to-device copy would wait for the stream
        slots = slots.pin_memory().to(device, non_blocking=True)
    take = torch.empty(len(ranks), dtype=torch.int64, device=device)
    take[slots] = torch.cat(picked)
    taken = torch.zeros(page_limit, dtype=torch.bool, device=device).index_fill_(0, take, True)
    rest = torch.nonzero_static(~taken[pages], size=count - len(ranks)).squeeze(1)
    order = torch.cat([take, pages.index_select(0, rest.clamp(min=0))]).to(free_pages.dtype)
    return torch.where(found, order, free_pages), found


class CpSharedPagedTokenToKVPoolAllocator(sg.PagedTokenToKVPoolAllocator):
    #: in-seq-split CP (0.5.12.post1): each new page of a long chunk goes to the rank computing it
    compute_owner_pages: bool = True

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort):
        layout = getattr(kvcache, "cp_layout", None)
        if layout is None:
            raise TypeError(
                "CpSharedPagedTokenToKVPoolAllocator needs the CP shared-KV pool as kvcache, "
                f"got {type(kvcache).__name__}"
            )
        if size != kvcache.physical_size * layout.cp_size or page_size != layout.page_size:
            raise ValueError(
                f"logical allocator size {size} (page {page_size}) != physical pool size "
                f"{kvcache.physical_size} x cp_size {layout.cp_size} (page {layout.page_size})"
            )
        self.cp_layout = layout
        self.physical_size = kvcache.physical_size
        self._stats = AllocationStats()
        #: compute-owner decisions made on the device, not yet read: (found, event, pages, free)
        self._undecided: Deque[tuple] = collections.deque()
        self._check_allocations = debug_enabled()
        #: set only inside pages_in_lanes' block (one load-back's allocation)
        self._pending_lanes: Optional[torch.Tensor] = None
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    @property
    def stats(self) -> AllocationStats:
        """The decisions so far (reading them waits for the device to have made them)."""
        self._read_decisions(wait=True)
        return self._stats

    def _note_decision(self, found: torch.Tensor, chunk_pages: int) -> None:
        """Keep ``found`` (a device bool) to be read once the device has computed it."""
        event = None
        if found.is_cuda:  # NOTE: a non-blocking copy and an event: nothing here waits for the device
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(found, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            found = host
        self._undecided.append((found, event, chunk_pages, self.free_pages.numel()))

    def _read_decisions(self, wait: bool) -> None:
        """Count (and log) the decisions the device has made; all of them with ``wait``."""
        while self._undecided:
            found, event, chunk_pages, free = self._undecided[0]
            if event is not None and not (wait or event.query()):
                return
            if event is not None:
                event.synchronize()
            self._undecided.popleft()
            if bool(found):
                self._stats.compute_owner_chunks += 1
                continue
            self._stats.lane_fallbacks += 1
            log = logger.warning if self._stats.lane_fallbacks == 1 else logger.debug
            log("CP shared KV: an owner lane had too few free pages for a %d-page chunk (%d free in all); "
                "that chunk took interleaved pages (lane fallbacks so far: %d)",
                chunk_pages, free, self._stats.lane_fallbacks)

    def _checked(self, out_locs):
        if self._check_allocations and out_locs is not None and out_locs.numel():
            low, high = int(out_locs.min()), int(out_locs.max())
            if low < self.page_size or high >= self.size + self.page_size:
                raise AssertionError(
                    f"allocated logical locations [{low}, {high}] leave the logical range "
                    f"[{self.page_size}, {self.size + self.page_size})"
                )
        return out_locs

    def alloc(self, need_size: int):
        if self._pending_lanes is not None:
            return self._checked(self._alloc_in_lanes(need_size, self._pending_lanes))
        return self._checked(super().alloc(need_size))

    @contextlib.contextmanager
    def pages_in_lanes(self, lanes: torch.Tensor):
        """Within the block, ``alloc`` gives page i to rank ``lanes[i]`` or returns None (a HiCache
        load-back: the host copy of a page is on one rank, its device page must be that rank's)."""
        with attributes_set(self, _pending_lanes=lanes):
            yield

    def _alloc_in_lanes(self, need_size: int, lanes: torch.Tensor):
        if need_size != lanes.numel() * self.page_size:
            raise ValueError(f"{FLAG}: {lanes.numel()} lanes given for {need_size} tokens of pages of {self.page_size}")
        found = self._order_free_pages_for(lanes.tolist())
        # NOTE: a host read (the only one of a load-back): with a lane short of pages there is no
        # fallback -- the page's bytes are on its host lane's rank -- so SGLang must hear None and
        # evict (or recompute) now; the decision is the same on every rank
        if found is None or not bool(found):
            return None
        out = super().alloc(need_size)
        if self._check_allocations and out is not None:
            self._check_page_owners(out, 0, lanes.tolist(), "load-back pages", "their host lanes")
        return out

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                     num_new_pages=None):
        ranks = self._compute_owner_ranks(prefix_lens_cpu, seq_lens_cpu)
        out = self._checked(super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                                 extend_num_tokens, num_new_pages))
        if ranks and self._check_allocations and out is not None:
            self._check_compute_owners(out, int(prefix_lens_cpu[0]), ranks)
        return out

    def alloc_decode(self, *args, **kwargs):
        return self._checked(super().alloc_decode(*args, **kwargs))

    # ------------------------------------------------------------ compute owner
    def _compute_owner_ranks(self, prefix_lens_cpu, seq_lens_cpu) -> Optional[Sequence[int]]:
        """Put one page of each new page's computing rank at the front of ``free_pages``
        (in order) and return those ranks; None when the chunk takes interleaved pages."""
        if not self.compute_owner_pages or len(prefix_lens_cpu) != 1:
            return None  # in-seq-split CP prefill runs one request per batch
        layout = self.cp_layout
        split = page_aligned_split(int(prefix_lens_cpu[0]), int(seq_lens_cpu[0]), self.page_size, layout.cp_size)
        self._read_decisions(wait=False)  # those the device has made since (debug mode reads each at once)
        if split is None:
            self._stats.short_chunks += 1
            return None
        ranks = split.new_page_ranks()
        found = self._order_free_pages_for(ranks)
        if found is None:
            # NOTE: the whole pool lacks the pages (a host-side count, no read): SGLang's own
            # alloc_extend reports it out of memory; no lane is to blame, so no fallback
            return None
        # NOTE: decided on the device (no host read under the overlap schedule); counted later
        self._note_decision(found, len(ranks))
        if self._check_allocations:  # debug: read it now, to check the pages against it
            fallbacks = self._stats.lane_fallbacks
            self._read_decisions(wait=True)
            return None if self._stats.lane_fallbacks > fallbacks else ranks
        return ranks

    def _order_free_pages_for(self, ranks: Sequence[int]) -> Optional[torch.Tensor]:
        """Put one free page of each of ``ranks``' lanes at the front of ``free_pages``, in order
        (every free page a candidate); the device bool saying whether every lane had them (the
        free list unchanged where not), or None when the pool has fewer free pages than ranks."""
        # NOTE: SGLang's own merge of the pages freed since (0.5.12.post1 keeps them in
        # release_pages, 0.5.23 in staged_pages; a no-op where there are none)
        self.merge_and_sort_free()
        if self.free_pages.numel() < len(ranks):
            return None
        self.free_pages, found = compute_owner_order_on_device(self.free_pages, ranks, self.cp_layout.cp_size,
                                                               self.size // self.page_size + 1)
        return found

    def _check_compute_owners(self, out_locs, prefix_len: int, ranks: Sequence[int]) -> None:
        first_new = -(-prefix_len // self.page_size) * self.page_size - prefix_len  # rows on the shared page
        self._check_page_owners(out_locs, first_new, ranks, "compute-owner pages", "their computing ranks")

    def _check_page_owners(self, out_locs, first: int, ranks: Sequence[int], what: str, whose: str) -> None:
        pages = out_locs[first:: self.page_size] // self.page_size
        owners = self.cp_layout.owner_for_logical_pages(pages).tolist()
        if owners != list(ranks):
            raise AssertionError(f"{FLAG}: {what} {pages.tolist()} have owners {owners}, {whose} are {list(ranks)}")


class CpSharedInterleavedPagesAllocator(CpSharedPagedTokenToKVPoolAllocator):
    """The allocator under interleave CP (SGLang 0.5.23): token i is computed on rank
    i mod N, so every page's rows come from every rank and no page has a computing rank;
    every chunk takes interleaved pages, the free list as SGLang keeps it."""

    compute_owner_pages = False
