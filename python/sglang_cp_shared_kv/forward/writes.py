"""The current chunk's stores: into this rank's shard or into a dense view, and the owner
copy from a view into the shard.

Per layer each chunk row is quantised and stored **once** on a rank:

* local writes (:mod:`.local_writes_v0512`): this rank's own rows, straight into its shard at
  their physical locations (:func:`store_local_mla_rows`, :func:`store_local_index_rows`);
  nothing is stored into the views (they gather the shards);
* otherwise (phase 3), the whole gathered chunk into the layer's dense view
  (:func:`store_mla_rows_into`, :func:`store_index_rows_into`, called by
  :mod:`.materialize`); the rows whose page this rank owns are then copied byte for byte
  from the view into the shard (:func:`copy_owned_mla_rows`, :func:`copy_owned_index_rows`).
  NOTE: storing the owned rows from the gathered chunk instead, as phase 2 did, quantised
  each of them twice and read the chunk twice.

Any other MLA writer of SGLang (the full-view path, where the chunk was written before
``forward_extend``) goes through the pool's ``set_mla_kv_buffer``, which stores the owned
rows of what it is given (``pool.owned_rows.store_owned_mla_rows``). SGLang's own store into a given
buffer is the pool's ``stock_store_mla_rows`` (each release's pool class says how).

Every store takes the fused kernel of ``sgl-kernel/`` where it writes SGLang's bytes
(:class:`~sglang_cp_shared_kv.kernels.KernelDispatch`), and SGLang's own store otherwise,
so the bytes are always exactly those a stock pool would hold for the same rows. Rows
on the dummy page 0 (SGLang's padding) have no owner and are never written to a shard.
"""

from __future__ import annotations

from typing import Callable

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.forward.batch_state import CpSharedBatchState


# -------------------------------------------------------------------------- MLA rows
def store_local_mla_rows(pool, layer, physical_locs: torch.Tensor, k_nope: torch.Tensor,
                         k_rope: torch.Tensor) -> None:
    """Row i of (k_nope | k_rope) at ``physical_locs[i]`` of this rank's shard: the rows this
    rank computed, all on pages it owns (``forward.local_writes_v0512``)."""
    shard = pool.physical_kv_buffer(layer.layer_id)

    def stock():
        pool.stock_store_mla_rows(layer, shard, physical_locs, k_nope, k_rope)

    pool.context.kernels.store_mla_rows(shard, None, physical_locs, k_nope, k_rope,
                                        packed_fp8=pool.stores_packed_fp8, stock=stock)


def store_mla_rows_into(pool, buffer: torch.Tensor, layer, locs: torch.Tensor, k_nope: torch.Tensor,
                        k_rope: torch.Tensor) -> None:
    """SGLang's MLA store (fp8 quantisation included) of every row into ``buffer`` at
    ``locs``: the bytes are exactly those a stock pool would hold for these rows."""
    def stock():
        pool.stock_store_mla_rows(layer, buffer, locs, k_nope, k_rope)

    pool.context.kernels.store_mla_rows(buffer, None, locs, k_nope, k_rope,
                                        packed_fp8=pool.stores_packed_fp8, stock=stock)


# ------------------------------------------------------------------------ index rows
_FUSED_INDEX_STORE: dict = {}  # (key dtype, location dtype, page size) -> SGLang takes its fused path


def _sglang_uses_fused_index_store(key: torch.Tensor, locs: torch.Tensor, page_size: int) -> bool:
    """Whether SGLang's index store takes its fused CUDA path for these dtypes (our kernel
    reproduces that path's bytes, not the act_quant fallback's; the same kernel on both
    releases: test_fused_index_store_source.py). A fact of the installed
    SGLang and these dtypes, the same in every process: cached per module."""
    if not key.is_cuda:
        return False
    flags = (key.dtype, locs.dtype, page_size)
    if flags not in _FUSED_INDEX_STORE:
        _FUSED_INDEX_STORE[flags] = not sg.is_fp8_fnuz() and sg.can_use_fused_index_store(*flags)
    return _FUSED_INDEX_STORE[flags]


def store_index_rows_into(sglang_store: Callable[[torch.Tensor, torch.Tensor], None], pool, layer_id: int,
                          key: torch.Tensor, target: torch.Tensor, locs: torch.Tensor) -> None:
    """Index key ``key[i]`` at token location ``locs[i]`` of ``target`` (the layer's dense
    view, or this rank's shard), by the fused kernel or by ``sglang_store(key, locs)``:
    SGLang's own store of ``key`` at ``locs`` into the buffer the pool names for the layer
    (each release's hook says how SGLang's store is told the locations)."""
    def stock():
        with pool.index_writes_into(layer_id, target):
            sglang_store(key, locs)

    if _sglang_uses_fused_index_store(key, locs, pool.page_size):
        pool.context.kernels.store_index_rows(target, None, locs, key, stock=stock, page_size=pool.page_size)
    else:
        stock()


def store_local_index_rows(sglang_store: Callable[[torch.Tensor, torch.Tensor], None], pool, layer_id: int,
                           key: torch.Tensor, physical_locs: torch.Tensor) -> None:
    """Index key ``key[i]`` at ``physical_locs[i]`` of this rank's shard: the keys this rank
    computed, all on pages it owns (``forward.local_writes_v0512``)."""
    store_index_rows_into(sglang_store, pool, layer_id, key, pool.physical_index_buffer(layer_id), physical_locs)


# ------------------------------------------------------------------------ owner copy
def copy_owned_mla_rows(pool, state: CpSharedBatchState, layer_id: int, dense: torch.Tensor) -> None:
    """This rank's owned chunk rows of the layer's dense MLA view into its shard."""
    pool.context.kernels.copy_mla_rows(pool.physical_kv_buffer(layer_id), state.owned_physical_locs, dense,
                                       state.owned_dense_locs)


def copy_owned_index_rows(pool, state: CpSharedBatchState, layer_id: int, dense: torch.Tensor) -> None:
    """This rank's owned chunk rows of the layer's dense index view into its shard."""
    pool.context.kernels.copy_index_rows(pool.physical_index_buffer(layer_id), state.owned_physical_locs, dense,
                                         state.owned_dense_locs, pool.page_size)
