"""The rows of a chunk this rank owns, and the MLA store that writes only those.

A shared-KV rank stores a row only where it owns the row's page (``cp_shared_kv_layout``),
at its physical location. :func:`owned_rows_of` finds those rows of a location tensor;
for the batch's own ``out_cache_loc`` it reuses what the forward's batch state computed
once (no host synchronisation), any other tensor is filtered here (one).

:func:`store_owned_mla_rows` is what the pool's ``set_mla_kv_buffer`` does with the rows
SGLang's own MLA writers hand it: the owned rows, through the fused kernel where it writes
SGLang's bytes (``kernels.KernelDispatch``), SGLang's store otherwise. It reads the forward
in flight (``pool.in_flight``, ``forward.in_flight``) for the batch state, and works
without one too (then it filters).
"""

from __future__ import annotations

from typing import Tuple

import torch

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout


def owned_rows_of(layout: CpSharedKVLayout, state, loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows of ``loc`` this rank owns, their physical locations). ``state``: the forward's
    ``forward.batch_state.CpSharedBatchState`` (its ``out_cache_loc``, ``owned_rows`` and
    ``owned_physical_locs``), or None.

    The batch's own ``out_cache_loc`` -- the tensor itself or a view of the same memory
    (``.contiguous()`` or ``.view`` of it) -- reuses the rows computed once per forward; any
    other location tensor is filtered here (one host synchronisation).
    """
    if state is not None and same_memory(loc, state.out_cache_loc):
        return state.owned_rows, state.owned_physical_locs
    return with_physical_locs(layout, loc, layout.owned_by_this_rank(loc, validate=False).nonzero().squeeze(1))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` reads exactly ``b``'s elements (same storage, offset, shape, strides, dtype).

    NOTE: ``out_cache_loc`` is not written during a forward, so equal memory means equal
    locations; a writer's ``.contiguous()`` of it is the same tensor, not a copy."""
    return a is b or (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
                      and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def with_physical_locs(layout: CpSharedKVLayout, loc: torch.Tensor,
                       rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``rows``, the physical locations of ``loc`` at those rows, which this rank owns)."""
    return rows, layout.logical_locs_to_physical(loc.index_select(0, rows), validate=False)


def store_owned_mla_rows(pool, layer, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
    """Write the rows of ``loc`` this rank owns at their physical locations; drop the rest."""
    in_flight = pool.in_flight
    rows, physical_locs = owned_rows_of(pool.cp_layout, None if in_flight is None else in_flight.batch_state, loc)
    if not rows.numel():
        return

    shard = pool.physical_kv_buffer(layer.layer_id)

    def stock():
        pool.stock_store_mla_rows(layer, shard, physical_locs, k_nope.index_select(0, rows),
                                  k_rope.index_select(0, rows))

    pool.context.kernels.store_mla_rows(shard, rows, physical_locs, k_nope, k_rope,
                                        packed_fp8=pool.stores_packed_fp8, stock=stock)
