#!/usr/bin/env python3
"""End to end inside a real SGLang server: HiCache's host tier (``--enable-hierarchical-cache``,
L2) under --enable-nsa-prefill-cp-shared-kv gives back, bit for bit, the KV a prefix had
when it was computed.

Same CPN in-seq-split prefill layout, dummy weights and options as scripts/e2e_cp_logprobs.py
(whose ``launch`` starts every server here), the deterministic top-k always (exact at every
position). Four servers:

  device        flag off, no HiCache, a pool (BIG_POOL per rank) that never evicts: the
                reference -- the probe hits its prefix in device memory
  off_hicache   flag off, HiCache, POOL per rank: stock's host tier on a CP prefill (recorded;
                judged like ``on_hicache`` where it answers)
  on_hicache    flag on, HiCache, POOL physical per rank (N x POOL logical): judged
  on_hicache_corrupt  as on_hicache, CP rank 1 zeroes the first page of every load-back it
                copies (scripts/e2e/sitecustomize.py): the negative control
  off_storage   flag off, HiCache with a Mooncake store (L3, a ``mooncake_master`` on loopback
                started for the run), a host tier of STORAGE_HICACHE_RATIO x the device pool:
                stock's storage tier on a CP prefill (recorded; judged like ``on_storage``)
  on_storage    flag on, the same: judged (not in the default set: ``--runs`` names it, and
                the GPU site needs the store, ``STORE=1 scripts/build_gpu_mooncake.sh``)

Each server answers, one request at a time and without a flush in between: the PREFIX-token
prompt (page-aligned; SGLang's write-through policy backs it up to host memory when it is
inserted), then, on the HiCache servers, FILLER-token prompts until more tokens went through
than the server's logical device pool holds (the prefix is evicted from device memory and
stays in host memory: the host tier holds HICACHE_RATIO x the device pool), then the probe:
the prefix and SUFFIX new tokens, logprobs from PREFIX on. The probe's logprobs read the
prefix's KV loaded back from host memory on the HiCache servers, and from device memory on
``device``. The storage runs post fillers until the prefix left device *and* host memory
(it stays in the store), and wait for every prefetch (``wait_complete``): their probe reads the
prefix's KV fetched from the store into host memory and loaded back.

Pass (``checks``): on_hicache's probe logprobs equal device's at every position and so do its
prefix's; its probe found PREFIX tokens cached, all of them in host memory
(``cached_tokens_details``), while device's found them in device memory; every CP rank loaded
pages back and backed pages up (``sglang:cp_shared_kv_hicache_pages_total``), and the ranks'
loaded-back pages cover the prefix; its host pool per rank is stock's (off_hicache's
"Allocating ... GB host memory" line, same POOL per rank) and its logical host tokens are N x
the physical; the control's probe differs from device's. on_storage: its probe's and prefix's
logprobs equal device's; its probe found the prefix cached, all of it from the store
(``cached_tokens_details["storage"]``); every CP rank stored and fetched pages, and the
fetched pages cover the prefix. off_hicache's results are reported
(``stock``): whether stock's host tier serves this CP prefill at all, and if so whether its
probe equals device's too.

Usage: python scripts/e2e_hicache_logprobs.py --out e2e_hicache.json [--tp 2|4|8] [--runs ...]
                                              [--runs device,off_storage,on_storage]
                                              [--kv-cache-dtype bfloat16] [--share-gpu] [--parallel 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

from sglang_cp_shared_kv_testing import shared_gpu
from sglang_cp_shared_kv_testing.server import (
    TINY_DSV32,
    accumulate_runs,
    prometheus_samples,
    samples_by_rank,
    stable_topk_problem,
    startup_figures,
    stop,
    write_model,
    write_report,
)
from sglang_cp_shared_kv_testing.support import load_script

E2E = load_script("e2e_cp_logprobs")  # its launch, generate and compare: one way to start, ask and compare

PAGE = 64
PREFIX = 3008  # 47 pages: a history chunk and a shorter one when computed (CHUNK 2,048)
SUFFIX = 1000
FILLER = 4000  # two chunks each
POOL = 8192  # --max-total-tokens (physical, per rank) of the HiCache runs
BIG_POOL = E2E.BIG_POOL  # device's: it never evicts
#: --hicache-ratio: the host tier holds the prefix and every filler (host_holds_the_prefix)
HICACHE_RATIO = 3
PAGES_METRIC = "sglang:cp_shared_kv_hicache_pages_total"
#: --hicache-ratio of the storage runs: the fillers push the prefix out of host memory too
STORAGE_HICACHE_RATIO = 1.5


class Run(NamedTuple):  # NOTE: not a dataclass: load_script loads this file outside sys.modules
    flag_on: bool
    hicache: bool
    pool: int  #: --max-total-tokens (physical, per rank)
    corrupt_load_rank: Optional[int] = None  #: the CP rank whose load-backs are corrupted
    storage: bool = False  #: HiCache's storage tier: a Mooncake store started for the run

    @property
    def hicache_ratio(self) -> float:
        return STORAGE_HICACHE_RATIO if self.storage else HICACHE_RATIO


RUNS = {
    "device": Run(False, False, BIG_POOL),
    "off_hicache": Run(False, True, POOL),
    "on_hicache": Run(True, True, POOL),
    "on_hicache_corrupt": Run(True, True, POOL, corrupt_load_rank=1),
    "off_storage": Run(False, True, POOL, storage=True),
    "on_storage": Run(True, True, POOL, storage=True),
}
#: what runs without --runs (the storage runs need the store in the GPU site)
DEFAULT_RUNS = ("device", "off_hicache", "on_hicache", "on_hicache_corrupt")
PORTS_PER_RUN = 10


def logical_pool(name: str, cp_size: int) -> int:
    run = RUNS[name]
    return run.pool * cp_size if run.flag_on else run.pool


def filler_count(name: str, cp_size: int) -> int:
    """Fillers a HiCache run posts: more tokens than its logical device pool holds, so the
    prefix (least recently used) is evicted to host memory; a storage run, more than its
    device pool and host tier hold together, so it is evicted from host memory too."""
    run = RUNS[name]
    if not run.hicache:
        return 0
    held = logical_pool(name, cp_size) * (1 + run.hicache_ratio if run.storage else 1)
    return math.ceil(held / FILLER) + 1


def host_holds_the_prefix(name: str, cp_size: int) -> bool:
    """A host-tier run's host memory (HICACHE_RATIO x the logical device pool) holds the prefix
    and every filler, so nothing pushes the prefix out of host memory before the probe; a
    storage run's cannot (the prefix must come back from the store)."""
    run = RUNS[name]
    fits = PREFIX + filler_count(name, cp_size) * FILLER <= run.hicache_ratio * logical_pool(name, cp_size)
    return fits != run.storage


