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
(:data:`COPY_DIRECTIONS`); the host pool's tokens in
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
from sglang_cp_shared_kv.hicache.storage_v0512 import PrefetchHostPages
from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import FLAG, debug_enabled

logger = logging.getLogger(__name__)

#: the directions of ``sglang:cp_shared_kv_hicache_pages_total``: device -> host, host -> device,
#: host -> storage (L3), storage -> host
COPY_DIRECTIONS = ("backed_up", "loaded_back", "stored", "fetched")


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
        #: pages this rank copied: backed up from its device pool, loaded back into it, stored
        #: to the storage tier (L3), fetched from it
        self.pages_copied = dict.fromkeys(COPY_DIRECTIONS, 0)
        self._metrics_enabled = bool(getattr(device_pool.context, "metrics_enabled", False))

    def count_copied_pages(self, direction: str, pages: int) -> None:
        """``pages`` of this rank's pages more ``direction`` (one of :data:`COPY_DIRECTIONS`)."""
        if direction not in self.pages_copied:
            raise ValueError(f"count_copied_pages: direction must be one of {COPY_DIRECTIONS}, got {direction!r}")
        self.pages_copied[direction] += pages
        if self._metrics_enabled:
            hicache_pages_counter().labels(cp_rank=str(self.rule.layout.cp_rank), direction=direction).inc(pages)

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
        if self._metrics_enabled:
            gauge = hicache_host_tokens_gauge()
            gauge.labels(cp_rank=str(self.rule.layout.cp_rank), kind="physical").set(self.physical_size)
            gauge.labels(cp_rank=str(self.rule.layout.cp_rank), kind="logical").set(self.size)

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
        if self.lanes is None:
            return super().available_size()
        return self.lanes.available_pages() * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if self.lanes is None:
            return super().alloc(need_size)
        if need_size % self.page_size:
            raise ValueError(f"{FLAG}: host allocation of {need_size} tokens is not whole pages of {self.page_size}")
        with self.lock:
            pages = need_size // self.page_size
            lanes = self._pending_lanes if self._pending_lanes is not None else self.lanes.cyclic_lanes(pages)
            if lanes.numel() != pages:
                raise ValueError(f"{FLAG}: {lanes.numel()} host lanes given for a {pages}-page allocation")
            got = self.lanes.alloc(lanes)
        if got is None:
            return None
        return (got[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, indices: torch.Tensor) -> int:
        if self.lanes is None:
            return super().free(indices)
        pages = torch.unique(indices.cpu() // self.page_size)
        with self.lock:
            if self._check:
                twice = self.lanes.free_page_set() & set(pages.tolist())
                if twice:
                    raise AssertionError(f"{FLAG}: host pages {sorted(twice)[:8]} freed while free")
            self.lanes.free(pages)
        return len(indices)

    # ------------------------------------------------------------ this rank's rows
    def own_rows(self, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """Of one copy's (logical host, logical device) token locations, the rows this rank
        holds, as (physical host rows, physical device rows). Decided from the host
        locations (CPU): a host page's lane is its device page's owner (allocation keeps
        them equal), so no device read."""
        host_indices = host_indices.cpu()
        layout = self.rule.layout
        lanes = self.rule.lanes(host_indices // self.page_size)
        if self._check:
            # NOTE: every page of the copy, not only this rank's: the same on every rank, so a
            # broken pairing fails every rank here together, none waiting in a collective
            owners = layout.owner_for_logical_pages(device_indices // self.page_size).cpu()
            if not torch.equal(owners, lanes):
                raise AssertionError(f"{FLAG}: host pages of lanes {lanes[::self.page_size].tolist()} are paired with "
                                     f"device pages of ranks {owners[::self.page_size].tolist()}")
        positions = (lanes == layout.cp_rank).nonzero().squeeze(1)
        host_rows = self.rule.physical_rows(host_indices.index_select(0, positions))
        if device_indices.is_cuda:  # NOTE: a pageable host-to-device copy would wait for the stream
            positions = positions.pin_memory().to(device_indices.device, non_blocking=True)
        picked = device_indices.index_select(0, positions)
        return host_rows, layout.logical_locs_to_physical(picked, validate=False)


def hicache_pages_counter():
    return prometheus_metric(
        "counter", "sglang:cp_shared_kv_hicache_pages_total",
        "Pages a CP rank copied under shared KV (each rank only its own pages): backed_up from its "
        "device pool to host memory, loaded_back from host memory, stored to the HiCache storage "
        "tier (L3), fetched from it.",
        ("cp_rank", "direction"))


def hicache_host_tokens_gauge():
    # NOTE: "mostrecent": SGLang runs Prometheus in multiprocess mode; one value per (rank, kind)
    return prometheus_metric(
        "gauge", "sglang:cp_shared_kv_hicache_host_tokens",
        "HiCache host pool tokens under shared KV: physical (this CP rank's host memory) and logical "
        "(the CP group's host tier, N times a rank's).",
        ("cp_rank", "kind"), multiprocess_mode="mostrecent")
