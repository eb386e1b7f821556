"""The logical page allocator of a CP shared-KV group.

Every CP rank runs the same scheduler decisions on the same requests, so a stock
``PagedTokenToKVPoolAllocator`` over the *logical* capacity already hands out
identical logical pages on every rank. This subclass pins down what the rest of the
plugin relies on:

* invariant: ``size == pool.physical_size * cp_size`` (stated once, checked at
  construction);
* the layout (``cp_layout``) and the physical figures are reachable from the allocator;
* with ``SGLANG_DEBUG_CP_SHARED_KV=1``, every allocation is checked to stay inside the
  logical range and off the dummy page 0 (this syncs the device).

Phase 5 (compute-owner allocation) will reorder ``free_pages`` by owner lane inside
``alloc_extend`` here; the constructor signature stays SGLang's because ``_init_pools``
calls it.
"""

from __future__ import annotations

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.config import debug_enabled


class CpSharedPagedTokenToKVPoolAllocator(sg.PagedTokenToKVPoolAllocator):
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
        self._check_allocations = debug_enabled()
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

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
        return self._checked(super().alloc(need_size))

    def alloc_extend(self, *args, **kwargs):
        return self._checked(super().alloc_extend(*args, **kwargs))

    def alloc_decode(self, *args, **kwargs):
        return self._checked(super().alloc_decode(*args, **kwargs))
