"""Owner-only KV and index writes: a rank stores only the rows of the pages it owns.

* MLA latent rows: ``CpSharedNSATokenToKVPool.set_mla_kv_buffer`` (every CUDA writer
  goes through it) keeps the owned rows via :func:`owned_rows_of` and stores them at
  physical locations with the fused owner-store kernel, or SGLang's own store.
* NSA index K/scale: ``Indexer._store_index_k_cache`` AROUND
  (:func:`store_index_k_owned_and_dense`) stores the owned rows at physical locations,
  then builds the layer's dense index view for the reads that follow
  (:func:`materialize.materialize_index`). Both stores use the fused kernel where SGLang
  itself would take its fused CUDA path (the kernel reproduces that path's bytes), and
  SGLang's store (fused JIT, aiter or fallback; whichever it picks) otherwise.

Rows on the dummy page 0 (SGLang's padding) have no owner and are never written.
"""

from __future__ import annotations

from typing import Tuple

import torch

from sglang_cp_shared_kv.batch_state import batch_state_of
from sglang_cp_shared_kv.scoped import attributes_set


def owned_rows_of(pool, loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows of ``loc`` this rank owns, their physical locations).

    The batch's own ``out_cache_loc`` reuses the rows computed once per forward; any
    other location tensor is filtered here (one host synchronisation).
    """
    state = pool.batch_state
    if state is not None and loc is state.out_cache_loc:
        return state.owned_rows, state.owned_physical_locs
    layout = pool.cp_layout
    rows = layout.owned_by_this_rank(loc, validate=False).nonzero().squeeze(1)
    return rows, layout.logical_locs_to_physical(loc.index_select(0, rows), validate=False)


def out_cache_loc_as(forward_batch, locs: torch.Tensor):
    """SGLang's index stores write at ``forward_batch.out_cache_loc``; point it elsewhere."""
    return attributes_set(forward_batch, out_cache_loc=locs)


_FUSED_INDEX_STORE: dict = {}  # (key dtype, location dtype, page size) -> SGLang takes its fused path


def _sglang_uses_fused_index_store(key: torch.Tensor, locs: torch.Tensor, page_size: int) -> bool:
    """Whether SGLang's index store takes its fused CUDA path for these dtypes (our kernel
    reproduces that path's bytes, not the act_quant fallback's)."""
    if not key.is_cuda:
        return False
    flags = (key.dtype, locs.dtype, page_size)
    if flags not in _FUSED_INDEX_STORE:
        from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store
        from sglang.srt.layers.quantization.fp8_kernel import is_fp8_fnuz

        _FUSED_INDEX_STORE[flags] = not is_fp8_fnuz() and can_use_nsa_fused_store(*flags)
    return _FUSED_INDEX_STORE[flags]


def store_index_k_owned_and_dense(original, indexer, forward_batch, layer_id, key, *args, **kwargs):
    """AROUND ``Indexer._store_index_k_cache``."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(indexer, forward_batch, layer_id, key, *args, **kwargs)
    from sglang_cp_shared_kv import kernels
    from sglang_cp_shared_kv.materialize import materialize_index

    pool = forward_batch.token_to_kv_pool

    def sglang_store(rows, locs, buffer):
        def stock():
            with out_cache_loc_as(forward_batch, locs), pool.index_writes_into(layer_id, buffer):
                original(indexer, forward_batch, layer_id, key if rows is None else key.index_select(0, rows),
                         *args, **kwargs)

        if _sglang_uses_fused_index_store(key, locs, pool.page_size):
            kernels.store_index_rows(buffer, rows, locs, key, stock=stock, page_size=pool.page_size)
        else:
            stock()

    if state.num_owned_rows:
        sglang_store(state.owned_rows, state.owned_physical_locs, pool.physical_index_buffer(layer_id))
    materialize_index(state, pool, layer_id, lambda dense: sglang_store(None, state.dense_out_locs, dense))
