"""SGLang 0.5.12.post1: the GPU-verified release (real CP2, CP4 and CP8 servers and PD pairs on
an H200, bf16 and fp8), the default install and the selfcheck's. NSA prefill CP with the
in-seq split; local writes and compute-owner pages."""

from __future__ import annotations

from sglang_cp_shared_kv.releases.release import COMMON_SYMBOLS, Release, SymbolTable

#: Every SGLang symbol the plugin reads on this release.
SYMBOLS: SymbolTable = {
    **COMMON_SYMBOLS,
    # --- KV pool and allocator (subclassed; their module globals rebound while pools are built)
    "NSATokenToKVPool": ("sglang.srt.mem_cache.memory_pool", "NSATokenToKVPool"),
    "PagedTokenToKVPoolAllocator": ("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator"),
    "model_runner_kv_cache_mixin": ("sglang.srt.model_executor.model_runner_kv_cache_mixin", None),
    # --- NSA forward path
    "index_k_ops": ("sglang.srt.layers.attention.nsa.index_buf_accessor", None),  # GetKAndS, SetKAndS, GetK, GetS
    "can_use_fused_index_store": ("sglang.jit_kernel.fused_store_index_cache", "can_use_nsa_fused_store"),
    "is_fp8_fnuz": ("sglang.srt.layers.quantization.fp8_kernel", "is_fp8_fnuz"),
    "is_nsa_prefill_cp_round_robin_split": ("sglang.srt.layers.attention.nsa.utils",
                                            "is_nsa_prefill_cp_round_robin_split"),
    "cp_utils": ("sglang.srt.layers.utils.cp_utils", None),
    "get_attention_cp_group": ("sglang.srt.layers.dp_attention", "get_attention_cp_group"),
    "get_attention_cp_rank": ("sglang.srt.layers.dp_attention", "get_attention_cp_rank"),
    "get_attention_cp_size": ("sglang.srt.layers.dp_attention", "get_attention_cp_size"),
    # --- configuration
    "is_deepseek_nsa": ("sglang.srt.configs.model_config", "is_deepseek_nsa"),
    # --- PD transfer (Mooncake)
    "INDEX_STATE_TYPE": ("sglang.srt.disaggregation.base.conn", "StateType.NSA"),  # the index pages' state
    "KVTransferError": ("sglang.srt.disaggregation.mooncake.conn", "KVTransferError"),
    # --- HiCache (subclassed: the host pool of one rank's pages)
    "MLATokenToKVPoolHost": ("sglang.srt.mem_cache.memory_pool_host", "MLATokenToKVPoolHost"),
}

RELEASE = Release(
    version="0.5.12.post1",
    name="v0512",
    symbols=SYMBOLS,
    cp_strategy="in-seq-split",
    # NOTE: the CP sizes stock in-seq-split NSA prefill CP serves (its attention
    # CP size, and --tp-size: the split sets ep_size = tp_size with DeepEP, and asserts tp_size <= 8).
    # Evidence, measured on one H200 (2026-12-04, every rank sharing it, flag off, the tiny
    # DeepSeek-V3.2 with its dense MLP, expert count and vocabulary made divisible): CP2, CP4 and CP8
    # serve; CP3 and CP5 stop at a 1,504-token prompt, CP6 and CP7 at the second chunk of a
    # 3,008-token prompt (after answering four one-chunk prompts), all with "CUDA error: an illegal
    # memory access" (docs/results/repro_cp_sizes_cp6_cp7_h200.json). And for every real
    # DeepSeek-V3.2 / GLM-5: the in-seq split forces --moe-a2a-backend deepep over all --tp-size ranks
    # (SGLang's server_args.py, _handle_model_specific_adjustments), and DeepEP's normal (prefill) mode has
    # configs and intranode kernels for 2, 4 and 8 ranks only (deep_ep Buffer.get_dispatch_config /
    # get_combine_config; csrc/kernels/launch.cuh SWITCH_RANKS).
    served_cp_sizes=(2, 4, 8),
    unserved_cp_size_cause=('at CP 3, 5, 6 and 7 its scheduler died on a short prompt with "CUDA error: an illegal '
                            'memory access" (measured), and it runs DeepEP expert parallelism over all --tp-size '
                            'ranks, which has kernels for 2, 4 and 8 ranks'),
    gpu_verified=True,
    attention_backend_module="sglang.srt.layers.attention.nsa_backend",
    bootstrap_target="test",
    hisparse_signal="registration",
    serves_hicache=True,
    serves_hicache_storage=True,
    storage_tag_applied_twice=True,
    # NOTE: its cached status socket serves the one transfer worker that sends the status
    status_sends_locked=False,
    # NOTE: its decode frees a Failed room's pages at once (docs/design.md, "A failed room's
    # pages on decode")
    deferred_decode_release=False,
)
