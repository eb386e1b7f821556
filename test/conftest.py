"""Shared pytest setup. The plugin, its kernels and its test rigs
(``sglang_cp_shared_kv_testing``) are importable as installed packages
(``scripts/bootstrap.sh test``; on the GPU machine ``scripts/gpu_session.sh`` puts the
checkout on PYTHONPATH): no ``sys.path`` edits here."""

from pathlib import Path  # noqa: E402

from sglang_cp_shared_kv.releases import installed, v0523

#: What runs where the installed SGLang is 0.5.23 (``releases.v0523``; ``scripts/bootstrap.sh
#: test-0.5.23``) besides its own tests (every ``*_v0523.py``): the modules that do not touch an
#: SGLang class and the suites parametrized over both releases (the Mooncake PD e2e, the
#: selfcheck, the rank agreement). NOTE: the rest drive what only 0.5.12.post1 has (its NSA pool
#: and classes, the in-seq split, local writes, compute-owner pages, the real-server scripts);
#: each run says which files it left out.
SHARED_WITH_V0523 = frozenset({
    "test_repository.py",
    "unit/test_dense_layout.py", "unit/test_kernel_bench_dry_run.py", "unit/test_kernel_fallbacks.py",
    "unit/test_kernel_references.py", "unit/test_layout.py", "unit/test_nvtx.py",
    "unit/test_package_structure.py", "unit/test_planner.py", "unit/test_prometheus_registry.py",
    "unit/test_scoped.py", "unit/test_stable_topk.py", "unit/test_stage_timer.py", "unit/test_transfer_pages.py",
    "unit/test_compare_upstream_kv_sharding.py", "unit/test_releases.py", "unit/test_share_identical_dists.py",
    "integration/test_transfer_mooncake_e2e.py", "integration/test_fused_index_store_source.py",
    "integration/test_selfcheck.py", "integration/test_rank_agreement.py", "unit/test_rank_agreement_audit.py",
    "gpu/test_stable_topk_cuda.py", "integration/test_mooncake_master.py",
})
_HERE = Path(__file__).resolve().parent
_ON_V0523 = installed.INSTALLED is v0523.RELEASE
_left_out = set()  # a path can be offered once per command-line argument


def pytest_ignore_collect(collection_path, config):
    if not _ON_V0523 or collection_path.suffix != ".py":
        return None
    name = collection_path.resolve().relative_to(_HERE).as_posix()
    if not name.startswith("test") and "/test_" not in name:
        return None  # conftest.py and helpers
    if name.endswith(f"_{v0523.RELEASE.name}.py") or name in SHARED_WITH_V0523:
        return None
    _left_out.add(name)
    return True


def pytest_report_header(config):
    if _ON_V0523:
        return (f"sglang {installed.INSTALLED_VERSION}: its own tests (*_{v0523.RELEASE.name}.py) and "
                "test/conftest.py's SHARED_WITH_V0523 are collected")
    return f"sglang {installed.INSTALLED_VERSION}"


def pytest_terminal_summary(terminalreporter):
    if _left_out:
        terminalreporter.write_line(f"sglang {v0523.RELEASE.version}: {len(_left_out)} test files not run "
                                    "(they drive what only sglang 0.5.12.post1 has): " + ", ".join(sorted(_left_out)))
