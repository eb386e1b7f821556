"""Every SGLang symbol the plugin imports, in one table (the hook targets are the other
table, ``plugin.HOOKS``).

The plugin's modules never ``import sglang...`` themselves (a unit test walks the package
and enforces it); they read SGLang through this module::

    from sglang_cp_shared_kv import sglang_api as sg

    class CpSharedNSATokenToKVPool(sg.NSATokenToKVPool): ...
    group = sg.get_attention_cp_group()

Each name resolves when it is used (PEP 562 ``__getattr__``), so importing the plugin costs
nothing until a symbol is needed: the plugin loader imports ``plugin.py`` in every SGLang
process, the tokenizer and the router included.

There is one table per SGLang release (:data:`SYMBOLS_BY_VERSION`), picked once from the
installed distribution's version; the hook tables are picked the same way
(``plugin.hooks_for``). A port to a newer SGLang (0.5.13+ renames NSA to DSA and
``in-seq-split`` to ``zigzag``; see docs/design.md, "Porting") adds a table here, a hook
table and the hooks whose targets changed shape, nothing else.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Dict, Optional, Tuple

#: The GPU-verified release: every hook, local writes and compute-owner pages, the default
#: install, the selfcheck's.
SGLANG_VERSION = "0.5.12.post1"
#: The newest release (docs/design.md, "The CP strategy on 0.5.23"): DSA interleave CP, its
#: own symbol and hook tables. NOTE: bit-exact in the CPU rigs on its real classes; no GPU
#: here has its torch (2.14.1), so startup says it has not run on one.
SGLANG_VERSION_0523 = "0.5.23"
#: Releases the flag serves on.
SUPPORTED_SGLANG_VERSIONS = (SGLANG_VERSION, SGLANG_VERSION_0523)
#: Releases with a table of their own (the flag is known there, whatever it then does).
SGLANG_VERSIONS_WITH_TABLES = (SGLANG_VERSION, SGLANG_VERSION_0523)


def installed_sglang_version() -> Optional[str]:
    """The version of the installed ``sglang`` distribution (None: not installed)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def is_supported_base(version: Optional[str]) -> bool:
    return version in SUPPORTED_SGLANG_VERSIONS


def table_version(version: Optional[str]) -> Optional[str]:
    """The release whose tables serve ``version`` (None: it has none)."""
    return version if version in SGLANG_VERSIONS_WITH_TABLES else None


def installed_table_version() -> Optional[str]:
    """The release whose tables serve the installed SGLang (None: it has none)."""
    return table_version(installed_sglang_version())


def unsupported_base_problem(version: Optional[str]) -> str:
    """What the flag says on an SGLang it has no table for."""
    supported = " or ".join(f"sglang=={v}" for v in SUPPORTED_SGLANG_VERSIONS)
    return (f"this sglang-cp-shared-kv release runs on {supported}, and the installed sglang is "
            f"{version or 'not found'}: install sglang=={SGLANG_VERSION} (scripts/bootstrap.sh; the GPU-verified "
            f"one) or sglang=={SGLANG_VERSION_0523}, or drop the flag")

#: name -> (module, attribute); attribute None: the module itself, dotted: an attribute of an
#: attribute (an enum member). The symbols both releases have where they are, meaning the same.
_SYMBOLS_BOTH: Dict[str, Tuple[str, str | None]] = {
    "envs": ("sglang.srt.environ", "envs"),
    # --- PD transfer (Mooncake)
    "KVPoll": ("sglang.srt.disaggregation.base.conn", "KVPoll"),
    "StateType": ("sglang.srt.disaggregation.base.conn", "StateType"),
    "DisaggregationMode": ("sglang.srt.disaggregation.utils", "DisaggregationMode"),
    "MooncakeKVManager": ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager"),
    "NetworkAddress": ("sglang.srt.utils.network", "NetworkAddress"),
    # --- the decode server (its admission queue)
    "prepare_abort": ("sglang.srt.disaggregation.utils", "prepare_abort"),
    # --- the plugin framework
    "HookRegistry": ("sglang.srt.plugins.hook_registry", "HookRegistry"),
    "HookType": ("sglang.srt.plugins.hook_registry", "HookType"),
}

#: SGLang 0.5.12.post1.
_SYMBOLS_0512: Dict[str, Tuple[str, str | None]] = {
    **_SYMBOLS_BOTH,
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
}

#: SGLang 0.5.23: its settings layer, the pool and capacity, the forward path under interleave
#: CP, the decode server and the PD transfer.
_SYMBOLS_0523: Dict[str, Tuple[str, str | None]] = {
    **_SYMBOLS_BOTH,
    # --- KV pool and allocator (subclassed; the configurator's module globals rebound while pools are built)
    "DSATokenToKVPool": ("sglang.srt.mem_cache.memory_pool", "DSATokenToKVPool"),
    "MLATokenToKVPool": ("sglang.srt.mem_cache.memory_pool", "MLATokenToKVPool"),
    "unwrap_write_loc": ("sglang.srt.mem_cache.memory_pool", "unwrap_write_loc"),
    "PagedTokenToKVPoolAllocator": ("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator"),
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

#: Each release's table; :data:`SYMBOLS` is the installed release's (0.5.12.post1's where
#: there is none: the unsupported path resolves no symbol).
SYMBOLS_BY_VERSION: Dict[str, Dict[str, Tuple[str, str | None]]] = {
    SGLANG_VERSION: _SYMBOLS_0512,
    SGLANG_VERSION_0523: _SYMBOLS_0523,
}
SYMBOLS = SYMBOLS_BY_VERSION[installed_table_version() or SGLANG_VERSION]


def resolve(name: str):
    """The SGLang object ``name`` of :data:`SYMBOLS` (its module imported on first use)."""
    module_name, attribute = SYMBOLS[name]
    value = importlib.import_module(module_name)
    for part in (attribute.split(".") if attribute is not None else ()):
        value = getattr(value, part)
    return value


def __getattr__(name: str):
    if name not in SYMBOLS:
        raise AttributeError(f"{__name__} has no SGLang symbol {name!r}; add it to SYMBOLS")
    # NOTE: looked up on every use, never cached here: the hook registry and the tests
    # rebind module attributes of SGLang, and this must see what SGLang itself sees.
    return resolve(name)
