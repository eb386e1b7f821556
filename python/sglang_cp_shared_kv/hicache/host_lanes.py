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

from typing import List, Optional, Tuple

import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings.config import FLAG


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

    def owned_rows(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
                   check: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Of one copy's (logical host, logical device) token locations, the rows this rank
        holds, as (physical host rows, physical device rows). Decided from the host locations
        (CPU): a host page's lane is its device page's owner (allocation keeps them equal), so
        no device read; ``check`` reads the device pages' owners and compares."""
        host_indices = host_indices.cpu()
        layout = self.layout
        lanes = self.lanes(host_indices // self.page_size)
        if check:
            # NOTE: every page of the copy, not only this rank's: the same on every rank, so a
            # broken pairing fails every rank here together, none waiting in a collective
            owners = layout.owner_for_logical_pages(device_indices // self.page_size).cpu()
            if not torch.equal(owners, lanes):
                raise AssertionError(f"{FLAG}: host pages of lanes {lanes[::self.page_size].tolist()} are paired with "
                                     f"device pages of ranks {owners[::self.page_size].tolist()}")
        positions = (lanes == layout.cp_rank).nonzero().squeeze(1)
        host_rows = self.physical_rows(host_indices.index_select(0, positions))
        if device_indices.is_cuda:  # NOTE: a pageable host-to-device copy would wait for the stream
            positions = positions.pin_memory().to(device_indices.device, non_blocking=True)
        picked = device_indices.index_select(0, positions)
        return host_rows, layout.logical_locs_to_physical(picked, validate=False)


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

    def floor_pages(self) -> int:
        """The lane floor: N times the emptiest lane's free pages, the most pages an allocation
        by :meth:`cyclic_lanes` always fits (it takes at most ceil(k/N) of any lane)."""
        return min(self.free_pages_per_lane()) * self.rule.cp_size

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

    def alloc_locs(self, need_size: int, lanes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The logical host token locations of ``need_size`` tokens (whole pages): page i in lane
        ``lanes[i]`` (None: :meth:`cyclic_lanes`), or None when a lane runs short."""
        page = self.rule.page_size
        if need_size % page:
            raise ValueError(f"{FLAG}: host allocation of {need_size} tokens is not whole pages of {page}")
        pages = need_size // page
        lanes = self.cyclic_lanes(pages) if lanes is None else lanes
        if lanes.numel() != pages:
            raise ValueError(f"{FLAG}: {lanes.numel()} host lanes given for a {pages}-page allocation")
        got = self.alloc(lanes)
        if got is None:
            return None
        return (got[:, None] * page + torch.arange(page)).reshape(-1)

    def free_locs(self, indices: torch.Tensor, check: bool = False) -> int:
        """Give back the pages of logical host token locations ``indices``; ``check``: refuse a
        page that is already free (a double free). Returns the number of locations."""
        pages = torch.unique(indices.cpu() // self.rule.page_size)
        if check:
            twice = self.free_page_set() & set(pages.tolist())
            if twice:
                raise AssertionError(f"{FLAG}: host pages {sorted(twice)[:8]} freed while free")
        self.free(pages)
        return len(indices)

    def free_page_set(self) -> set:
        """Every free page (a debug check's view)."""
        return set(torch.cat(self._free).tolist()) if self._free else set()
