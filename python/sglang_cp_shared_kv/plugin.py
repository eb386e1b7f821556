"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``cp_shared_kv``).

``register`` only registers hooks; each hook lives in the module of its concern
and passes straight through to SGLang unless ``--enable-nsa-prefill-cp-shared-kv``
is set. With the flag on, startup verifies that every hook below is in place
(:mod:`sglang_cp_shared_kv.hook_check`) and refuses to start otherwise.
"""

from __future__ import annotations

from sglang_cp_shared_kv import capacity, metrics, server_args
from sglang_cp_shared_kv.hook_check import HookSpec, register_hooks

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
_METRICS = "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector"

HOOKS = (
    # --- the flag, validation, capacity, metrics
    HookSpec(f"{_SERVER_ARGS}.__init__", server_args.init_accepting_flag, "around"),
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", server_args.add_flag_to_parser, "after"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", server_args.from_cli_args_with_flag, "around"),
    HookSpec(f"{_SERVER_ARGS}.check_server_args", server_args.validate_after_stock_checks, "after"),
    HookSpec(f"{_KV_MIXIN}._resolve_memory_pool_config", capacity.split_capacity, "after"),
    HookSpec(f"{_KV_MIXIN}._init_pools", capacity.build_pools, "around"),
    HookSpec(f"{_KV_MIXIN}.init_memory_pool", capacity.log_capacity, "after"),
    HookSpec(f"{_METRICS}.emit_constants", metrics.emit_physical_capacity, "after"),
    # --- forward path: owner-only writes, full-view reads
    # --- PD transfer of each rank's shard
)


def register() -> None:
    register_hooks(HOOKS)
