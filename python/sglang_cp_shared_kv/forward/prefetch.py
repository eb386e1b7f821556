"""Phase 8: gather layer L+1's MLA history while layer L computes.

With ``SGLANG_CP_SHARED_KV_PREFETCH=1`` (read at startup), a second process group over the
attention-CP ranks -- its own communicator, so its all-gathers never interleave with the
compute group's (SGLang's own K / index-key / hidden-state gathers) -- carries the history
gathers one layer ahead:

* layer L's ``forward_extend`` hook takes layer L's history if it was prefetched (waiting
  on it right before the chunk is stored into the view), else gathers it now (the first
  layer of every forward), then starts layer L+1's gather (asynchronous: NCCL runs it on
  the prefetch communicator's stream, gloo on its thread) and goes on computing layer L;
* at most two dense MLA views are alive (layer L's, and layer L+1's being filled); none
  outlives its layer or the forward: the last layer starts nothing, and a new batch drops
  whatever a failed forward left;
* only the history region moves early. The current chunk is stored into the view by layer
  L+1 itself, after the wait; a full-view layer (``save_kv_cache=False``: its chunk rows
  reached the shards through another writer) gathers its current region then,
  synchronously, and also its history again when the prefix ends mid-page (below);
* every rank starts the same gathers in the same order with the same sizes: the decision
  uses the startup setting, the layer numbers and the batch's page map (M_h > 0), which are
  the same on every rank.

Why the history cannot change under a prefetch: history pages hold tokens before
``prefix_len``, written by earlier forwards. During a forward the only writes into the
shards are the owner writes of the current chunk's rows (positions >= ``prefix_len``). The
page the prefix shares with the chunk (a prefix ending mid-page) is the one history page
those writes touch, and only in its chunk rows: its prefetched copy may hold stale bytes
there, but the chunk's rows are stored into the view after the wait, over exactly those
rows, as the synchronous path does. A full-view layer stores no chunk rows into the view
(they come from the shards), so when the prefix ends mid-page it drops the prefetched
history (after waiting for it: the gather must complete on every rank) and gathers the
history again after its chunk rows reached the shards.

Nor can a history page be freed and reused under it (SGLang 0.5.12.post1):

* a radix-cache prefix is locked for the request's lifetime: the scheduler admits a request
  with ``PrefillAdder._req_inc_lock_ref`` -> ``RadixCache.inc_lock_ref`` (``lock_ref`` + 1 on
  its last node and every ancestor), ``RadixCache.cache_unfinished_req`` moves the lock to
  the new last node after each chunk (dec then inc, the chunk's pages now in the tree), and
  only ``cache_finished_req``'s ``dec_lock_ref`` releases it; ``RadixCache.evict`` frees only
  ``evictable_leaves``, which ``_update_leaf_status`` keeps to nodes with ``lock_ref == 0``;
* with the overlap scheduler (``Scheduler.event_loop_overlap``) the next batch is prepared
  on the host -- its pages allocated, perhaps pages a finished request freed -- while this
  forward runs on the GPU, but ``Scheduler.run_batch`` issues every forward on the one
  ``forward_stream``, so the next batch's writes run after this forward's kernels; and no
  prefetch outlives its forward (layer L+1 makes the compute stream wait for it, the last
  layer starts none), so none is in flight when they run.
"""

from __future__ import annotations

import logging


from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.forward.materialize import MlaHistory, gather_mla_history
from sglang_cp_shared_kv.observability.nvtx import marked

logger = logging.getLogger(__name__)


def history_of(state: CpSharedBatchState, pool, layer_id: int, *, full_view: bool) -> MlaHistory:
    """Layer ``layer_id``'s MLA history: the prefetched one, else gathered now. ``full_view``:
    the layer reads its chunk rows from the shards (``save_kv_cache=False``)."""
    prefetched = pool.in_flight.take_prefetched(layer_id)
    if prefetched is not None and full_view and state.prefix_ends_mid_page:
        prefetched.wait()  # complete it on every rank, then drop it: its shared page predates the chunk rows
        prefetched = None
    return prefetched if prefetched is not None else gather_mla_history(state, pool, layer_id, state.group)


def prefetch_next(state: CpSharedBatchState, pool, layer_id: int) -> None:
    """Start layer ``layer_id + 1``'s history gather on the prefetch group (when prefetch is
    on, the batch has history and there is a next layer)."""
    group = pool.context.prefetch_group
    last_layer = pool.start_layer + len(pool.kv_buffer) - 1
    if group is None or state.page_map.history_pad == 0 or layer_id >= last_layer:
        return
    # a container: the layer's materialize:mla:view / pack / gather are timed inside it too
    with marked("prefetch:issue", state.timer):
        pool.in_flight.put_prefetched(gather_mla_history(state, pool, layer_id + 1, group, async_op=True))
    if state.debug:
        logger.debug("CP shared KV: layer %d MLA history prefetch started during layer %d", layer_id + 1, layer_id)
