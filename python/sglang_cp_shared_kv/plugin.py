"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``cp_shared_kv``).

``register`` only registers hooks: the table of the installed SGLang release
(:func:`hooks_for`, :data:`.releases.installed.INSTALLED`), one per release
(:func:`_hooks_v0512`, :func:`_hooks_v0523`: the flag validated in the release's terms, the
pool and capacity, the forward path under its CP strategy, HiCache's host tier where served,
the decode server and the PD transfer), each in one block per concern package; on a release the plugin does not serve,
:data:`UNSUPPORTED_BASE_HOOKS`, a flag that refuses to start and says why. These tables name
every SGLang target the plugin hooks (the SGLang symbols it imports are the other table,
:mod:`sglang_cp_shared_kv.sglang_api`). Each hook lives in the module of its concern and
passes straight through to SGLang unless ``--enable-nsa-prefill-cp-shared-kv`` is set. With
the flag on, startup verifies that every hook below is in place
(:mod:`sglang_cp_shared_kv.hook_check`) and refuses to start otherwise.

NOTE: the modules holding the hooks subclass SGLang classes when they are imported, which
on another release fails (0.5.23 has no ``NSATokenToKVPool``). SGLang imports this module in
every process, so a table imports them only when it is built (on first use), and the
unsupported path needs only :mod:`.settings.server_args`'s parser hook, which touches no
SGLang symbol.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

from sglang_cp_shared_kv.hook_check import RESOLUTION, HookSpec, register_hooks
from sglang_cp_shared_kv.releases import v0512, v0523
from sglang_cp_shared_kv.releases.installed import INSTALLED
from sglang_cp_shared_kv.releases.release import Release
from sglang_cp_shared_kv.settings import server_args

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
_SCHEDULER_METRICS = "sglang.srt.observability.scheduler_metrics_mixin.SchedulerMetricsMixin"
_NSA_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer.Indexer"
_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
_PREFILL_QUEUE = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue"
_MLA_ATTENTION = "sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA"
_DECODE_QUEUE = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
_DECODE_TRANSFER_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"
_HOST_POOLS = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_HYBRID_CONTROLLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
_HOST_POOL_GROUP = "sglang.srt.mem_cache.memory_pool_host.HostPoolGroup"
_HIRADIX = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache"  # 0.5.12.post1
_KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"  # 0.5.23
_DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"  # 0.5.23
_DSA_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"  # 0.5.23


