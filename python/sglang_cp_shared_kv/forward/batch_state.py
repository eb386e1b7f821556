"""Per-forward shared-KV state, built once per batch and reused by every layer.

:func:`build_batch_state` runs from the ``init_forward_metadata`` hook (after SGLang's CP
padding and its own metadata, once per forward, before the model). For one sequence it
computes, on the device,

* the rows of ``out_cache_loc`` this rank owns and their physical locations
  (``pool.owned_rows.owned_rows_of`` hands them to every owner store of this forward);
* the dense placement of the sequence's pages (:mod:`.dense_layout`) and from it the
  *page inverse*, a logical page -> dense page table;
* the dense location of every ``out_cache_loc`` row, and of the owned ones (the owner
  copy reads them from the dense view, :mod:`.writes`).

:func:`dense_metadata` then translates the backend's page tables (``page_table_1``,
``real_page_table``, ``page_table_1_flattened``) through the page inverse (one lookup per
entry, :meth:`KernelDispatch.remap_locs`), so the indexer's fused top-k (which builds its
indices from ``page_table_1``), the index reads and the attention kernels all address the
dense scratch, untouched.

A batch of several requests (0.5.23's interleave; 0.5.12.post1's in-seq split takes one) is
one page list (:func:`.several_requests_v0523.batch_pages`, from the whole batch's request table:
a rank's own tables keep only the requests it holds query tokens of) and one dense map, a
radix prefix two requests share placed once; the backend's tables are translated row by
row (:func:`.several_requests_v0523.dense_rows`).

Host synchronisation: one per batch (the page map's read, which carries the owned-row
count too); none per layer.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import FLAG, debug_enabled
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward import several_requests_v0523 as several_requests
from sglang_cp_shared_kv.forward.dense_layout import DensePageMap, build_dense_page_map
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.pool.owned_rows import with_physical_locs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpSharedBatchState:
    """Everything a layer needs to write its shard and read the dense view."""

    layout: CpSharedKVLayout
    kernels: KernelDispatch
    group: object  # torch.distributed ProcessGroup of the attention CP ranks
    page_map: DensePageMap
    seq_pages: torch.Tensor  # the logical pages the map places, as listed (one request: in sequence order)
    prefix_lens: Tuple[int, ...]  # per request of the batch, in batch order
    extend_lens: Tuple[int, ...]
    out_cache_loc: torch.Tensor  # the batch's logical out_cache_loc (identity marks its writes)
    owned_rows: torch.Tensor  # rows of out_cache_loc whose page this rank owns
    owned_physical_locs: torch.Tensor  # their physical locations in this rank's pool
    page_inverse: torch.Tensor  # (logical pages + 1,) int32: dense page of each page of the sequence, else 0
    dense_out_locs: torch.Tensor  # dense location of every out_cache_loc row (padding: 0)
    owned_dense_locs: torch.Tensor  # dense locations of the owned rows (the owner copy's source)
    debug: bool
    timer: Optional[object] = None  # the rank's StageTimer (observability/stage_timer.py) when timing is on
    #: the attention kernel reads the chunk's gathered KV rows themselves, not the cache
    #: (fp8 flashmla_sparse RAGGED without a prefix): that chunk's latent must be gathered
    chunk_kv_read_directly: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.prefix_lens)

    @property
    def prefix_len(self) -> int:
        """The prefix of the batch's one request (0.5.12.post1's paths, which take one)."""
        return self._one_request(self.prefix_lens)

    @property
    def extend_len(self) -> int:
        return self._one_request(self.extend_lens)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.extend_len

    @property
    def prefix_ends_mid_page(self) -> bool:
        """Some request's prefix ends inside a page (that page is history and chunk alike)."""
        return any(prefix % self.layout.page_size for prefix in self.prefix_lens)

    def _one_request(self, values: Tuple[int, ...]) -> int:
        if len(values) != 1:
            raise ValueError(f"{FLAG}: a per-request length asked of a batch of {len(values)} requests")
        return values[0]

    @property
    def num_owned_rows(self) -> int:
        return int(self.owned_rows.numel())


def cp_device_group(layout: CpSharedKVLayout):
    """The attention-CP process group SGLang set up for this rank (the gathers' group;
    :func:`check_cp_group` checks it against the layout)."""
    return sg.get_attention_cp_group().device_group


def cp_cpu_group():
    """The CPU (gloo) group SGLang keeps beside the attention-CP device group: the forward's
    agreement point (:mod:`.agreement`) exchanges its few integers there, with no device
    synchronisation."""
    return sg.get_attention_cp_group().cpu_group


def check_cp_group(state: "CpSharedBatchState") -> None:
    """The CP group's rank and size are the layout's (the all-gather output is ordered by
    group rank, the layout by CP rank)."""
    group, layout = state.group, state.layout
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    if (rank, size) != (layout.cp_rank, layout.cp_size):
        raise AssertionError(f"the attention CP group has rank {rank} of {size} but the pool was built "
                             f"for CP rank {layout.cp_rank} of {layout.cp_size}")


