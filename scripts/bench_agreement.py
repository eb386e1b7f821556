#!/usr/bin/env python3
"""What the forward's agreement point costs (forward/agreement.py): one all-reduce (MAX) of one
int64 over the CP group's CPU (gloo) group, once per prefill forward, when no rank has news.

N rank processes over gloo on this machine's loopback, each calling the plugin's real
``ForwardAgreement.end_forward`` the way the hook after ``ModelRunner.forward`` does, with
nothing to report (the serving path), ``--iterations`` times after a warm-up; interleaved
with it, a bare ``torch.distributed.barrier`` on the same group (the least any host
collective over these processes costs). Prints JSON: per N, microseconds per agreement and
per barrier (median, p90, p99, max over ranks of each rank's median) and the ratio.

No GPU: the agreement never touches the device. A CPU box with fewer cores than ranks
measures scheduling as much as gloo; the JSON records the core count. For scale: a prefill
forward of an 8K-token chunk takes tens to hundreds of milliseconds (docs/performance.md).

    .venv/bin/python scripts/bench_agreement.py [--cp-sizes 2,4,8] [--iterations 2000] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp-sizes", default="2,4,8")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def _quantiles(samples_us):
    ordered = sorted(samples_us)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p90": pick(0.9), "p99": pick(0.99)}


def _rank_main(rank, n, port, out_dir, iterations, warmup):
    import torch

    from sglang_cp_shared_kv.forward.agreement import ForwardAgreement
    from sglang_cp_shared_kv.kernels import KernelDispatch
    from sglang_cp_shared_kv_testing.cp_harness import finish_rank

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    group = torch.distributed.new_group(list(range(n)), backend="gloo")
    agreement = ForwardAgreement(rank, n, KernelDispatch())
    agree_us, barrier_us = [], []
    for i in range(warmup + iterations):
        agreement.begin_forward()
        start = time.perf_counter()
        agreement.end_forward(group)
        middle = time.perf_counter()
        torch.distributed.barrier(group=group)
        end = time.perf_counter()
        if i >= warmup:
            agree_us.append((middle - start) * 1e6)
            barrier_us.append((end - middle) * 1e6)
    finish_rank(out_dir, rank, {"agreement_us": _quantiles(agree_us), "barrier_us": _quantiles(barrier_us),
                                "agreements": agreement.agreements})


def measure(n: int, iterations: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    from sglang_cp_shared_kv_testing.support import free_port, run_rank_processes

    out_dir = tempfile.mkdtemp(prefix=f"bench-agreement-{n}-")
    per_rank = run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                                  args=(n, free_port(), out_dir, iterations, warmup), timeout_s=600,
                                  what="agreement benchmark")
    assert all(r["agreements"] == warmup + iterations for r in per_rank)
    agree = [r["agreement_us"]["median"] for r in per_rank]
    barrier = [r["barrier_us"]["median"] for r in per_rank]
    return {"cp_size": n, "agreement_us_rank0": per_rank[0]["agreement_us"],
            "barrier_us_rank0": per_rank[0]["barrier_us"],
            "agreement_us_median_max_over_ranks": max(agree), "barrier_us_median_max_over_ranks": max(barrier),
            "agreement_over_barrier": statistics.median(agree) / statistics.median(barrier)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = [int(x) for x in args.cp_sizes.split(",")]
    result = {"what": "forward agreement point (gloo all-reduce MAX of one int64), no fault",
              "command": "scripts/bench_agreement.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpu_cores": os.cpu_count(), "iterations": args.iterations,
              "sizes": [measure(n, args.iterations, args.warmup) for n in sizes]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
