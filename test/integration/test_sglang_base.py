"""Which SGLang release the plugin runs on: the installed one picks the hook table, and on a
release without one the flag refuses to start, naming the supported releases."""

import argparse

import pytest

from sglang_cp_shared_kv import plugin

from sglang_cp_shared_kv.settings import server_args
from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.releases import installed, v0523
from sglang_cp_shared_kv.settings.config import FLAG, FLAG_DEST


def test_the_installed_sglang_is_a_supported_base():
    """The environment the suite runs in (scripts/bootstrap.sh) has a table: every hook."""
    release = installed.for_version(installed.INSTALLED_VERSION)
    assert release is installed.INSTALLED is not None and plugin.hooks_for(release) is plugin.HOOKS


@pytest.mark.parametrize("version", ["0.5.22", "0.5.12", "0.5.24", None])
def test_on_another_release_the_flag_alone_is_registered(version):
    assert installed.for_version(version) is None
    assert plugin.hooks_for(installed.for_version(version)) == plugin.UNSUPPORTED_BASE_HOOKS
    (spec,) = plugin.UNSUPPORTED_BASE_HOOKS
    assert spec.target.endswith("ServerArgs.add_cli_args") and spec.hook_type == "after"


def test_naming_the_flag_on_an_unsupported_release_stops_the_parse_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(installed, "INSTALLED_VERSION", "0.5.22")
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    parser.add_argument("--enable-nsa-prefill-context-parallel", action="store_true")
    server_args.add_refusing_flag_to_parser(None, parser)
    assert getattr(parser.parse_args([]), FLAG_DEST) is False  # left out: nothing changes
    assert parser.parse_args(["--enable-nsa-prefill"]).enable_nsa_prefill_context_parallel  # stock abbreviation
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([FLAG])
    assert exc.value.code == 2
    message = capsys.readouterr().err
    assert FLAG in message and "sglang==0.5.12.post1" in message and "installed sglang is 0.5.22" in message
    assert "drop the flag" in message


IMPORT_CHECK = """
import sys
from sglang_cp_shared_kv import sglang_api as sg

def refuse(name):
    raise AssertionError(f"resolved SGLang symbol {name} before the release was checked")

sg.resolve = refuse
from sglang_cp_shared_kv import plugin
(spec,) = plugin.hooks_for(None)
print("OK", spec.target, sorted(m for m in sys.modules if m.startswith("sglang_cp_shared_kv.")))
"""


