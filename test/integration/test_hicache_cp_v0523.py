"""Sharded HiCache host tier (L2) on SGLang 0.5.23, CP groups of N = 2, 3, 4 CPU processes (gloo):
0.5.23's real UnifiedRadixCache, HybridCacheController and host pools (KV + DSA index K). Each
rank backs up to host memory and loads back only its own pages, and the bytes a forward's dense
view reads after the load (assembled from the owners) equal a stock (flag off, replicated)
HiCache run's, byte for byte, bf16 and fp8 (``sglang_cp_shared_kv_testing.hicache_cp_v0523``).
Also: the flag's settings on 0.5.23 (L2 served; the Mooncake storage tier, L3, served with or
without a key tag, another storage backend refused naming the fix; the storage tier itself:
``test_hicache_l3_v0523.py``)."""

import pytest

from sglang_cp_shared_kv.releases import installed, v0523

if installed.INSTALLED is not v0523.RELEASE:
    pytest.skip(f"needs sglang {v0523.RELEASE.version}", allow_module_level=True)

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE  # noqa: E402
from sglang_cp_shared_kv_testing.hicache_cp_v0523 import CASES, CONTROL, PRESSURE, run_hicache_group  # noqa: E402

CASE_NAMES = [case.name for case in CASES]
REQUEST_PAGES = {case.name: case.request_pages for case in CASES}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def group_run(request, tiny_nsa_model):
    return request.param, run_hicache_group(request.param, tiny_nsa_model)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_loaded_back_bytes_equal_the_stock_run(group_run, name):
    n, ranks = group_run
    tokens = REQUEST_PAGES[name] * PAGE_SIZE
    for rank, cases in enumerate(ranks):
        case = cases[name]
        assert case["errors"] == [], f"rank {rank}: {case['errors']}"
        assert case["host_hit_length"] == case["stock_host_hit_length"] == tokens
        assert case["loaded"] == case["device_hit_after_load"] == tokens


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_rank_decides_the_same_locations_and_copies_only_its_pages(group_run, name):
    n, ranks = group_run
    first = ranks[0][name]
    assert sum(cases[name]["own_pages"] for cases in ranks) == REQUEST_PAGES[name]
    for rank, cases in enumerate(ranks):
        case = cases[name]
        assert case["new_locs"] == first["new_locs"], rank
        # the controller narrows through the plugin's pool (stock marks only upstream's own sharded pool)
        assert case["sharded"] and not case["stock_sharded"]
        for pool in ("kv", "index"):  # MLA latent and index K, both ways: this rank's pages, each once
            copied = case["copied"][pool]
            assert len(copied["backed_up"]) == len(copied["loaded_back"]) == case["own_pages"], (rank, pool, copied)
            assert sorted(copied["backed_up"]) == sorted(copied["loaded_back"]), (rank, pool)
        # the pool's own count and, with --enable-metrics, the Prometheus counter say the same
        own = {"backed_up": case["own_pages"], "loaded_back": case["own_pages"]}
        assert case["pages_copied"] == {**own, "stored": 0, "fetched": 0} and case["metric_pages"] == own, rank
        assert case["physical_host_pages_in_own_lane"]
        assert case["foreign_host_rows_untouched"], f"rank {rank} wrote host rows it does not hold"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_ranks_host_buffers_are_stocks_for_its_physical_pool_and_the_tier_is_n_times(group_run, name):
    n, ranks = group_run
    for rank, cases in enumerate(ranks):
        host = cases[name]["host"]
        # the bytes stock gives a rank whose device pool is this rank's physical pool, KV and index K
        assert host["physical_size"] == host["expected_physical"] == host["stock_size_for_physical_pool"], rank
        assert (host["kv_bytes"], host["index_bytes"]) == (host["stock_kv_bytes"], host["stock_index_bytes"]), rank
        # the group's host tier: N times a rank's, as the pool group reports it to SGLang
        assert host["logical_size"] == host["group_logical_size"] == n * host["physical_size"], rank
        assert host["group_size"] == host["physical_size"]
        assert cases[name]["metric_host_tokens"] == {"physical": host["physical_size"],
                                                     "logical": host["logical_size"]}, rank
        # (the flag-off replicated run's host pool is sized from the whole logical device pool)
        assert host["stock_replicated_size"] > host["physical_size"]
        # after the round trip every page is free again but the request's, which the tree keeps
        assert host["free_after"] == host["logical_size"] - REQUEST_PAGES[name] * PAGE_SIZE, rank
        assert host["lane_floor_after"] <= host["free_after"]


