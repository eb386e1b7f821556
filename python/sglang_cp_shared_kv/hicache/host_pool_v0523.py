"""SGLang 0.5.23's KV host pool under the flag: one rank's pages, the group's capacity.

0.5.23 builds HiCache's host tier for a DSA pool from the pool's declarations
(``hybrid_pool_assembler._DsaStrategy``): the KV host pool (``MLATokenToKVPoolHost``, the
anchor) by ``build_kv_host_pool``, then the index-K sidecar (``DSAIndexerPoolHost``), which
copies the anchor's ``size`` and ``page_num`` and rides on its indices. Stock sizes the anchor
from ``kv_pool.host_capacity_tokens`` when set (else ``kv_pool.size``, which is logical under
the flag); the hook sets it to the rank's physical size first, so each rank's host buffers hold
what stock gives a rank with that device pool.

:class:`CpSharedKVHostPool` is put around the built anchor, as upstream puts its own
``PageInterleaveHostPool`` around it for ``--enable-kv-cache-sharding`` (the same slots, the
same facade shape: ``size`` stays this rank's rows, ``logical_size`` is N times that; buffers
and copies stay the wrapped pool's), with this plugin's rule instead of upstream's placement:

* host page ``h`` is in lane ``h mod N`` at physical host page ``h div N``
  (:class:`~.host_lanes.HostPageRule`, no reserved page), allocated lane by lane
  (:class:`~.host_lanes.HostPageLanes`, identical on every rank): a backup's host pages in
  its device pages' owner lanes (:meth:`pages_in_lanes`, set by the controller hook);
* ``owned_rows`` narrows a (logical host, logical device) pairing to this rank's pages as
  (physical host rows, physical device rows): the host rule for the host side, the device
  layout (``cp_shared_kv_layout``) for the device side. The controller, once marked
  sharded (``is_kv_sharded``), narrows the KV copy and every sidecar (index K) through it;
* ``available_size`` is the lane floor (N times the emptiest lane's free pages), so the
  radix cache's host eviction runs when a lane runs short rather than a backup failing
  while the pool as a whole has room (a backup whose lanes still do not fit is dropped on
  every rank alike: the decision reads only the rank-identical free lists);
* ``placement.local_mask`` answers which rows are this rank's for stock's transfer-byte count.

The KV pages this rank copies are counted on the facade (``pages_copied``: the copies SGLang's
transfer engine hands the anchor, already narrowed to this rank's rows) and, with
``--enable-metrics``, in ``sglang:cp_shared_kv_hicache_pages_total{cp_rank,direction}``; the host
tokens in ``sglang:cp_shared_kv_hicache_host_tokens{cp_rank,kind}`` (the 0.5.12.post1 pool's
metrics, same names and labels).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import List, Optional, Tuple

import torch

from sglang_cp_shared_kv.hicache.host_lanes import HostPageLanes, HostPageRule
from sglang_cp_shared_kv.hicache.metrics import COPY_DIRECTIONS, HostTierCounts
from sglang_cp_shared_kv.scoped import attributes_set
from sglang_cp_shared_kv.settings.config import FLAG, debug_enabled

logger = logging.getLogger(__name__)


class HostLanePlacement:
    """The one question stock's sharded controller asks a placement (``local_mask``), answered
    by the host rule: which logical host slots are rank ``rank``'s."""

    def __init__(self, rule: HostPageRule):
        self.rule = rule

    def local_mask(self, loc: torch.Tensor, rank: int) -> torch.Tensor:
        return self.rule.lanes(loc.cpu() // self.rule.page_size) == rank


class CpSharedKVHostPool:
    """Lane-by-lane logical slots over a built KV host pool of this rank's rows (module docstring)."""

    def __init__(self, host_pool, device_pool):
        layout = device_pool.cp_layout
        if host_pool.page_size != layout.page_size:
            raise ValueError(f"{FLAG}: host pages of {host_pool.page_size} tokens, device pages of {layout.page_size}")
        self.host_pool = host_pool
        self.device_pool = device_pool
        self.rule = HostPageRule(layout)
        self.placement = HostLanePlacement(self.rule)
        self.shard_rank = layout.cp_rank
        self.shard_size = layout.cp_size
        self.physical_page_num = host_pool.size // host_pool.page_size
        self.lanes = HostPageLanes(self.rule, self.physical_page_num)
        self._lanes_lock = threading.RLock()
        self._pending_lanes: Optional[torch.Tensor] = None
        self._check = debug_enabled()
        self.counts = HostTierCounts(self.shard_rank,
                                     bool(getattr(getattr(device_pool, "context", None), "metrics_enabled", False)))
        self.counts.publish_host_tokens(self.physical_size, self.logical_size)
        logger.info("CP shared KV HiCache: host pool of %d tokens on this rank (%d pages, %.2f GB), %d logical tokens "
                    "over the CP group of %d (each rank backs up and loads back its own pages)",
                    host_pool.size, self.physical_page_num, host_pool.size * host_pool.size_per_token / 1e9,
                    self.logical_size, self.shard_size)

    def __getattr__(self, name: str):
        # buffers, layout, copies and their lifecycle stay the wrapped pool's
        return getattr(object.__getattribute__(self, "host_pool"), name)

    @property
    def cp_layout(self):
        return self.rule.layout

    @property
    def physical_size(self) -> int:
        return self.host_pool.size

    @property
    def logical_size(self) -> int:
        return self.lanes.logical_pages * self.host_pool.page_size

    # ------------------------------------------------------------ allocation
    @contextlib.contextmanager
    def pages_in_lanes(self, lanes: torch.Tensor):
        """Within the block, the next allocation takes one host page of ``lanes[i]`` per page i."""
        with attributes_set(self, _pending_lanes=lanes):
            yield

    def clear(self):
        self.host_pool.clear()
        with self._lanes_lock:
            self.lanes.clear()

    def available_size(self) -> int:
        """The lane floor: N times the free pages of the emptiest lane (module docstring)."""
        with self._lanes_lock:
            return self.lanes.floor_pages() * self.host_pool.page_size

    def free_size(self) -> int:
        """Every free host token of the group's tier (all lanes)."""
        with self._lanes_lock:
            return self.lanes.available_pages() * self.host_pool.page_size

    def alloc(self, need_size: int, start_owner: Optional[int] = None) -> Optional[torch.Tensor]:
        if start_owner is not None:
            raise ValueError(f"{FLAG}: a host allocation by upstream's rotation (start_owner={start_owner}); "
                             "the shared-KV tier allocates by its device pages' lanes")
        with self._lanes_lock:
            return self.lanes.alloc_locs(need_size, self._pending_lanes)

    def free(self, indices: torch.Tensor) -> int:
        with self._lanes_lock:
            return self.lanes.free_locs(indices, check=self._check)

    def free_pages_per_lane(self) -> List[int]:
        with self._lanes_lock:
            return self.lanes.free_pages_per_lane()

    # ------------------------------------------------------------ copies (SGLang's transfer engine)
    @property
    def pages_copied(self):
        """KV pages this rank copied: backed up from its device pool, loaded back into it, stored to
        the storage tier (L3), fetched from it."""
        return self.counts.pages

    def count_copied_pages(self, direction: str, pages: int) -> None:
        self.counts.count(direction, pages)

    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend):
        self.count_copied_pages("backed_up", host_indices.numel() // self.host_pool.page_size)
        return self.host_pool.backup_from_device_all_layer_physical(device_pool, host_indices, device_indices,
                                                                    io_backend)

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                          *, is_draft: bool = False):
        if layer_id == 0 and not is_draft:
            self.count_copied_pages("loaded_back", host_indices.numel() // self.host_pool.page_size)
        return self.host_pool.load_to_device_per_layer_physical(device_pool, host_indices, device_indices, layer_id,
                                                                io_backend, is_draft=is_draft)

    # ------------------------------------------------------------ this rank's rows
    def owned_rows(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of one copy (:meth:`.host_lanes.HostPageRule.owned_rows`)."""
        return self.rule.owned_rows(host_indices, device_indices, check=self._check)


__all__ = ["COPY_DIRECTIONS", "CpSharedKVHostPool", "HostLanePlacement"]