def prompts(name: str, cp_size: int):
    """[(label, token ids, logprob start)] in the order run ``name`` posts them."""
    import numpy as np

    def tokens(seed, n):
        return np.random.default_rng(seed).integers(2, TINY_DSV32["vocab_size"], size=n).tolist()

    prefix = tokens(101, PREFIX)
    fillers = [(f"filler_{i}", tokens(200 + i, FILLER), FILLER - 1) for i in range(filler_count(name, cp_size))]
    return [("prefix", prefix, 0)] + fillers + [("probe", prefix + tokens(102, SUFFIX), PREFIX)]


def host_gb(log_text: str):
    """The host memory SGLang allocated for the KV host pool on each rank (GB, its log line)."""
    return sorted({float(x) for x in re.findall(r"Allocating ([\d.]+) GB host memory for hierarchical KV cache", log_text)})


def shared_host_tokens(log_text: str):
    """The flag's host pool line: {(physical tokens on a rank, logical tokens over the group)}."""
    return sorted({(int(a), int(b)) for a, b in re.findall(
        r"CP shared KV HiCache: host pool of (\d+) tokens on this rank .*?, (\d+) logical", log_text)})


def pages_by_rank(samples):
    """{cp rank: {"backed_up": pages, "loaded_back": pages}} from PAGES_METRIC's samples."""
    return samples_by_rank(samples, "direction")


