"""The dense views the stock NSA kernels read, one layer at a time.

Per layer, on every CP rank, in the same order (the hooks in :mod:`.hooks` call these):

1. index (from the ``Indexer._store_index_k_cache`` hook): :func:`materialize_index` --
   one all-gather of the owned history pages of the index buffer, SGLang's own index
   store of the current chunk into the dense view, then the owner copy of this rank's
   chunk rows from the view into its shard; the indexer's K/scale reads (prev and next
   segments alike) are then served from the view;
2. MLA (from the ``NativeSparseAttnBackend.forward_extend`` hook): :func:`materialize_mla`
   (or a prefetched history and :func:`finish_mla_view`) -- one all-gather of the owned
   history pages of the latent cache, SGLang's own store of the current chunk into the
   dense view, the owner copy into the shard -- then the stock ``forward_extend`` with
   the dense view as its KV cache. Both views are released when it returns.

Each chunk row is quantised once per layer, into the view; the shard receives the bytes
of its owned rows from there (:mod:`.writes`). In a local-writes forward
(:mod:`.local_writes_v0512`) the chunk's rows are in the shards before the view is built, and
the current region is all-gathered from them like the history (both steps above without
the store and the copy).

A collective happens only for a region that has pages (the history: M_h > 0), and its
size derives from the logical page list (identical on all ranks). Pages move as int64
words. When the current chunk's KV is not passed (``save_kv_cache=False``: written
earlier by another path), the current region is gathered too (the phase-2 full view);
that decision is made from the call's arguments, which are the same on every rank, as
is the local-writes decision.

Each step is an NVTX range / stage-timer stage of its own (:class:`GatherStages`, with the
view's kind: ``materialize:index:...`` or ``materialize:mla:...``): ``view``, ``pack``,
``gather``, ``current``; then ``materialize:chunk`` and ``owner_write``.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState
from sglang_cp_shared_kv.forward.writes import copy_owned_index_rows, copy_owned_mla_rows, store_mla_rows_into
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.observability.nvtx import marked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatherStages:
    """The NVTX range / stage-timer names of one kind of view (``index`` or ``mla``), each a
    leaf (no other named stage inside it):

    * ``view``: allocating the dense view (and zeroing its dummy page);
    * ``pack``: copying this rank's owned history pages into one contiguous send buffer
      (absent when they are one run of the shard: sent from there, no pack);
    * ``gather``: the all-gather of the history pages into the view (for an asynchronous
      prefetch gather only its launch on the compute stream: the exposed rest is
      ``prefetch:wait``);
    * ``current``: the pack and all-gather of the current region (local writes, a full
      view): no prefetch can hide it.
    """

    view: str
    pack: str
    gather: str
    current: str

    @classmethod
    def of(cls, kind: str) -> "GatherStages":
        return cls(*(f"materialize:{kind}:{leaf}" for leaf in ("view", "pack", "gather", "current")))


INDEX_STAGES = GatherStages.of("index")
MLA_STAGES = GatherStages.of("mla")


def page_words(buffer: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``buffer`` (contiguous, page-major) as (num_pages, int64 words per page)."""
    return buffer.reshape(-1).view(torch.uint8).view(torch.int64).view(num_pages, -1)


def _stage(name: Optional[str], timer):
    """:func:`marked` ``name``, or nothing for None (work inside a caller's range)."""
    return nullcontext() if name is None else marked(name, timer)


def gather_region(kernels: KernelDispatch, dense_words: torch.Tensor, region: Tuple[int, int],
                  shard_words: torch.Tensor, send_pages: torch.Tensor, group, *, async_op: bool = False,
                  timer=None, run: int = -1, pack_stage: Optional[str] = None, gather_stage: Optional[str] = None):
    """All-gather every rank's ``send_pages`` of its shard into ``dense_words[region]``.
    ``run`` >= 0: this rank's pages are the consecutive pages from ``run`` (the padding after
    them unread), sent straight from the shard without a pack (and no ``pack_stage``).
    ``pack_stage`` / ``gather_stage``: the NVTX range / stage-timer names of the pack and of
    the all-gather (None: no range of its own). Returns (bytes this rank receives, the
    collective's work handle when ``async_op``, else None); no collective, on every rank
    alike, when the region is empty."""
    start, end = region
    if end == start:
        return 0, None
    count = send_pages.numel()
    if 0 <= run and run + count <= shard_words.shape[0]:
        # NOTE: a rank-local choice; the collective (shapes, order, group) is the same either way
        packed = shard_words[run: run + count]
    else:
        with _stage(pack_stage, timer):
            packed = kernels.pack_pages(shard_words, send_pages)
    with _stage(gather_stage, timer):
        work = torch.distributed.all_gather_into_tensor(dense_words[start:end], packed, group=group,
                                                        async_op=async_op)
    return (end - start - packed.shape[0]) * packed.shape[1] * 8, work


