"""The per-rank physical NSA KV pool of SGLang 0.5.12.post1 behind a logical, N-times-larger
address space.

``CpSharedNSATokenToKVPool`` is an ``NSATokenToKVPool`` whose buffers (MLA latent rows
and indexer pages) hold only this rank's physical pages, while ``size`` reports the
logical capacity; what it does the same way on every release (dense-view reads, index
write targets, the per-batch state, refusals) is :class:`~.pool_base.CpSharedPoolMixin`.
It holds the rank's :class:`~sglang_cp_shared_kv.context.CpSharedKVContext` (``context``).

It is installed only by :func:`use_cp_shared_pool_classes`, which swaps the pool and
allocator classes that ``ModelRunnerKVCacheMixin._init_pools`` looks up, for the
duration of that one call, when the flag is on. The stock classes stay what they
are everywhere else (HiSparse ``isinstance`` checks, a decode server in the same
environment).

``set_mla_kv_buffer`` writes only the rows this rank owns, at physical locations (every
CUDA MLA writer goes through it; :func:`pool.owned_rows.store_owned_mla_rows`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.pool.owned_rows import store_owned_mla_rows
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin
from sglang_cp_shared_kv.scoped import attributes_set


class CpSharedNSATokenToKVPool(CpSharedPoolMixin, sg.NSATokenToKVPool):
    """NSA pool of ``size // cp_size`` physical tokens exposing ``size`` logical tokens.

    Constructor arguments are ``NSATokenToKVPool``'s, with ``size`` the *logical*
    capacity (what SGLang's ``_init_pools`` passes once the capacity hook has run),
    plus the rank's context, given explicitly or bound to the class by :meth:`bound_to`.
    """

    def __init__(self, size: int, page_size: int, *args, context: Optional[CpSharedKVContext] = None,
                 index_buf_size: Optional[int] = None, **kwargs):
        physical_size = self._physical_size_for(size, page_size, context, index_buf_size)
        super().__init__(physical_size, page_size, *args, index_buf_size=physical_size, **kwargs)
        self._expose_logical_size(size)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        """Write the rows this rank owns at their physical locations; drop the rest."""
        store_owned_mla_rows(self, layer, loc, cache_k_nope, cache_k_rope)

    def stock_store_mla_rows(self, layer, buffer, locs, k_nope, k_rope) -> None:
        index = layer.layer_id - self.start_layer
        own = self.kv_buffer[index]
        self.kv_buffer[index] = buffer  # NOTE: 0.5.12's store writes self.kv_buffer[layer], nothing else
        try:
            sg.NSATokenToKVPool.set_mla_kv_buffer(self, layer, locs, k_nope, k_rope)
        finally:
            self.kv_buffer[index] = own

    @property
    def stores_packed_fp8(self) -> bool:
        return self.nsa_kv_cache_store_fp8

    def get_index_k_continuous(self, layer_id, seq_len, page_indices):
        buf = self.index_view(layer_id, "the index K")
        return sg.index_k_ops.GetK.execute(self, buf, seq_len=seq_len, page_indices=page_indices)

    def get_index_k_scale_continuous(self, layer_id, seq_len, page_indices):
        buf = self.index_view(layer_id, "the index K scale")
        return sg.index_k_ops.GetS.execute(self, buf, seq_len=seq_len, page_indices=page_indices)


@contextmanager
def use_cp_shared_pool_classes(context: CpSharedKVContext):
    """Within the block, ``_init_pools`` builds our pool (bound to ``context``) and allocator."""
    with attributes_set(sg.model_runner_kv_cache_mixin,
                        NSATokenToKVPool=CpSharedNSATokenToKVPool.bound_to(context),
                        PagedTokenToKVPoolAllocator=CpSharedPagedTokenToKVPoolAllocator):
        yield
