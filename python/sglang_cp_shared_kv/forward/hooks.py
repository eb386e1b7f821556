"""The forward-path hooks ``plugin.HOOKS`` names: each translates SGLang's arguments and
calls the modules of this package. On a stock pool (the flag off) each is a pure
pass-through to SGLang.

Order within one forward: ``init_forward_metadata`` (batch state) -> per layer: the
indexer's key all-gather (re-range) and index store (index view: history gathered, chunk
stored, owned rows copied to the shard) -> the latent all-gather (re-range) and
``forward_extend`` (the layer's MLA history, prefetched or gathered now; the next layer's
history prefetch started; the chunk into the MLA view, owned rows copied to the shard;
stock kernels) -> the final hidden-state all-gather (re-range).
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.forward import batch_state as batch_state_module
from sglang_cp_shared_kv.forward import in_seq_rerange, materialize, prefetch, writes
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.nvtx import marked
from sglang_cp_shared_kv.pool import CpSharedNSATokenToKVPool


def batch_state_of(forward_batch) -> Optional[CpSharedBatchState]:
    """The shared-KV state of the forward in flight, None on a stock pool (flag off)."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    return pool.batch_state if isinstance(pool, CpSharedNSATokenToKVPool) else None


def attach_batch_state(result, backend, forward_batch, *args, **kwargs):
    """AFTER ``NativeSparseAttnBackend.init_forward_metadata``: build the batch state, point
    the backend's page tables at the dense scratch, hand the state to the pool."""
    pool = forward_batch.token_to_kv_pool
    if not isinstance(pool, CpSharedNSATokenToKVPool):
        return result
    pool.end_batch()
    metadata = backend.forward_metadata
    timer = pool.context.stage_timer
    if timer is not None:
        timer.begin_forward(forward_batch.out_cache_loc.device)
    with marked("batch_state", timer):
        state = batch_state_module.build_for_forward(pool, metadata, forward_batch)
    if state is None:  # idle batch
        return result
    dense = batch_state_module.dense_metadata(metadata, state)
    if state.debug:
        batch_state_module.check_batch_state(state, metadata, dense, pool)
    backend.forward_metadata = dense
    pool.begin_batch(state)
    return result


def store_index_k_owned_and_dense(original, indexer, forward_batch, layer_id, key, *args, **kwargs):
    """AROUND ``Indexer._store_index_k_cache``: the layer's dense index view (history
    gathered, the chunk stored by SGLang's store), and this rank's owned keys from it into
    its shard."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(indexer, forward_batch, layer_id, key, *args, **kwargs)

    def sglang_store(batch, layer, keys):
        original(indexer, batch, layer, keys, *args, **kwargs)

    materialize.materialize_index(
        state, forward_batch.token_to_kv_pool, layer_id,
        lambda dense: writes.store_index_rows_into(sglang_store, forward_batch, state, layer_id, key, dense))
    return None


def forward_extend_on_dense_view(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``NativeSparseAttnBackend.forward_extend``: the layer's dense MLA view (and
    from it the owned rows into the shard), then SGLang's ``forward_extend`` reading that
    view (and storing nothing)."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    pool = forward_batch.token_to_kv_pool
    k_rope = kwargs.get("k_rope")
    chunk = (k, k_rope) if save_kv_cache and k is not None and k_rope is not None else None
    # prefetched during the layer before, or gathered now
    history = prefetch.history_of(state, pool, layer.layer_id, full_view=chunk is None)
    prefetch.prefetch_next(state, pool, layer.layer_id)
    pool.set_mla_view(layer.layer_id, materialize.finish_mla_view(state, pool, layer, history, chunk))
    try:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs)
    finally:
        pool.clear_views()  # this layer's index reads are done too


def all_gather_in_seq_order(original, input_tensor, cp_size, forward_batch, stream):
    """AROUND ``cp_utils.cp_all_gather_rerange_output`` (the registry rebinds the name in
    the modules that imported it: ``nsa_indexer``, ``deepseek_v2``, ``deepseek_nextn``)."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    uses_shared_kv = isinstance(pool, CpSharedNSATokenToKVPool)
    if not in_seq_rerange.takes_plugin_path(input_tensor, forward_batch, uses_shared_kv):
        return original(input_tensor, cp_size, forward_batch, stream)
    return in_seq_rerange.gather_in_seq_order(pool.context.kernels, input_tensor, cp_size,
                                              forward_batch.attn_cp_metadata, stream)
