"""Multi-process CP harness: is what the stock NSA kernels read with shared KV bit-identical
to what they read on a replicated (flag-off) pool?

N rank processes over ``torch.distributed`` gloo, each with SGLang's attention-CP
``GroupCoordinator`` set up as in a server, hold

* the plugin's ``CpSharedNSATokenToKVPool`` (this rank's shard) and allocator, and
* a stock ``NSATokenToKVPool`` of the same logical size: the replicated baseline,

and run the same requests through both. For each forward the harness builds SGLang's
real ``ForwardBatch`` and ``NSAMetadata`` (as ``init_forward_metadata`` builds them for
one in-seq-split request; :mod:`.cp_rig`) and drives the plugin's real hook functions
(:mod:`sglang_cp_shared_kv.forward.hooks`):

* ``attach_batch_state`` (the ``init_forward_metadata`` AFTER hook),
* ``store_index_k_owned_and_dense`` around SGLang's real
  ``Indexer._store_index_k_cache`` (on CPU its fallback path: ``act_quant`` +
  ``set_index_k_scale_buffer``; on CUDA its fused JIT store),
* ``forward_extend_on_dense_view`` around
  :func:`.attention_reference.stock_forward_extend_inputs`,
  which does what the stock ``forward_extend`` does before its kernel call (store the
  chunk, fetch the KV cache) and records what the kernel would receive.

Attention kernels cannot run on a CPU, so the harness compares what they would read:
the index K/scale the indexer reads (full and rank-dependent lengths, the fused
K+scale read too), the top-k positions of a torch reference indexer, the KV rows each
top-k index selects (the sparse kernels' input), the rows ``page_table_1_flattened``
selects (the fp8 RAGGED dequantize input), and the output of a torch reference of
sparse MLA attention over them. Everything must match bit for bit.

Mismatches are collected, never raised mid-scenario, so every rank keeps issuing the
same collectives; the parent process enforces a deadline and kills stragglers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List

import torch

from sglang_cp_shared_kv_testing.cp_rig_v0512 import InSeqRig
from sglang_cp_shared_kv_testing.cp_scenarios import SCENARIOS
from sglang_cp_shared_kv_testing.support import (
    all_gather_through_gloo,
    free_port,
    gloo_attention_cp_group,
    in_seq_cp_server_args,
    run_rank_processes,
)


# ============================================================ parent side
def run_cp_group(n: int, jobs: List[tuple], *, device: str = "cpu",
                 timeout_s: float = 1200.0) -> Dict[str, dict]:
    """Run ``jobs`` = [(scenario, dtype, debug[, options])] on ``n`` ranks, debug being "on",
    "off" or "alternate" (per forward), options {"prefetch": bool, "slow_prefetch_rank": r}
    (that rank starts each prefetch late), {"slow_compute_rank": r} (that rank's layer
    SLOW_COMPUTE_LAYER computes late, its next layer's prefetch in flight; rank 0's stats
    then say how often: ``slow_compute``), {"nvtx": "off" | "on"} (the NVTX switch so
    for the job, the ranges asked for and the ranges pushed counted: ``nvtx``),
    {"stage_timer": bool} (NVTX on and every stage
    timed; rank 0's stats then hold ``stage_times``), {"host_syncs": bool} (the plugin's host
    synchronisations counted by forward phase: ``stats["host_syncs"]``); with prefetch, every
    all-gather is counted by group and sync/async (``stats["all_gathers_per_rank"]``); return, per
    ``scenario/dtype/debug[/options]`` key, the merged outcome of all ranks."""
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"cp-harness-{n}-")
    ctx = mp.get_context("spawn")
    port = free_port()
    per_rank = run_rank_processes(ctx, _rank_main, n, out_dir, args=(n, port, out_dir, jobs, device),
                                  timeout_s=timeout_s, what="CP harness")
    return merge_rank_outcomes(per_rank)


#: stats that differ by rank and are summed over the ranks (a request absent from a rank's
#: attention tables is absent from some ranks only)
SUMMED_OVER_RANKS = ("requests_without_rows",)


def merge_rank_outcomes(per_rank: List[dict]) -> Dict[str, dict]:
    """Each job's outcome over all ranks: every rank's errors (named), rank 0's stats (those of
    ``SUMMED_OVER_RANKS`` summed over the ranks), each rank's all-gather counts, and an error
    where a rank's allocator decided differently."""
    merged: Dict[str, dict] = {}
    for r, result in enumerate(per_rank):
        for key, outcome in result["scenarios"].items():
            entry = merged.setdefault(key, {"errors": [], "stats": dict(outcome["stats"])})
            if r:
                for name in SUMMED_OVER_RANKS:
                    if name in outcome["stats"]:
                        entry["stats"][name] += outcome["stats"][name]
            entry["errors"] += [f"rank {r}: {e}" for e in outcome["errors"]]
            if "all_gathers" in outcome["stats"]:  # each rank's own, not only rank 0's
                entry["stats"].setdefault("all_gathers_per_rank", []).append(outcome["stats"]["all_gathers"])
            if outcome["stats"]["allocation"] != entry["stats"]["allocation"]:  # decisions must agree
                entry["errors"].append(f"rank {r}: allocator decisions {outcome['stats']['allocation']} differ "
                                       f"from rank 0's {entry['stats']['allocation']}")
    return merged


