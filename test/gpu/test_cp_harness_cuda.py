"""The bit-exact CP harness with CUDA tensors and SGLang's real Triton/JIT kernels
(no torch stand-ins): several ranks share the one GPU over gloo."""

import pytest

from sglang_cp_shared_kv_testing.cp_harness import run_cp_group

SCENARIOS = ("single_chunk", "chunked_prefill", "radix_prefix_hit", "prefix_mid_page",
             "fewer_pages_than_ranks", "full_view_fallback", "aligned_chunked_prefill", "aligned_radix_hit",
             "corrupted_shard_is_detected")


@pytest.mark.parametrize("n", [2, 3])
def test_harness_on_cuda_with_real_kernels(n):
    jobs = [(name, dtype, debug) for dtype in ("bf16", "fp8_e4m3") for debug in ("on", "off")
            for name in SCENARIOS]
    results = run_cp_group(n, jobs, device="cuda", timeout_s=540)
    failures = {k: v["errors"] for k, v in results.items()
                if v["errors"] and not k.startswith("corrupted_shard_is_detected/")}
    assert not failures, failures
    assert all(v["stats"]["detected"] for k, v in results.items()
               if k.startswith("corrupted_shard_is_detected/"))
    # local writes ran with the real kernels: each rank's own rows stored into its shard by
    # the fused stores, SGLang's chunk gathers left out (their re-range kernel ran for the rest)
    for key, outcome in results.items():
        if key.startswith("aligned_chunked_prefill/"):
            assert outcome["stats"]["write_paths"].get("index=local,mla=local", 0) == 2 + key.startswith(
                "aligned_chunked_prefill/bf16"), (key, outcome["stats"]["write_paths"])


@pytest.mark.parametrize("n", [2, 3])
def test_prefetch_on_cuda_with_real_kernels(n):
    """Phase 8 with CUDA tensors: the layer-ahead MLA history gather runs asynchronously on
    its own group (gloo here: several ranks share the GPU) while the layer computes on the
    CUDA stream; the next layer waits for it. Bit-exact, also with a rank that issues its
    gathers late, with a rank whose first layer's compute stream spins (``torch.cuda._sleep``)
    after the next layer's gather started, and the negative control still caught."""
    jobs = [(name, dtype, "off", {"prefetch": True}) for dtype in ("bf16", "fp8_e4m3")
            for name in ("chunked_prefill", "radix_prefix_hit", "full_view_fallback", "aligned_chunked_prefill",
                         "corrupted_shard_is_detected")]
    jobs += [("chunked_prefill", "bf16", "on", {"prefetch": True, "slow_prefetch_rank": 1})]
    jobs += [("chunked_prefill", "fp8_e4m3", "off", {"prefetch": True, "slow_compute_rank": 0})]
    results = run_cp_group(n, jobs, device="cuda", timeout_s=540)
    failures = {k: v["errors"] for k, v in results.items()
                if v["errors"] and not k.startswith("corrupted_shard_is_detected/")}
    assert not failures, failures
    assert all(v["stats"]["detected"] for k, v in results.items() if k.startswith("corrupted_shard_is_detected/"))
    assert all(v["stats"]["prefetch_group"] == {"distinct": True, "size": n} for v in results.values())
    for key, outcome in results.items():  # the layer-ahead gathers on their own group, asynchronous
        late = [rank == 1 and "slow_prefetch_rank=1" in key for rank in range(n)]
        assert [set(g) for g in outcome["stats"]["all_gathers_per_rank"]] == [
            {"compute/sync", "prefetch/sync" if late[r] else "prefetch/async"} for r in range(n)], key
    slowed = results["chunked_prefill/fp8_e4m3/debug=off/prefetch=True/slow_compute_rank=0"]["stats"]
    assert slowed["slow_compute"] == {"slowed": slowed["forwards"], "with_prefetch_in_flight": slowed["forwards"] - 1}


def test_stage_timer_reads_cuda_events_inside_a_cp_group():
    """Timing on (the NVTX switch) with CUDA tensors: every stage is timed with CUDA events on
    the stream it ran on, read back without a host synchronisation; bit-exact still."""
    jobs = [("chunked_prefill", dtype, "off", {"prefetch": True, "stage_timer": True})
            for dtype in ("bf16", "fp8_e4m3")]
    results = run_cp_group(2, jobs, device="cuda", timeout_s=540)
    for key, outcome in results.items():
        assert not outcome["errors"], (key, outcome["errors"])
        stats, times = outcome["stats"], outcome["stats"]["stage_times"]
        assert times["clock"] == "cuda_events" and times["pending"] == 0, times
        assert times["forwards"] == stats["forwards"]
        stages = times["stages"]
        assert stages["owner_write"]["calls"] == 2 * stats["layers"]
        assert stages["materialize:chunk"]["calls"] == stats["layers"]
        # device time, not zero: each stage launched real kernels on the stream
        assert stages["owner_write"]["total_ms"] > 0 and stages["materialize:index:gather"]["total_ms"] > 0
        assert stages["materialize:index:view"]["calls"] == stages["materialize:mla:view"]["calls"] == stats["layers"]
