"""The per-rank physical DSA KV pool of SGLang 0.5.23 behind a logical, N-times-larger
address space (the 0.5.12.post1 twin is :mod:`.pool.kv_pool_v0512`).

``CpSharedDSATokenToKVPool`` is a ``DSATokenToKVPool`` of ``size // cp_size`` physical
tokens (MLA latent rows, and index-K pages behind 0.5.23's ``IndexKeyCache``) whose
``size`` is the logical capacity; what every release's pool does the same way is
:class:`~.pool_base.CpSharedPoolMixin`. What 0.5.23 changed, and how this class meets it:

* ``set_mla_kv_buffer(layer, loc_info, k_nope, k_rope, layer_id_override=None)``: the
  location may come wrapped (``KVWriteLoc``; SGLang's ``unwrap_write_loc``), and the store
  into an arbitrary buffer is SGLang's own ``_write_mla_kv_buffer(dst_buffer, loc, ...)``
  (:meth:`stock_store_mla_rows`), no buffer swap needed;
* the index K lives in ``IndexKeyCache`` (``index_k_with_scale_buffer`` is its buffer list);
  the indexer still reads and writes through the pool's three index methods, which the
  mixin serves from the dense view and the named write target;
* refused at construction: index-K pooling (``index_kpool > 1``, GLM-5's compressed
  index pages), shared top-k layers (no index K on some layers) and DCP-replicated pools
  -- layouts whose index pages are not one 64-token page per logical page.

Installed only by :func:`use_cp_shared_dsa_pool_classes` (``capacity_v0523``), which swaps the
classes ``KVCacheConfigurator`` looks up while it configures this rank's pools.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.pool.allocator import CpSharedInterleavedPagesAllocator
from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.pool.owned_rows import store_owned_mla_rows
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin
from sglang_cp_shared_kv.scoped import attributes_set


class CpSharedDSATokenToKVPool(CpSharedPoolMixin, sg.DSATokenToKVPool):
    """DSA pool of ``size // cp_size`` physical tokens exposing ``size`` logical tokens.

    Constructor arguments are ``DSATokenToKVPool``'s, with ``size`` the *logical* capacity
    (what ``KVCacheConfigurator._build_dsa_kv_pool`` passes once the capacity hook has
    run), plus the rank's context, given explicitly or bound by :meth:`bound_to`.
    """

    def __init__(self, size: int, page_size: int, *args, context: Optional[CpSharedKVContext] = None,
                 index_buf_size: Optional[int] = None, index_kpool: int = 1, index_kpool_compress: bool = False,
                 skip_topk_layers=None, dcp_replicated: bool = False, **kwargs):
        unsupported = [what for what, used in (
            (f"index_kpool={index_kpool} (pooled index-K pages)", index_kpool != 1 or index_kpool_compress),
            ("layers sharing the previous layer's top-k (no index K of their own)",
             skip_topk_layers is not None and any(skip_topk_layers)),
            ("a DCP-replicated pool (--dcp-size > 1)", dcp_replicated)) if used]
        if unsupported:
            raise ValueError(f"{FLAG}: the shared-KV pool keeps one 64-token index page per logical page; "
                             f"this model's pool asks for {', '.join(unsupported)}")
        physical_size = self._physical_size_for(size, page_size, context, index_buf_size)
        super().__init__(physical_size, page_size, *args, index_buf_size=physical_size,
                         skip_topk_layers=skip_topk_layers, **kwargs)
        self._expose_logical_size(size)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope, layer_id_override=None):
        """Write the rows this rank owns at their physical locations; drop the rest."""
        if layer_id_override is not None and layer_id_override != layer.layer_id:
            self._refuse(f"an MLA store into layer {layer_id_override} on behalf of layer {layer.layer_id}")
        loc, _, _ = sg.unwrap_write_loc(loc_info)
        store_owned_mla_rows(self, layer, loc, cache_k_nope, cache_k_rope)

    def stock_store_mla_rows(self, layer, buffer, locs, k_nope, k_rope) -> None:
        sg.MLATokenToKVPool._write_mla_kv_buffer(self, buffer, locs, k_nope, k_rope)

    @property
    def stores_packed_fp8(self) -> bool:
        return self.dsa_kv_cache_store_fp8


@contextmanager
def use_cp_shared_dsa_pool_classes(context: CpSharedKVContext):
    """Within the block, ``KVCacheConfigurator`` builds our pool (bound to ``context``) and
    allocator for a DSA model."""
    with attributes_set(sg.kv_cache_configurator,
                        DSATokenToKVPool=CpSharedDSATokenToKVPool.bound_to(context),
                        PagedTokenToKVPoolAllocator=CpSharedInterleavedPagesAllocator):
        yield
