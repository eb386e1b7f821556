"""Sharded HiCache on CP groups of N = 2, 3, 4 CPU processes (gloo), SGLang 0.5.12.post1's real
HiRadixCache: each rank backs up to host memory and loads back only its own pages, and the
bytes read back equal the stock (replicated) HiCache run's, bit for bit
(``sglang_cp_shared_kv_testing.hicache_cp_v0512``)."""

import pytest

from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NsaModelShape
from sglang_cp_shared_kv.pool.planner import plan_host_tier
from sglang_cp_shared_kv_testing.hicache_cp_v0512 import CASES, CONTROL, run_hicache_group

CASE_NAMES = [case.name for case in CASES]
DTYPE_NAMES = {case.name: case.dtype_name for case in CASES}
#: the rig's pools (hicache_rig_v0512: two layers of the real NSA row geometry)
RIG_SHAPE = NsaModelShape("hicache rig", num_layers=2, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
                          index_head_dim=INDEX_DIM, index_topk=2048, max_context_len=1 << 16)
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
        assert host["metric_host_tokens"] == {"physical": host["physical_size"], "logical": host["size"]}, rank
        # the bytes stock gives a rank's host pool for its (physical) device pool; N times the tokens
        assert host["physical_size"] == host["stock_size_for_physical_pool"]
        assert host["size"] == n * host["physical_size"]
        # the capacity planner sizes a rank's host memory as SGLang just did, byte for byte
        plan = plan_host_tier(RIG_SHAPE, n, DTYPE_NAMES[name], host["device_physical_size"], hicache_ratio=2.0)
        assert (plan.host_tokens_per_rank, plan.logical_host_tokens) == (host["physical_size"], host["size"])
        assert (plan.mla_host_bytes_per_rank, plan.index_host_bytes_per_rank) == (
            host["kv_host_bytes"], host["index_host_bytes"])


def test_the_control_with_lanes_ignored_comes_back_wrong(group_run):
    """Host pages dealt out without their device pages' lanes: some rank copies rows of pages
    it does not hold, and the test above would see it (wrong bytes or a page off its lane)."""
    n, ranks = group_run
    cases = [r[CONTROL.name] for r in ranks]
    assert any(c["errors"] or not c["owners_match_lanes"] for c in cases)


def test_the_gpu_runs_load_back_control_corrupts_only_the_named_ranks_load_backs():
    """scripts/e2e_hicache_logprobs.py's negative control (CPSKV_E2E_CORRUPT_LOAD_RANK=1 in
    scripts/e2e/sitecustomize.py) must reach the bytes the flag's host tier loads back: here,
    on the same rig, the request's bytes read back over the group differ from stock's in one
    page, the request's second (logical page 2: rank 1's first), MLA rows only, on both layers."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = ("import json\n"
              "from sglang_cp_shared_kv_testing.hicache_cp_v0512 import CASES, run_hicache_group\n"
              "ranks = run_hicache_group(2, cases=(CASES[0],))\n"
              "print('ERRORS', json.dumps([r[CASES[0].name]['errors'] for r in ranks]))\n")
    env = {**os.environ, "CPSKV_E2E": "1", "CPSKV_E2E_CORRUPT_LOAD_RANK": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "scripts" / "e2e"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ERRORS"))[len("ERRORS"):])
    # (every rank compares the group's bytes, so both see rank 1's page)
    assert errors[0] == errors[1] == [f"mla layer {layer}: rows {list(range(64, 72))}... differ" for layer in (0, 1)], errors
    assert out.stdout.count("zeroes the first page of each HiCache load-back") >= 2  # each rank process said so