def test_a_full_host_tier_evicts_host_pages_alike_on_every_rank_and_leaks_none(group_run):
    """More requests backed up than the group's host tier holds: a backup whose lanes run short
    evicts host pages first (the lane floor), every rank keeps the same requests in host memory,
    the probe after them still round-trips byte for byte, and every host page is either free or
    the tree's."""
    n, ranks = group_run
    tokens = PRESSURE.request_pages * PAGE_SIZE
    first = ranks[0][PRESSURE.name]
    hits = first["filler_host_hits"]
    assert len(hits) == PRESSURE.fillers * n + 1 and 0 in hits and tokens in hits  # some evicted, some kept
    for rank, cases in enumerate(ranks):
        case = cases[PRESSURE.name]
        assert case["errors"] == [] and case["host_hit_length"] == tokens, rank
        assert case["filler_host_hits"] == hits, rank
        assert case["host"]["free_after"] + case["host_tokens_in_tree"] == case["host"]["logical_size"], rank
        assert case["foreign_host_rows_untouched"], rank


def test_the_control_with_lanes_ignored_comes_back_wrong(group_run):
    """Host pages dealt out without their device pages' lanes: ranks copy rows of pages they do
    not hold, and the byte comparison above sees it."""
    n, ranks = group_run
    assert any(r[CONTROL.name]["errors"] for r in ranks)


# ---------------------------------------------------------------- settings on 0.5.23
@pytest.fixture
def hopper(monkeypatch, plugin_loaded):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")


def _args(model, *extra):
    from sglang.srt.server_args import prepare_server_args

    from sglang_cp_shared_kv.settings.config import FLAG

    return prepare_server_args(["--model-path", model, "--load-format", "dummy", "--skip-tokenizer-init", "--device",
                                "cuda", "--tp", "2", "--enable-prefill-cp", "--cp-strategy", "interleave",
                                "--page-size", "64", "--disaggregation-mode", "prefill",
                                "--disaggregation-transfer-backend", "mooncake", FLAG, *extra])


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_hicache_in_host_memory_is_served_on_0523(hopper, tiny_nsa_model, layout):
    server_args = _args(tiny_nsa_model, "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                        "--hicache-mem-layout", layout)
    server_args.resolve_once()
    server_args.check_server_args()  # no problem


@pytest.mark.parametrize("tag", [None, "tenant-a"])
def test_the_mooncake_storage_tier_is_served_on_0523_with_or_without_a_key_tag(hopper, tiny_nsa_model, tag):
    extra = ["--hicache-storage-backend-extra-config", f'{{"extra_backend_tag": "{tag}"}}'] if tag else []
    server_args = _args(tiny_nsa_model, "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                        "--hicache-storage-backend", "mooncake", *extra)
    server_args.resolve_once()
    server_args.check_server_args()  # no problem (0.5.23 tags every key once)


#: id: (HiCache options, the problem named, the fix named)
HICACHE_REFUSALS_V0523 = {
    "another_storage_backend": (("--hicache-storage-backend", "file"),
                                "--hicache-storage-backend file: the sharded HiCache storage tier serves mooncake",
                                "use --hicache-storage-backend mooncake"),
    # host memory as a staging buffer only: its pages allocated per storage operation, outside the lanes
    "buffer_only_host_memory": (("--hicache-io-backend", "direct", "--hicache-storage-backend", "mooncake",
                                 "--hicache-host-memory-mode", "buffer_only", "--hicache-ratio", "1.2"),
                                "--hicache-host-memory-mode buffer_only: the sharded host tier keeps each rank's own",
                                "remove --hicache-host-memory-mode (cache is the default)"),
}


@pytest.mark.parametrize("case", list(HICACHE_REFUSALS_V0523))
def test_what_the_sharded_hicache_does_not_serve_is_refused_on_0523_naming_the_setting_and_the_fix(
        hopper, tiny_nsa_model, case):
    from sglang_cp_shared_kv.settings.server_args import CpSharedKVConfigError

    options, problem, fix = HICACHE_REFUSALS_V0523[case]
    server_args = _args(tiny_nsa_model, "--enable-hierarchical-cache", *options)
    server_args.resolve_once()
    with pytest.raises(CpSharedKVConfigError) as exc:
        server_args.check_server_args()
    message = str(exc.value)
    assert problem in message and fix in message and message.count("\n  - ") == 1, message
