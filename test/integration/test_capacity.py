"""Capacity split on SGLang's real memory-pool resolution and pool construction (CPU)."""

import logging

import pytest

from sglang_cp_shared_kv.pool import capacity
from sglang_cp_shared_kv.pool.allocator import CpSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.pool.capacity import PHYSICAL_TOKENS_ATTR, split_capacity
from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool
from sglang_cp_shared_kv_testing.cpu_model_runner import CpuNsaModelRunner
from sglang_cp_shared_kv_testing.support import shared_kv_kwargs

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env",
                                     "sglang_world_of_one")

BUDGET = 64 << 20  # bytes of "free GPU memory" each runner profiles


def runner(model, *, tp=4, rank=1, budget=BUDGET, **overrides):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(**shared_kv_kwargs(model, tp_size=tp, **overrides))
    return CpuNsaModelRunner(server_args, available_bytes=budget, attn_cp_rank=rank)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_logical_capacity_is_n_times_physical(tiny_nsa_model, tp):
    stock = runner(tiny_nsa_model, tp=tp, rank=0, enable_nsa_prefill_cp_shared_kv=False)
    stock_config = stock._resolve_memory_pool_config(0)
    shared = runner(tiny_nsa_model, tp=tp, rank=tp - 1)
    config = shared._resolve_memory_pool_config(0)
    physical = getattr(config, PHYSICAL_TOKENS_ATTR)
    assert physical == stock_config.max_total_num_tokens  # the profiled per-rank size is kept
    assert config.max_total_num_tokens == physical // 64 * tp * 64
    # the request pool is sized from the physical figure, as without the flag
    assert config.max_running_requests == stock_config.max_running_requests
    assert not hasattr(stock_config, PHYSICAL_TOKENS_ATTR)


def test_split_is_applied_once(tiny_nsa_model):
    shared = runner(tiny_nsa_model)
    config = shared._resolve_memory_pool_config(0)
    logical = config.max_total_num_tokens
    with pytest.raises(RuntimeError, match="applied twice"):
        split_capacity(config, shared, 0)
    assert config.max_total_num_tokens == logical


def test_max_total_tokens_caps_the_physical_pool(tiny_nsa_model):
    shared = runner(tiny_nsa_model, max_total_tokens=640)
    config = shared._resolve_memory_pool_config(0)
    assert getattr(config, PHYSICAL_TOKENS_ATTR) == 640
    assert config.max_total_num_tokens == 4 * 640


def test_init_memory_pool_builds_shared_pool(tiny_nsa_model, caplog):
    stock = runner(tiny_nsa_model, rank=0, enable_nsa_prefill_cp_shared_kv=False)
    stock.init_memory_pool(0)
    shared = runner(tiny_nsa_model, rank=3)
    with caplog.at_level(logging.INFO, logger="sglang_cp_shared_kv.pool.capacity"):
        shared.init_memory_pool(0)
    pool, alloc = shared.token_to_kv_pool, shared.token_to_kv_pool_allocator
    assert isinstance(pool, CpSharedNSATokenToKVPool)
    assert type(alloc) is CpSharedPagedTokenToKVPoolAllocator
    physical = stock.max_total_num_tokens
    assert pool.physical_size == physical and pool.cp_layout.cp_rank == 3
    assert pool.size == alloc.size == shared.max_total_num_tokens == 4 * physical
    assert alloc.available_size() == 4 * physical
    # per-rank KV memory is what the flag-off runner allocates
    assert pool.get_kv_size_bytes() == stock.token_to_kv_pool.get_kv_size_bytes()
    assert shared.req_to_token_pool.size == stock.req_to_token_pool.size
    # one startup line with the figures operators look for
    [line] = [r.getMessage() for r in caplog.records if r.name == "sglang_cp_shared_kv.pool.capacity"]
    for field in (f"physical_tokens_per_rank={physical}", f"logical_tokens={4 * physical}", "cp_size=4",
                  "shard_policy=page_interleaved", f"kv_gb_per_rank={stock.token_to_kv_pool.mem_usage:.2f}"):
        assert field in line
    assert capacity.context_of(shared).split.logical_tokens == 4 * physical
    assert capacity.context_of(stock) is None
    chunk = shared.server_args.chunked_prefill_size
    assert f"chunked_prefill_size={chunk} (full chunks are stored where they are computed: a multiple of 512)" in line


def test_a_chunk_size_that_defeats_local_writes_is_named_at_startup(tiny_nsa_model, caplog):
    """--chunked-prefill-size not a multiple of 2N x 64: SGLang cuts every chunk mid-page, so no
    chunk is stored where it was computed; CP rank 0 says so once, naming a size that works."""
    for rank in (0, 1):
        shared = runner(tiny_nsa_model, rank=rank, chunked_prefill_size=6000)
        with caplog.at_level(logging.INFO, logger="sglang_cp_shared_kv.pool.capacity"):
            shared.init_memory_pool(0)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "sglang_cp_shared_kv.pool.capacity"]
    assert len(warnings) == 1, warnings
    assert "--chunked-prefill-size 6000 is not a multiple of 2 x CP size x page size = 512" in warnings[0]
    assert "with --chunked-prefill-size 5632 the full chunks are stored where they are computed" in warnings[0]


def test_flag_off_builds_stock_pool(tiny_nsa_model):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    stock = runner(tiny_nsa_model, enable_nsa_prefill_cp_shared_kv=False)
    stock.init_memory_pool(0)
    assert type(stock.token_to_kv_pool) is NSATokenToKVPool
    assert type(stock.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
    assert stock.token_to_kv_pool.size == stock.max_total_num_tokens
    assert not hasattr(stock.memory_pool_config, PHYSICAL_TOKENS_ATTR)


def test_scheduler_process_revalidates(tiny_nsa_model, monkeypatch):
    from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError

    shared = runner(tiny_nsa_model)
    monkeypatch.delenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"):
        shared.init_memory_pool(0)
    assert shared.token_to_kv_pool_allocator is None  # refused before any pool was built


def test_cp_rank_comes_from_the_attention_cp_group_in_a_server(tiny_nsa_model, monkeypatch):
    # SGLang's TpModelWorker builds the ModelRunner without attn_cp_rank.
    from sglang.srt.layers import dp_attention

    shared = runner(tiny_nsa_model, tp=4)
    shared.attn_cp_rank = None
    monkeypatch.setattr(dp_attention, "get_attention_cp_rank", lambda: 2)
    monkeypatch.setattr(dp_attention, "get_attention_cp_size", lambda: 4)
    layout = capacity.layout_for_runner(shared)
    assert (layout.cp_rank, layout.cp_size) == (2, 4)
    monkeypatch.setattr(dp_attention, "get_attention_cp_size", lambda: 2)
    with pytest.raises(RuntimeError, match="attention CP group has 2 ranks"):
        capacity.layout_for_runner(shared)