def assert_clean(results: Dict[str, dict], scenario: str) -> Dict[str, dict]:
    """The merged outcomes of ``scenario`` (every dtype and option it ran with), asserted to
    exist and to carry no error."""
    outcomes = {k: v for k, v in results.items() if k.startswith(scenario + "/")}
    assert outcomes, f"{scenario} did not run"
    failures = {k: v["errors"] for k, v in outcomes.items() if v["errors"]}
    assert not failures, failures
    return outcomes


# ============================================================== rank side
def _rank_main(rank, n, port, out_dir, jobs, device):
    result: dict = {"scenarios": {}}
    try:
        group = init_rank_process(rank, n, port, device)
        for name, dtype_name, debug, *more in jobs:
            options = more[0] if more else {}
            rig = InSeqRig(rank, n, dtype_name, group, device, debug=debug, prefetch=options.get("prefetch", False))
            prefetch_group = rig.shared.context.prefetch_group
            if prefetch_group is not None:  # its own communicator over the same ranks
                rig.stats["prefetch_group"] = {
                    "distinct": prefetch_group is not group.device_group,
                    "size": torch.distributed.get_world_size(prefetch_group)}
            with _slow_prefetch(options.get("slow_prefetch_rank") == rank), \
                    _slow_compute(rig, options.get("slow_compute_rank") == rank), \
                    _stage_timed(rig, rank, options.get("stage_timer", False)), \
                    _host_syncs_counted(rig, options.get("host_syncs", False)), \
                    _all_gathers_recorded(rig, group.device_group, prefetch_group), \
                    _nvtx_ranges_counted(rig, options.get("nvtx")):
                SCENARIOS[name](rig)
            rig.stats["allocation"] = dataclasses.asdict(rig.allocator.stats)
            outcome = {"errors": rig.errors[:20], "stats": rig.stats}
            result["scenarios"][job_key(name, dtype_name, debug, options)] = outcome
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)


def job_key(name: str, dtype_name: str, debug: str, options: dict) -> str:
    """A job's key in the merged outcome: ``scenario/dtype/debug=...[/option=value...]``."""
    return f"{name}/{dtype_name}/debug={debug}" + "".join(f"/{k}={v}" for k, v in sorted(options.items()))


