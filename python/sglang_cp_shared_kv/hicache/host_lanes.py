"""Logical host pages, lane by lane: the host tier's page rule and its allocator (pure torch, CPU).

The host tier follows the device pool's rule (:mod:`sglang_cp_shared_kv.cp_shared_kv_layout`):
logical page ``l`` is rank ``(l - 1) mod N``'s, at its physical page ``(l - 1) div N + 1``.
SGLang's host pools have no dummy page (host slot 0 is usable), so host page ``h`` is layout
page ``h + 1``:

* ``lane(h) = h mod N``                 (the rank holding host page ``h``);
* ``physical(h) = h div N``             (its page in that rank's host buffer);
* capacity: ``logical_pages = N * physical_pages`` (exactly N times one rank's host pool).

A backup takes, for each device page, a free host page of the device page's owner lane; a
load-back takes device pages of the host pages' lanes. Every rank runs the same allocator on
the same requests, so the free lists stay identical on every rank (nothing here reads a
rank's own state).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout


class HostPageRule:
    """The device layout's rule applied to host pages (module docstring); stateless."""

    def __init__(self, layout: CpSharedKVLayout):
        self.layout = layout
        self.page_size = layout.page_size
        self.cp_size = layout.cp_size

    def lanes(self, host_pages: torch.Tensor) -> torch.Tensor:
        """The rank holding each host page."""
        return self.layout.owner_for_logical_pages(host_pages + 1, validate=False)

    def physical_pages(self, host_pages: torch.Tensor) -> torch.Tensor:
        """Each host page's page in its lane rank's host buffer."""
        return self.layout.logical_pages_to_physical(host_pages + 1, validate=False) - 1

    def physical_rows(self, host_locs: torch.Tensor) -> torch.Tensor:
        """Each logical host token location's row in its lane rank's host buffer."""
        return self.physical_pages(host_locs // self.page_size) * self.page_size + host_locs % self.page_size

    def first_pages(self, locs: torch.Tensor) -> torch.Tensor:
        """The page of each whole page of ``locs`` (token locations, whole pages in order)."""
        return locs[:: self.page_size] // self.page_size


class HostPageLanes:
    """The free logical host pages of ``physical_pages`` pages per rank, one free list per lane.

    ``alloc(lanes)`` takes one page of each requested lane, in order, or nothing when a lane
    runs short (SGLang then evicts host pages and retries, as for its own pool running short).
    """

    def __init__(self, rule: HostPageRule, physical_pages: int):
        if physical_pages <= 0:
            raise ValueError(f"a host pool needs at least one page per rank, got {physical_pages}")
        self.rule = rule
        self.physical_pages = physical_pages
        self.logical_pages = physical_pages * rule.cp_size
        self._free: List[torch.Tensor] = []
        self.clear()

    def clear(self) -> None:
        n = self.rule.cp_size
        # lane r: host pages r, r + N, ... (physical pages 0, 1, ... of rank r), ascending
        self._free = [torch.arange(r, self.logical_pages, n, dtype=torch.int64) for r in range(n)]

    def free_pages_per_lane(self) -> List[int]:
        return [int(lane.numel()) for lane in self._free]

    def available_pages(self) -> int:
        return sum(self.free_pages_per_lane())

    def alloc(self, lanes: torch.Tensor) -> Optional[torch.Tensor]:
        """One free host page of lane ``lanes[i]`` for each i (int64, CPU), or None."""
        lanes = lanes.to(torch.int64).cpu()
        wanted = torch.bincount(lanes, minlength=self.rule.cp_size).tolist()
        if any(count > lane.numel() for count, lane in zip(wanted, self._free)):
            return None
        pages = torch.empty(lanes.numel(), dtype=torch.int64)
        for rank, count in enumerate(wanted):
            if count:
                pages[lanes == rank] = self._free[rank][:count]
                self._free[rank] = self._free[rank][count:]
        return pages

    def cyclic_lanes(self, page_count: int) -> torch.Tensor:
        """Lanes for pages with no device page behind them yet (SGLang's storage prefetch): the
        lanes with the most free pages first, ties to the lower rank; the same on every rank."""
        free = self.free_pages_per_lane()
        order = sorted(range(self.rule.cp_size), key=lambda r: (-free[r], r))
        return torch.tensor([order[i % len(order)] for i in range(page_count)], dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Give ``pages`` back to their lanes (each lane kept ascending)."""
        pages = pages.to(torch.int64).cpu()
        lanes = self.rule.lanes(pages)
        for rank in range(self.rule.cp_size):
            back = pages[lanes == rank]
            if back.numel():
                self._free[rank] = torch.sort(torch.cat([self._free[rank], back])).values

    def free_page_set(self) -> set:
        """Every free page (a debug check's view)."""
        return set(torch.cat(self._free).tolist()) if self._free else set()
