"""The per-rank physical NSA KV pool behind a logical, N-times-larger address space.

``CpSharedNSATokenToKVPool`` is an ``NSATokenToKVPool`` whose buffers (MLA latent rows
and indexer pages) hold only this rank's physical pages, while ``size`` reports the
logical capacity: SGLang asserts page-table bounds against ``token_to_kv_pool.size``
and every page table it builds carries logical locations.

It is installed only by :func:`use_cp_shared_pool_classes`, which swaps the pool and
allocator classes that ``ModelRunnerKVCacheMixin._init_pools`` looks up, for the
duration of that one call, when the flag is on. The stock classes stay what they
are everywhere else (HiSparse ``isinstance`` checks, a decode server in the same
environment).

Reads and writes of KV rows by logical location arrive with the owner-only write and
full-view read path; until then the location-addressed accessors refuse rather than
touch the wrong physical row.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import ClassVar, Optional

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

from sglang_cp_shared_kv.config import FLAG
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout

logger = logging.getLogger(__name__)


class CpSharedNSATokenToKVPool(NSATokenToKVPool):
    """NSA pool of ``size // cp_size`` physical tokens exposing ``size`` logical tokens.

    Constructor arguments are ``NSATokenToKVPool``'s, with ``size`` the *logical*
    capacity (what SGLang's ``_init_pools`` passes once the capacity hook has run),
    plus the layout, given explicitly or bound to the class by :meth:`bound_to`.
    """

    bound_layout: ClassVar[Optional[CpSharedKVLayout]] = None

    @classmethod
    def bound_to(cls, layout: CpSharedKVLayout) -> type:
        """A subclass whose instances use ``layout`` (SGLang constructs the pool itself)."""
        return type(cls.__name__, (cls,), {"bound_layout": layout, "__module__": cls.__module__})

    def __init__(self, size: int, page_size: int, *args, layout: Optional[CpSharedKVLayout] = None,
                 index_buf_size: Optional[int] = None, **kwargs):
        layout = layout or self.bound_layout
        if layout is None:
            raise TypeError(f"{type(self).__name__} needs a CpSharedKVLayout (layout= or bound_to())")
        if layout.page_size != page_size:
            raise ValueError(f"layout page size {layout.page_size} != pool page size {page_size}")
        physical_size = layout.physical_tokens(size)
        if index_buf_size is not None and index_buf_size != size:
            raise ValueError(
                f"index_buf_size={index_buf_size} differs from the pool size {size}; "
                "only HiSparse sets it, and HiSparse is not supported with shared KV"
            )
        self.cp_layout = layout
        self.physical_size = physical_size
        super().__init__(physical_size, page_size, *args, index_buf_size=physical_size, **kwargs)
        # SGLang bounds-checks logical page tables against `size`; buffers stay physical.
        self.size = size
        self.logical_size = size

    # Location-addressed paths that would treat logical locations as physical rows.
    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError(
            f"{FLAG}: offloading KV to host by location (retract/offload) is not supported "
            "with shared KV; its locations are logical and the rows are spread over the CP group"
        )

    def load_cpu_copy(self, *args, **kwargs):
        self.get_cpu_copy()

    def _refuse_unmapped_access(self, *args, **kwargs):
        raise NotImplementedError(
            f"{FLAG}: this build has the shared-KV capacity split but not yet the owner-only "
            "write / full-view read path; KV rows cannot be addressed by logical location"
        )

    set_mla_kv_buffer = _refuse_unmapped_access
    get_mla_kv_buffer = _refuse_unmapped_access
    set_kv_buffer = _refuse_unmapped_access
    set_index_k_scale_buffer = _refuse_unmapped_access
    get_index_k_with_scale_buffer = _refuse_unmapped_access
    get_index_k_continuous = _refuse_unmapped_access
    get_index_k_scale_continuous = _refuse_unmapped_access
    get_index_k_scale_buffer = _refuse_unmapped_access


@contextmanager
def use_cp_shared_pool_classes(layout: CpSharedKVLayout):
    """Within the block, ``_init_pools`` builds our pool and allocator classes."""
    from sglang.srt.model_executor import model_runner_kv_cache_mixin as mixin

    from sglang_cp_shared_kv.allocator import CpSharedPagedTokenToKVPoolAllocator

    replacements = {
        "NSATokenToKVPool": CpSharedNSATokenToKVPool.bound_to(layout),
        "PagedTokenToKVPoolAllocator": CpSharedPagedTokenToKVPoolAllocator,
    }
    saved = {name: getattr(mixin, name) for name in replacements}
    for name, cls in replacements.items():
        setattr(mixin, name, cls)
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(mixin, name, cls)
