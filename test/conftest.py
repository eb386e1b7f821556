"""Shared pytest setup. The plugin, its kernels and its test rigs
(``sglang_cp_shared_kv.testing``) are importable as installed packages
(``scripts/bootstrap.sh test``; on the GPU machine ``scripts/gpu_session.sh`` puts the
checkout on PYTHONPATH): no ``sys.path`` edits here."""

from pathlib import Path  # noqa: E402

from sglang_cp_shared_kv import sglang_api as sg  # noqa: E402

#: What runs where the installed SGLang is 0.5.23 (``sglang_api.SGLANG_VERSION_0523``;
#: ``scripts/bootstrap.sh test-0.5.23``): the modules that do not touch an SGLang class, the
#: 0.5.23 tests of each concern and the suites parametrized over both releases (the Mooncake
#: PD e2e). NOTE: the rest drive what only 0.5.12.post1 has (its NSA pool and classes, the
#: in-seq split, local writes, compute-owner pages, the selfcheck's rigs, the real-server
#: scripts); each run says which files it left out.
SGLANG_0523_TESTS = frozenset({
    "test_repository.py",
    "unit/test_dense_layout.py", "unit/test_kernel_bench_dry_run.py", "unit/test_kernel_fallbacks.py",
    "unit/test_kernel_references.py", "unit/test_layout.py", "unit/test_nvtx.py",
    "unit/test_package_structure.py", "unit/test_planner.py", "unit/test_prometheus_registry.py",
    "unit/test_scoped.py", "unit/test_stable_topk.py", "unit/test_stage_timer.py", "unit/test_transfer_pages.py",
    "unit/test_compare_upstream_kv_sharding.py", "integration/test_sglang_0523_settings.py",
    "integration/test_kv_configurator_0523.py", "integration/test_pool_dsa_0523.py",
    "integration/test_capacity_0523.py", "integration/test_decode_admission_0523.py",
    "integration/test_cp_harness_0523.py", "integration/test_forward_hooks_0523.py",
    "integration/test_deploy_commands_0523.py", "integration/test_launch_server_0523.py",
    "integration/test_transfer_hooks_0523.py", "integration/test_transfer_mooncake_e2e.py",
    "integration/test_metrics_0523.py", "integration/test_fused_index_store_source.py",
    "integration/test_selfcheck.py", "integration/test_rank_agreement.py", "unit/test_rank_agreement_audit.py",
})
_HERE = Path(__file__).resolve().parent
_INSTALLED = sg.installed_sglang_version()  # NOTE: read once, not per collected path
_left_out = set()  # a path can be offered once per command-line argument


def pytest_ignore_collect(collection_path, config):
    if _INSTALLED != sg.SGLANG_VERSION_0523 or collection_path.suffix != ".py":
        return None
    name = collection_path.resolve().relative_to(_HERE).as_posix()
    if not name.startswith("test") and "/test_" not in name:
        return None  # conftest.py and helpers
    if name in SGLANG_0523_TESTS:
        return None
    _left_out.add(name)
    return True


def pytest_report_header(config):
    if _INSTALLED == sg.SGLANG_VERSION_0523:
        return f"sglang {_INSTALLED}: the tests of test/conftest.py's SGLANG_0523_TESTS are collected"
    return f"sglang {_INSTALLED}"


def pytest_terminal_summary(terminalreporter):
    if _left_out:
        terminalreporter.write_line(f"sglang {sg.SGLANG_VERSION_0523}: {len(_left_out)} test files not run "
                                    "(they drive what only sglang 0.5.12.post1 has): " + ", ".join(sorted(_left_out)))
