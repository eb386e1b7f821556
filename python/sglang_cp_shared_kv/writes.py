"""Owner-only KV and index writes: a rank stores only the rows of the pages it owns.

* MLA latent rows: ``CpSharedNSATokenToKVPool.set_mla_kv_buffer`` (every CUDA writer
  goes through it) keeps the owned rows via :func:`owned_rows_of` and hands them to
  SGLang's own store at physical locations.
* NSA index K/scale: ``Indexer._store_index_k_cache`` AROUND
  (:func:`store_index_k_owned_and_dense`) runs SGLang's store (fused JIT, aiter or
  fallback; whichever it picks) once on the owned rows at physical locations, then
  builds the layer's dense index view for the reads that follow
  (:func:`materialize.materialize_index`).

Rows on the dummy page 0 (SGLang's padding) have no owner and are never written.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Tuple

import torch

from sglang_cp_shared_kv.batch_state import batch_state_of


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


@contextmanager
def out_cache_loc_as(forward_batch, locs: torch.Tensor):
    """SGLang's index stores write at ``forward_batch.out_cache_loc``; point it elsewhere."""
    logical = forward_batch.out_cache_loc
    forward_batch.out_cache_loc = locs
    try:
        yield
    finally:
        forward_batch.out_cache_loc = logical


def store_index_k_owned_and_dense(original, indexer, forward_batch, layer_id, key, *args, **kwargs):
    """AROUND ``Indexer._store_index_k_cache``."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(indexer, forward_batch, layer_id, key, *args, **kwargs)
    from sglang_cp_shared_kv.materialize import materialize_index

    pool = forward_batch.token_to_kv_pool
    if state.num_owned_rows:
        with out_cache_loc_as(forward_batch, state.owned_physical_locs), \
                pool.index_writes_into(layer_id, pool.physical_index_buffer(layer_id)):
            original(indexer, forward_batch, layer_id, key.index_select(0, state.owned_rows),
                     *args, **kwargs)

    def store_chunk_into(dense: torch.Tensor) -> None:
        with out_cache_loc_as(forward_batch, state.dense_out_locs), pool.index_writes_into(layer_id, dense):
            original(indexer, forward_batch, layer_id, key, *args, **kwargs)

    materialize_index(state, pool, layer_id, store_chunk_into)