def build_batch_state(layout: CpSharedKVLayout, kernels: KernelDispatch, group, *, seq_pages: torch.Tensor,
                      prefix_lens: Sequence[int], extend_lens: Sequence[int], out_cache_loc: torch.Tensor,
                      num_logical_pages: int, debug: bool, timer=None, history_pages: Optional[int] = None,
                      chunk_kv_read_directly: bool = False) -> CpSharedBatchState:
    """State of a batch of requests of ``prefix_lens[i] + extend_lens[i]`` tokens on logical
    ``seq_pages`` (pages numbered below ``num_logical_pages``): one request's pages in
    sequence order, or several requests' as :func:`.several_requests_v0523.batch_pages` lists them,
    their ``history_pages`` first."""
    page_size = layout.page_size
    prefix_lens, extend_lens = tuple(int(x) for x in prefix_lens), tuple(int(x) for x in extend_lens)
    several = len(prefix_lens) > 1
    if history_pages is None:
        (prefix_len,) = prefix_lens
        history_pages = -(-prefix_len // page_size)
    owned = layout.owned_by_this_rank(out_cache_loc, validate=False)
    # NOTE: the owned-row count rides in the page map's host read, the forward's only
    # synchronisation; nonzero_static then needs none (nonzero would read its size)
    page_map = build_dense_page_map(layout, seq_pages, history_pages, read_also=(owned.sum(),), repeats=several)
    owned_rows, owned_physical_locs = with_physical_locs(
        layout, out_cache_loc, torch.nonzero_static(owned, size=page_map.read_also[0]).squeeze(1))
    page_inverse = kernels.build_page_inverse(seq_pages, page_map.dense_page, num_logical_pages)
    # SGLang's padding rows sit at location 0, the dummy page, which maps to the dense dummy page.
    dense_out_locs = kernels.remap_locs(out_cache_loc, page_inverse, page_size)
    return CpSharedBatchState(
        layout=layout, kernels=kernels, group=group, page_map=page_map, seq_pages=seq_pages, prefix_lens=prefix_lens,
        extend_lens=extend_lens, out_cache_loc=out_cache_loc, owned_rows=owned_rows,
        owned_physical_locs=owned_physical_locs, page_inverse=page_inverse, dense_out_locs=dense_out_locs,
        owned_dense_locs=dense_out_locs.index_select(0, owned_rows), debug=debug, timer=timer,
        chunk_kv_read_directly=chunk_kv_read_directly,
    )


def dense_metadata(metadata, state: CpSharedBatchState):
    """``metadata`` (SGLang's frozen ``NSAMetadata``) with its page tables translated to
    the dense scratch. Entries past the sequence (never read) are set to the dummy page."""
    if state.num_requests > 1:
        return several_requests.dense_rows(metadata, state)
    page_size, remap = state.layout.page_size, state.kernels.remap_locs
    dense_table = remap(metadata.page_table_1, state.page_inverse, page_size)
    dense_table[:, state.seq_len:] = 0
    dense_real = remap(metadata.real_page_table, state.page_inverse, 1)
    dense_real[:, state.page_map.num_pages:] = 0
    replaced = dict(page_table_1=dense_table, real_page_table=dense_real)
    if metadata.page_table_1_flattened is not None:
        replaced["page_table_1_flattened"] = dense_table[0, : state.seq_len].to(
            metadata.page_table_1_flattened.dtype)
    return dataclasses.replace(metadata, **replaced)


def attends_over_gathered_chunk(backend, forward_batch) -> bool:
    """Whether ``backend``'s ``forward_extend`` attends over the chunk's gathered KV rows
    (its ``k`` / ``k_rope`` arguments) instead of the cache: fp8 KV, ``flashmla_sparse``'s
    RAGGED top-k transform, no request with a prefix (SGLang 0.5.12.post1,
    ``nsa_backend.forward_extend``; 0.5.23's ``has_prefix_sharing``)."""
    method = getattr(backend, "get_topk_transform_method", None)
    return (method is not None and not any(forward_batch.extend_prefix_lens_cpu)
            and method(forward_batch.forward_mode).name == "RAGGED")


def build_for_forward(pool, metadata, forward_batch, backend=None, *,
                      one_request: bool = False) -> Optional[CpSharedBatchState]:
    """The state of ``forward_batch`` on the shared-KV ``pool`` (``metadata``: the NSA
    backend's; ``backend``: that backend), or None for an idle batch; refuses what a
    shared-KV prefill rank cannot run (``one_request``: a batch of several requests, which
    0.5.12.post1's in-seq split never forms)."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return None
    if not mode.is_extend_without_speculative():
        raise NotImplementedError(
            f"{FLAG}: forward mode {mode.name} on a shared-KV prefill rank; only prefill "
            "(extend) runs here, decode runs on the decode server (a non-PD test server needs "
            "--skip-server-warmup, --disable-overlap-schedule and requests with max_new_tokens=1)")
    if one_request and forward_batch.batch_size != 1:
        raise NotImplementedError(
            f"{FLAG}: a prefill batch of {forward_batch.batch_size} requests; on sglang {installed.INSTALLED_VERSION} a shared-KV "
            "prefill rank runs one request per batch, as its in-seq split does")
    prefix_lens = [int(x) for x in forward_batch.extend_prefix_lens_cpu]
    extend_lens = [int(x) for x in forward_batch.extend_seq_lens_cpu]
    layout = pool.cp_layout
    if forward_batch.batch_size == 1:
        num_pages = -(-(prefix_lens[0] + extend_lens[0]) // pool.page_size)
        seq_pages, history_pages = metadata.real_page_table[0, :num_pages], None
    else:
        seq_pages, history_pages = several_requests.batch_pages(backend, forward_batch, prefix_lens, extend_lens,
                                                                pool.page_size)
    return build_batch_state(
        layout, pool.context.kernels, cp_device_group(layout), seq_pages=seq_pages, history_pages=history_pages,
        prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=forward_batch.out_cache_loc,
        num_logical_pages=pool.size // pool.page_size + 1, debug=debug_enabled(), timer=pool.context.stage_timer,
        chunk_kv_read_directly=attends_over_gathered_chunk(backend, forward_batch),
    )


# ------------------------------------------------------------------------- checks
def check_batch_state(state: CpSharedBatchState, metadata, dense, pool) -> None:
    """Debug-mode invariants of the batch state, SGLang's ``metadata`` and its ``dense``
    translation (synchronise the device); a failed one raises ``AssertionError``, which the
    caller carries to the batch's agreement point (``steps.begin_forward``)."""
    if state.num_requests > 1:
        several_requests.check_rows(state, metadata, dense, pool)
        return
    layout, page_map, seq_len = state.layout, state.page_map, state.seq_len
    page_size = layout.page_size
    page_table_1 = metadata.page_table_1
    positions = torch.arange(seq_len, device=page_table_1.device)
    logical_table = page_table_1[0, :seq_len].to(torch.int64)
    pages = logical_table // page_size
    if bool((pages <= 0).any()) or bool((pages > pool.size // page_size).any()):
        raise AssertionError("the sequence's page table leaves the logical page range")
    if not torch.equal(logical_table % page_size, positions % page_size):
        raise AssertionError("the sequence's page table is not page-aligned")
    chunk = state.out_cache_loc[: state.extend_len].to(torch.int64)
    if not torch.equal(chunk, logical_table[state.prefix_len:]):
        raise AssertionError("out_cache_loc does not match the page table's chunk rows")
    if bool((state.out_cache_loc[state.extend_len:] >= page_size).any()):
        raise AssertionError("padding rows of out_cache_loc leave the dummy page")
    dense_slots = page_map.dense_token_table(seq_len, seq_len)  # where each position must land
    if not torch.equal(state.dense_out_locs[: state.extend_len].to(torch.int64), dense_slots[state.prefix_len:]):
        raise AssertionError("the chunk's dense locations are not its positions' dense slots")
    if not torch.equal(dense.page_table_1[0, :seq_len].to(torch.int64), dense_slots):
        raise AssertionError("the dense page_table_1 does not address each position's dense slot")
    if not torch.equal(dense.real_page_table[0, : page_map.num_pages].to(torch.int64), page_map.dense_page):
        raise AssertionError("the dense real_page_table does not list the sequence's dense pages")
    owners = layout.owner_for_logical_pages(state.out_cache_loc[state.owned_rows] // page_size)
    if bool((owners != layout.cp_rank).any()):
        raise AssertionError("a row selected for this rank is owned by another rank")
    if state.num_owned_rows and int(state.owned_physical_locs.max()) >= pool.physical_size + page_size:
        raise AssertionError("an owned row maps outside the physical pool")
    logger.debug(
        "CP shared KV batch: seq_len=%d prefix=%d pages=%d history=%d M_h=%d M_c=%d dense_pages=%d owned_rows=%d",
        state.seq_len, state.prefix_len, page_map.num_pages, page_map.history_pages,
        page_map.history_pad, page_map.current_pad, page_map.num_dense_pages, state.num_owned_rows)


#: What every CP rank must hold identically to size the forward's collectives (debug mode
#: agrees on it at the batch's start, ``steps.begin_forward``): the map's pages, its history
#: pages and paddings (M_h, M_c) and the sum of the logical pages it places.
GATHER_PLAN_FIELDS = ("pages", "history", "M_h", "M_c", "page_sum")


def gather_plan(state: CpSharedBatchState) -> Tuple[int, ...]:
    """This rank's :data:`GATHER_PLAN_FIELDS` (reads the device: debug mode only)."""
    page_map = state.page_map
    return (page_map.num_pages, page_map.history_pages, page_map.history_pad, page_map.current_pad,
            int(state.seq_pages.to(torch.int64).sum()))