def test_the_entry_point_module_touches_no_sglang_symbol_before_the_release_is_known():
    """SGLang imports plugin.py in every process; on 0.5.23 the pool module's class statement
    (a subclass of 0.5.12's NSATokenToKVPool) would raise and the plugin would not load at all
    -- the flag then failing as an unknown argument. Found running the entry point on a real
    0.5.23 install (2026-12-03)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "python")}
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("OK sglang.srt.server_args.ServerArgs.add_cli_args")
    for module in ("pool.kv_pool_v0512", "pool.capacity", "pool.allocator", "forward.hooks", "transfer.hooks"):
        assert f"sglang_cp_shared_kv.{module}'" not in out.stdout


_HYBRID = "sglang.srt.mem_cache.hybrid_cache"
#: HiCache's hooks on 0.5.23: the host tier (L2) and, where built, the storage tier (L3)
HICACHE_HOOKS_V0523 = (
    (f"{_HYBRID}.hybrid_pool_assembler.build_kv_host_pool", "around"),
    (f"{_HYBRID}.hybrid_pool_assembler.attach_hybrid_pool_to_unified_cache", "after"),
    (f"{_HYBRID}.hybrid_cache_controller.HybridCacheController.allocate_host_transfers", "around"),
    (f"{_HYBRID}.hybrid_cache_controller.HybridCacheController.load", "around"),
    (f"{_HYBRID}.hybrid_cache_controller.HybridCacheController.attach_storage_backend", "after"),
    ("sglang.srt.managers.scheduler.Scheduler._hicache_l3_layout", "after"),
)


def test_on_0523_the_table_holds_every_concern():
    """0.5.23 is served: the flag parses (under its DSA-era alias too), rides into the
    scheduler processes and is validated in 0.5.23's terms; the pool and capacity hooks, the
    forward path's, the decode server's and the PD transfer's are in (test_settings_v0523.py,
    test_capacity_v0523.py, test_kv_pool_v0523.py, test_forward_hooks_v0523.py,
    test_cp_harness_v0523.py, test_decode_admission_v0523.py, test_transfer_hooks_v0523.py and
    test_transfer_mooncake_e2e.py run them against 0.5.23's real classes)."""
    from sglang_cp_shared_kv.pool import capacity_v0523 as capacity_dsa
    from sglang_cp_shared_kv.decode import server_v0523 as decode_server_dsa
    from sglang_cp_shared_kv.observability import idle_pool_audit_v0523 as idle_pool_audit, metrics
    from sglang_cp_shared_kv.settings import server_args_v0523 as server_args_dsa
    from sglang_cp_shared_kv.forward import hooks as forward
    from sglang_cp_shared_kv.forward import hooks_v0523 as forward_dsa
    from sglang_cp_shared_kv.hicache import hooks_v0523 as hicache_dsa
    from sglang_cp_shared_kv.hicache import lane_hooks
    from sglang_cp_shared_kv.hook_check import RESOLUTION
    from sglang_cp_shared_kv.transfer import hooks as transfer
    from sglang_cp_shared_kv.transfer import hooks_v0523 as transfer_dsa

    table = plugin.hooks_for(v0523.RELEASE)
    assert installed.for_version(v0523.RELEASE.version) is v0523.RELEASE
    assert {spec.hook.__module__ for spec in table} == {server_args_dsa.__name__, capacity_dsa.__name__,
                                                         forward_dsa.__name__, decode_server_dsa.__name__,
                                                         metrics.__name__, idle_pool_audit.__name__,
                                                         forward.__name__,  # the agreement point: both releases
                                                         transfer.__name__, transfer_dsa.__name__,
                                                         # HiCache's host tier (the lane hooks: both releases)
                                                         hicache_dsa.__name__, lane_hooks.__name__}
    backend = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
    indexer = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer"
    configurator = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    decode_queue = "sglang.srt.disaggregation.decode.DecodePreallocQueue"
    mooncake = "sglang.srt.disaggregation.mooncake.conn"
    assert {(spec.target, spec.hook_type) for spec in table} == {
        ("sglang.srt.server_args.ServerArgs.add_cli_args", "after"),
        ("sglang.srt.server_args.ServerArgs.from_cli_args", "around"),
        ("sglang.srt.server_args.ServerArgs.check_server_args", "after"),
        ("apply_prefill_cp_cuda_graph_default", RESOLUTION),
        ("handle_kv_cache_sharding", RESOLUTION),
        (f"{configurator}._resolve_memory_pool_config", "after"),
        (f"{configurator}.configure", "around"),
        ("sglang.srt.managers.scheduler.Scheduler.emit_metrics_constants", "after"),
        ("sglang.srt.managers.scheduler.Scheduler.on_idle", "around"),  # the idle pool audit
        ("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_all_pools",
         "after"),
        (f"{backend}.init_forward_metadata", "after"),
        (f"{backend}.forward_extend", "around"),
        (f"{indexer}._store_index_k_cache", "around"),
        (f"{indexer}._fused_k_prepare_and_store", "around"),
        ("sglang.srt.model_executor.model_runner.ModelRunner.forward", "after"),
        (f"{decode_queue}.__init__", "after"),
        (f"{decode_queue}._check_if_req_exceed_kv_capacity", "around"),
        ("sglang.srt.disaggregation.utils.filter_kv_indices_for_cp_rank", "around"),
        (f"{mooncake}.MooncakeKVManager.__init__", "after"),
        ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager", "after"),
        ("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add", "around"),
        *((f"{mooncake}.MooncakeKVManager.{name}", "around") for name in (
            "add_transfer_request", "_transfer_data", "_should_skip_cp_replicated_state_transfer",
            "maybe_send_extra", "send_aux", "update_status", "conclude_transfer", "_handle_aux_data")),
        ("sglang.srt.disaggregation.common.conn.CommonKVSender.abort", "around"),
        (f"{mooncake}.MooncakeKVReceiver.failure_exception", "around"),
        *HICACHE_HOOKS_V0523}
    assert v0523.RELEASE.symbols is not sg.SYMBOLS  # 0.5.12.post1's here