def finish_rank(out_dir: str, rank: int, result: dict) -> None:
    """Write the rank's ``result`` where the parent reads it, and end the process (a failed
    rank makes the parent stop the others)."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if "fatal" in result else 0)


@contextlib.contextmanager
def _stage_timed(rig: InSeqRig, rank: int, on: bool):
    """With ``on``: NVTX on (ranges become no-ops without a GPU) and a stage timer on the
    rank's context for the job; its final snapshot goes to ``rig.stats["stage_times"]``."""
    if not on:
        yield
        return
    from sglang_cp_shared_kv.settings.config import NVTX_ENV
    from sglang_cp_shared_kv.observability.stage_timer import StageTimer

    timer = StageTimer(rank)
    rig.shared.context.stage_timer = timer
    saved = os.environ.get(NVTX_ENV)
    os.environ[NVTX_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NVTX_ENV, None)
        else:
            os.environ[NVTX_ENV] = saved
        rig.shared.context.stage_timer = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timer.collect()
        rig.stats["stage_times"] = timer.snapshot()


@contextlib.contextmanager
def _all_gathers_recorded(rig, compute_group, prefetch_group):
    """With a prefetch group: every ``torch.distributed.all_gather_into_tensor`` of the job
    (the plugin's history and current gathers, SGLang's in-seq gathers) counted by the group
    it goes over and whether it is asynchronous, into ``rig.stats["all_gathers"]``
    (``"compute/sync"``, ``"prefetch/async"``, ...)."""
    if prefetch_group is None:
        yield
        return
    from sglang_cp_shared_kv.scoped import attributes_set

    real = torch.distributed.all_gather_into_tensor
    counts = rig.stats.setdefault("all_gathers", {})

    def recorded(output, input, group=None, async_op=False):
        where = "compute" if group is compute_group else "prefetch" if group is prefetch_group else "other"
        key = f"{where}/{'async' if async_op else 'sync'}"
        counts[key] = counts.get(key, 0) + 1
        return real(output, input, group=group, async_op=async_op)

    with attributes_set(torch.distributed, all_gather_into_tensor=recorded):
        yield


@contextlib.contextmanager
def _nvtx_ranges_counted(rig: InSeqRig, switch):
    """With ``switch`` "off" or "on": the NVTX switch set so for the job, and
    ``rig.stats["nvtx"]``: ``asked`` (calls of :func:`..nvtx.marked`, each reading the
    switch once) and ``pushed`` (ranges opened, by name; on a CPU the push itself is then
    skipped, there being no GPU to mark)."""
    if switch is None:
        yield
        return
    from sglang_cp_shared_kv.observability import nvtx
    from sglang_cp_shared_kv.settings.config import NVTX_ENV
    from sglang_cp_shared_kv.scoped import attributes_set

    counts = rig.stats.setdefault("nvtx", {"asked": 0, "pushed": {}})
    real_enabled, real_pushed = nvtx.nvtx_enabled, nvtx._pushed

    def enabled():
        counts["asked"] += 1
        return real_enabled()

    def pushed(name):
        counts["pushed"][name] = counts["pushed"].get(name, 0) + 1
        return real_pushed(name)

    saved = os.environ.pop(NVTX_ENV, None)
    if switch == "on":
        os.environ[NVTX_ENV] = "1"
    try:
        with attributes_set(nvtx, nvtx_enabled=enabled, _pushed=pushed):
            yield
    finally:
        os.environ.pop(NVTX_ENV, None)
        if saved is not None:
            os.environ[NVTX_ENV] = saved


@contextlib.contextmanager
def _host_syncs_counted(rig: InSeqRig, on: bool):
    """With ``on``: the plugin's host synchronisations counted by forward phase and call site
    (:mod:`.host_syncs`), into ``rig.stats["host_syncs"]``."""
    if not on:
        yield
        return
    from sglang_cp_shared_kv_testing.host_syncs import HostSyncCounter

    rig.host_syncs = HostSyncCounter()
    try:
        with rig.host_syncs.counting():
            yield
    finally:
        rig.stats["host_syncs"] = rig.host_syncs.report()
        rig.host_syncs = None


