#!/usr/bin/env python3
"""TTFT of a real CP2 prefill server, flag off vs on (and on with phase-8 prefetch), side by
side on the same GPUs, requests interleaved so drift cancels; then, from inside the flag-on
servers, the time each stage of the plugin's work takes per layer.

Needs two GPUs (one server = TP2, in-seq-split CP2), sglang 0.5.12.post1 and this plugin
(scripts/gpu_session.sh sets the environment). The model is DeepSeek-V3.2's attention and
MLP at full size with --layers dense layers (random non-degenerate weights, see
scripts/e2e/sitecustomize.py); every server gets the same layout, so the same weights.

Phase 1 (TTFT): servers off, on, on_prefetch run at once (--mem-fraction-static 0.28 each,
their own --port and --nccl-port). After one warm-up request per length and server, each
length is sent --runs times to every server, the server order rotating every round; TTFT
is the wall time of a max_new_tokens=1 request (fresh random prompt each time, the same
prompt for every server in a round). Overhead % = median(server) / median(off) - 1.
Beside each TTFT, from inside the server: SGLang's own device timer of the forward passes
(``--enable-metrics`` with ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1`` on every server; the
slowest TP rank's ``sglang:forward_execution_seconds_total{category="extend"}``), read
before the request and after a 64-token request that follows it (a forward's time is
reported when the next forward ends), less that server's median 64-token forward: the
GPU time of the prompt's chunked-prefill forwards, free of HTTP and scheduler noise, with
its own medians and overhead %. The flag-on servers also report their write-path counts
(``sglang:cp_shared_kv_prefill_forwards_total``: chunks stored where they were computed).

Phase 2 (stage times): on and on_prefetch restarted with SGLANG_CP_SHARED_KV_NVTX=1 and
SGLANG_CP_SHARED_KV_TIMING_DIR; per length one request between two 64-token requests
(a forward's figures are written when the next one starts); the delta of each CP rank's
stage-times file over those requests (``cp0``, ``cp1``, ...: in-seq-split gives the ranks
different halves of the causal work), per forward and per layer (it includes one
64-token forward).

Verdicts and derived figures, beside the numbers they come from (never instead of them):
each flag-on summary entry has ``goal_overhead_pct`` (1.0: issue 12's goal at CP2) and
``meets_goal`` (overhead_pct <= it); ``ttft.goal`` puts the TTFT and the forward-time
verdicts of each length side by side (``meets_goal``: both); ``exposed_ms_per_layer`` (from
phase 2) is, per length, each CP rank's sum of the leaf stages per layer for ``on`` and
``on_prefetch``, the slowest rank's, and what prefetch saves on it; ``runs_meet_issue_minimum``
says whether --runs reached the issue's 5 (fewer runs are measured and marked, not refused).

A server that fails to start or a request that fails is reported (``errors``) and that
server leaves the comparison; the others go on, and the JSON is rewritten after every
round, so a call that runs out of time keeps the rounds it finished.

Usage: python scripts/bench_e2e_ttft.py --out ttft.json [--lengths 16384,32768,65536,114688]
       [--runs 5] [--layers 8] [--kv-cache-dtype bfloat16] [--cp-size 2]
       [--skip-stage-times | --only-stage-times]
       --cp-size 1: one GPU, the stock TP1 server alone (no CP, so no flag): the run-to-run
       spread of TTFT and of the server-side forward time, i.e. what each can resolve.
JSON on stdout and in --out. Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from sglang_cp_shared_kv_testing.server import (
    WRITE_PATHS_METRIC,
    e2e_env,
    post,
    prometheus_samples,
    start_server,
    stop,
    write_model,
)

CHUNK = 8192
#: NOTE: issue 12's goal for the flag's TTFT overhead at CP2, in per cent of the flag-off median
GOAL_OVERHEAD_PCT = 1.0
#: NOTE: issue 12 asks for at least this many runs per length and server
ISSUE_MIN_RUNS = 5
#: stage-timer stages that contain other stages (forward.prefetch: the next layer's MLA view,
#: pack and gather launch are timed inside ``prefetch:issue``); every other stage is a leaf
CONTAINER_STAGES = frozenset({"prefetch:issue"})
#: SGLang's device-timed forward seconds (with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1)
FORWARD_SECONDS_METRIC = "sglang:forward_execution_seconds_total"
#: the short request after each prompt: its forward reports the prompt's last one
FLUSH_TOKENS = 64
VARIANTS = {  # name: (flag on, prefetch)
    "off": (False, False), "on": (True, False), "on_prefetch": (True, True),
}
#: DeepSeek-V3.2's attention and dense-MLP dimensions; every layer dense (no MoE weights).
DSV32_DIMS = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 2048, "vocab_size": 129280, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "moe_layer_freq": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
}


# ------------------------------------------------------------------ pure parts
def model_config(layers: int) -> dict:
    return dict(DSV32_DIMS, num_hidden_layers=layers, first_k_dense_replace=layers)


def schedule(lengths: Sequence[int], runs: int, variants: Sequence[str]) -> List[Tuple[int, int, str]]:
    """(round, length, variant) in send order: every variant once per length per round, the
    variant order rotated by one each round (each variant goes first equally often)."""
    out = []
    for rnd in range(runs):
        order = list(variants[rnd % len(variants):]) + list(variants[: rnd % len(variants)])
        for length in lengths:
            out += [(rnd, length, v) for v in order]
    return out


def summarize(ttft: Dict[str, Dict[int, List[float]]], base: str = "off") -> dict:
    """Median, min, max and spread per variant and length; against ``base``::

        overhead_pct = 100 * (median(variant) / median(base) - 1)
        meets_goal   = overhead_pct <= goal_overhead_pct (GOAL_OVERHEAD_PCT)

    the goal judged on the medians as measured, whatever their spread (``spread_pct`` beside
    it says how far to trust it)."""
    out: dict = {}
    for variant, by_length in ttft.items():
        for length, times in by_length.items():
            if not times:  # a server that left the comparison before measuring this length
                continue
            med = statistics.median(times)
            entry = {"runs": len(times), "median_s": round(med, 5), "min_s": round(min(times), 5),
                     "max_s": round(max(times), 5), "spread_pct": round(100 * (max(times) - min(times)) / med, 2)}
            if variant != base and ttft.get(base, {}).get(length):
                entry["overhead_pct"] = round(100 * (med / statistics.median(ttft[base][length]) - 1), 2)
                entry["goal_overhead_pct"] = GOAL_OVERHEAD_PCT
                entry["meets_goal"] = entry["overhead_pct"] <= GOAL_OVERHEAD_PCT
            out.setdefault(variant, {})[str(length)] = entry
    return out


def goal_verdict(ttft_summary: dict, forward_summary: dict) -> dict:
    """Per flag-on variant and length: the TTFT (HTTP) and forward (server-side) overheads
    side by side with the goal (issue 12's, at CP2); ``meets_goal`` only when both were
    measured and both meet it (a missing one is named in ``missing``)."""
    out: dict = {}
    for variant in sorted(set(ttft_summary) | set(forward_summary)):
        for length in sorted(set(ttft_summary.get(variant, {})) | set(forward_summary.get(variant, {})), key=int):
            ttft = ttft_summary.get(variant, {}).get(length, {})
            forward = forward_summary.get(variant, {}).get(length, {})
            if "overhead_pct" not in ttft and "overhead_pct" not in forward:
                continue  # the base itself, or a length the base lacks
            judged = {name: entry["overhead_pct"] for name, entry in (("ttft", ttft), ("forward", forward))
                      if "overhead_pct" in entry}
            verdict = {"ttft_overhead_pct": judged.get("ttft"), "forward_overhead_pct": judged.get("forward"),
                       "goal_overhead_pct": GOAL_OVERHEAD_PCT,
                       "ttft_meets_goal": ttft.get("meets_goal"), "forward_meets_goal": forward.get("meets_goal"),
                       "runs": min(entry["runs"] for entry in (ttft, forward) if entry)}
            missing = sorted({"ttft", "forward"} - set(judged))
            verdict["meets_goal"] = not missing and verdict["ttft_meets_goal"] and verdict["forward_meets_goal"]
            if missing:
                verdict["missing"] = missing
            out.setdefault(variant, {})[length] = verdict
    return out


def stage_delta(before: dict, after: dict, layers: int) -> dict:
    """Per stage, what ``after`` (a stage-times snapshot) adds to ``before``: calls, ms, ms
    per forward and per layer; and the time the plugin's work held the compute stream::

        exposed_ms_per_layer = sum of the leaf stages' ms / forwards / layers

    (every stage but CONTAINER_STAGES, whose inner stages are leaves counted already; an
    asynchronous gather's leaf is its launch, its exposed rest ``prefetch:wait``)."""
    forwards = after["forwards"] - before["forwards"]
    out = {"forwards": forwards, "stages": {}}
    exposed_ms = 0.0
    for stage, now in after["stages"].items():
        then = before["stages"].get(stage, {"calls": 0, "total_ms": 0.0})
        ms = now["total_ms"] - then["total_ms"]
        out["stages"][stage] = {"calls": now["calls"] - then["calls"], "ms": round(ms, 4),
                                "ms_per_forward": round(ms / forwards, 4) if forwards else None,
                                "ms_per_layer": round(ms / forwards / layers, 4) if forwards else None}
        if stage not in CONTAINER_STAGES:
            exposed_ms += ms
    out["exposed_ms"] = round(exposed_ms, 4)
    out["exposed_ms_per_layer"] = round(exposed_ms / forwards / layers, 4) if forwards else None
    return out


def exposed_side_by_side(stage_times: dict) -> dict:
    """Per length, each flag-on variant's ``exposed_ms_per_layer`` per CP rank, the slowest
    rank's (the others wait for it at the next collective), and, with both variants::

        prefetch_saves_ms_per_layer = slowest(on) - slowest(on_prefetch)
    """
    out: dict = {}
    for variant, by_length in stage_times.items():
        for length, ranks in by_length.items():
            if length == "error":
                continue
            per_rank = {rank: delta["exposed_ms_per_layer"] for rank, delta in ranks.items()
                        if delta.get("exposed_ms_per_layer") is not None}
            if not per_rank:
                continue
            slowest = max(per_rank, key=per_rank.get)
            out.setdefault(length, {})[variant] = dict(per_rank, slowest_rank=slowest,
                                                       slowest_ms_per_layer=per_rank[slowest])
    for by_variant in out.values():
        if "on" in by_variant and "on_prefetch" in by_variant:
            by_variant["prefetch_saves_ms_per_layer"] = round(
                by_variant["on"]["slowest_ms_per_layer"] - by_variant["on_prefetch"]["slowest_ms_per_layer"], 4)
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def extend_seconds_between(before: Dict[str, float], after: Dict[str, float]) -> float:
    """The slowest TP rank's device-timed extend (prefill) seconds from ``before`` to
    ``after``, two readings of ``FORWARD_SECONDS_METRIC`` (one sample per label set:
    tp_rank, category, ...).

    NOTE: the largest per-rank increase, not the increase of the largest total: the rank
    ahead in total need not be the one that took longer in between."""
    return max((v - before.get(labels, 0.0) for labels, v in after.items() if 'category="extend"' in labels),
               default=0.0)


def prompt(seed: int, length: int, vocab: int) -> List[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(2, vocab, size=length).tolist()


# ------------------------------------------------------------------- servers
def launch(name: str, variant: str, model: Path, args, index: int, work: Path, timing_dir: Path = None):
    flag_on, prefetch = VARIANTS[variant]
    port, nccl_port = args.port + 10 * index, args.port + 10 * index + 5
    cp = ["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split",
          "--disable-custom-all-reduce"] if args.cp_size > 1 else []  # --cp-size 1: stock TP1, the noise floor
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
           "--skip-tokenizer-init", "--trust-remote-code", "--tp", str(args.cp_size), *cp, "--page-size", "64",
           "--mem-fraction-static", str(args.mem_fraction),
           "--disable-cuda-graph", "--disable-piecewise-cuda-graph", "--random-seed", "0",
           "--port", str(port), "--nccl-port", str(nccl_port), "--kv-cache-dtype", args.kv_cache_dtype,
           "--chunked-prefill-size", str(CHUNK), "--sampling-backend", "pytorch",
           "--skip-server-warmup", "--disable-overlap-schedule",
           "--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse",
           "--enable-metrics"]
    env = e2e_env({"SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0",
                   "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
                   "SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"})
    if flag_on:
        cmd.append("--enable-nsa-prefill-cp-shared-kv")
        env["SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD"] = "1"
    if prefetch:
        env["SGLANG_CP_SHARED_KV_PREFETCH"] = "1"
    if timing_dir is not None:
        env.update(SGLANG_CP_SHARED_KV_NVTX="1", SGLANG_CP_SHARED_KV_TIMING_DIR=str(timing_dir))
    proc = start_server(name, cmd, env, port, work / f"{name}.log", args.boot_timeout)
    return proc, port


def generate(port: int, ids: List[int]) -> float:
    t0 = time.perf_counter()
    post(port, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    return time.perf_counter() - t0


def forward_samples(port: int) -> Dict[str, float]:
    return prometheus_samples(port, FORWARD_SECONDS_METRIC)


def flush_forward_s(port: int, vocab: int, pairs: int = 5) -> float:
    """The median device time of one FLUSH_TOKENS-token forward on this server."""
    samples = []
    for i in range(pairs):
        generate(port, prompt(40_000 + i, FLUSH_TOKENS, vocab))
        before = forward_samples(port)
        generate(port, prompt(50_000 + i, FLUSH_TOKENS, vocab))
        samples.append(extend_seconds_between(before, forward_samples(port)))  # the first of the two
    return statistics.median(samples)


def variants_for(cp_size: int) -> List[str]:
    """The servers to compare: all of VARIANTS, or at CP size 1 (no CP group, so no flag) the
    flag-off server alone, whose spread is the noise floor of both measurements."""
    return list(VARIANTS) if cp_size > 1 else ["off"]


def measure_ttft(args, model: Path, work: Path, checkpoint=None) -> dict:
    """Phase 1 (module docstring). ``checkpoint(result)`` is called with the result so far
    after the warm-up and after every round."""
    servers, variants, errors = {}, variants_for(args.cp_size), {}
    vocab = DSV32_DIMS["vocab_size"]
    ttft: Dict[str, Dict[int, List[float]]] = {v: {n: [] for n in args.lengths} for v in variants}
    forward: Dict[str, Dict[int, List[float]]] = {v: {n: [] for n in args.lengths} for v in variants}
    flush: Dict[str, float] = {}
    write_paths: Dict[str, Dict[str, float]] = {}

    def result() -> dict:
        raw = lambda by_variant: {v: {str(n): t for n, t in by.items()} for v, by in by_variant.items()}  # noqa: E731
        summary, forward_summary = summarize(ttft), summarize(forward)
        return {"raw_s": raw(ttft), "summary": summary,
                "forward_raw_s": raw(forward), "forward_summary": forward_summary,
                "goal": goal_verdict(summary, forward_summary),
                "forward_per_chunk_ms": forward_per_chunk_ms(forward),
                "flush_forward_s": flush, "write_paths": write_paths, "errors": errors}

    def drop(variant: str, what: str, exc: Exception) -> None:
        errors[variant] = f"{what}: {type(exc).__name__}: {exc}"
        print(f"bench_e2e_ttft: {variant} leaves the comparison: {errors[variant]}", file=sys.stderr)
        proc_port = servers.pop(variant, None)
        if proc_port is not None:
            stop(proc_port[0])

    try:
        for i, variant in enumerate(variants):
            try:
                servers[variant] = launch(variant, variant, model, args, i, work)
            except Exception as exc:  # noqa: BLE001 -- reported; the other servers are still compared
                drop(variant, "start", exc)
        for variant in list(servers):
            try:
                for length in args.lengths:  # warm-up: JIT and allocator for each shape
                    generate(servers[variant][1], prompt(10_000 + length, length, vocab))
                flush[variant] = flush_forward_s(servers[variant][1], vocab)
            except Exception as exc:  # noqa: BLE001
                drop(variant, "warm-up", exc)
        if checkpoint:
            checkpoint(result())
        last_round = None
        for rnd, length, variant in schedule(args.lengths, args.runs, variants):
            if checkpoint and last_round is not None and rnd != last_round:
                checkpoint(result())
            last_round = rnd
            if variant not in servers:
                continue
            port = servers[variant][1]
            try:
                before = forward_samples(port)
                seconds = generate(port, prompt(rnd * 1000 + length, length, vocab))
                generate(port, prompt(rnd, FLUSH_TOKENS, vocab))
                forwards = extend_seconds_between(before, forward_samples(port)) - flush[variant]
            except Exception as exc:  # noqa: BLE001
                drop(variant, f"round {rnd}, {length} tokens", exc)
                continue
            ttft[variant][length].append(seconds)
            forward[variant][length].append(forwards)
            print(f"round {rnd} {length:>7} {variant:<12} TTFT {seconds:.4f} s, forwards {forwards:.4f} s",
                  file=sys.stderr)
        for variant, (_, port) in servers.items():
            if VARIANTS[variant][0]:
                write_paths[variant] = prometheus_samples(port, WRITE_PATHS_METRIC)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return result()


def forward_per_chunk_ms(forward: Dict[str, Dict[int, List[float]]]) -> Dict[str, Dict[str, float]]:
    """Median forward time of a prompt divided by its CHUNK-token chunks, per variant and length
    (the mean over chunks: later chunks attend over more history)."""
    return {v: {str(n): round(statistics.median(t) / -(-n // CHUNK) * 1e3, 3) for n, t in by.items() if t}
            for v, by in forward.items()}


def stage_files(timing_dir: Path) -> Dict[str, dict]:
    """Each CP rank's stage-times file in ``timing_dir``: {"cp0": ..., "cp1": ...}."""
    files = {path.stem.rsplit("-", 1)[1]: json.loads(path.read_text())
             for path in timing_dir.glob("stage-times-cp*.json")}
    if not files:
        raise RuntimeError(f"no stage-times file in {timing_dir} (the server did not write SGLANG_CP_SHARED_KV_TIMING_DIR)")
    return files


def measure_stage_times(args, model: Path, work: Path) -> dict:
    """Per flag-on variant and length, the stage-time delta of one request (module docstring);
    a variant that fails keeps what it measured and says why (``error``), and the next one runs."""
    out = {}
    vocab = DSV32_DIMS["vocab_size"]
    for i, variant in enumerate(("on", "on_prefetch")):
        timing_dir = work / f"timing-{variant}"
        out[variant], proc = {}, None
        try:
            proc, port = launch(f"{variant}-timed", variant, model, args, i, work, timing_dir)
            for length in args.lengths:
                generate(port, prompt(20_000 + length, length, vocab))  # warm-up
                generate(port, prompt(1, FLUSH_TOKENS, vocab))
                generate(port, prompt(2, FLUSH_TOKENS, vocab))
                before = stage_files(timing_dir)
                generate(port, prompt(30_000 + length, length, vocab))
                generate(port, prompt(3, FLUSH_TOKENS, vocab))
                after = stage_files(timing_dir)
                out[variant][str(length)] = {rank: stage_delta(before[rank], after[rank], args.layers)
                                             for rank in sorted(after) if rank in before}
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and the exit status
            out[variant]["error"] = f"{type(exc).__name__}: {exc}"
            print(f"bench_e2e_ttft: stage times of {variant} failed: {out[variant]['error']}", file=sys.stderr)
        finally:
            if proc is not None:
                stop(proc)
    return out


def report_header(args, command: str) -> dict:
    """The report's settings; ``runs_meet_issue_minimum``: ``--runs`` >= ISSUE_MIN_RUNS (a
    shorter run is reported as such, not refused: a quick look is still worth its JSON)."""
    return {"command": command, "layers": args.layers, "cp_size": args.cp_size, "chunk": CHUNK,
            "kv_cache_dtype": args.kv_cache_dtype, "lengths": args.lengths, "runs": args.runs,
            "runs_meet_issue_minimum": args.runs >= ISSUE_MIN_RUNS, "goal_overhead_pct": GOAL_OVERHEAD_PCT}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_e2e_ttft.json")
    ap.add_argument("--workdir", default="ttft-work")
    ap.add_argument("--lengths", default="16384,32768,65536,114688")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cp-size", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--mem-fraction", type=float, default=0.28)
    ap.add_argument("--port", type=int, default=27000)  # (below the ephemeral range)
    ap.add_argument("--boot-timeout", type=int, default=600)
    ap.add_argument("--skip-stage-times", action="store_true", help="phase 1 only")
    ap.add_argument("--only-stage-times", action="store_true",
                    help="phase 2 only (two servers instead of five: fits a device call of its own)")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.runs < 1 or args.layers < 1 or args.cp_size < 1 or not args.lengths:
        ap.error("--runs, --layers and --cp-size must be >= 1, --lengths non-empty")
    if args.only_stage_times and (args.skip_stage_times or args.cp_size < 2):
        ap.error("--only-stage-times needs --cp-size 2 or more and no --skip-stage-times")
    work = Path(args.workdir)
    model = write_model(work / f"dsv32-dims-{args.layers}l", model_config(args.layers))
    report = report_header(args, " ".join(sys.argv))
    if not report["runs_meet_issue_minimum"]:
        print(f"bench_e2e_ttft: --runs {args.runs} is below the issue's minimum of {ISSUE_MIN_RUNS} per length; "
              "the report says so (runs_meet_issue_minimum: false)", file=sys.stderr)

    def checkpoint(ttft: dict) -> None:
        report["ttft"] = ttft
        Path(args.out).write_text(json.dumps(report, indent=1))

    status = 0
    if not args.only_stage_times:
        checkpoint(measure_ttft(args, model, work, checkpoint))  # phase 1 kept whatever phase 2 does
        status = int(bool(report["ttft"]["errors"]))
    if not args.skip_stage_times and args.cp_size > 1:
        report["stage_times"] = measure_stage_times(args, model, work)
        report["exposed_ms_per_layer"] = exposed_side_by_side(report["stage_times"])
        status |= int(any("error" in by_length for by_length in report["stage_times"].values()))
    text = json.dumps(report, indent=1)
    Path(args.out).write_text(text)
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
