"""Local writes (phases 4-5): each chunk row stored by the rank that computed it, and
SGLang's all-gathers of the chunk's KV left out.

When SGLang's in-seq split cuts a chunk on page boundaries and compute-owner allocation
gave each of its pages to the rank computing it (``page_split``, ``allocator``) -- every
full chunk of a chunked prefill at the default 8,192 tokens for N = 2, 4, 8 -- each rank
holds every row of the pages it owns *before* any all-gather. Per layer, then:

* each rank quantises and stores its own rows' index keys and MLA latent straight into
  its shard, at their physical locations (one store of 1/N of the chunk: no owner filter,
  no copy from a view, no row quantised on more than one rank);
* SGLang's two in-seq all-gathers of the chunk's bf16 KV -- the index key inside
  ``Indexer._get_q_k_bf16``, the latent in ``rebuild_cp_kv_cache`` -- are not issued;
* the dense views' current region is all-gathered from the shards instead, like the
  history: stored rows, 656 + 132 B per token with fp8 KV (1,152 + 132 B with bf16)
  instead of the bf16 1,152 + 256 B SGLang gathers;
* the stock kernels read the same dense views as on every other path.

Every other chunk -- cut mid-page (a prompt's last, shorter chunk), after a prefix that
ends mid-page, given interleaved pages (lane fallback), too short to be split -- takes the
phase-3 path: SGLang gathers the chunk, every rank stores it into the views and copies its
owned rows into its shard (:mod:`.writes`, :mod:`.materialize`).

One exception, on the MLA side only: with fp8 KV, ``flashmla_sparse``'s RAGGED path
attends over the gathered bf16 chunk rows themselves (``k``, ``k_rope``) when the chunk
has no prefix, not over the cache (``NativeSparseAttnBackend.forward_extend``); such a
chunk keeps SGLang's latent all-gather (and the phase-3 MLA path) while its index keys
stay local.

The decision is made once per forward, at its first layer, from SGLang's CP metadata
(``split_list``), the sequence's pages and the batch's lengths -- the same on every CP
rank, so every rank leaves out the same collectives and issues the same ones instead (by
construction: :func:`plan_local_writes` reads no rank's own metadata; debug mode also
agrees on it, ``forward.agreement``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState, cp_cpu_group
from sglang_cp_shared_kv.pool.page_split import segment_row_ranges, token_split_page_ranks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalWrites:
    """How one forward's chunk rows reach the shards (the same answer on every CP rank)."""

    index: bool  #: index keys stored by their computing rank; SGLang's key all-gather left out
    mla: bool  #: likewise the MLA latent; SGLang's latent all-gather left out
    #: why the chunk takes the phase-3 path (or, with ``index`` and not ``mla``, the MLA side)
    reason: str = ""
    rows: int = 0  #: this rank's local rows, as SGLang hands them to the hooks (its padding included)
    real_rows: int = 0  #: the first ``real_rows`` of them are chunk rows; the rest SGLang's padding
    physical_locs: Optional[torch.Tensor] = None  #: (real_rows,) their locations in this rank's pool


def _phase3(reason: str) -> LocalWrites:
    return LocalWrites(index=False, mla=False, reason=reason)


def local_row_ranges(split_list, zigzag_index) -> List[Tuple[int, int]]:
    """[start, end) chunk rows of this rank's local rows, in the order SGLang's
    ``cp_split_and_rebuild_data`` lays them out (its segments, in ``zigzag_index`` order)."""
    ranges = segment_row_ranges(split_list)
    return [ranges[segment] for segment in zigzag_index]


def in_seq_segments(rank: int, cp_size: int) -> List[int]:
    """The zigzag segments SGLang's in-seq split gives CP rank ``rank``, in the order its
    ``zigzag_index`` lists them: ``rank`` and ``2 * cp_size - 1 - rank``."""
    return [rank, 2 * cp_size - 1 - rank]


def _padding_ends_every_ranks_rows(split: List[int], extend_len: int, n: int) -> bool:
    """SGLang pads the chunk at its end: every rank's real rows come before its padding rows
    (checked for every rank, so every rank decides alike)."""
    for rank in range(n):
        padding_seen = False
        for start, end in local_row_ranges(split, in_seq_segments(rank, n)):
            if padding_seen and min(end, extend_len) > start:
                return False
            padding_seen = padding_seen or end > extend_len
    return True


