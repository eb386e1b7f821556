"""Sharded HiCache on CP groups of N = 2, 3, 4 CPU processes (gloo), SGLang 0.5.12.post1's real
HiRadixCache: each rank backs up to host memory and loads back only its own pages, and the
bytes read back equal the stock (replicated) HiCache run's, bit for bit
(``sglang_cp_shared_kv_testing.hicache_cp_v0512``)."""

import pytest

from sglang_cp_shared_kv_testing.hicache_cp_v0512 import CASES, CONTROL, run_hicache_group

CASE_NAMES = [case.name for case in CASES]
REQUEST_PAGES = {case.name: case.request_pages for case in CASES}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def group_run(request):
    return request.param, run_hicache_group(request.param)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_loaded_back_bytes_equal_the_stock_run(group_run, name):
    n, ranks = group_run
    for rank, cases in enumerate(ranks):
        case = cases[name]
        assert case["errors"] == [], f"rank {rank}: {case['errors']}"
        assert case["host_hit_length"] == case["stock_host_hit_length"] == REQUEST_PAGES[name] * 64
        assert case["device_hit_after_load"] == REQUEST_PAGES[name] * 64


@pytest.mark.parametrize("name", CASE_NAMES)
def test_every_rank_decides_the_same_locations_and_each_page_lands_on_its_lane(group_run, name):
    n, ranks = group_run
    first = ranks[0][name]
    for rank, cases in enumerate(ranks):
        case = cases[name]
        assert case["new_locs"] == first["new_locs"] and case["host_indices"] == first["host_indices"], rank
        assert case["owners_match_lanes"], f"rank {rank}: a page loaded back off its host page's rank"
        assert case["foreign_host_rows_untouched"], f"rank {rank} wrote host pages of another rank's lane"
        # one agreement per load-back (the plugin's), in the same place on every rank
        assert case["sync_calls"] == first["sync_calls"]
        assert case["sync_calls"]["loading_check"] == {"_all_reduce_attn_groups": 1}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_each_rank_copies_only_its_pages_and_the_host_capacity_is_n_times(group_run, name):
    n, ranks = group_run
    hosts = [cases[name]["host"] for cases in ranks]
    assert sum(h["own_pages"] for h in hosts) == REQUEST_PAGES[name]
    for rank, host in enumerate(hosts):
        assert host["pages_backed_up"] == host["pages_loaded_back"] == host["own_pages"], rank
        # --enable-metrics: the Prometheus counter says the same, per rank and direction
        assert host["metric_pages"] == {"backed_up": host["own_pages"], "loaded_back": host["own_pages"]}, rank
        # the bytes stock gives a rank's host pool for its (physical) device pool; N times the tokens
        assert host["physical_size"] == host["stock_size_for_physical_pool"]
        assert host["size"] == n * host["physical_size"]


def test_the_control_with_lanes_ignored_comes_back_wrong(group_run):
    """Host pages dealt out without their device pages' lanes: some rank copies rows of pages
    it does not hold, and the test above would see it (wrong bytes or a page off its lane)."""
    n, ranks = group_run
    cases = [r[CONTROL.name] for r in ranks]
    assert any(c["errors"] or not c["owners_match_lanes"] for c in cases)
