"""The shared-KV pool and allocator subclasses, built from the real SGLang classes on CPU."""

import numpy as np
import pytest
import torch

from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.context import CpSharedKVContext
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.kv_geometry import NsaModelShape
from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool, use_cp_shared_pool_classes

LAYERS = 2
DTYPES = {  # kv cache dtype -> (torch dtype, kv_cache_dim as SGLang computes it)
    "bf16": (torch.bfloat16, 576),
    "fp8_e4m3": (torch.float8_e4m3fn, 656),
}


def pool_kwargs(dtype_name):
    dtype, dim = DTYPES[dtype_name]
    return dict(page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64, layer_num=LAYERS,
                device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=dim)


def shared_pool(physical, n, rank=0, dtype_name="bf16"):
    context = CpSharedKVContext(CpSharedKVLayout(PAGE, n, rank))
    return CpSharedNSATokenToKVPool(physical * n, context=context, **pool_kwargs(dtype_name))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_buffers_are_physical_and_size_is_logical(n, dtype_name):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    physical = 5 * PAGE
    pool = shared_pool(physical, n, rank=n - 1, dtype_name=dtype_name)
    stock = NSATokenToKVPool(physical, **pool_kwargs(dtype_name))
    assert pool.size == pool.logical_size == physical * n
    assert pool.physical_size == physical
    for ours, theirs in zip(pool.kv_buffer, stock.kv_buffer):
        assert ours.shape == theirs.shape == (physical + PAGE, 1, DTYPES[dtype_name][1])
    for ours, theirs in zip(pool.index_k_with_scale_buffer, stock.index_k_with_scale_buffer):
        assert ours.shape == theirs.shape
    # per-rank bytes equal a stock pool of the physical size, and SGLang's own report
    assert pool.get_kv_size_bytes() == stock.get_kv_size_bytes()
    assert pool.mem_usage == stock.mem_usage
    # ... and our planner's geometry reproduces SGLang's buffer sizes exactly
    shape = NsaModelShape("tiny", LAYERS, 512, 64, 128, 2048, 8192)
    assert sum(shape.pool_bytes(physical, dtype_name, PAGE)) == stock.get_kv_size_bytes()
    # Mooncake registers the physical buffers
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    assert lens == [b.nbytes for b in stock.kv_buffer]


def test_bound_class_carries_the_layout():
    layout = CpSharedKVLayout(PAGE, 4, 2)
    context = CpSharedKVContext(layout)
    cls = CpSharedNSATokenToKVPool.bound_to(context)
    assert issubclass(cls, CpSharedNSATokenToKVPool)
    pool = cls(8 * PAGE, **pool_kwargs("bf16"))
    assert pool.cp_layout is layout and pool.context is context and pool.physical_size == 2 * PAGE


def test_two_contexts_side_by_side_share_nothing():
    """Two shared-KV pools in one process (two engines, or two test configurations): each
    has its own layout, kernel fallback set and capacity figures."""
    first, second = shared_pool(2 * PAGE, 2, rank=0), shared_pool(3 * PAGE, 4, rank=3, dtype_name="fp8_e4m3")
    assert first.context is not second.context
    assert first.context.kernels is not second.context.kernels
    first.context.kernels.failed.add("pack_pages")
    assert second.context.kernels.failed == set()
    assert (first.cp_layout.cp_size, first.cp_layout.cp_rank) == (2, 0)
    assert (second.cp_layout.cp_size, second.cp_layout.cp_rank) == (4, 3)
    assert first.context.split is None and second.context.split is None
    cls_a = CpSharedNSATokenToKVPool.bound_to(first.context)
    cls_b = CpSharedNSATokenToKVPool.bound_to(second.context)
    assert cls_a(2 * PAGE * 2, **pool_kwargs("bf16")).context is first.context
    assert cls_b(3 * PAGE * 4, **pool_kwargs("fp8_e4m3")).context is second.context


def test_pool_without_context_or_with_bad_size_refuses():
    with pytest.raises(TypeError, match="needs a CpSharedKVContext"):
        CpSharedNSATokenToKVPool(8 * PAGE, **pool_kwargs("bf16"))
    with pytest.raises(ValueError, match="not a multiple of page_size\\*cp_size"):
        CpSharedNSATokenToKVPool(7 * PAGE, context=CpSharedKVContext(CpSharedKVLayout(PAGE, 2, 0)),
                                 **pool_kwargs("bf16"))


def test_location_addressed_paths_refuse_instead_of_corrupting():
    pool = shared_pool(2 * PAGE, 2)
    with pytest.raises(NotImplementedError, match="host by location"):
        pool.get_cpu_copy(torch.arange(64))
    with pytest.raises(NotImplementedError, match="get_mla_kv_buffer"):
        pool.get_mla_kv_buffer(None, torch.arange(1))
    with pytest.raises(RuntimeError, match="without a materialized dense view"):
        pool.get_key_buffer(0)
    with pytest.raises(RuntimeError, match="without a materialized dense view"):
        pool.get_index_k_continuous(0, 64, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="outside a shared-KV index store"):
        pool.get_index_k_with_scale_buffer(0)