def ask(port, ids, start):
    """(logprobs from ``start`` on or {"refused": ...}, cached tokens, their details)."""
    result, meta = E2E.generate(port, ids, start)
    return result, meta.get("cached_tokens"), meta.get("cached_tokens_details")


def storage_args(master) -> list:
    """A storage run's HiCache options: the Mooncake store at ``master`` (TCP on loopback),
    SGLang's page-first layout its backend requires, every prefetch awaited."""
    # NOTE: 1 GB of each rank's host memory for the store: the prefix and every filler fit
    config = master.extra_config(global_segment_size=1 << 30)
    return ["--hicache-storage-backend", "mooncake", "--hicache-mem-layout", "page_first_direct",
            "--hicache-io-backend", "direct", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps(config)]


def one_run(name, model, args, log_path):
    spec = RUNS[name]
    port = args.port + PORTS_PER_RUN * list(RUNS).index(name)
    extra_args, extra_env = [], {}
    if spec.hicache:
        extra_args += ["--enable-hierarchical-cache", "--hicache-ratio", str(spec.hicache_ratio),
                       "--hicache-write-policy", "write_through"]
    if spec.corrupt_load_rank is not None:
        extra_env["CPSKV_E2E_CORRUPT_LOAD_RANK"] = str(spec.corrupt_load_rank)
    with contextlib.ExitStack() as stack:
        if spec.storage:
            from sglang_cp_shared_kv_testing.mooncake_master import mooncake_master

            extra_args += storage_args(stack.enter_context(mooncake_master()))
        return _serve(name, spec, model, port, args, log_path, extra_args, extra_env)


def _serve(name, spec, model, port, args, log_path, extra_args, extra_env):
    flag_on, hicache, pool, corrupt_load_rank = spec.flag_on, spec.hicache, spec.pool, spec.corrupt_load_rank
    t0 = time.monotonic()
    proc = E2E.launch(name, flag_on, None, pool, model, port, args, log_path, extra_args, extra_env)
    run = {"boot_s": round(time.monotonic() - t0, 1), "pool": pool, "hicache": hicache, "storage": spec.storage,
           "fillers": filler_count(name, args.tp), "answers": {}}
    try:
        for label, ids, start in prompts(name, args.tp):
            result, cached, details = ask(port, ids, start)
            keep = label in ("prefix", "probe")
            run["answers"][label] = {"cached_tokens": cached, "cached_tokens_details": details,
                                     **({"logprobs": result} if keep or isinstance(result, dict) else {})}
        if flag_on:
            run["hicache_pages"] = pages_by_rank(prometheus_samples(port, PAGES_METRIC))
    finally:
        stop(proc)
    text = log_path.read_text(errors="replace")
    run["startup"] = {**startup_figures(text), "host_gb": host_gb(text), "shared_host_tokens": shared_host_tokens(text)}
    run["problems"] = [p for p in [stable_topk_problem(run["startup"], name, log_path, args.tp),
                                   shared_gpu.problem(run["startup"], name, log_path, args.tp) if args.share_gpu else None]
                       if p]
    if corrupt_load_rank is not None and run["startup"]["corrupting_load_processes"] < 1:
        run["problems"].append(f"{name}: no process reported corrupting its load-backs; see {log_path}")
    return run


def _answer(run, label):
    return run["answers"].get(label, {})


def _logprobs(run, label):
    lp = _answer(run, label).get("logprobs")
    return lp if isinstance(lp, list) else None


