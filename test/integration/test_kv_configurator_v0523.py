"""SGLang 0.5.23's real ``KVCacheConfigurator.configure`` on a CPU machine, flag off (stock), for
CP rank r of a DSA interleave prefill server: the rig in
``sglang_cp_shared_kv_testing/cpu_kv_configurator.py`` and what stock SGLang builds with it.
Runs only where sglang 0.5.23 is installed (``scripts/bootstrap.sh test-0.5.23``).
"""

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv_testing.cpu_kv_configurator import (  # noqa: E402
    CpuDsaRank,
    interleave_prefill_server_args,
)
from sglang_cp_shared_kv_testing.support import TINY_DSV32  # noqa: E402

pytestmark = pytest.mark.usefixtures("plugin_loaded", "pretend_hopper", "all_cp_ranks_env")

BUDGET = 64 << 20  # bytes of "free GPU memory" each rank profiles
PAGE = 64


def rank(model, *extra, tp=2, tp_rank=0, budget=BUDGET):
    return CpuDsaRank(interleave_prefill_server_args(model, *extra, tp=tp), available_bytes=budget,
                      tp_rank=tp_rank)


def test_configure_builds_the_stock_dsa_pool_and_paged_allocator_on_the_cpu(tiny_nsa_model):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    result = rank(tiny_nsa_model, tp_rank=1).configure()
    pool, allocator = result.token_to_kv_pool, result.token_to_kv_pool_allocator
    assert type(pool) is DSATokenToKVPool and pool.device == "cpu"
    assert type(allocator) is PagedTokenToKVPoolAllocator and allocator.get_kvcache() is pool
    tokens = result.max_total_num_tokens
    assert tokens > 0 and tokens % PAGE == 0
    assert pool.size == allocator.size == allocator.available_size() == tokens
    assert result.memory_pool_config.max_total_num_tokens == tokens
    assert result.req_to_token_pool.size == result.max_running_requests > 0


def test_the_token_count_follows_the_budget_and_max_total_tokens_caps_it(tiny_nsa_model):
    tokens = rank(tiny_nsa_model).configure().max_total_num_tokens
    doubled = rank(tiny_nsa_model, budget=2 * BUDGET).configure().max_total_num_tokens
    assert abs(doubled - 2 * tokens) < 2 * PAGE  # both floored to whole pages
    capped = rank(tiny_nsa_model, "--max-total-tokens", "640").configure()
    assert capped.max_total_num_tokens == capped.token_to_kv_pool.size == 640


@pytest.mark.parametrize("tp", [2, 4])
def test_the_context_is_cp_rank_r_of_n(tiny_nsa_model, tp):
    from sglang.srt.runtime_context import get_context, get_parallel

    for r in (0, tp - 1):
        rig = rank(tiny_nsa_model, tp=tp, tp_rank=r)
        with rig.active():
            parallel = get_parallel()
            assert (parallel.attn_cp_rank, parallel.attn_cp_size) == (r, tp)
            assert (parallel.tp_rank, parallel.attn_tp_size) == (r, 1)
        assert get_context() is not rig.context  # the process's own context is back


@pytest.mark.parametrize("dtype, torch_dtype, row_width", [
    ("bf16", "bfloat16", 512 + 64),  # kv_lora_rank + qk_rope_head_dim, bf16
    ("fp8_e4m3", "float8_e4m3fn", 512 + 4 * 4 + 64 * 2),  # fp8 nope, 4 fp32 scales, bf16 rope: bytes
])
def test_per_layer_buffers(tiny_nsa_model, dtype, torch_dtype, row_width):
    import torch

    result = rank(tiny_nsa_model, "--kv-cache-dtype", dtype).configure()
    pool, tokens = result.token_to_kv_pool, result.max_total_num_tokens
    assert pool.dtype == getattr(torch, torch_dtype)
    layers = TINY_DSV32["num_hidden_layers"]
    assert len(pool.kv_buffer) == len(pool.index_k_with_scale_buffer) == layers
    index_head_dim = TINY_DSV32["index_head_dim"]
    for layer in range(layers):
        # one page more than the allocator hands out (SGLang's padding slot 0 page)
        assert pool.kv_buffer[layer].shape == (tokens + PAGE, 1, row_width)
        # index keys: one row per page (fp8 keys then one fp32 scale per 128), one page more
        assert pool.index_k_with_scale_buffer[layer].shape == (tokens // PAGE + 1, PAGE * (index_head_dim + 4))
        assert pool.index_k_with_scale_buffer[layer].dtype == torch.uint8
