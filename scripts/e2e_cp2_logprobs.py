#!/usr/bin/env python3
"""End to end inside a real SGLang server: prompt logprobs of an NSA CP2 in-seq-split
prefill server with --enable-nsa-prefill-cp-shared-kv must match the same server
without it.

Needs two GPUs, sglang 0.5.12.post1 and this plugin installed. It writes a tiny
DeepSeek-V3.2 config, then launches four servers one after another on the same two
GPUs, identical but for the flag (same parallel layout, hence the same dummy weights,
made non-degenerate by scripts/e2e/sitecustomize.py):

  off_a, off_b   flag off, twice: the run-to-run spread
  on             flag on
  on_corrupt     flag on, one history page zeroed on CP rank 1 (negative control)

Each answers the same prefill-only requests (max_new_tokens=1, return_logprob,
logprob_start_len=0; --chunked-prefill-size 2048): a 1.5K prompt (one chunk), 3K and 6K
prompts (history + current chunks), and a prompt sharing the 3K prompt's first 2,048
tokens (a radix hit; logprobs of its new tokens). The flag-on server runs with
SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD=1: it needs no decode server for this.

Pass: positions that see <= index_topk keys are bit-identical on and off (top-k keeps
every key there); beyond, the flag-on run's mean deviation from the flag-off run stays
within the flag-off runs' own mean deviation (+25 %; see ``verdict``); on prompts with
history the negative control lands clearly outside the spread; the startup logs show
the same physical tokens per rank and twice the logical tokens. JSON summary on stdout
and in --out.

--stable-topk makes the comparison exact: every server runs with SGLang's NSA top-k
kernels replaced by deterministic stand-ins (``sglang_cp_shared_kv.testing.stable_topk``:
the same keys, in key order; the stock kernel returns them in the order of its atomics,
which is what varies past index_topk). Then off_a and off_b must agree bit for bit at
every position, so must on and off_a, and the negative control must differ somewhere.

--tp 1 runs the flag-off servers only, without CP, on one GPU (off_a, off_b): the
determinism probe, with and without --stable-topk.

Each run's logprobs and startup figures are kept in --workdir, so the four servers can
be run in separate invocations (--runs off_a,on then --runs off_b,on_corrupt); the
report compares whatever runs the workdir holds and passes only when all four are there.

Usage: python scripts/e2e_cp2_logprobs.py --out e2e.json [--runs off_a,off_b,on,on_corrupt]
                                          [--kv-cache-dtype bfloat16] [--stable-topk] [--tp 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from sglang_cp_shared_kv.testing.server import (
    TINY_DSV32,
    WRITE_PATHS_METRIC,
    accumulate_runs,
    e2e_env,
    post,
    prometheus_samples,
    stable_topk_problem,
    start_server,
    startup_figures,
    stop,
    write_model,
    write_report,
)

INDEX_TOPK = TINY_DSV32["index_topk"]
CHUNK = 2048  # --chunked-prefill-size
RUNS = {  # name: (flag on, corrupt rank)
    "off_a": (False, None), "off_b": (False, None), "on": (True, None), "on_corrupt": (True, 1),
}
RUNS_WITHOUT_CP = ("off_a", "off_b")  # --tp 1: one GPU, no CP, so no flag


def prompts():
    import numpy as np

    def tokens(seed, n):
        return np.random.default_rng(seed).integers(2, TINY_DSV32["vocab_size"], size=n).tolist()

    p3k = tokens(2, 3000)
    return {
        "1.5k_single_chunk": (tokens(1, 1500), 0),
        "3k_chunked": (p3k, 0),
        "6k_chunked": (tokens(3, 6000), 0),
        "radix_hit_3k_prefix": (p3k[:2048] + tokens(4, 1000), 2048),
    }


def launch(name, flag_on, corrupt_rank, model, port, args, log_path):
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--trust-remote-code", "--tp", str(args.tp), "--page-size", "64",
           "--mem-fraction-static", "0.5", "--disable-cuda-graph", "--random-seed", "0", "--port", str(port),
           "--kv-cache-dtype", args.kv_cache_dtype, "--chunked-prefill-size", str(CHUNK),
           "--disable-piecewise-cuda-graph", "--sampling-backend", "pytorch",
           # no decode here: the warm-up decodes, and the overlap scheduler launches a decode step
           # before it sees that a 1-token request is done; a shared-KV prefill rank refuses decode
           "--skip-server-warmup", "--disable-overlap-schedule"]
    if args.kv_cache_dtype == "bfloat16" or args.tp > 1:
        # flag off and on alike (the flag would pick it for fp8 + in-seq-split, stock would crash
        # on its fp8 default flashmla_kv: docs/troubleshooting.md); without CP fp8 keeps the defaults
        cmd += ["--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse"]
    if args.tp > 1:
        cmd += ["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split",
                "--disable-custom-all-reduce"]
    env = e2e_env({"SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"})
    if args.stable_topk:
        env["CPSKV_E2E_STABLE_TOPK"] = "1"
    if flag_on:
        # --enable-metrics: the run reports how its chunks reached the shards (WRITE_PATHS_METRIC)
        cmd += ["--enable-nsa-prefill-cp-shared-kv", "--enable-metrics"]
        env["SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD"] = "1"
    if corrupt_rank is not None:
        env["CPSKV_E2E_CORRUPT_RANK"] = str(corrupt_rank)
    return start_server(name, cmd, env, port, log_path, args.boot_timeout)


def logprobs(port, ids, start):
    out = post(port, "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
               timeout=180)  # NOTE: a 6K-token prefill of the tiny model takes seconds; a hang must not eat the call
    return [x[0] for x in out["meta_info"]["input_token_logprobs"]]


def compare(results, run, base, start):
    """|run - base| over positions that see <= index_topk keys ("near") and beyond ("far"):
    near max, far max, far mean."""
    near, far = [], []
    for i, (a, b) in enumerate(zip(results[run], results[base])):
        if a is None or b is None:
            continue
        keys = start + i  # position of the token whose logprob this is (it sees that many keys)
        (near if keys <= INDEX_TOPK else far).append(abs(a - b))
    return {"near_max": max(near, default=0.0), "far_max": max(far, default=0.0),
            "far_mean": sum(far) / len(far) if far else 0.0}


def verdict(entry, has_history, exact):
    """With the stock top-k, past index_topk every run differs from every other (the
    kernel returns the keys in a varying order), so "within the spread" compares the mean
    deviation, which is stable from run to run, with a 25 % margin; a single maximum over
    ~1K noisy positions is not. With the stable top-k (``exact``) every difference counts."""
    spread, on, corrupt = entry["spread"], entry.get("on"), entry.get("corrupt")
    identical = lambda d: d["near_max"] == 0.0 and d["far_max"] == 0.0  # noqa: E731
    checks = {"repeat_bit_identical" if exact else "repeat_near_bit_identical":
              identical(spread) if exact else spread["near_max"] == 0.0}
    if on is not None:
        if exact:
            checks["on_bit_identical"] = identical(on)
        else:
            checks["near_bit_identical"] = on["near_max"] == 0.0
            checks["far_within_spread"] = on["far_mean"] <= 1.25 * spread["far_mean"]
    if corrupt is not None and has_history:  # the control corrupts a gathered history page
        worst = max(corrupt["near_max"], corrupt["far_max"])
        checks["control_detected"] = worst > 0.0 if exact else worst > 5 * max(spread["far_max"], 1e-3)
    return checks


def one_run(name, model, requests, args, log_path):
    """Boot run ``name``'s server, take every prompt's logprobs, stop it: the run's record."""
    flag_on, corrupt = RUNS[name]
    t0 = time.monotonic()
    proc = launch(name, flag_on, corrupt, model, args.port, args, log_path)
    run = {"boot_s": round(time.monotonic() - t0, 1), "logprobs": {}}
    try:
        for prompt, (ids, start) in requests.items():
            if start == 0:  # fresh prompts run from an empty cache; the radix-hit one reuses it
                post(args.port, "/flush_cache")
            run["logprobs"][prompt] = logprobs(args.port, ids, start)
        if flag_on:
            run["write_paths"] = prometheus_samples(args.port, WRITE_PATHS_METRIC)
    finally:
        stop(proc)
    run["startup"] = startup_figures(log_path.read_text())
    if args.stable_topk:  # every TP rank must have taken it, else the comparison is not exact
        problem = stable_topk_problem(run["startup"], name, log_path, args.tp)
        run["stable_topk_problems"] = [problem] if problem else []
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="e2e_cp2_logprobs.json")
    ap.add_argument("--workdir", default="e2e-work")
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--boot-timeout", type=int, default=420)
    ap.add_argument("--runs", default=None, help="servers to run now (comma-separated; default: all of the layout)")
    ap.add_argument("--tp", type=int, choices=(1, 2), default=2,
                    help="2: CP2 in-seq-split on two GPUs (default); 1: one GPU, no CP, flag-off runs only")
    ap.add_argument("--stable-topk", action="store_true",
                    help="deterministic NSA top-k in every server: demand bit equality at every position")
    ap.add_argument("--logdir", default=None, help="server logs (default: --workdir)")
    args = ap.parse_args()
    layout_runs = list(RUNS) if args.tp == 2 else list(RUNS_WITHOUT_CP)
    selected = layout_runs if args.runs is None else [r for r in args.runs.split(",") if r]
    unknown = sorted(set(selected) - set(layout_runs))
    if unknown:
        ap.error(f"runs {unknown} are not part of --tp {args.tp}; choose from {layout_runs}")
    tag = f"{args.kv_cache_dtype}.tp{args.tp}" + (".stable-topk" if args.stable_topk else "")
    work = Path(args.workdir)
    logdir = Path(args.logdir) if args.logdir else work
    logdir.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "tiny-dsv32", TINY_DSV32)
    os.environ.setdefault("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    requests = prompts()
    runs, failed = accumulate_runs(
        work, tag, selected, layout_runs,
        lambda name: one_run(name, str(model), requests, args, logdir / f"{name}.{tag}.log"), "e2e")
    topk_problems = {name: run.get("stable_topk_problems", ["not recorded"])
                     for name, run in runs.items() if args.stable_topk}
    report = {"kv_cache_dtype": args.kv_cache_dtype, "tp": args.tp, "stable_topk": args.stable_topk,
              "index_topk": INDEX_TOPK, "runs": sorted(runs), "failed_runs": failed,
              "stable_topk_problems": {name: p for name, p in topk_problems.items() if p},
              "timings": {name: {"boot_s": run["boot_s"]} for name, run in runs.items()},
              "startup": {name: run["startup"] for name, run in runs.items()},
              # prefill forwards by write path, summed over the CP ranks (flag-on runs)
              "write_paths": {name: run["write_paths"] for name, run in runs.items() if "write_paths" in run},
              "prompts": {}}
    complete = set(runs) == set(layout_runs)
    ok = complete and not any(topk_problems.values())
    for prompt in requests:
        start = requests[prompt][1]
        results = {name: run["logprobs"][prompt] for name, run in runs.items()}
        entry = {"positions": len(next(iter(results.values()), []))}
        for label, run in (("spread", "off_b"), ("on", "on"), ("corrupt", "on_corrupt")):
            if run in results and "off_a" in results:
                entry[label] = compare(results, run, "off_a", start)
        if "on" in results and "off_b" in results:
            entry["on_vs_off_b"] = compare(results, "on", "off_b", start)
        if complete:
            has_history = start > 0 or len(requests[prompt][0]) > CHUNK
            entry["checks"] = verdict(entry, has_history, args.stable_topk)
            entry["pass"] = all(entry["checks"].values())
            ok &= entry["pass"]
        report["prompts"][prompt] = entry
    if "off_a" in runs and "on" in runs:
        off_pool, on = runs["off_a"]["startup"]["pool_tokens"], runs["on"]["startup"]["shared"]
        report["startup_pass"] = bool(on) and all(p in off_pool and l == 2 * p for p, l in on)
        ok &= report["startup_pass"]
    report["pass"] = ok
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