@functools.cache
def _transfer_hooks_on_both_releases() -> Tuple[HookSpec, ...]:
    """The PD transfer hooks whose targets kept their shape from 0.5.12.post1 to 0.5.23 (the
    filter and ``add_transfer_request`` hand 0.5.23's new arguments on)."""
    from sglang_cp_shared_kv.transfer import hooks as transfer

    return (
        HookSpec("sglang.srt.disaggregation.utils.filter_kv_indices_for_cp_rank", transfer.filter_owned_pages,
                 "around"),
        HookSpec(f"{_PREFILL_QUEUE}._init_kv_manager", transfer.check_transfer_matches_pool, "after"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.add_transfer_request", transfer.enqueue_owned_chunk, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager._transfer_data", transfer.write_in_bounded_batches, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.maybe_send_extra", transfer.send_owned_state_pages, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.send_aux", transfer.send_aux_unless_failed, "around"),
        # an aborted request: decode told at once (bootstrap/in-flight queues; aborted before
        # decode registered it: told when it registers)
        HookSpec("sglang.srt.disaggregation.common.conn.CommonKVSender.abort", transfer.fail_aborted_room_on_decode,
                 "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.update_status", transfer.fail_late_registration_of_aborted_room,
                 "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager._handle_aux_data", transfer.accept_failure_cause, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVReceiver.failure_exception", transfer.failure_exception_with_cause, "around"),
    )


@functools.cache
def _forward_agreement_hook() -> HookSpec:
    """The forward's agreement point, on both releases: a problem one CP rank recorded during
    the forward fails every rank together, a kernel that raised on one falls back on all
    (``forward.agreement``)."""
    from sglang_cp_shared_kv.forward import hooks as forward

    return HookSpec("sglang.srt.model_executor.model_runner.ModelRunner.forward", forward.agree_after_forward,
                    "after")


@functools.cache
def _hooks_v0512() -> Tuple[HookSpec, ...]:
    """SGLang 0.5.12.post1 (imports the modules that hold the hooks)."""
    from sglang_cp_shared_kv.pool import capacity
    from sglang_cp_shared_kv.decode import server as decode_server
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0512 as idle_pool_audit, metrics
    from sglang_cp_shared_kv.forward import hooks as forward
    from sglang_cp_shared_kv.hicache import hooks_v0512 as hicache
    from sglang_cp_shared_kv.hicache import lane_hooks
    from sglang_cp_shared_kv.transfer import hooks as transfer

    return (
        # --- the flag, validation, capacity, metrics
        HookSpec(f"{_SERVER_ARGS}.__init__", server_args.init_accepting_flag, "around"),
        HookSpec(f"{_SERVER_ARGS}.add_cli_args", server_args.add_flag_to_parser, "after"),
        HookSpec(f"{_SERVER_ARGS}.from_cli_args", server_args.from_cli_args_with_flag, "around"),
        HookSpec(f"{_SERVER_ARGS}._set_default_nsa_backends", server_args.nsa_backends_for_in_seq_split, "around"),
        HookSpec(f"{_SERVER_ARGS}.check_server_args", server_args.validate_after_stock_checks, "after"),
        HookSpec(f"{_KV_MIXIN}._resolve_memory_pool_config", capacity.split_capacity, "after"),
        HookSpec(f"{_KV_MIXIN}._init_pools", capacity.build_pools, "around"),
        HookSpec(f"{_KV_MIXIN}.init_memory_pool", capacity.log_capacity, "after"),
        HookSpec(f"{_SCHEDULER_METRICS}.install_device_timer_on_runners", metrics.emit_physical_capacity, "after"),
        # an idle scheduler's pool page by page, beside SGLang's own idle check (--enable-metrics)
        HookSpec("sglang.srt.managers.scheduler_runtime_checker_mixin.SchedulerRuntimeCheckerMixin._check_all_pools",
                 idle_pool_audit.audit_idle_pools, "after"),
        # --- forward path: owner-only writes, dense-view reads
        HookSpec(f"{_NSA_BACKEND}.init_forward_metadata", forward.attach_batch_state, "after"),
        HookSpec(f"{_INDEXER}._store_index_k_cache", forward.store_index_k_owned_and_dense, "around"),
        HookSpec(f"{_NSA_BACKEND}.forward_extend", forward.forward_extend_on_dense_view, "around"),
        # local writes: a chunk computed page by page by its pages' owners is stored where it
        # was computed, and SGLang's all-gathers of its index key and latent are left out
        HookSpec(f"{_INDEXER}._get_q_k_bf16", forward.index_key_kept_local, "around"),
        HookSpec(f"{_MLA_ATTENTION}.rebuild_cp_kv_cache", forward.latent_kept_local, "around"),
        # the in-seq CP all-gather (latent, index key, hidden) re-ordered by one kernel; the
        # registry rebinds the name in the modules that imported it (deepseek_v2, nsa_indexer, ...)
        HookSpec("sglang.srt.layers.utils.cp_utils.cp_all_gather_rerange_output",
                 forward.all_gather_in_seq_order, "around"),
        _forward_agreement_hook(),
        # --- HiCache: each rank's host pool holds, backs up and loads back its own pages
        HookSpec(f"{_HOST_POOLS}.build_kv_host_pool", hicache.build_owner_local_host_pool, "around"),
        HookSpec(f"{_HOST_POOLS}.attach_hybrid_nsa_pool_to_hiradix_cache", hicache.expose_logical_host_capacity,
                 "after"),
        HookSpec(f"{_HYBRID_CONTROLLER}.write", lane_hooks.backup_in_owner_lanes, "around"),
        HookSpec(f"{_HYBRID_CONTROLLER}.load", lane_hooks.load_back_in_host_lanes, "around"),
        HookSpec("sglang.srt.managers.cache_controller.HiCacheController.move_indices", hicache.move_own_rows,
                 "around"),
        HookSpec(f"{_HOST_POOL_GROUP}.backup_from_device_all_layer", hicache.backup_own_rows, "around"),
        HookSpec(f"{_HOST_POOL_GROUP}.load_to_device_per_layer", hicache.load_own_rows, "around"),
        HookSpec(f"{_HIRADIX}.loading_check", hicache.agree_on_loads_done, "around"),
        # --- HiCache's storage tier (L3): each rank stores and fetches its own pages
        HookSpec(f"{_HYBRID_CONTROLLER}.attach_storage_backend", hicache.shard_storage_backend, "after"),
        HookSpec(f"{_HYBRID_CONTROLLER}._storage_hit_query", hicache.hit_query_own_pages, "around"),
        HookSpec(f"{_HYBRID_CONTROLLER}._page_transfer", hicache.mark_prefetch_transfer_done, "around"),
        HookSpec("sglang.srt.managers.cache_controller.HiCacheController.append_host_mem_release",
                 hicache.release_host_pages_in_prefetch_order, "around"),
        HookSpec(f"{_HIRADIX}.prefetch_from_storage", hicache.open_prefetch_pages, "around"),
        HookSpec(f"{_HIRADIX}.check_prefetch_progress", hicache.resolve_prefetch_pages, "around"),
        HookSpec(f"{_HIRADIX}.release_aborted_request", hicache.resolve_aborted_prefetch_pages, "around"),
        HookSpec(f"{_HIRADIX}.drain_storage_control_queues", hicache.drain_with_prefetch_pages, "around"),
        HookSpec(f"{_HIRADIX}._force_release_pending_storage_ops", hicache.release_prefetch_pages_on_detach,
                 "around"),
        # --- PD transfer of each rank's shard
        *_transfer_hooks_on_both_releases(),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.__init__", transfer.prepare_prefill_transfer, "after"),
        # an aborted request in the waiting queue: decode told at once
        HookSpec("sglang.srt.disaggregation.prefill.release_req_to_metadata_buffer",
                 transfer.fail_unsent_room_on_release, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.sync_status_to_decode_endpoint",
                 transfer.report_failure_cause_to_decode, "around"),
        # a failed room: each rank tells decode once its last write of it is done (drain markers
        # behind its chunks, met by the transfer workers)
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.transfer_worker", transfer.drain_markers_reach_the_worker, "around"),
        HookSpec(f"{_MOONCAKE}.MooncakeKVSender.failure_exception", transfer.drain_room_failed_by_the_group, "around"),
        # (decode: a rank's Success for a room decode already gave up counts as its drain)
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.start_decode_thread", transfer.watch_late_successes, "around"),
        # --- the decode server (flag on there too): refuse at once a request it can never hold
        HookSpec(f"{_DECODE_QUEUE}.__init__", decode_server.check_decode_server, "after"),
        HookSpec(f"{_DECODE_QUEUE}._check_if_req_exceed_kv_capacity", decode_server.refuse_what_decode_can_never_hold,
                 "around"),
        # ... and hold a failed room's pages and metadata slot until every prefill rank is done with them
        HookSpec(f"{_DECODE_TRANSFER_QUEUE}.__init__", decode_server.hold_failed_rooms, "after"),
        HookSpec(f"{_DECODE_TRANSFER_QUEUE}.pop_transferred", decode_server.pop_transferred_holding_failed_rooms,
                 "around"),
        HookSpec("sglang.srt.mem_cache.common.release_kv_cache", decode_server.release_unless_held, "around"),
        HookSpec("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
                 decode_server.release_drained_rooms, "after"),
        HookSpec("sglang.srt.managers.scheduler.Scheduler.is_fully_idle", decode_server.busy_while_holding, "after"),
    )


@functools.cache
def _hooks_v0523() -> Tuple[HookSpec, ...]:
    """SGLang 0.5.23: the settings layer (:mod:`.settings.server_args_v0523`), the
    pool and capacity (:mod:`.pool.capacity_v0523`), the idle pool audit
    (:mod:`.observability.idle_pool_audit_v0523`), the forward path under interleave CP
    (:mod:`.forward.hooks_v0523`), HiCache's host and storage tiers (:mod:`.hicache.hooks_v0523`), the decode
    server (:mod:`.decode.server_v0523`) and the PD
    transfer (:mod:`.transfer.hooks`, :mod:`.transfer.hooks_v0523` where 0.5.23 changed the
    target's shape)."""
    from sglang_cp_shared_kv.pool import capacity_v0523
    from sglang_cp_shared_kv.decode import server_v0523 as decode_server_dsa
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0523 as idle_pool_audit, metrics
    from sglang_cp_shared_kv.settings import server_args_v0523 as dsa
    from sglang_cp_shared_kv.forward import hooks_v0523 as forward
    from sglang_cp_shared_kv.hicache import hooks_v0523 as hicache
    from sglang_cp_shared_kv.hicache import lane_hooks
    from sglang_cp_shared_kv.transfer import hooks_v0523 as transfer_dsa

    return (
        HookSpec(f"{_SERVER_ARGS}.add_cli_args", dsa.add_flag_and_alias_to_parser, "after"),
        HookSpec(f"{_SERVER_ARGS}.from_cli_args", dsa.from_cli_args_carrying_flag, "around"),
        HookSpec("apply_prefill_cp_cuda_graph_default", dsa.prefill_cuda_graph_off, RESOLUTION),
        HookSpec("handle_kv_cache_sharding", dsa.refuse_kv_sharding_beside_the_flag, RESOLUTION),
        HookSpec(f"{_SERVER_ARGS}.check_server_args", dsa.validate_after_stock_checks, "after"),
        HookSpec(f"{_KV_CONFIGURATOR}._resolve_memory_pool_config", capacity_v0523.split_capacity, "after"),
        HookSpec(f"{_KV_CONFIGURATOR}.configure", capacity_v0523.configure_shared_pools, "around"),
        HookSpec("sglang.srt.managers.scheduler.Scheduler.emit_metrics_constants",
                 metrics.emit_physical_capacity_with_constants, "after"),
        # an idle scheduler's pool page by page, beside SGLang's own idle check (--enable-metrics): the
        # check moved to the invariant checker, which the watchdog calls too; the audit takes on_idle's only
        HookSpec("sglang.srt.managers.scheduler.Scheduler.on_idle", idle_pool_audit.mark_idle_check, "around"),
        HookSpec("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
                 "._check_all_pools", idle_pool_audit.audit_idle_pools, "after"),
        # --- forward path (interleave CP): owner-only writes of the gathered chunk, dense-view reads
        HookSpec(f"{_DSA_BACKEND}.init_forward_metadata", forward.attach_batch_state, "after"),
        HookSpec(f"{_DSA_INDEXER}._store_index_k_cache", forward.store_index_k_owned_and_dense, "around"),
        # a batch too short to deal out runs unsplit, its index key through SGLang's fused store
        HookSpec(f"{_DSA_INDEXER}._fused_k_prepare_and_store", forward.fused_index_k_owned_and_dense, "around"),
        HookSpec(f"{_DSA_BACKEND}.forward_extend", forward.forward_extend_on_dense_view, "around"),
        _forward_agreement_hook(),
        # --- HiCache (L2): each rank's host pool holds, backs up and loads back its own pages
        # (stock agrees the progress and narrows every copy once the controller is sharded)
        HookSpec(f"{_HOST_POOLS}.build_kv_host_pool", hicache.build_owner_local_host_pool, "around"),
        HookSpec(f"{_HOST_POOLS}.attach_hybrid_pool_to_unified_cache", hicache.mark_controller_sharded, "after"),
        HookSpec(f"{_HYBRID_CONTROLLER}.allocate_host_transfers", lane_hooks.backup_in_owner_lanes, "around"),
        HookSpec(f"{_HYBRID_CONTROLLER}.load", lane_hooks.load_back_in_host_lanes, "around"),
        # --- HiCache's storage tier (L3): each rank stores and fetches its own pages (stock agrees
        # the hit, the fetched count and every host page's release on the scheduler thread)
        HookSpec(f"{_HYBRID_CONTROLLER}.attach_storage_backend", hicache.shard_storage_backend, "after"),
        # the external L3 layout (a router's own lookup in the store) names no @cp<N> key: off, saying why
        HookSpec("sglang.srt.managers.scheduler.Scheduler._hicache_l3_layout", hicache.describe_sharded_l3_layout,
                 "after"),
        # --- the decode server (flag on there too): refuse at once a request it can never hold
        HookSpec(f"{_DECODE_QUEUE}.__init__", decode_server_dsa.check_decode_server, "after"),
        HookSpec(f"{_DECODE_QUEUE}._check_if_req_exceed_kv_capacity",
                 decode_server_dsa.refuse_what_decode_can_never_hold, "around"),
        # --- PD transfer of each rank's shard
        *_transfer_hooks_on_both_releases(),
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.__init__", transfer_dsa.prepare_prefill_transfer, "after"),
        # 0.5.23 sends the index pages from CP rank 0 only; each rank holds (and sends) its own
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager._should_skip_cp_replicated_state_transfer",
                 transfer_dsa.every_rank_sends_its_index_pages, "around"),
        # (0.5.23 aborts every queue through the sender, so maybe_release_metadata_buffer, also
        # called on a requeue, is not hooked)
        HookSpec(f"{_MOONCAKE}.MooncakeKVManager.conclude_transfer", transfer_dsa.report_failure_cause_to_decode,
                 "around"),
        # a prompt refused at intake gets no sender (0.5.23): decode told at once, not at its timeout
        HookSpec(f"{_PREFILL_QUEUE}.add", transfer_dsa.fail_room_refused_at_intake, "around"),
    )


#: Each served release's table, built on first use (module docstring).
_TABLES = {v0512.RELEASE: _hooks_v0512, v0523.RELEASE: _hooks_v0523}

#: On an SGLang release the plugin does not serve (``releases.installed.SUPPORTED``): the
#: flag alone, which refuses to start, naming the supported releases.
UNSUPPORTED_BASE_HOOKS = (
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", server_args.add_refusing_flag_to_parser, "after"),
)


def hooks_for(release: Optional[Release]) -> Tuple[HookSpec, ...]:
    """The hook table of ``release`` (None: a release the plugin does not serve)."""
    table = _TABLES.get(release)
    return table() if table is not None else UNSUPPORTED_BASE_HOOKS


def __getattr__(name: str):
    if name == "HOOKS":  # the installed release's table, built on first use (module docstring)
        return hooks_for(INSTALLED)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    register_hooks(hooks_for(INSTALLED))
