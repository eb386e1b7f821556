"""The forward-path hooks of SGLang 0.5.23 (``plugin._hooks_v0523``, block "forward path"):
DSA prefill CP with ``--cp-strategy interleave``.

Interleave deals a batch's tokens out round-robin, all-gathers each layer's index key
(``InterleaveCPStrategy.materialize_full_indexer_k_cache``, inside the indexer) and latent
(``materialize_full_mla_kv``, or the indexer-overlapped gather of ``indexer_with_cp_kv``),
and every rank then stores the whole chunk at the batch's ``out_cache_loc``: the shape of
0.5.12.post1's phase 3, so the steps are :mod:`.steps`' on both releases. There is nothing
to keep local (every rank computes rows of every page) and nothing to re-range
(interleave's gather restores token order itself), so 0.5.12.post1's local-writes and
re-range hooks have no counterpart here.

Where the pool is: 0.5.23's ``ForwardBatch`` carries none; the attention backend holds it
(``backend.token_to_kv_pool``) and the indexer reads it from the forward context SGLang
publishes around each forward (``forward_context.get_token_to_kv_pool()``: the backend's).

Order within one forward: ``init_forward_metadata`` (batch state, page tables translated)
-> per layer: the index store (index view: history gathered, the gathered chunk stored
by SGLang's store, owned rows copied to the shard) -> ``forward_extend`` (MLA history,
prefetched or gathered; the gathered chunk into the view, owned rows to the shard; stock
kernels, ``save_kv_cache=False``).

A batch too short to deal out (fewer tokens than CP ranks) runs unsplit on every rank,
and its index key then takes SGLang's fused prepare-and-store (``_fused_k_prepare_and_store``)
instead of ``_store_index_k_cache``: hooked the same way, SGLang's own kernel writing the
chunk into the dense view.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.forward import materialize, steps
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.pool.owned_rows import same_memory
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin


def _shared_pool_in_flight(pool) -> Optional[CpSharedPoolMixin]:
    """``pool`` when it is a shared-KV pool with a batch in flight whose index stores are
    the plugin's to direct (None: flag off, idle batch, or a store the plugin issued itself)."""
    if not isinstance(pool, CpSharedPoolMixin) or pool.in_flight is None or pool.directs_index_writes:
        return None
    return pool


def _check_chunk_locations(pool, state: CpSharedBatchState, out_cache_loc, what: str, layer_id: int) -> None:
    """SGLang stores at the batch's ``out_cache_loc`` (None: that one); any other location
    list would be rows the batch state never planned for. Recorded for the forward's
    agreement point (every rank then fails, naming it); the store goes to the planned rows."""
    if out_cache_loc is None or same_memory(out_cache_loc, state.out_cache_loc):
        return
    if out_cache_loc.shape == state.out_cache_loc.shape and torch.equal(out_cache_loc, state.out_cache_loc):
        return
    pool.context.agreement.record(
        "chunk_locations", f"{what} asked to store at {tuple(out_cache_loc.shape)} locations other than the batch's "
        "out_cache_loc; a shared-KV prefill rank stores only its batch's chunk", layer_id)


def attach_batch_state(result, backend, forward_batch, *args, **kwargs):
    """AFTER ``DeepseekSparseAttnBackend.init_forward_metadata``: the batch state on the
    backend's pool, the backend's page tables pointed at the dense scratch."""
    pool = backend.token_to_kv_pool
    if isinstance(pool, CpSharedPoolMixin) and steps.begin_forward(pool, backend, forward_batch) is not None:
        pool.context.count_write_path("gathered", "gathered")  # interleave: every chunk row gathered
    return result


def store_index_k_owned_and_dense(original, indexer, forward_batch, layer_id, key, *, act_quant=None,
                                  out_cache_loc=None):
    """AROUND ``Indexer._store_index_k_cache``: ``key`` is the whole chunk's (interleave
    gathered it); the layer's dense index view, the chunk stored into it by SGLang's store
    at its dense locations, this rank's owned rows copied into its shard."""
    pool = _shared_pool_in_flight(sg.get_token_to_kv_pool())
    if pool is None:
        return original(indexer, forward_batch, layer_id, key, act_quant=act_quant, out_cache_loc=out_cache_loc)
    state = pool.in_flight.batch_state
    _check_chunk_locations(pool, state, out_cache_loc, "the index store", layer_id)

    def sglang_store(keys, locs):
        original(indexer, forward_batch, layer_id, keys, act_quant=act_quant, out_cache_loc=locs)

    steps.store_gathered_index_chunk(state, pool, layer_id, key, sglang_store)
    return None


def fused_index_k_owned_and_dense(original, indexer, key_raw, positions, forward_batch, layer_id, act_quant,
                                  out_cache_loc=None):
    """AROUND ``Indexer._fused_k_prepare_and_store`` (a batch SGLang does not split: every
    rank computes the whole chunk): SGLang's own prepare-and-store writes the chunk into the
    layer's dense index view; this rank's owned rows are copied into its shard."""
    pool = _shared_pool_in_flight(sg.get_token_to_kv_pool())
    if pool is None:
        return original(indexer, key_raw, positions, forward_batch, layer_id, act_quant, out_cache_loc=out_cache_loc)
    state = pool.in_flight.batch_state
    _check_chunk_locations(pool, state, out_cache_loc, "the fused index prepare-and-store", layer_id)

    def sglang_prepare_and_store(dense):
        with pool.index_writes_into(layer_id, dense):
            original(indexer, key_raw, positions, forward_batch, layer_id, act_quant,
                     out_cache_loc=state.dense_out_locs)

    materialize.materialize_index(state, pool, layer_id, sglang_prepare_and_store)
    return None


def forward_extend_on_dense_view(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``DeepseekSparseAttnBackend.forward_extend``: the layer's dense MLA view (the
    gathered chunk stored into it, the owned rows into the shard), then SGLang's
    ``forward_extend`` reading that view and storing nothing."""
    pool = backend.token_to_kv_pool
    in_flight = pool.in_flight if isinstance(pool, CpSharedPoolMixin) else None
    if in_flight is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    k_rope = kwargs.get("k_rope")
    chunk = (k, k_rope) if save_kv_cache and k is not None and k_rope is not None else None
    return steps.attend_on_dense_view(
        in_flight.batch_state, pool, layer, chunk,
        lambda: original(backend, q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs))
