"""Shared KV is bit-exact against the replicated baseline on N = 2, 3, 4, 8 CP ranks.

One process group per N runs every scenario (see sglang_cp_shared_kv_testing/cp_harness.py for what is
compared): bf16 and fp8 KV, SGLANG_DEBUG_CP_SHARED_KV on and off; the soak alternates
the debug checks forward by forward; at N = 2, 3, 4 the chunked scenarios run again with
the one-layer-ahead MLA history prefetch (phase 8) -- every all-gather's group recorded,
also with one rank issuing its prefetches late or computing a layer late, and with the
NVTX switch off and on -- and with the plugin's host synchronisations counted.

NOTE: N = 8 is eight processes on CI's two cores (it was 12 of CI's 38 minutes): there every
scenario runs with the debug checks on only (they add checks, not a different path), and
the 200-mix soak runs at N = 2, 3 and 4.
"""

from collections import Counter

import pytest

from sglang_cp_shared_kv_testing.cp_harness import assert_clean, run_cp_group

SCENARIOS = ("single_chunk", "chunked_prefill", "radix_prefix_hit", "prefix_mid_page",
             "fewer_pages_than_ranks", "full_view_fallback", "aligned_chunked_prefill", "aligned_radix_hit")
DTYPES = ("bf16", "fp8_e4m3")
# phase 8: the one-layer-ahead MLA history gather, where there is history to gather
PREFETCH_N = (2, 3, 4)
PREFETCH_SCENARIOS = ("chunked_prefill", "radix_prefix_hit", "full_view_fallback", "aligned_chunked_prefill",
                      "corrupted_shard_is_detected")
SOAK_N = (2, 3, 4)
# with prefetch, rank 0's first layer computing late while the next layer's gather is in flight
SLOW_COMPUTE_JOBS = (("chunked_prefill", "bf16"), ("radix_prefix_hit", "fp8_e4m3"))
# host synchronisations counted (at N in PREFETCH_N): bf16 without prefetch, fp8 with it
HOST_SYNC_SCENARIOS = ("chunked_prefill", "radix_prefix_hit", "prefix_mid_page", "full_view_fallback",
                       "aligned_chunked_prefill")


def debug_modes(n):
    return ("on", "off") if n in SOAK_N else ("on",)


@pytest.fixture(scope="module", params=[2, 3, 4, 8], ids=lambda n: f"N{n}")
def group(request):
    n = request.param
    jobs = [(name, dtype, debug) for dtype in DTYPES for debug in debug_modes(n) for name in SCENARIOS]
    jobs += [("corrupted_shard_is_detected", dtype, "off") for dtype in DTYPES]
    jobs += [("lane_exhaustion", dtype, "on") for dtype in DTYPES]
    if n in SOAK_N:
        jobs += [("soak", dtype, "alternate") for dtype in DTYPES]
    if request.param in PREFETCH_N:
        jobs += [(name, dtype, "off", {"prefetch": True}) for dtype in DTYPES for name in PREFETCH_SCENARIOS]
        jobs += [("chunked_prefill", "bf16", "on", {"prefetch": True, "slow_prefetch_rank": 1})]
        jobs += [(name, dtype, "off", {"prefetch": True, "slow_compute_rank": 0}) for name, dtype in SLOW_COMPUTE_JOBS]
        jobs += [("aligned_chunked_prefill", "bf16", "off", {"prefetch": True, "nvtx": switch}) for switch in ("off", "on")]
        jobs += [("chunked_prefill", "fp8_e4m3", "off", {"prefetch": True, "stage_timer": True})]
        jobs += [("aligned_chunked_prefill", "bf16", "off", {"prefetch": True, "stage_timer": True})]
        jobs += [(name, "bf16", "off", {"host_syncs": True}) for name in HOST_SYNC_SCENARIOS]
        jobs += [(name, "fp8_e4m3", "off", {"host_syncs": True, "prefetch": True}) for name in HOST_SYNC_SCENARIOS]
    return request.param, run_cp_group(request.param, jobs, timeout_s=900)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_bit_exact(group, scenario):
    n, results = group
    outcomes = assert_clean(results, scenario)
    plain = {k: v for k, v in outcomes.items() if "prefetch" not in k and "host_syncs" not in k}
    assert len(plain) == len(DTYPES) * len(debug_modes(n))  # (and the prefetch and host-sync runs below)
    assert all(v["stats"]["topk_rows"] > 0 for v in outcomes.values())


