"""SGLang 0.5.12.post1's real HiCache (HiRadixCache -> HybridCacheController -> HostPoolGroup
of MLA KV + NSA indexer host pools) over a STOCK ``NSATokenToKVPool`` and stock
``PagedTokenToKVPoolAllocator``, on a CPU (sglang_cp_shared_kv_testing/hicache_rig_v0512.py):
the baseline the sharded (flag-on) host tier is compared to. A request's MLA rows and index
pages go device -> host (write-through on insert, or write-back on eviction), leave the
device, come back as a host hit and are loaded to new device locations bit for bit.
(test/conftest.py leaves this file out where the installed SGLang is 0.5.23.)"""

import pytest
import torch

from sglang_cp_shared_kv_testing.hicache_rig_v0512 import (
    KVCACHEIO_STANDINS,
    PAGE,
    HiCacheRequest,
    build_hicache,
    expected_host_size,
    hicache_on_cpu,
    host_pools,
    round_trip,
    stock_allocator,
    stock_nsa_pool,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_direct,
)

DEVICE_PAGES = 8  # pages 1..8 usable (page 0 is the allocator's dummy page)
REQUEST_PAGES = 3


@pytest.fixture
def hicache_cpu(sglang_world_of_one):
    """HiCache runnable on this CPU for the test, and the world-of-one TP CPU group."""
    from sglang.srt.distributed import parallel_state as ps

    with hicache_on_cpu():
        yield ps.get_tp_group().cpu_group


def _stock_cache(group, *, policy="write_through", layout="layer_first", dtype_name="bf16", ratio=2.0):
    pool = stock_nsa_pool(DEVICE_PAGES * PAGE, dtype_name=dtype_name)
    allocator = stock_allocator(pool)
    cache = build_hicache(pool, allocator, page_size=PAGE, hicache_ratio=ratio, write_policy=policy,
                          io_backend="direct", mem_layout=layout, group=group)
    return pool, cache


@pytest.mark.parametrize("policy,layout,dtype_name", [
    ("write_through", "layer_first", "bf16"),
    ("write_through", "page_first_direct", "bf16"),
    ("write_back", "layer_first", "bf16"),
    ("write_back", "page_first_direct", "bf16"),
    ("write_through_selective", "layer_first", "bf16"),
    ("write_through", "layer_first", "fp8_e4m3"),
])
def test_evict_host_hit_load_back_returns_the_written_bytes(hicache_cpu, policy, layout, dtype_name):
    pool, cache = _stock_cache(hicache_cpu, policy=policy, layout=layout, dtype_name=dtype_name)
    request = HiCacheRequest.seeded(pool, pages=REQUEST_PAGES, seed=7)
    tokens = REQUEST_PAGES * PAGE

    trip = round_trip(cache, request)

    assert trip.evicted_tokens == tokens
    assert trip.host_hit_length == tokens  # the whole request is a host hit (page-aligned)
    assert len(trip.host_indices) == tokens
    assert trip.host_bytes.mismatches(trip.written) == [], "host copy after the backup"
    # need_sort: the evicted pages wait in release_pages, so the load takes other pages
    assert set(trip.new_locs.tolist()).isdisjoint(trip.old_locs.tolist())
    assert trip.device_bytes_after_load.mismatches(trip.written) == [], "device after load-back"
    assert trip.device_hit_after_load == tokens
    assert not cache.ongoing_write_through and not cache.ongoing_load_back
    # the rank agreement: writing_check all-reduces (a no-op in a world of one); loading_check
    # and the rest do not
    reduces = {step: calls["_all_reduce_attn_groups"] for step, calls in trip.sync_calls.items()}
    assert reduces.get("loading_check", 0) == 0
    assert reduces.get("writing_check", 0) == (0 if policy == "write_back" else 1)
    assert sum(reduces.values()) == reduces.get("writing_check", 0)


