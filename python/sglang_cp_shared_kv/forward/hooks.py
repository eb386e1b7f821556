"""The forward-path hooks ``plugin.HOOKS`` names: each translates SGLang's arguments and
calls the modules of this package. On a stock pool (the flag off) each is a pure
pass-through to SGLang.

Order within one forward: ``init_forward_metadata`` (batch state) -> per layer: the
indexer's key all-gather (re-range) and index store (index view: history gathered, chunk
stored, owned rows copied to the shard) -> the latent all-gather (re-range) and
``forward_extend`` (the layer's MLA history, prefetched or gathered now; the next layer's
history prefetch started; the chunk into the MLA view, owned rows copied to the shard;
stock kernels) -> the final hidden-state all-gather (re-range).

In a local-writes forward (:mod:`.local_writes_v0512`, decided at the first layer) the two
chunk all-gathers are left out: ``Indexer._get_q_k_bf16`` keeps this rank's keys, the
index store puts them into its shard and gathers the whole index view from the shards;
``rebuild_cp_kv_cache`` puts this rank's latent rows into its shard, and
``forward_extend`` gathers the whole MLA view from the shards.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.forward import in_seq_rerange_v0512 as in_seq_rerange, local_writes_v0512 as local_writes, materialize, steps, writes
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.observability.nvtx import marked
from sglang_cp_shared_kv.pool.kv_pool_base import CpSharedPoolMixin
from sglang_cp_shared_kv.scoped import attributes_set


def batch_state_of(forward_batch) -> Optional[CpSharedBatchState]:
    """The shared-KV state of the forward in flight, None on a stock pool (flag off)."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    in_flight = pool.in_flight if isinstance(pool, CpSharedPoolMixin) else None
    return in_flight.batch_state if in_flight is not None else None


def attach_batch_state(result, backend, forward_batch, *args, **kwargs):
    """AFTER ``NativeSparseAttnBackend.init_forward_metadata``: build the batch state, point
    the backend's page tables at the dense scratch, hand the state to the pool."""
    pool = forward_batch.token_to_kv_pool
    if isinstance(pool, CpSharedPoolMixin):
        steps.begin_forward(pool, backend, forward_batch, one_request=True)
    return result


def _local_rows(pool, plan: local_writes.LocalWrites, rows, what: str, layer_id: int):
    """The chunk rows of ``rows`` (this rank's local rows, as SGLang hands them over). Another
    count than planned can happen on one rank alone: recorded for the forward's agreement
    point (every rank then fails, naming it), the rank carrying on with zeros."""
    if rows.shape[0] != plan.rows:
        pool.context.agreement.record(
            "local_rows", f"local writes planned {plan.rows} local {what} rows on this rank, SGLang handed over "
            f"{rows.shape[0]}", layer_id)
        return rows.new_zeros((plan.real_rows, *rows.shape[1:]))
    return rows[: plan.real_rows]


def index_key_kept_local(original, indexer, q_lora, x, positions, enable_dual_stream, forward_batch):
    """AROUND ``Indexer._get_q_k_bf16``: in a local-writes forward, the in-seq all-gather of
    the index key inside it returns this rank's own keys (stored where they were computed)."""
    state = batch_state_of(forward_batch)
    if state is None or not local_writes.plan_for(forward_batch.token_to_kv_pool, forward_batch).index:
        return original(indexer, q_lora, x, positions, enable_dual_stream, forward_batch=forward_batch)
    with forward_batch.token_to_kv_pool.in_flight.gathers_in_seq_kept_local():
        return original(indexer, q_lora, x, positions, enable_dual_stream, forward_batch=forward_batch)