def test_each_chunk_row_is_quantised_once_per_layer(group):
    """One store of the chunk per layer (into the dense view: MLA and index), and one owner
    copy from the view into the shard: no second store of the owned rows."""
    n, results = group
    for key, outcome in assert_clean(results, "chunked_prefill").items():
        stats = outcome["stats"]
        layers = stats["layers"]
        assert layers > 0 and stats["shard_rows_compared"] > 0, key
        calls = dict(stats["kernel_calls"])
        # the index store is our kernel where it reproduces SGLang's fused store (CUDA), else SGLang's own
        index_stores = calls.pop("store_index_rows", 0) + calls.pop("sglang_index_store", 0)
        assert index_stores == layers, (key, stats)
        assert calls == {"store_mla_rows": layers, "copy_mla_rows": layers, "copy_index_rows": layers}, (key, stats)


#: aligned_chunked_prefill's four chunks, how each reached the shards: two page-aligned
#: chunks, one a row short of that (SGLang pads it), one cut mid-page; with fp8 KV the first
#: (no prefix) keeps SGLang's latent gather, which its RAGGED attention reads
LOCAL, MLA_GATHERED, GATHERED = "index=local,mla=local", "index=local,mla=gathered", "index=gathered,mla=gathered"
ALIGNED_PATHS = {"bf16": [LOCAL, LOCAL, LOCAL, GATHERED], "fp8_e4m3": [MLA_GATHERED, LOCAL, LOCAL, GATHERED]}


def test_local_writes_leave_out_sglangs_chunk_gathers(group):
    """A chunk SGLang cuts page by page, on pages its computing ranks own: each rank stores
    its own index keys and latent rows into its shard (one store per layer each, no owner
    copy) and SGLang's two in-seq all-gathers of the chunk are not issued; every other chunk
    is gathered by SGLang and copied out of the views (phase 3). Bit-exact either way (the
    scenario test above)."""
    n, results = group
    for key, outcome in assert_clean(results, "aligned_chunked_prefill").items():
        stats, paths = outcome["stats"], ALIGNED_PATHS[key.split("/")[1]]
        assert stats["write_paths"] == dict(Counter(paths)), (key, stats["write_paths"])
        per_forward = stats["layers"] // stats["forwards"]
        gathered_index = per_forward * sum("index=gathered" in p for p in paths)
        gathered_mla = per_forward * sum("mla=gathered" in p for p in paths)
        assert stats["sglang_gathers"] == {"index key": gathered_index, "latent": gathered_mla}, (key, stats)
        calls = dict(stats["kernel_calls"])
        assert calls.pop("store_index_rows", 0) + calls.pop("sglang_index_store", 0) == stats["layers"], key
        assert calls == {"store_mla_rows": stats["layers"], "copy_index_rows": gathered_index,
                         "copy_mla_rows": gathered_mla}, (key, calls)


def test_soak_bit_exact(group):
    n, results = group
    if n not in SOAK_N:
        pytest.skip(f"the soak runs at N in {SOAK_N}")
    outcomes = assert_clean(results, "soak")
    for stats in (v["stats"] for v in outcomes.values()):
        assert stats["mixes"] >= 200 and stats["forwards"] >= 200
        # the mixes exercise both allocation paths: compute-owner chunks and short (interleaved) ones
        assert stats["allocation"]["compute_owner_chunks"] > 0 and stats["allocation"]["short_chunks"] > 0
        # and both write paths: chunks stored where they were computed, chunks gathered
        assert stats["write_paths"].get("index=local,mla=local", 0) > 0, stats["write_paths"]
        assert stats["write_paths"].get("index=gathered,mla=gathered", 0) > 0, stats["write_paths"]


def test_lane_exhaustion_falls_back_alike_on_every_rank(group):
    """Free pages skewed to one owner lane: the chunk takes interleaved pages on every rank
    (the harness fails a scenario whose ranks' allocator decisions differ), stays bit-exact,
    and the next chunk is compute-owner again."""
    n, results = group
    for key, outcome in assert_clean(results, "lane_exhaustion").items():
        stats = outcome["stats"]
        assert stats["lane_fallbacks"] == 1 and stats["compute_owner_after"] == 1
        # the fallback chunk's interleaved pages are gathered; the next chunk (no prefix) is
        # stored where it was computed (fp8: its latent gathered, RAGGED reads the chunk)
        after = LOCAL if key.split("/")[1] == "bf16" else MLA_GATHERED
        assert stats["write_paths"] == {GATHERED: 1, after: 1}, (key, stats["write_paths"])


