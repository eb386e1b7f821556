"""The sharded HiCache storage tier (L3) on CP groups of N = 2, 3, 4 CPU processes (gloo), SGLang
0.5.12.post1's real HiRadixCache and its Mooncake backend against a real Mooncake store on
loopback (``sglang_cp_shared_kv_testing.hicache_l3_v0512``): each rank stores and fetches only its
own pages under keys naming the CP size; the bytes loaded back after a prefetch equal what was
written (and the stock run's); a lost object or a failed fetch on one rank shortens the group's
hit on every rank alike, and so does a backend call that raises on one rank (a fetch, an existence
query or a store), counted and logged there; a group of another CP size misses what this group
stored while it is in the store, and would hit it under keys that do not name the CP size (the
negative control); no host page leaks, also of a prefetch SGLang stopped tracking."""

import pytest

from sglang_cp_shared_kv_testing.hicache_l3_checks import (
    PAGE,
    check_backend_error_contained,
    check_no_leak,
    check_other_cp_size_misses,
    check_own_pages,
    check_round_trip,
    check_the_miss_check_fails_without_cp_size_keys,
)
from sglang_cp_shared_kv_testing.hicache_l3_v0512 import (
    BACKEND_RAISES,
    CASES,
    OTHER_CP_SIZE,
    SIZE_BLIND_CONTROL,
    run_storage_group,
)
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master

ALL = CASES + BACKEND_RAISES + (OTHER_CP_SIZE, SIZE_BLIND_CONTROL)
CASE = {case.name: case for case in ALL}
SHARDED = [case.name for case in ALL if case.flag and not case.size_blind_keys]


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


@pytest.mark.parametrize("name", [case.name for case in ALL])
def test_the_prefetched_pages_load_back_bit_identical_and_every_rank_agrees(group_run, name):
    check_round_trip(CASE[name], group_run[2])


@pytest.mark.parametrize("name", [case.name for case in ALL])
def test_no_host_page_leaks_and_the_host_tier_is_n_times(group_run, name):
    n, _extra, ranks = group_run
    check_no_leak(CASE[name], ranks, n)


@pytest.mark.parametrize("name", SHARDED)
def test_each_rank_stores_and_fetches_only_its_own_pages_under_keys_naming_the_cp_size(group_run, name):
    n, _extra, ranks = group_run
    case = CASE[name]
    if case.prefetch_twice:  # two prefetches fetched every page, the second one's was loaded back
        assert sum(cases[name]["pages_copied"]["stored"] for cases in ranks) == case.pages
        assert sum(cases[name]["pages_copied"]["fetched"] for cases in ranks) == 2 * case.pages
        assert sum(cases[name]["pages_copied"]["loaded_back"] for cases in ranks) == case.pages
        return
    check_own_pages(case, ranks)


def test_stock_storage_keys_name_no_cp_size(group_run):
    n, _extra, ranks = group_run
    for rank, cases in enumerate(ranks):
        stored = cases["stock"]["stored"]
        assert stored["mla_stock"] == stored["index_stock"] == [1] * CASE["stock"].pages, rank
        assert not cases["stock"]["sharded"], rank


def test_a_group_of_another_cp_size_misses_cleanly(group_run):
    """A request this group stored, confirmed in the store under ``<hash>@cp<N>``, prefetched again
    inside this group under the keys of a group of N + 1: no page found, nothing fetched or loaded,
    no host page leaked. (A group started after this one exits could not tell: the store drops a
    group's objects with the segments its clients mounted.)"""
    check_other_cp_size_misses(OTHER_CP_SIZE, group_run[2])


def test_the_other_cp_size_check_fails_when_keys_do_not_name_the_cp_size(group_run):
    """The negative control: the same round trip and lookup with keys that name no CP size
    (``<hash>@cp`` for a group of any size) finds and loads back the whole request under the keys
    of a group of N + 1, so the check above fails on it."""
    check_the_miss_check_fails_without_cp_size_keys(SIZE_BLIND_CONTROL, group_run[2])


@pytest.mark.parametrize("name", [case.name for case in BACKEND_RAISES])
def test_a_backend_call_raising_on_one_rank_fails_only_its_pages_counted_and_logged(group_run, name):
    """One CP rank's backend (rank 1's; rank 0's, holding the first page, for a second fetch) raises
    on every call of a fetch, an existence query or a store (a Mooncake master out of reach). Stock
    0.5.12.post1 lets the raise end that rank's storage thread (I/O, prefetch or backup), and the
    other ranks then wait for it at their next MIN: the rig's prefetch or backup never settles.
    Here the run completes on every rank, the raise counted and logged on that rank alone; the
    agreed hit, bytes and host pages are the tests above."""
    check_backend_error_contained(CASE[name], group_run[2])