def store_index_k_owned_and_dense(original, indexer, forward_batch, layer_id, key, *args, **kwargs):
    """AROUND ``Indexer._store_index_k_cache``: this rank's index keys into its shard (local
    writes: ``key`` holds its own rows) and the layer's dense index view gathered from the
    shards; or (phase 3: ``key`` is the gathered chunk) the view's history gathered, the chunk
    stored into it by SGLang's store, and this rank's owned keys copied from it into its
    shard."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(indexer, forward_batch, layer_id, key, *args, **kwargs)
    pool = forward_batch.token_to_kv_pool

    def sglang_store(keys, locs):  # 0.5.12.post1's store writes at forward_batch.out_cache_loc
        with attributes_set(forward_batch, out_cache_loc=locs):
            original(indexer, forward_batch, layer_id, keys, *args, **kwargs)

    plan = local_writes.plan_for(pool, forward_batch)
    if plan.index:
        with marked("owner_write", state.timer):
            writes.store_local_index_rows(sglang_store, pool, layer_id,
                                          _local_rows(pool, plan, key, "index key", layer_id), plan.physical_locs)
        materialize.materialize_index(state, pool, layer_id, None)
    else:
        steps.store_gathered_index_chunk(state, pool, layer_id, key, sglang_store)
    return None


def latent_kept_local(original, attention, latent_cache, forward_batch, k_nope, k_pe):
    """AROUND ``DeepseekV2AttentionMLA.rebuild_cp_kv_cache``: in a local-writes forward, this
    rank's own latent rows go straight into its shard and SGLang's latent all-gather is left
    out (``forward_extend`` then reads a view gathered from the shards); otherwise SGLang's."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(attention, latent_cache, forward_batch, k_nope, k_pe)
    pool = forward_batch.token_to_kv_pool
    plan = local_writes.plan_for(pool, forward_batch)
    if not plan.mla:
        return original(attention, latent_cache, forward_batch, k_nope, k_pe)
    layer = attention.attn_mqa
    with marked("owner_write", state.timer):
        writes.store_local_mla_rows(pool, layer, plan.physical_locs,
                                    _local_rows(pool, plan, k_nope, "latent", layer.layer_id),
                                    _local_rows(pool, plan, k_pe, "latent", layer.layer_id))
    return k_nope, k_pe


def forward_extend_on_dense_view(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``NativeSparseAttnBackend.forward_extend``: the layer's dense MLA view (and
    from it the owned rows into the shard), then SGLang's ``forward_extend`` reading that
    view (and storing nothing)."""
    state = batch_state_of(forward_batch)
    if state is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    pool = forward_batch.token_to_kv_pool
    k_rope = kwargs.get("k_rope")
    if local_writes.plan_for(pool, forward_batch).mla:
        chunk = None  # this rank's rows are in its shard; k holds only them: gather the view
    else:
        chunk = (k, k_rope) if save_kv_cache and k is not None and k_rope is not None else None
    return steps.attend_on_dense_view(
        state, pool, layer, chunk,
        lambda: original(backend, q, k, v, layer, forward_batch, save_kv_cache=False, **kwargs))


def agree_after_forward(result, runner, forward_batch, *args, **kwargs):
    """AFTER ``ModelRunner.forward``: the forward's agreement point (:mod:`.agreement`) on
    a shared-KV pool -- a problem any CP rank recorded during the forward fails every rank
    here, together; a kernel that raised on any rank falls back on every rank."""
    pool = getattr(runner, "token_to_kv_pool", None)
    if isinstance(pool, CpSharedPoolMixin):
        steps.end_forward(pool)
    return result


def all_gather_in_seq_order(original, input_tensor, cp_size, forward_batch, stream):
    """AROUND ``cp_utils.cp_all_gather_rerange_output`` (the registry rebinds the name in
    the modules that imported it: ``nsa_indexer``, ``deepseek_v2``, ``deepseek_nextn``)."""
    pool = getattr(forward_batch, "token_to_kv_pool", None)
    uses_shared_kv = isinstance(pool, CpSharedPoolMixin)
    in_flight = pool.in_flight if uses_shared_kv else None
    if in_flight is not None and in_flight.gathers_kept_local:  # the index key of a local-writes forward
        return input_tensor
    if not in_seq_rerange.takes_plugin_path(input_tensor, forward_batch, uses_shared_kv):
        return original(input_tensor, cp_size, forward_batch, stream)
    return in_seq_rerange.gather_in_seq_order(pool.context.kernels, input_tensor, cp_size,
                                              forward_batch.attn_cp_metadata, stream)