def test_swap_is_scoped_to_the_block():
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
    from sglang.srt.model_executor import model_runner_kv_cache_mixin as mixin

    with use_cp_shared_pool_classes(CpSharedKVContext(CpSharedKVLayout(PAGE, 2, 1))):
        assert issubclass(mixin.NSATokenToKVPool, CpSharedNSATokenToKVPool)
        assert mixin.PagedTokenToKVPoolAllocator is CpSharedPagedTokenToKVPoolAllocator
    assert mixin.NSATokenToKVPool is NSATokenToKVPool
    assert mixin.PagedTokenToKVPoolAllocator is PagedTokenToKVPoolAllocator
    with pytest.raises(RuntimeError):
        with use_cp_shared_pool_classes(CpSharedKVContext(CpSharedKVLayout(PAGE, 2, 1))):
            raise RuntimeError("boom")
    assert mixin.NSATokenToKVPool is NSATokenToKVPool


def allocator_for(pool, need_sort=True):
    return CpSharedPagedTokenToKVPoolAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, need_sort)


def test_reference_capacity_512_over_128():
    # docs/design.md#reference-values: logical 512 tokens over physical 128 with N = 4
    pool = shared_pool(128, 4)
    alloc = allocator_for(pool)
    assert alloc.available_size() == 512
    locs = alloc.alloc(128)
    assert alloc.available_size() == 384
    alloc.free(locs)
    assert alloc.available_size() == 512


def test_allocator_invariant_is_checked():
    pool = shared_pool(128, 4)
    with pytest.raises(ValueError, match="!= physical pool size 128 x cp_size 4"):
        CpSharedPagedTokenToKVPoolAllocator(256, PAGE, torch.bfloat16, "cpu", pool, True)
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    with pytest.raises(TypeError, match="needs the CP shared-KV pool"):
        CpSharedPagedTokenToKVPoolAllocator(128, PAGE, torch.bfloat16, "cpu",
                                            NSATokenToKVPool(128, **pool_kwargs("bf16")), True)


def _extend(alloc, prefix_len, seq_len, last_loc):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    return alloc.alloc_extend(t(prefix_len), t(prefix_len), t(seq_len), t(seq_len), t(last_loc),
                              seq_len - prefix_len)


@pytest.mark.usefixtures("triton_standins")
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_whole_logical_range_without_physical_collisions(n, monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    physical_pages = 5
    pool = shared_pool(physical_pages * PAGE, n)
    alloc = allocator_for(pool)
    rng = np.random.default_rng(n)
    requests = []
    # fill the logical range with extends of random lengths (a prefix ending mid-page included)
    while alloc.available_size() >= 2 * PAGE:
        first = int(rng.integers(1, PAGE * 2))
        locs = _extend(alloc, 0, first, -1)
        more = int(rng.integers(1, PAGE))
        if alloc.available_size() >= PAGE * 2:
            locs = torch.cat([locs, _extend(alloc, first, first + more, int(locs[-1]))])
        requests.append(locs)
    all_locs = torch.cat(requests)
    assert len(torch.unique(all_locs)) == len(all_locs)
    assert all_locs.min() >= PAGE and all_locs.max() < pool.size + PAGE
    # every logical page maps to a distinct (owner rank, physical page) inside that rank's pool
    pages = torch.unique(all_locs // PAGE)
    slots = set()
    for rank in range(n):
        lay = CpSharedKVLayout(PAGE, n, rank)
        mine = pages[lay.owned_pages_mask(pages)]
        phys = lay.logical_pages_to_physical(mine)
        assert phys.numel() == 0 or (phys.min() >= 1 and phys.max() <= physical_pages)
        slots.update((rank, p) for p in phys.tolist())
    assert len(slots) == len(pages)
    # free everything: the whole logical range is available again
    for locs in requests:
        alloc.free(locs)
    assert alloc.available_size() == pool.size


@pytest.mark.usefixtures("triton_standins")
def test_decode_allocation_stays_logical():
    pool = shared_pool(2 * PAGE, 4)
    alloc = allocator_for(pool)
    locs = _extend(alloc, 0, PAGE, -1)
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    nxt = alloc.alloc_decode(t(PAGE + 1), t(PAGE + 1), t(int(locs[-1])))
    assert nxt.item() % PAGE == 0 and nxt.item() // PAGE != locs[0].item() // PAGE


def test_debug_check_catches_out_of_range_locations(monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_CP_SHARED_KV", "1")
    pool = shared_pool(2 * PAGE, 2)
    alloc = allocator_for(pool)
    alloc.free_pages = torch.tensor([999], dtype=torch.int64)  # a corrupted free list
    with pytest.raises(AssertionError, match="leave the logical range"):
        alloc.alloc(PAGE)