@pytest.mark.parametrize("ratio", [2.0, 1.5])
def test_host_pools_are_ratio_times_the_device_pool_plus_one_page(hicache_cpu, ratio):
    pool, cache = _stock_cache(hicache_cpu, ratio=ratio)
    kv_host, index_host = host_pools(cache)
    want = expected_host_size(pool.size, ratio)

    assert want == (int(DEVICE_PAGES * PAGE * ratio) // PAGE + 1) * PAGE
    assert kv_host.size == index_host.size == cache.token_to_kv_pool_host.size == want
    assert kv_host.page_num == want // PAGE
    assert tuple(kv_host.kv_buffer.shape) == (pool.layer_num, want, 1, pool.kv_cache_dim)
    assert index_host.indexer_page_num == (want + PAGE + 1) // PAGE  # as the device index buffer counts
    assert cache.token_to_kv_pool_host.available_size() == want  # host slot 0 is usable
    assert not kv_host.kv_buffer.is_pinned()


def test_cuda_kernels_and_kernel_io_are_refused(hicache_cpu):
    with pytest.raises(NotImplementedError, match="io_backend='direct'"):
        KVCACHEIO_STANDINS["transfer_kv_all_layer_mla"](None, None, None, None, 0, 0)
    pool = stock_nsa_pool(DEVICE_PAGES * PAGE)
    with pytest.raises(ValueError, match="stand-ins serve"):
        build_hicache(pool, stock_allocator(pool), io_backend="kernel", group=hicache_cpu)


def test_direct_standins_check_their_contract():
    src, dst = torch.arange(8.0).view(8, 1), torch.zeros(8, 1)
    transfer_kv_direct([src], [dst], torch.tensor([6, 7, 0, 1]), torch.tensor([0, 1, 2, 3]), 2)
    assert dst.flatten().tolist() == [6, 7, 0, 1, 0, 0, 0, 0]
    with pytest.raises(TypeError, match="int64"):
        transfer_kv_direct([src], [dst], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="whole number of pages"):
        transfer_kv_direct([src], [dst], torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), 2)
    host = torch.zeros(2, 1, 2, 1)  # (pages, layers, page, 1)
    with pytest.raises(ValueError, match="consecutive"):
        transfer_kv_all_layer_direct_lf_pf([src], [host], torch.tensor([0, 2]), torch.tensor([0, 1]), 2)
    transfer_kv_all_layer_direct_lf_pf([src], [host], torch.tensor([4, 5]), torch.tensor([2, 3]), 2)
    assert host[1, 0].flatten().tolist() == [4, 5]


def test_the_rig_is_scoped(sglang_world_of_one):
    import sys

    with hicache_on_cpu() as mph:
        pass
    before = dict(mph.ALLOC_MEMORY_FUNCS), mph.HICACHE_HOST_MEMORY_RESERVE_BYTES
    with hicache_on_cpu() as mph:
        assert mph.transfer_kv_direct is transfer_kv_direct
        assert mph.ALLOC_MEMORY_FUNCS["cpu"] is not before[0].get("cpu")
        assert mph.HICACHE_HOST_MEMORY_RESERVE_BYTES == 0
    assert (dict(mph.ALLOC_MEMORY_FUNCS), mph.HICACHE_HOST_MEMORY_RESERVE_BYTES) == before
    assert before[1] == 10 * 1024**3
    kvcacheio = sys.modules.get("sgl_kernel.kvcacheio")
    assert kvcacheio is None or kvcacheio.transfer_kv_direct is not transfer_kv_direct  # only a real one stays


def test_the_shared_host_pool_reports_what_a_prefetch_allocation_fits_on_uneven_lanes(hicache_cpu, plugin_loaded):
    """Stock's ``prefetch_from_storage`` allocates, evicts host memory, allocates again, and then
    allocates ``available_size()`` tokens and starts the prefetch without checking it got pages
    (a None there ends every rank's prefetch thread). The flag's host pool (CP2, rank 0) reports
    the lane floor, which that allocation fits however uneven the lanes are; ``free_size()``
    counts every free page, more than such an allocation can take."""
    from sglang_cp_shared_kv_testing.hicache_cp_v0512 import shared_pool

    pool, allocator = shared_pool(0, 2, "bf16", DEVICE_PAGES)
    cache = build_hicache(pool, allocator, page_size=PAGE, hicache_ratio=2.0, write_policy="write_through",
                          io_backend="direct", group=hicache_cpu)
    host = host_pools(cache)[0]
    assert type(host).__name__ == "CpSharedMLATokenToKVPoolHost"
    per_lane = host.lanes.free_pages_per_lane()[0]
    assert host.available_size() == host.free_size() == 2 * per_lane * PAGE
    with host.pages_in_lanes(torch.ones(per_lane - 2, dtype=torch.int64)):  # lane 1 down to 2 free pages
        assert host.alloc((per_lane - 2) * PAGE) is not None
    assert host.lanes.free_pages_per_lane() == [per_lane, 2]
    assert host.free_size() == (per_lane + 2) * PAGE and host.available_size() == 2 * 2 * PAGE
    assert host.alloc(host.free_size()) is None
    floor = host.available_size()
    got = host.alloc(floor)
    assert got is not None and got.numel() == floor == 4 * PAGE