def test_prefetch_bit_exact(group):
    """Phase 8: with each layer's MLA history gathered one layer ahead on a second group
    (asynchronous gloo), kernel inputs and attention stay bit-exact for chunked prefill,
    radix hits and full-view layers, bf16 and fp8; a rank that issues its layer-ahead
    gathers late (only when its next layer needs them) changes nothing: every rank waits
    for the gather before reading the view."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    runs = {k: v for k, v in results.items()
            if "prefetch=True" in k and not any(o in k for o in ("/host_syncs=", "/slow_compute_rank=", "/nvtx="))}
    assert len(runs) == len(DTYPES) * len(PREFETCH_SCENARIOS) + 3
    for key, outcome in runs.items():
        if key.startswith("corrupted_shard_is_detected/"):
            assert outcome["stats"]["detected"], key  # the comparison still catches a bad page
            continue
        assert not outcome["errors"], (key, outcome["errors"])
        assert outcome["stats"]["prefetch_group"] == {"distinct": True, "size": n}, key


def test_prefetch_gathers_go_over_their_own_communicator(group):
    """Every rank's asynchronous all-gathers (the layer-ahead MLA history) go over the
    prefetch group and never the compute group; every synchronous one (the other history
    gathers, current regions, SGLang's in-seq gathers) over the compute group. With a rank
    that issues its layer-ahead gathers late (synchronously, when the layer needs them),
    those still go over the prefetch group."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    runs = {k: v for k, v in results.items() if "prefetch=True" in k}
    assert len(runs) == len(DTYPES) * len(PREFETCH_SCENARIOS) + 3 + len(HOST_SYNC_SCENARIOS) + len(SLOW_COMPUTE_JOBS) + 2
    for key, outcome in runs.items():
        per_rank = outcome["stats"]["all_gathers_per_rank"]
        assert len(per_rank) == n, key
        for rank, gathers in enumerate(per_rank):
            late = "slow_prefetch_rank=1" in key and rank == 1
            want = {"compute/sync", "prefetch/sync" if late else "prefetch/async"}
            assert set(gathers) == want, (key, rank, gathers)


def test_prefetch_survives_a_slow_layer_compute(group):
    """Rank 0 computes its first layer late -- after the hook started the next layer's MLA
    history gather, which then completes before this layer reads its own view -- in every
    forward: kernel inputs and attention stay bit-exact, so the prefetch wrote into the next
    layer's own buffer and the next layer read it complete."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    runs = {k: v for k, v in results.items() if "slow_compute_rank=0" in k}
    assert {tuple(k.split("/")[:2]) for k in runs} == set(SLOW_COMPUTE_JOBS)
    for key, outcome in runs.items():
        assert not outcome["errors"], (key, outcome["errors"])
        stats = outcome["stats"]
        slowed = stats["slow_compute"]
        assert slowed["slowed"] == stats["forwards"], (key, slowed)
        # each forward with a history prefetched its next layer before the slowed compute
        # (the first forward of each request without a prefix has nothing to prefetch)
        assert slowed["with_prefetch_in_flight"] == stats["forwards"] - 1 > 0, (key, slowed)


def test_nvtx_off_pushes_no_range_in_a_whole_forward(group):
    """NVTX off (the default): a whole forward path -- batch state, index and MLA views,
    local writes, prefetch -- asks for its ranges and pushes none; the same run with NVTX on
    pushes every stage's (the control: the count can see them), and stays bit-exact."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    off = results["aligned_chunked_prefill/bf16/debug=off/nvtx=off/prefetch=True"]
    on = results["aligned_chunked_prefill/bf16/debug=off/nvtx=on/prefetch=True"]
    for outcome in (off, on):
        assert not outcome["errors"], outcome["errors"]
    assert off["stats"]["nvtx"]["asked"] == on["stats"]["nvtx"]["asked"] > 0
    assert off["stats"]["nvtx"]["pushed"] == {}
    pushed = on["stats"]["nvtx"]["pushed"]
    assert sum(pushed.values()) == on["stats"]["nvtx"]["asked"]  # every range asked for, pushed
    assert {"batch_state", "owner_write", "materialize:index:view", "materialize:mla:current",
            "prefetch:issue", "prefetch:wait"} <= set(pushed), pushed


def test_stage_timer_times_every_stage_of_every_forward(group):
    """With timing on (the NVTX switch), every stage of every forward is timed and read back,
    and the run stays bit-exact. The index and MLA views are timed apart, each in leaf
    stages: the view's allocation, the history's pack and all-gather, and a local-writes
    chunk's current-region gathers (``materialize:<kind>:current``: no prefetch can hide
    them); ``prefetch:issue`` contains the next layer's MLA view and history gather."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"prefetch runs at N in {PREFETCH_N}")
    timed = {k: v for k, v in results.items() if "stage_timer=True" in k}
    assert {k.split("/")[0] for k in timed} == {"chunked_prefill", "aligned_chunked_prefill"}
    for key, outcome in timed.items():
        assert not outcome["errors"], (key, outcome["errors"])
        stats = outcome["stats"]
        times = stats["stage_times"]
        assert times["forwards"] == stats["forwards"] and times["pending"] == 0 and times["dropped"] == 0
        calls = {stage: v["calls"] for stage, v in times["stages"].items()}
        layers, per_forward = stats["layers"], stats["layers"] // stats["forwards"]
        local = per_forward * stats["write_paths"].get(LOCAL, 0)  # layers stored where computed
        # both scenarios' first chunk has no prefix: every later layer gathers a history
        history_layers = layers - per_forward
        assert calls["batch_state"] == stats["forwards"]
        assert calls["owner_write"] == 2 * layers  # index and MLA, every layer of every forward
        assert calls["materialize:chunk"] == layers - local
        for kind in ("index", "mla"):
            assert calls[f"materialize:{kind}:view"] == layers, (key, kind, calls)  # one view per layer
            assert calls.get(f"materialize:{kind}:current", 0) == local, (key, kind, calls)  # its current pages
            assert calls[f"materialize:{kind}:gather"] == history_layers, (key, kind, calls)
            # a rank whose history pages are one run of its shard sends them without a pack
            assert calls.get(f"materialize:{kind}:pack", 0) <= history_layers, (key, kind, calls)
        assert "materialize:pack+gather" not in calls and "materialize:current" not in calls
        # in a forward with history, every layer's MLA history after the first is prefetched, and waited for
        assert calls["prefetch:issue"] == calls["prefetch:wait"] == (stats["forwards"] - 1) * (per_forward - 1)
        assert all(v["total_ms"] >= 0 for v in times["stages"].values()) and times["clock"] == "perf_counter"
    assert timed["aligned_chunked_prefill/bf16/debug=off/prefetch=True/stage_timer=True"]["stats"][
        "write_paths"][LOCAL] == 3


def test_one_host_synchronisation_per_forward_and_none_in_the_layers(group):
    """The plugin makes the host wait for the device once per forward -- the page map's sizes,
    read before the first layer -- and never inside a layer (sglang_cp_shared_kv_testing/host_syncs.py counts the
    torch calls that synchronise on CUDA, by the plugin module that makes them): chunked
    prefill, radix hits, a prefix ending mid-page, full-view layers and local writes, with
    and without the prefetch."""
    n, results = group
    if n not in PREFETCH_N:
        pytest.skip(f"host synchronisations are counted at N in {PREFETCH_N}")
    runs = {k: v for k, v in results.items() if "host_syncs=True" in k}
    assert len(runs) == 2 * len(HOST_SYNC_SCENARIOS)
    for key, outcome in runs.items():
        assert not outcome["errors"], (key, outcome["errors"])
        in_forward = {phase: sites for phase, sites in outcome["stats"]["host_syncs"].items() if phase != "after"}
        assert set(in_forward) == {"forward start"}, (key, in_forward)
        (site, calls), = in_forward["forward start"].items()
        assert site.startswith("forward/dense_layout.py:") and site.endswith(" Tensor.tolist"), (key, site)
        assert calls == outcome["stats"]["forwards"], (key, calls)


def test_corrupted_shard_is_detected(group):
    """Negative control: the comparison catches one corrupted history page on one rank."""
    n, results = group
    for key, outcome in results.items():
        if key.startswith("corrupted_shard_is_detected/"):
            assert outcome["stats"]["detected"], key