@contextlib.contextmanager
def _slow_prefetch(slow: bool):
    """On this rank, each layer-ahead gather is issued only when its layer needs it, 0.2 s
    late: the other ranks' views of that layer stay incomplete until then, so a rank that
    read its prefetched view without waiting for it would read missing pages."""
    if not slow:
        yield
        return
    from sglang_cp_shared_kv.forward import prefetch
    from sglang_cp_shared_kv.scoped import attributes_set

    real = prefetch.gather_mla_history

    class IssuedOnWait:
        def __init__(self, args, kwargs):
            self.layer_id, self._call, self._history = args[2], (args, kwargs), None

        def wait(self):
            time.sleep(0.2)
            args, kwargs = self._call
            self._history = real(*args, **{**kwargs, "async_op": False})

        def __getattr__(self, name):  # dense, received: once waited for
            return getattr(self._history, name)

    def late(*args, async_op=False, **kwargs):
        return IssuedOnWait(args, kwargs) if async_op else real(*args, **kwargs)

    with attributes_set(prefetch, gather_mla_history=late):
        yield


#: NOTE: the rig has two layers; the first is the one whose compute can overlap a prefetch
#: (the last layer starts none)
SLOW_COMPUTE_LAYER = 0
#: NOTE: how long the slowed layer's compute is held up: long against a gloo all-gather of
#: the rig's few pages (milliseconds); on CUDA, GPU clock cycles spun on the compute stream
#: (about 0.1 s at an H200's 1.98 GHz)
SLOW_COMPUTE_S = 0.2
SLOW_COMPUTE_CYCLES = 200_000_000


@contextlib.contextmanager
def _slow_compute(rig: InSeqRig, slow: bool):
    """On this rank, layer SLOW_COMPUTE_LAYER's stock ``forward_extend`` starts late (a host
    sleep on CPU; on CUDA ``torch.cuda._sleep`` on the compute stream), after the hook
    started the next layer's history prefetch: that gather completes while this layer has yet
    to read its own view, so a prefetch that wrote into a buffer this layer still reads, or a
    next layer that read its view before the gather was complete, would break bit-exactness.
    ``rig.stats["slow_compute"]``: layers slowed, and how many of them with the next layer's
    prefetch in flight (issued since the last slowed layer)."""
    if not slow:
        yield
        return
    from sglang_cp_shared_kv.forward import prefetch
    from sglang_cp_shared_kv.scoped import attributes_set

    counts = rig.stats.setdefault("slow_compute", {"slowed": 0, "with_prefetch_in_flight": 0})
    issued = {"layer": None}  # the layer whose history was last prefetched, until a slowed layer saw it
    real_gather, real_forward_extend = prefetch.gather_mla_history, rig.shared_forward_extend

    def gather(state, pool, layer_id, group, *, async_op=False):
        if async_op:
            issued["layer"] = layer_id
        return real_gather(state, pool, layer_id, group, async_op=async_op)

    def slowed(backend, q, k, v, layer, forward_batch, **kwargs):
        if layer.layer_id == SLOW_COMPUTE_LAYER:
            counts["slowed"] += 1
            counts["with_prefetch_in_flight"] += issued["layer"] == layer.layer_id + 1
            issued["layer"] = None
            if q.is_cuda:
                torch.cuda._sleep(SLOW_COMPUTE_CYCLES)
            else:
                time.sleep(SLOW_COMPUTE_S)
        return real_forward_extend(backend, q, k, v, layer, forward_batch, **kwargs)

    with attributes_set(prefetch, gather_mla_history=gather), attributes_set(rig, shared_forward_extend=slowed):
        yield


def init_rank_process(rank: int, n: int, port: int, device: str):
    """gloo world + SGLang's attention-CP GroupCoordinator over it, as SGLang sets them up,
    and the global server arguments SGLang's in-seq CP helpers read."""
    from sglang.srt import server_args

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # several ranks share one GPU over gloo
    else:
        from sglang_cp_shared_kv_testing import torch_standins

        torch_standins.install()
    local_rank = 0 if device == "cuda" else rank  # on CUDA all ranks share GPU 0
    group = gloo_attention_cp_group(rank, n, port, local_rank=local_rank, timeout_s=300)
    all_gather_through_gloo(group)
    server_args._global_server_args = in_seq_cp_server_args()
    return group
