"""The steps of one shared-KV prefill forward that every release's hooks take the same way
(:mod:`.hooks` on 0.5.12.post1, :mod:`.hooks_v0523` on 0.5.23); the hooks only find the pool
and the batch in their release's arguments and call these.

* :func:`begin_forward` -- once per forward, after the attention backend's metadata: the
  batch state (:mod:`.batch_state`) in the forward's :class:`.in_flight.ForwardInFlight`
  on the pool, the backend's page tables pointed at the dense scratch;
* :func:`store_gathered_index_chunk` -- per layer, the index key of the whole chunk (every
  rank holds all of it after SGLang's all-gather): the layer's dense index view, the chunk
  stored into it by SGLang's store, this rank's owned rows copied into its shard;
* :func:`attend_on_dense_view` -- per layer, the MLA history (prefetched or gathered now),
  the next layer's prefetch started, the chunk into the view and the owned rows into the
  shard, then SGLang's ``forward_extend`` reading that view and storing nothing;
* :func:`end_forward` -- once per forward, after the model: the agreement point
  (:mod:`.agreement`), where a problem one rank recorded fails every rank together.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from sglang_cp_shared_kv.forward import batch_state as batch_state_module
from sglang_cp_shared_kv.forward import materialize, prefetch, writes
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.forward.in_flight import ForwardInFlight
from sglang_cp_shared_kv.observability.nvtx import marked


def begin_forward(pool, backend, forward_batch, *, one_request: bool = False) -> Optional[CpSharedBatchState]:
    """The batch state of ``forward_batch`` on ``pool`` (None: an idle batch), in the
    forward's :class:`.in_flight.ForwardInFlight` set on the pool, with
    ``backend.forward_metadata`` translated to the dense scratch (``one_request``:
    the release's CP split takes one request per batch, a batch of more is refused). The
    forward must then reach its agreement point (:mod:`.agreement`); in debug mode the
    batch-state checks and the gather plan are agreed here, before the first collective."""
    pool.in_flight = None  # only a failed forward that never reached end_forward leaves one
    agreement = pool.context.agreement
    if not forward_batch.forward_mode.is_idle():
        agreement.begin_forward()
    metadata = backend.forward_metadata
    timer = pool.context.stage_timer
    if timer is not None:
        timer.begin_forward(forward_batch.out_cache_loc.device)
    with marked("batch_state", timer):
        state = batch_state_module.build_for_forward(pool, metadata, forward_batch, backend, one_request=one_request)
    if state is None:
        return None
    with agreement.carried("cp_group"):
        batch_state_module.check_cp_group(state)
    dense = batch_state_module.dense_metadata(metadata, state)
    if state.debug:
        with agreement.carried("debug:batch_state"):
            batch_state_module.check_batch_state(state, metadata, dense, pool)
        agreement.agree(batch_state_module.cp_cpu_group(), extra=batch_state_module.gather_plan(state),
                        extra_names=batch_state_module.GATHER_PLAN_FIELDS, extra_what="the gather plan")
    backend.forward_metadata = dense
    pool.in_flight = ForwardInFlight(state, agreement)
    return state


def end_forward(pool) -> None:
    """After the model's forward, on every CP rank: the forward's agreement point (nothing
    when it began no shared-KV batch, an idle one); the forward in flight dropped."""
    try:
        pool.context.agreement.end_forward(batch_state_module.cp_cpu_group())
    finally:
        pool.in_flight = None


def rows_for_locations(pool, state: CpSharedBatchState, rows: torch.Tensor, what: str, layer_id: int) -> torch.Tensor:
    """``rows`` when it holds one row per row of the batch's ``out_cache_loc``, as a chunk
    handed to a store must. NOTE: other counts happen only where SGLang hands a store
    something else than the whole chunk (a rank's own rows, or rows narrowed for a kernel);
    stored anyway they would land at the wrong locations. The check can fail on one rank
    alone, so it is recorded for the forward's agreement point (which then fails every rank,
    naming it) and the rank carries on in step with zeros of the expected shape."""
    expected = int(state.out_cache_loc.shape[0])
    if int(rows.shape[0]) == expected:
        return rows
    pool.context.agreement.record(
        "chunk_rows", f"{what} has {int(rows.shape[0])} rows for the batch's {expected} out_cache_loc rows; a "
        "shared-KV prefill rank stores exactly its batch's chunk (report this with the server arguments: an "
        "unsupported path reached the store)", layer_id)
    return rows.new_zeros((expected, *rows.shape[1:]))


def store_gathered_index_chunk(state: CpSharedBatchState, pool, layer_id: int, key: torch.Tensor,
                               sglang_store: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """The layer's dense index view: history from the shards, ``key`` (one row per row of the
    batch's ``out_cache_loc``) stored into it by ``sglang_store(keys, locs)`` or the fused
    kernel, this rank's owned rows copied from it into the shard."""
    key = rows_for_locations(pool, state, key, "the index key chunk", layer_id)
    materialize.materialize_index(
        state, pool, layer_id,
        lambda dense: writes.store_index_rows_into(sglang_store, pool, layer_id, key, dense, state.dense_out_locs))


def attend_on_dense_view(state: CpSharedBatchState, pool, layer,
                         chunk: Optional[Tuple[torch.Tensor, torch.Tensor]], attend: Callable[[], object]):
    """``attend()`` (SGLang's ``forward_extend`` with ``save_kv_cache=False``) over the
    layer's complete dense MLA view: ``chunk`` = (k_nope, k_rope) of every chunk row stored
    into it, or with ``chunk`` None the chunk's rows gathered from the shards too."""
    if chunk is not None:
        chunk = tuple(rows_for_locations(pool, state, rows, "the MLA latent chunk", layer.layer_id) for rows in chunk)
    # prefetched during the layer before, or gathered now
    history = prefetch.history_of(state, pool, layer.layer_id, full_view=chunk is None)
    in_flight = pool.in_flight
    try:
        prefetch.prefetch_next(state, pool, layer.layer_id)
        in_flight.set_mla_view(layer.layer_id, materialize.finish_mla_view(state, pool, layer, history, chunk))
        return attend()
    finally:
        in_flight.clear_views()  # this layer's index reads are done too