def gather_history(state: CpSharedBatchState, stages: GatherStages, dense_words: torch.Tensor,
                   shard_words: torch.Tensor, group=None, *, async_op: bool = False):
    """:func:`gather_region` of the batch's history region (over ``group``, default the
    compute group): every rank's owned history pages, packed (``stages.pack``) or straight
    from its run, then all-gathered (``stages.gather``)."""
    m = state.page_map
    return gather_region(state.kernels, dense_words, m.history_region, shard_words, m.history_send,
                         state.group if group is None else group, async_op=async_op, timer=state.timer,
                         run=m.history_run, pack_stage=stages.pack, gather_stage=stages.gather)


def gather_current(state: CpSharedBatchState, stages: GatherStages, dense_words: torch.Tensor,
                   shard_words: torch.Tensor) -> int:
    """:func:`gather_region` of the batch's current region on the compute group (its chunk
    rows are in the shards already), pack and all-gather as one ``stages.current`` range;
    the bytes this rank receives."""
    m = state.page_map
    start, end = m.current_region
    if end == start:
        return 0
    with marked(stages.current, state.timer):
        return gather_region(state.kernels, dense_words, m.current_region, shard_words, m.current_send, state.group,
                             run=m.current_run)[0]


def new_dense_view(like: torch.Tensor, num_rows: int, page_rows: int) -> torch.Tensor:
    """An uninitialised dense view of ``num_rows`` rows shaped like ``like``; only the dummy
    page (the first ``page_rows`` rows) is zeroed."""
    dense = torch.empty((num_rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
    dense[:page_rows].zero_()  # the dummy page: padding rows land here, nothing valid reads it
    return dense


def _check_owned_rows_match(pool, what: str, physical_rows: torch.Tensor, dense_rows: torch.Tensor,
                            layer_id: int) -> None:
    """Debug mode: the owned rows copied into the shard are the view's, byte for byte (a
    difference recorded for the forward's agreement point)."""
    if not torch.equal(physical_rows.view(torch.uint8), dense_rows.view(torch.uint8)):
        pool.context.agreement.record(
            "debug:owned_rows", f"{what} rows written to this rank's pool differ from the dense view's", layer_id)


# ------------------------------------------------------------------------ index
def index_rows(buffer: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """(n, K bytes + scale bytes) of the index rows at ``locs`` of a page-major index buffer."""
    k_bytes = buffer.shape[1] // page_size - 4
    page, slot = locs // page_size, locs % page_size
    k = buffer[page[:, None], slot[:, None] * k_bytes + torch.arange(k_bytes, device=locs.device)]
    s_base = page_size * k_bytes
    s = buffer[page[:, None], s_base + slot[:, None] * 4 + torch.arange(4, device=locs.device)]
    return torch.cat([k, s], dim=1)


def materialize_index(state: CpSharedBatchState, pool, layer_id: int,
                      store_chunk_into: Optional[Callable[[torch.Tensor], None]]) -> None:
    """The layer's dense index view: the history gathered from the shards, then
    ``store_chunk_into(dense)`` (SGLang's store of the gathered chunk) and the owner copy of
    this rank's chunk rows into its shard -- or, with ``store_chunk_into`` None (the chunk's
    rows are in the shards already: local writes), the current region gathered too."""
    pool.in_flight.clear_views()
    page_map, page_size = state.page_map, state.layout.page_size
    shard = pool.physical_index_buffer(layer_id)
    with marked(INDEX_STAGES.view, state.timer):
        dense = new_dense_view(shard, page_map.num_dense_pages, 1)
    dense_words, shard_words = page_words(dense, page_map.num_dense_pages), page_words(shard, shard.shape[0])
    received, _ = gather_history(state, INDEX_STAGES, dense_words, shard_words)
    if store_chunk_into is None:
        received += gather_current(state, INDEX_STAGES, dense_words, shard_words)
    else:
        store_chunk_into(dense)
        with marked("owner_write", state.timer):
            copy_owned_index_rows(pool, state, layer_id, dense)
        if state.debug:
            _check_owned_rows_match(pool, "index", index_rows(shard, state.owned_physical_locs, page_size),
                                    index_rows(dense, state.owned_dense_locs, page_size), layer_id)
    if state.debug:
        logger.debug("CP shared KV layer %d index: dense %d pages, received %d B%s", layer_id,
                     page_map.num_dense_pages, received, "" if store_chunk_into is not None else " (chunk local)")
    pool.in_flight.set_index_view(layer_id, dense)


# -------------------------------------------------------------------------- MLA
@dataclass
class MlaHistory:
    """One layer's dense MLA view with its history region gathered, or being gathered
    (``work``: the all-gather's handle until :meth:`wait`)."""

    layer_id: int
    dense: torch.Tensor
    received: int
    work: Optional[object] = None
    timer: Optional[object] = None  # the rank's StageTimer, when timing is on

    def wait(self) -> None:
        if self.work is not None:
            with marked("prefetch:wait", self.timer):
                self.work.wait()
            self.work = None


def gather_mla_history(state: CpSharedBatchState, pool, layer_id: int, group, *, async_op: bool = False) -> MlaHistory:
    """A new dense MLA view of ``layer_id`` and the all-gather of its history region (over
    ``group``; returns at once with ``async_op``, the gather then running on that group's
    own stream / thread until :meth:`MlaHistory.wait`)."""
    page_map, page_size = state.page_map, state.layout.page_size
    shard = pool.physical_kv_buffer(layer_id)
    with marked(MLA_STAGES.view, state.timer):
        dense = new_dense_view(shard, page_map.num_dense_pages * page_size, page_size)
    received, work = gather_history(state, MLA_STAGES, page_words(dense, page_map.num_dense_pages),
                                    page_words(shard, shard.shape[0] // page_size), group, async_op=async_op)
    return MlaHistory(layer_id, dense, received, work, state.timer)


def finish_mla_view(state: CpSharedBatchState, pool, layer, history: MlaHistory,
                    chunk: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The complete dense MLA view of ``layer``: ``history`` (waited for), then ``chunk`` =
    (k_nope, k_rope) of the current rows stored into it and this rank's owned rows copied
    from it into the shard, or, when None, the current region gathered from the shards as
    well (the chunk's rows reached the shards before: local writes, or the phase-2 full
    view of a chunk another writer stored)."""
    page_map, page_size = state.page_map, state.layout.page_size
    history.wait()
    dense, received = history.dense, history.received
    shard = pool.physical_kv_buffer(layer.layer_id)
    if chunk is None:
        received += gather_current(state, MLA_STAGES, page_words(dense, page_map.num_dense_pages),
                                   page_words(shard, shard.shape[0] // page_size))
    else:
        with marked("materialize:chunk", state.timer):
            store_mla_rows_into(pool, dense, layer, state.dense_out_locs, *chunk)
        with marked("owner_write", state.timer):
            copy_owned_mla_rows(pool, state, layer.layer_id, dense)
        if state.debug:
            _check_owned_rows_match(pool, "MLA", shard[state.owned_physical_locs], dense[state.owned_dense_locs],
                                    layer.layer_id)
    if state.debug:
        logger.debug("CP shared KV layer %d MLA: dense %d pages, received %d B%s", layer.layer_id,
                     page_map.num_dense_pages, received, "" if chunk is not None else " (full view)")
    return dense


def materialize_mla(state: CpSharedBatchState, pool, layer,
                    chunk: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The dense MLA view of ``layer``, gathered now (no prefetch)."""
    return finish_mla_view(state, pool, layer, gather_mla_history(state, pool, layer.layer_id, state.group), chunk)
