"""The sharded HiCache storage tier (L3) on CP groups of N = 2, 3, 4 CPU processes (gloo), SGLang
0.5.12.post1's real HiRadixCache and its Mooncake backend against a real Mooncake store on
loopback (``sglang_cp_shared_kv_testing.hicache_l3_v0512``): each rank stores and fetches only its
own pages under keys naming the CP size; the bytes loaded back after a prefetch equal what was
written (and the stock run's); a lost object or a failed fetch on one rank shortens the group's
hit on every rank alike; a group of another CP size misses; no host page leaks, also of a
prefetch SGLang stopped tracking."""

import pytest

from sglang_cp_shared_kv_testing.hicache_l3_v0512 import CASES, fetch_only, run_storage_group
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master

PAGE = 64
CASE = {case.name: case for case in CASES}
SHARDED = [case.name for case in CASES if case.flag]


@pytest.fixture(scope="module")
def master():
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def group_run(request, master):
    # NOTE: prefetch_threshold one page: SGLang revokes a prefetch whose hit is shorter (256
    # tokens by default), and the lost-page cases hit one to three pages
    extra = master.extra_config(prefetch_threshold=PAGE)
    # each group size stores under its own keys (<hash>@cp<N>) in the one store the module shares
    return request.param, extra, run_storage_group(request.param, extra)


def _expected_hit_pages(name, ranks):
    case = CASE[name]
    if case.lose_page is not None:
        return case.lose_page
    if case.fail_fetch is not None:
        rank, first = case.fail_fetch
        lanes = ranks[0][name]["prefetch_lanes"]
        return next(p for p in range(first, case.pages) if lanes[p] == rank)
    return case.pages


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_the_prefetched_pages_load_back_bit_identical_and_every_rank_agrees(group_run, name):
    n, _extra, ranks = group_run
    hit = _expected_hit_pages(name, ranks) * PAGE
    first = ranks[0][name]
    for rank, cases in enumerate(ranks):
        case = cases[name]
        assert case["errors"] == [], f"rank {rank}: {case['errors']}"
        # the request had left device and host memory: only the store could give it back
        assert (case["device_hit_before"], case["host_hit_before"]) == (0, 0), rank
        assert case["loaded_tokens"] == case["host_hit_length"] == hit, rank
        assert case["new_locs"] == first["new_locs"] and len(case["new_locs"]) == hit, rank
        assert case["steps"] == first["steps"], rank  # (the same scheduler steps on every rank)


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_no_host_page_leaks_and_the_host_tier_is_n_times(group_run, name):
    n, _extra, ranks = group_run
    for rank, cases in enumerate(ranks):
        case = cases[name]
        free_plus_tree, size = case["host_tokens"]
        assert free_plus_tree == size, f"rank {rank}: {size - free_plus_tree} host tokens leaked"
        free_plus_tree, size = case["host_tokens_after_detach"]
        assert free_plus_tree == size, f"rank {rank}: {size - free_plus_tree} host tokens leaked by the detach"
    if CASE[name].flag:
        assert ranks[0][name]["host_tokens"][1] == n * (2 * 8 + 1) * PAGE  # ratio 2 x 8 pages + 1, per rank


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_stores_and_fetches_only_its_own_pages_under_keys_naming_the_cp_size(group_run, name):
    n, _extra, ranks = group_run
    case = CASE[name]
    lanes = ranks[0][name]["prefetch_lanes"]
    hit_pages = _expected_hit_pages(name, ranks)
    assert sum(cases[name]["pages_copied"]["stored"] for cases in ranks) == case.pages
    if case.prefetch_twice:  # two prefetches fetched every page, the second one's was loaded back
        assert sum(cases[name]["pages_copied"]["fetched"] for cases in ranks) == 2 * case.pages
        assert sum(cases[name]["pages_copied"]["loaded_back"] for cases in ranks) == case.pages
        return
    for rank, cases in enumerate(ranks):
        result = cases[name]
        assert result["sharded"] and not result["backup_skip"], rank
        own = [p for p in range(case.pages) if lanes[p] == rank]
        assert result["pages_copied"]["loaded_back"] == sum(1 for p in own if p < hit_pages), rank
        # what this rank fetched: its pages in the group's agreed hit (a lost page ends it before
        # any fetch); a rank whose fetches fail from a page on fetched its pages before that page
        # only, while the others fetched all of theirs (the group then inserts the shorter run)
        if case.fail_fetch is None:
            fetched = sum(1 for p in own if p < hit_pages)
        elif case.fail_fetch[0] == rank:
            fetched = sum(1 for p in own if p < case.fail_fetch[1])
        else:
            fetched = len(own)
        assert result["pages_copied"]["fetched"] == fetched, rank
        stored = result["stored"]
        # every page of the request under the CP-size key, MLA and index K; none under stock's key
        expected_mla = [0 if p == case.lose_page else 1 for p in range(case.pages)]
        assert stored["mla_ours"] == expected_mla and stored["index_ours"] == [1] * case.pages, rank
        assert stored["mla_stock"] == stored["index_stock"] == [0] * case.pages, rank


def test_stock_storage_keys_name_no_cp_size(group_run):
    n, _extra, ranks = group_run
    for rank, cases in enumerate(ranks):
        stored = cases["stock"]["stored"]
        assert stored["mla_stock"] == stored["index_stock"] == [1] * CASE["stock"].pages, rank
        assert not cases["stock"]["sharded"], rank


def test_a_group_of_another_cp_size_misses_cleanly(group_run):
    n, extra, _ranks = group_run
    other = 2 if n != 2 else 3
    seed = CASE["sharded"].seed  # what the group of n stored (and stock, under its own keys)
    ranks = run_storage_group(other, extra, (fetch_only(seed),))
    for rank, cases in enumerate(ranks):
        case = cases[f"fetch_only_{seed}"]
        assert case["errors"] == [], rank
        assert case["loaded_tokens"] == case["host_hit_length"] == 0, rank
        assert case["pages_copied"]["fetched"] == 0, rank
        free_plus_tree, size = case["host_tokens"]
        assert free_plus_tree == size, rank
