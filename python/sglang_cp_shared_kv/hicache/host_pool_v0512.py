"""SGLang 0.5.12.post1's MLA host pool under the flag: one rank's pages, the group's capacity.

SGLang sizes a host pool from its device pool (``--hicache-ratio`` times the device pool's
``size``, or ``--hicache-size`` GB) and asserts the host holds more than the device. The
shared-KV device pool's ``size`` is logical (N times its buffers), so the pool is built while
the device pool shows its physical size: the host buffer holds ratio x one rank's tokens,
the bytes stock gives each rank. Once SGLang has built the index-K sidecar (which copies
the KV host pool's size and page count at construction), :meth:`expose_logical_capacity`
turns ``size`` and allocation logical: N times the buffer, allocated through
:class:`~.host_lanes.HostPageLanes`. With a storage tier, the host pages of prefetches in
flight are kept in :class:`~.storage_v0512.PrefetchHostPages` (``prefetch_pages``).

Pages this rank copies are counted on the pool (``pages_copied``) and, with
``--enable-metrics``, in ``sglang:cp_shared_kv_hicache_pages_total{cp_rank,direction}``
(:data:`.metrics.COPY_DIRECTIONS`); the host pool's tokens in
``sglang:cp_shared_kv_hicache_host_tokens{cp_rank,kind}`` (``physical``: this rank's,
``logical``: the group's).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.hicache.host_lanes import HostPageLanes, HostPageRule
from sglang_cp_shared_kv.hicache.metrics import HostTierCounts
from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchHostPages
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import debug_enabled

logger = logging.getLogger(__name__)


class CpSharedMLATokenToKVPoolHost(sg.MLATokenToKVPoolHost):
    """SGLang's MLA host pool over one rank's host buffer, allocating logical host pages by lane."""

    def __init__(self, device_pool, *args, **kwargs):
        layout = device_pool.cp_layout
        self.rule = HostPageRule(layout)
        self.lanes: Optional[HostPageLanes] = None  # physical until expose_logical_capacity
        self._pending_lanes: Optional[torch.Tensor] = None
        self._check = debug_enabled()
        #: the host pages of storage prefetches in flight (freed in prefetch order)
        self.prefetch_pages = PrefetchHostPages()
        with attributes_set(device_pool, size=device_pool.physical_size):
            super().__init__(device_pool, *args, **kwargs)
        self.physical_size = self.size
        self.physical_page_num = self.page_num
        self.counts = HostTierCounts(layout.cp_rank, bool(getattr(device_pool.context, "metrics_enabled", False)))

    @property
    def pages_copied(self):
        """Pages this rank copied: backed up from its device pool, loaded back into it, stored to
        the storage tier (L3), fetched from it."""
        return self.counts.pages

    def count_copied_pages(self, direction: str, pages: int) -> None:
        """``pages`` of this rank's pages more ``direction`` (one of :data:`COPY_DIRECTIONS`)."""
        self.counts.count(direction, pages)

    @property
    def pages_backed_up(self) -> int:
        return self.pages_copied["backed_up"]

    @property
    def pages_loaded_back(self) -> int:
        return self.pages_copied["loaded_back"]

    @property
    def cp_layout(self):
        return self.rule.layout

    def expose_logical_capacity(self) -> None:
        """From now on ``size`` and allocation are logical (module docstring)."""
        self.lanes = HostPageLanes(self.rule, self.physical_page_num)
        self.size = self.lanes.logical_pages * self.page_size
        logger.info("CP shared KV HiCache: host pool of %d tokens on this rank (%d pages, %.2f GB), %d logical "
                    "tokens over the CP group of %d (each rank backs up and loads back its own pages)",
                    self.physical_size, self.physical_page_num, self.physical_size * self.size_per_token / 1e9,
                    self.size, self.rule.cp_size)
        self.counts.publish_host_tokens(self.physical_size, self.size)

    # ------------------------------------------------------------ allocation
    @contextlib.contextmanager
    def pages_in_lanes(self, lanes: torch.Tensor):
        """Within the block, the next allocation takes one host page of ``lanes[i]`` per page i."""
        with attributes_set(self, _pending_lanes=lanes):
            yield

    def clear(self):
        super().clear()
        self.prefetch_pages.clear()
        if self.lanes is not None:
            self.lanes.clear()

    def available_size(self):
        """The lane floor: N times the free pages of the emptiest lane (as on 0.5.23)."""
        # NOTE: not every free page: an allocation with no device pages behind it (a storage
        # prefetch) spreads its pages over the lanes in turn, so it fits only up to the floor;
        # stock's prefetch_from_storage sizes its last try from available_size() and starts the
        # prefetch without checking it got pages (a None there would end every rank's prefetch
        # thread). The floor reads the rank-identical free lists, so every rank sizes alike
        if self.lanes is None:
            return super().available_size()
        return self.lanes.floor_pages() * self.page_size

    def free_size(self) -> int:
        """Every free host token of the group's tier (all lanes)."""
        if self.lanes is None:
            return super().available_size()
        return self.lanes.available_pages() * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if self.lanes is None:
            return super().alloc(need_size)
        with self.lock:
            return self.lanes.alloc_locs(need_size, self._pending_lanes)

    def free(self, indices: torch.Tensor) -> int:
        if self.lanes is None:
            return super().free(indices)
        with self.lock:
            return self.lanes.free_locs(indices, check=self._check)

    # ------------------------------------------------------------ this rank's rows
    def own_rows(self, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """This rank's rows of one copy (:meth:`.host_lanes.HostPageRule.owned_rows`)."""
        return self.rule.owned_rows(host_indices, device_indices, check=self._check)
