"""The local-writes decision (``forward.local_writes_v0512.plan_local_writes``) against SGLang's
own in-seq split, rank by rank.

SGLang's metadata and split are its own functions on the CPU
(``testing.support.sglang_cp_utils_on_cpu``); the pages come from the plugin's real
allocator (``testing.allocation.request_pages``) or, for the interleaved case, in the
order the stock free list hands them out. A chunk is stored where it was computed only
when every page of it is computed, whole, by the rank that owns it; then each rank's
planned rows are exactly the rows SGLang's split gives it, on pages it owns. Every other
chunk keeps SGLang's gathers, with the reason.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.batch_state import build_batch_state
from sglang_cp_shared_kv.forward.local_writes_v0512 import check_plan, plan_local_writes
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv_testing.allocation import request_pages
from sglang_cp_shared_kv_testing.support import sglang_cp_utils_on_cpu


@pytest.fixture
def cp_utils(monkeypatch):
    return sglang_cp_utils_on_cpu(monkeypatch)


def chunk(cp_utils, n, rank, pages, prefix_len, extend_len, pad, *, split=True, reads_chunk=False):
    """(batch state, SGLang's CP metadata, a forward batch carrying it) of rank ``rank`` for
    the chunk [prefix_len, prefix_len + extend_len) of a request on ``pages``."""
    positions = torch.arange(prefix_len, prefix_len + extend_len)
    locs = torch.tensor(pages)[positions // PAGE] * PAGE + positions % PAGE
    out_cache_loc = torch.cat([locs, torch.zeros(pad, dtype=torch.int64)])  # SGLang pads with location 0
    layout = CpSharedKVLayout(PAGE, n, rank)
    seq_pages = torch.tensor(pages[: -(-(prefix_len + extend_len) // PAGE)])
    state = build_batch_state(layout, KernelDispatch(), None, seq_pages=seq_pages, prefix_lens=[prefix_len],
                              extend_lens=[extend_len], out_cache_loc=out_cache_loc,
                              num_logical_pages=max(pages) + 1, debug=False, chunk_kv_read_directly=reads_chunk)
    rows = extend_len + pad
    metadata = cp_utils.prepare_context_parallel_metadata(rows, rank, n, [prefix_len + extend_len]) if split else None
    return state, metadata, SimpleNamespace(attn_cp_metadata=metadata)


def sglang_rows(cp_utils, batch, rows):
    """The chunk rows SGLang's split gives this rank, in its local order."""
    return cp_utils.cp_split_and_rebuild_position(batch, torch.arange(rows))


CHUNKS = [(n, prefix_units, units, short) for n in (2, 3, 4, 8) for prefix_units in (0, 1) for units in (1, 2)
          for short in (0, 1)]


@pytest.mark.parametrize("n,prefix_units,units,short", CHUNKS)
def test_a_page_aligned_chunk_on_compute_owner_pages_is_stored_where_it_was_computed(
        cp_utils, n, prefix_units, units, short):
    unit = 2 * n * PAGE
    prefix_len, extend_len = prefix_units * unit, units * unit - short
    pad = (-extend_len) % n  # SGLang pads the chunk to a multiple of the CP size
    ends = ([prefix_len] if prefix_len else []) + [prefix_len + extend_len]
    pages, stats = request_pages(n, physical_pages=4 * (prefix_units + units) * 2, chunk_ends=ends)
    assert stats.lane_fallbacks == 0
    for rank in range(n):
        state, metadata, batch = chunk(cp_utils, n, rank, pages, prefix_len, extend_len, pad)
        plan = plan_local_writes(state, metadata)
        assert plan.index and plan.mla and plan.reason == "", (rank, plan.reason)
        mine = sglang_rows(cp_utils, batch, extend_len + pad)
        real = mine[mine < extend_len]
        assert plan.rows == mine.numel() and plan.real_rows == real.numel()
        assert torch.equal(mine[: plan.real_rows], real)  # SGLang's padding rows come last
        layout = state.layout
        want = layout.logical_locs_to_physical(state.out_cache_loc[real])
        assert torch.equal(plan.physical_locs, want), rank
        assert bool(layout.owned_by_this_rank(state.out_cache_loc[real]).all())
        check_plan(plan, state, batch)  # the debug-mode check agrees


def test_debug_check_catches_a_plan_that_misreads_the_split(cp_utils):
    n, unit = 2, 4 * PAGE
    pages, _ = request_pages(n, physical_pages=8, chunk_ends=[unit])
    state, metadata, batch = chunk(cp_utils, n, 1, pages, 0, unit, 0)
    plan = plan_local_writes(state, metadata)
    from dataclasses import replace

    with pytest.raises(AssertionError, match="planned physical locations"):
        check_plan(replace(plan, physical_locs=plan.physical_locs.roll(1)), state, batch)
    with pytest.raises(AssertionError, match="chunk rows"):
        check_plan(replace(plan, real_rows=plan.real_rows - 1), state, batch)


def test_the_mla_side_keeps_sglangs_gather_where_attention_reads_the_gathered_chunk(cp_utils):
    """fp8 flashmla_sparse RAGGED without a prefix attends over the gathered bf16 rows."""
    n, unit = 2, 4 * PAGE
    pages, _ = request_pages(n, physical_pages=8, chunk_ends=[unit])
    state, metadata, _ = chunk(cp_utils, n, 0, pages, 0, unit, 0, reads_chunk=True)
    plan = plan_local_writes(state, metadata)
    assert plan.index and not plan.mla and "RAGGED" in plan.reason


@pytest.mark.parametrize("case", ["interleaved pages", "cut mid-page", "prefix mid-page", "not split"])
def test_every_other_chunk_keeps_sglangs_gathers(cp_utils, case):
    n = 2
    unit = 2 * n * PAGE
    prefix_len, extend_len = (10, unit) if case == "prefix mid-page" else (0, unit if case != "cut mid-page" else 500)
    if case == "interleaved pages":
        pages = list(range(1, 9))  # the stock free list's order: owners 0, 1, 0, 1, ...
    else:
        pages, _ = request_pages(n, physical_pages=8, chunk_ends=[prefix_len + extend_len])
    reasons = {"interleaved pages": "not owned by the rank computing it", "cut mid-page": "cuts a page",
               "prefix mid-page": "prefix ends mid-page", "not split": "does not split"}
    for rank in range(n):
        state, metadata, _ = chunk(cp_utils, n, rank, pages, prefix_len, extend_len, (-extend_len) % n,
                                   split=case != "not split")
        plan = plan_local_writes(state, metadata)
        assert not plan.index and not plan.mla and reasons[case] in plan.reason, (case, plan.reason)
