"""A prefix loaded back from HiCache's host tier (L2) or fetched from its storage tier (L3) on a
sharded CP prefill goes to decode like a freshly computed one: N = 2, 3 prefill CP ranks (gloo,
SGLang 0.5.12.post1's real HiRadixCache and Mooncake store on loopback) each send their own pages
over the real Mooncake engine, and decode's bytes equal the flag-off HiCache run's, bit for bit
(``sglang_cp_shared_kv_testing.hicache_pd_v0512``)."""

import pytest

from sglang_cp_shared_kv_testing.hicache_pd_v0512 import REQUEST_PAGES, ROOMS, run_hicache_pd
from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master
from sglang_cp_shared_kv_testing.support import mooncake_engine_or_skip

PAGE = 64
SENT = [name for name, _tier, _seed in ROOMS if name != "control"]


@pytest.fixture(scope="module")
def master():
    mooncake_engine_or_skip()
    with mooncake_master() as running:
        yield running


@pytest.fixture(scope="module", params=[(2, "bf16"), (3, "fp8_e4m3")], ids=lambda p: f"N={p[0]}-{p[1]}")
def pd_run(request, master):
    n, dtype_name = request.param
    # NOTE: prefetch_threshold one page, as in the storage tests (SGLang's default is 256 tokens)
    return n, run_hicache_pd(n, dtype_name, master.extra_config(prefetch_threshold=PAGE))


@pytest.mark.parametrize("name", SENT)
def test_decode_receives_the_flag_off_runs_bytes_after_a_load_back(pd_run, name):
    n, processes = pd_run
    decode = processes[n]["rooms"][name]
    assert decode["status"] == "success", decode
    assert decode["verified"], decode["problems"]
    assert processes[n]["stray_writes"] == []


@pytest.mark.parametrize("name", SENT)
def test_every_rank_sends_exactly_the_pages_it_holds(pd_run, name):
    n, processes = pd_run
    sent = []
    for rank in range(n):
        # what was sent came back from host memory (l2) or the store (l3), the whole request
        assert processes[rank]["host_hit_length"][name] == REQUEST_PAGES * PAGE, rank
        outcome = processes[rank]["rooms"][name]
        assert outcome["status"] == "success", (rank, outcome)
        assert outcome["stats"]["kv_pages"] == outcome["stats"]["state_pages"] == outcome["pages_held"], (rank, outcome)
        sent.append(outcome["pages_held"])
    assert sum(sent) == REQUEST_PAGES and min(sent) > 0, sent


def test_the_control_with_one_zeroed_page_on_rank_1_is_caught_there(pd_run):
    n, processes = pd_run
    decode = processes[n]["rooms"]["control"]
    position = processes[1]["control_position"]
    assert decode["status"] == "success" and not decode["verified"], decode
    assert decode["problems"] == [f"layer 0: kv wrong at positions [{position}]"], decode["problems"]
