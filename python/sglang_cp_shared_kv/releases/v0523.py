"""SGLang 0.5.23: DSA prefill CP with the interleave strategy (docs/design.md, "The CP
strategy on 0.5.23"): its settings layer, the pool and capacity built by its KV
configurator, several requests per prefill batch, every rank sending its index pages, HiCache's
host tier (L2) sharded like the device pool and its storage tier (L3) like the host tier.
Bit-exact in the CPU rigs on its real classes; not run on a GPU yet (no lent image carries its
torch 2.14.1), which startup says."""

from __future__ import annotations

from sglang_cp_shared_kv.releases.release import COMMON_SYMBOLS, Release, SymbolTable

#: Every SGLang symbol the plugin reads on this release: its settings layer, the pool and
#: capacity, the forward path under interleave CP, the decode server and the PD transfer.
SYMBOLS: SymbolTable = {
    **COMMON_SYMBOLS,
    # --- KV pool and allocator (subclassed; the configurator's module globals rebound while pools are built)
    "DSATokenToKVPool": ("sglang.srt.mem_cache.memory_pool", "DSATokenToKVPool"),
    "MLATokenToKVPool": ("sglang.srt.mem_cache.memory_pool", "MLATokenToKVPool"),
    "unwrap_write_loc": ("sglang.srt.mem_cache.memory_pool", "unwrap_write_loc"),
    "PagedTokenToKVPoolAllocator": ("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator"),
    # a widened (upstream KV-sharding) allocator: 1 for ours and the stock paged one (the idle pool audit)
    "page_interleave_shard_size": ("sglang.srt.mem_cache.allocator.page_interleave", "page_interleave_shard_size"),
    "kv_cache_configurator": ("sglang.srt.mem_cache.kv_cache_configurator", None),
    "get_parallel": ("sglang.srt.runtime_context", "get_parallel"),
    "get_observability": ("sglang.srt.runtime_context", "get_observability"),  # --enable-metrics
    # --- DSA index K (the same GetKAndS / SetKAndS interface as 0.5.12's accessor)
    "index_k_ops": ("sglang.kernels.ops.kvcache.dsa_index_k_cache", None),
    "can_use_fused_index_store": ("sglang.kernels.ops.kvcache.dsa_fused_store_index_cache",
                                  "can_use_dsa_fused_store"),
    "is_fp8_fnuz": ("sglang.kernels.ops.quantization.fp8_kernel", "is_fp8_fnuz"),
    # --- DSA forward path (interleave CP): the CP group, the pool of the forward in flight
    "get_attention_cp_group": ("sglang.srt.distributed.parallel_state", "get_attn_cp_group"),
    "get_token_to_kv_pool": ("sglang.srt.model_executor.forward_context", "get_token_to_kv_pool"),
    # --- configuration (ServerArgs is a msgspec record resolved by named steps)
    "is_deepseek_dsa": ("sglang.srt.configs.model_config", "is_deepseek_dsa"),
    "model_config_of": ("sglang.srt.arg_groups.model_override_base", "model_config_of"),
    "resolved_view": ("sglang.srt.arg_groups.model_override_base", "resolved_view"),
    "resolving_view": ("sglang.srt.arg_groups.model_override_base", "resolving_view"),
    "declare_resolution": ("sglang.srt.arg_groups.overrides", "declare_resolution"),
    "cuda_graph_config": ("sglang.srt.model_executor.cuda_graph_config", None),
    # --- PD transfer (Mooncake; the same names as 0.5.12.post1's where they mean the same)
    "INDEX_STATE_TYPE": ("sglang.srt.disaggregation.base.conn", "StateType.DSA"),  # the index pages' state
    "KVTransferError": ("sglang.srt.disaggregation.common.conn", "KVTransferError"),
    # --- the plugin framework (resolution steps)
    "resolution_hooks": ("sglang.srt.arg_groups.resolution_hooks", None),
}

RELEASE = Release(
    version="0.5.23",
    name="v0523",
    symbols=SYMBOLS,
    cp_strategy="interleave",
    # NOTE: interleave deals tokens out round robin and pads, splits and gathers for any N
    # (the CPU rig is bit-exact at N = 2..8); no size refused
    served_cp_sizes=None,
    unserved_cp_size_cause=None,
    gpu_verified=False,
    attention_backend_module="sglang.srt.layers.attention.dsa_backend",
    bootstrap_target="test-0.5.23",
    hisparse_signal="room",
    serves_hicache=True,
    # NOTE: the storage tier (L3): each rank stores and fetches its own pages (hicache.storage);
    # its Mooncake backend tags every key once, so extra_backend_tag is served
    serves_hicache_storage=True,
    storage_tag_applied_twice=False,
    status_sends_locked=True,
    deferred_decode_release=True,
)