def identical(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(x == y for x, y in zip(a, b))


def _probe_checks(name, runs, tier: str, where: str):
    """A run's prefix and probe against ``device``'s, and its probe's prefix found cached in
    ``tier`` (a key of ``cached_tokens_details``: host, storage)."""
    run, device = runs[name], runs["device"]
    probe = _answer(run, "probe")
    details = probe.get("cached_tokens_details") or {}
    return {
        f"{name}: the prefix's logprobs equal device's": identical(_logprobs(run, "prefix"), _logprobs(device, "prefix")),
        f"{name}: the probe's logprobs equal device's at every position":
            identical(_logprobs(run, "probe"), _logprobs(device, "probe")),
        f"{name}: the probe found the {PREFIX} prefix tokens cached, all {where}":
            (probe.get("cached_tokens") or 0) >= PREFIX and (details.get(tier) or 0) >= PREFIX,
    }


def _rank_pages(run):
    # NOTE: int keys: a run's record comes back from its JSON file with the ranks as strings
    return {int(rank): p for rank, p in run.get("hicache_pages", {}).items()}


def storage_checks(name, runs, cp_size):
    """The judged checks of a storage run against ``device`` (module docstring)."""
    checks = _probe_checks(name, runs, "storage", "from the store")
    if RUNS[name].flag_on:
        pages = _rank_pages(runs[name])
        checks[f"{name}: every CP rank stored pages and fetched pages"] = (
            sorted(pages) == list(range(cp_size))
            and all(p.get("stored", 0) > 0 and p.get("fetched", 0) > 0 for p in pages.values()))
        checks[f"{name}: the ranks' fetched pages cover the prefix"] = (
            sum(p.get("fetched", 0) for p in pages.values()) >= PREFIX // PAGE)
    return checks


def hicache_checks(name, runs, cp_size):
    """The judged checks of a HiCache run against ``device`` (module docstring)."""
    run = runs[name]
    checks = _probe_checks(name, runs, "host", "in host memory")
    if RUNS[name].flag_on:  # flag on: the host tier's own figures
        pages = _rank_pages(run)
        checks[f"{name}: every CP rank backed pages up and loaded pages back"] = (
            sorted(pages) == list(range(cp_size))
            and all(p.get("backed_up", 0) > 0 and p.get("loaded_back", 0) > 0 for p in pages.values()))
        checks[f"{name}: the ranks' loaded-back pages cover the prefix"] = (
            sum(p.get("loaded_back", 0) for p in pages.values()) >= PREFIX // PAGE)
        shared = run["startup"]["shared_host_tokens"]
        checks[f"{name}: logical host tokens are {cp_size} x a rank's"] = (
            bool(shared) and all(logical == cp_size * physical for physical, logical in shared))
        if "off_hicache" in runs:
            checks[f"{name}: a rank's host memory is stock's (same pool per rank)"] = (
                run["startup"]["host_gb"] == runs["off_hicache"]["startup"]["host_gb"] != [])
    return checks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="e2e_hicache_logprobs.json")
    ap.add_argument("--workdir", default="e2e-hicache-work")
    ap.add_argument("--logdir", default=None, help="server logs (default: --workdir)")
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=24000)  # (below the ephemeral range)
    ap.add_argument("--boot-timeout", type=int, default=420)
    ap.add_argument("--runs", default=None,
                    help=f"servers to run now (default {','.join(DEFAULT_RUNS)}; all: {','.join(RUNS)})")
    ap.add_argument("--tp", type=int, choices=(2, 4, 8), default=2, help="CP size (in-seq split over the TP ranks)")
    ap.add_argument("--share-gpu", action="store_true", help="every rank of every server on GPU 0 (correctness only)")
    ap.add_argument("--parallel", type=int, default=1, help="runs booted at once (default 1)")
    args = ap.parse_args()
    args.stable_topk = True  # E2E.launch: every server takes the deterministic top-k
    selected = list(DEFAULT_RUNS) if args.runs is None else [r for r in args.runs.split(",") if r]
    unknown = sorted(set(selected) - set(RUNS))
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    for name in RUNS:  # NOTE: a design check, before any GPU time is spent
        assert host_holds_the_prefix(name, args.tp), name
    tag = f"{args.kv_cache_dtype}.tp{args.tp}" + (".share-gpu" if args.share_gpu else "")
    work = Path(args.workdir)
    logdir = Path(args.logdir) if args.logdir else work
    logdir.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "tiny-dsv32-64k", E2E.MODEL)
    runs, failed = accumulate_runs(work, tag, selected, list(RUNS),
                                   lambda name: one_run(name, str(model), args, logdir / f"{name}.{tag}.log"),
                                   "e2e-hicache", parallel=args.parallel)
    report = {"kv_cache_dtype": args.kv_cache_dtype, "cp_size": args.tp, "share_gpu": args.share_gpu,
              "stable_topk": True, "page": PAGE, "prefix": PREFIX, "suffix": SUFFIX, "filler": FILLER,
              "pool": POOL, "big_pool": BIG_POOL, "hicache_ratio": HICACHE_RATIO,
              "storage_hicache_ratio": STORAGE_HICACHE_RATIO,
              "runs": sorted(runs), "failed_runs": failed,
              "run_problems": {name: run["problems"] for name, run in runs.items() if run["problems"]},
              "timings": {name: {"boot_s": run["boot_s"]} for name, run in runs.items()},
              "startup": {name: run["startup"] for name, run in runs.items()},
              "hicache_pages": {name: run["hicache_pages"] for name, run in runs.items() if "hicache_pages" in run},
              "cached": {name: {label: {k: a.get(k) for k in ("cached_tokens", "cached_tokens_details")}
                                for label, a in run["answers"].items() if not label.startswith("filler")}
                         for name, run in runs.items()},
              "refused": {name: {label: a["logprobs"]["refused"] for label, a in run["answers"].items()
                                 if isinstance(a.get("logprobs"), dict)} for name, run in runs.items()}}
    if args.share_gpu:
        report["note"] = ("every rank of every server shared one GPU (--share-gpu): a correctness run; "
                          "its times (boot_s) say nothing about a deployment")
    checks = {}
    if "device" in runs:
        device_probe = _answer(runs["device"], "probe")
        checks["device: the probe found the prefix in device memory"] = (
            (device_probe.get("cached_tokens") or 0) >= PREFIX
            and not ((device_probe.get("cached_tokens_details") or {}).get("host") or 0))
        if "on_hicache" in runs:
            checks.update(hicache_checks("on_hicache", runs, args.tp))
        if "on_hicache_corrupt" in runs:
            checks["on_hicache_corrupt: the control's probe differs from device's"] = (
                _logprobs(runs["on_hicache_corrupt"], "probe") is not None
                and not identical(_logprobs(runs["on_hicache_corrupt"], "probe"), _logprobs(runs["device"], "probe")))
        if "off_hicache" in runs:  # stock: recorded, not judged
            report["stock"] = hicache_checks("off_hicache", runs, args.tp)
        if "on_storage" in runs:
            checks.update(storage_checks("on_storage", runs, args.tp))
        if "off_storage" in runs:  # stock: recorded, not judged
            report["stock_storage"] = storage_checks("off_storage", runs, args.tp)
    if "on_hicache" in runs and "off_hicache" in runs:
        report["compare"] = {"on_hicache probe vs off_hicache probe": E2E.compare(
            {"a": _logprobs(runs["on_hicache"], "probe") or [], "b": _logprobs(runs["off_hicache"], "probe") or []},
            "a", "b", PREFIX)}
    report["checks"] = checks
    # judged: the host-tier set, or the storage set (device and on_storage), whichever ran
    judged = [names for names in (("device", "on_hicache", "on_hicache_corrupt"), ("device", "on_storage"))
              if set(names) <= set(runs)]
    report["judged"] = sorted({name for names in judged for name in names})
    report["pass"] = bool(judged) and bool(checks) and all(checks.values()) and not any(
        runs[name]["problems"] for name in report["judged"])
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