def plan_local_writes(state: CpSharedBatchState, cp_metadata) -> LocalWrites:
    """The local-writes decision for the forward of ``state`` (module docstring).
    ``cp_metadata``: SGLang's ``ContextParallelMetadata`` of the batch (None: SGLang does
    not split it).

    NOTE: the decision (``index``, ``mla``, ``reason``) reads only what every CP rank holds
    identically -- SGLang's ``split_list``, the batch's lengths, the page map's owners, the
    attention path -- and every rank's segments as the split defines them, never this rank's
    own metadata: every rank leaves out the same collectives by construction. Only the rows
    (which of the chunk's rows are this rank's) are this rank's own."""
    layout, page_map, out_cache_loc = state.layout, state.page_map, state.out_cache_loc
    page_size, n, rank = layout.page_size, layout.cp_size, layout.cp_rank
    if cp_metadata is None or not cp_metadata.split_list or state.extend_len < 1:
        return _phase3("SGLang does not split this chunk across the CP ranks")
    if state.prefix_len % page_size:
        return _phase3("the prefix ends mid-page (its last page holds history and chunk rows)")
    split = [int(x) for x in cp_metadata.split_list]
    ranks = token_split_page_ranks(state.prefix_len, state.extend_len, split, page_size, n)
    if ranks is None:
        return _phase3("SGLang's token-balanced split cuts a page between two ranks")
    if ranks != page_map.current_owners:
        return _phase3("a page of the chunk is not owned by the rank computing it (interleaved pages)")
    if not _padding_ends_every_ranks_rows(split, state.extend_len, n):
        return _phase3("SGLang's padding rows are not at the end of a rank's rows")
    ranges = local_row_ranges(split, in_seq_segments(rank, n))
    real = [(start, min(end, state.extend_len)) for start, end in ranges if start < state.extend_len]
    rows = sum(end - start for start, end in ranges)
    real_rows = sum(end - start for start, end in real)
    locs = torch.cat([out_cache_loc[start:end] for start, end in real]) if real else out_cache_loc[:0]
    physical = layout.logical_locs_to_physical(locs, validate=False)
    mla = not state.chunk_kv_read_directly
    return LocalWrites(
        index=True, mla=mla, rows=rows, real_rows=real_rows, physical_locs=physical,
        reason="" if mla else "fp8 RAGGED attention of a chunk without prefix reads the gathered bf16 chunk rows")


def check_segments(cp_metadata, rank: int, n: int) -> None:
    """SGLang's metadata gives this rank the segments the plan assumes (``AssertionError``
    otherwise: the rows SGLang hands this rank would not be the planned ones)."""
    if cp_metadata is None or not cp_metadata.split_list:
        return
    zigzag = [int(x) for x in cp_metadata.zigzag_index]
    if zigzag != in_seq_segments(rank, n):
        raise AssertionError(f"CP rank {rank} computes segments {zigzag} of SGLang's in-seq split; rank r computes "
                             f"segments r and {2 * n - 1} - r ({in_seq_segments(rank, n)})")


def check_plan(plan: LocalWrites, state: CpSharedBatchState, forward_batch) -> None:
    """Debug mode: this rank's local rows are the positions SGLang's own split gives it, and
    every one of them lies on a page this rank owns (synchronises the device)."""
    from sglang_cp_shared_kv import sglang_api as sg

    total = int(sum(forward_batch.attn_cp_metadata.split_list))
    positions = torch.arange(total, device=state.out_cache_loc.device)
    mine = sg.cp_utils.cp_split_and_rebuild_position(forward_batch, positions)
    if mine.numel() != plan.rows or not bool((mine[: plan.real_rows] < state.extend_len).all()) or bool(
            (mine[plan.real_rows:] < state.extend_len).any()):
        raise AssertionError(f"local writes: this rank's rows (positions {mine.tolist()[:8]}...) are "
                             f"not the {plan.real_rows} chunk rows, then {plan.rows - plan.real_rows} padding, "
                             "that were planned")
    locs = state.out_cache_loc.index_select(0, mine[: plan.real_rows])
    if not torch.equal(state.layout.logical_locs_to_physical(locs, validate=False), plan.physical_locs):
        raise AssertionError("local writes: planned physical locations differ from SGLang's rows'")
    if not bool(state.layout.owned_by_this_rank(locs, validate=False).all()):
        raise AssertionError("local writes: a row computed here lies on a page another rank owns")


#: What debug mode agrees on after planning (every rank must decide alike)
PLAN_FIELDS = ("index_local", "mla_local")


def plan_for(pool, forward_batch) -> LocalWrites:
    """The decision for the forward in flight, made on its first call and kept in it.
    This rank's segments are checked against the plan's (a difference recorded for the
    forward's agreement point); in debug mode the plan is checked against SGLang's own split
    and the group agrees on the decision before any collective depends on it."""
    in_flight = pool.in_flight
    state = in_flight.batch_state
    cp_metadata = getattr(forward_batch, "attn_cp_metadata", None)
    kept = in_flight.local_writes
    if kept is not None and kept[0] is cp_metadata:
        return kept[1]
    agreement = pool.context.agreement
    plan = plan_local_writes(state, cp_metadata)
    if plan.index:
        with agreement.carried("in_seq_segments"):
            check_segments(cp_metadata, state.layout.cp_rank, state.layout.cp_size)
    if state.debug:
        if plan.index:
            with agreement.carried("debug:local_writes"):
                check_plan(plan, state, forward_batch)
        logger.debug("CP shared KV local writes: index=%s mla=%s rows=%d real=%d %s", plan.index, plan.mla,
                     plan.rows, plan.real_rows, plan.reason)
        agreement.agree(cp_cpu_group(), extra=(int(plan.index), int(plan.mla)), extra_names=PLAN_FIELDS,
                        extra_what="the local-writes decision")
    pool.context.count_write_path("local" if plan.index else "gathered", "local" if plan.mla else "gathered")
    in_flight.local_writes = (cp_metadata, plan)
    return plan
