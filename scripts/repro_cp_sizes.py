#!/usr/bin/env python3
"""Which CP sizes does stock SGLang 0.5.12.post1's in-seq-split NSA prefill CP serve? Flag off,
one GPU, every rank on it (``--share-gpu``), one server per CP size in turn.

Why ask: CP2, CP4 and CP8 servers answer every prompt of scripts/e2e_cp_logprobs.py; CP3 and CP5
servers (one H200, 2026-12-04) stopped at their first prompt with "CUDA error: an illegal memory
access", flag off and on alike. The plugin refuses every size but 2, 4 and 8 at startup
(``releases.v0512.RELEASE.served_cp_sizes``); CP6 and CP7 are refused on a reading of the code alone.
This probe measures it: per size N (default 3, 5, 6, 7) the tiny DeepSeek-V3.2 of the e2e scripts
with its sharded dims rounded up to multiples of N (``model_for``: at 2, 4 and 8 it is the e2e model
itself), then five prompts (``prompts``): one chunk SGLang's in-seq split cuts evenly and unpadded,
one it cuts into odd segments, one it pads, 1,504 tokens (padded and odd at CP3 and CP5: the crash),
and 3,008 tokens (two chunks of --chunked-prefill-size 2048). Recorded per size: booted, each
prompt's answer, the scheduler log's first error line, whether the server still ran after, its log.

Usage (one GPU, as scripts/gpu_session.sh prepares it: CP_SIZES="3,5,6,7"):
    python scripts/repro_cp_sizes.py [--sizes 3,5,6,7] [--parallel 1] [--launch-blocking]
                                     [--out repro_cp_sizes.json] [--workdir dir]
JSON to --out (rewritten after every size) and stdout; exit 0 once every size has a record.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import e2e_cp_logprobs as e2e  # this script's own folder is on sys.path
import repro_cp_uneven_split as uneven

from sglang_cp_shared_kv_testing import shared_gpu
from sglang_cp_shared_kv_testing.server import accumulate_runs, post, startup_figures, stop, write_model

#: NOTE: beyond the uneven repro's marks, a server that does not boot says why in a ValueError
#: (SGLang's own argument and weight-shape checks)
ERROR_MARKS = uneven.ERROR_MARKS + ("ValueError",)
#: dims rounded up to a multiple of N (times the alignment given): the vocabulary SGLang shards over
#: the TP ranks (after padding it to 64), the experts over the EP ranks (the in-seq split sets
#: ep_size = tp_size; ExpertLocationMetadata asserts the division), and the dense MLP as the
#: 2026-12-04 CP3/CP5 run had it (SGLang runs it unsharded there: moe_dense_tp_size 1)
SHARDED_DIMS = {"intermediate_size": 64, "vocab_size": 64, "n_routed_experts": 1}
#: seconds a server that left a prompt unanswered is given to end before "server_alive" is read
SETTLE_S = 5


def model_for(cp_size: int) -> dict:
    """The e2e model with each of :data:`SHARDED_DIMS` rounded up to a multiple of
    ``cp_size`` (times the dim's own alignment); unchanged at CP 2, 4 and 8."""
    config = dict(e2e.MODEL)
    for dim, align in SHARDED_DIMS.items():
        unit = math.lcm(align, cp_size)
        config[dim] = -(-config[dim] // unit) * unit
    return config


def prompts(cp_size: int) -> dict:
    """{name: token count}, in the order they are posted: the ones CP 2, 4 and 8 are known to
    serve in some form first, since a crash ends the server. SGLang pads a chunk to a multiple of
    N rows and cuts it into 2N zigzag segments (``prepare_mlp_sync_batch``,
    ``prepare_context_parallel_metadata``): 1,504 tokens at CP3 are padded AND cut into odd
    segments; the two prompts before it have one of those each."""
    segments = 2 * cp_size
    even = e2e.CHUNK // (segments * 64) * segments * 64  # unpadded, even segments, whole pages
    most = 1504 // segments
    odd = most if most % 2 else most - 1  # the longest odd segments of an unpadded chunk <= 1,504 tokens
    return {f"even_split_{even}": even, f"odd_segments_{odd * segments}": odd * segments,
            f"padded_{even - 1}": even - 1, "one_chunk_1504": 1504, "two_chunks_3008": 3008}


def ask(port: int, length: int, timeout: float) -> str:
    """Post a ``length``-token prompt (max_new_tokens 1); what came back, in a word or a line."""
    import numpy as np

    ids = np.random.default_rng(length).integers(2, e2e.TINY_DSV32["vocab_size"], size=length).tolist()
    try:
        out = post(port, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=timeout)
    except urllib.error.HTTPError as exc:
        return f"refused: HTTP {exc.code}: {exc.read().decode(errors='replace')[-300:]}"
    except (urllib.error.URLError, ConnectionError, OSError) as exc:  # a timeout is an OSError too
        return f"no answer: {type(exc).__name__}: {exc}"
    finish = out["meta_info"].get("finish_reason") or {}
    return f"refused: {finish.get('message')}" if finish.get("type") == "abort" else "answered"


def probe(cp_size: int, args) -> dict:
    """One flag-off server at CP ``cp_size``: its record (a server that never boots included)."""
    name = f"cp{cp_size}"
    config = model_for(cp_size)
    model = write_model(args.workdir / f"tiny-dsv32-{name}", config)
    log_path, port = args.workdir / f"{name}.log", args.port + e2e.PORTS_PER_RUN * cp_size
    run_args = argparse.Namespace(tp=cp_size, share_gpu=True, kv_cache_dtype="bfloat16", stable_topk=False,
                                  boot_timeout=args.boot_timeout)
    record = {"tp": cp_size, "attn_cp_size": cp_size, "log": str(log_path),
              "model": {dim: config[dim] for dim in SHARDED_DIMS}, "prompts": {}}
    t0 = time.monotonic()
    try:
        proc = e2e.launch(name, False, None, e2e.POOL, str(model), port, run_args, log_path)
    except RuntimeError as exc:  # exited, or not healthy in time: start_server stopped it
        record.update(booted=False, boot_error=str(exc), server_alive=False)
        proc = None
    if proc is not None:
        record.update(booted=True, boot_s=round(time.monotonic() - t0, 1))
        try:
            for prompt, length in prompts(cp_size).items():
                record["prompts"][prompt] = (ask(port, length, args.prompt_timeout) if proc.poll() is None
                                             else "not sent: the server had exited")
            if any(answer != "answered" for answer in record["prompts"].values()):
                try:  # NOTE: a server whose scheduler died takes a moment to end: give it that
                    proc.wait(timeout=SETTLE_S)
                except subprocess.TimeoutExpired:
                    pass
            record["server_alive"] = proc.poll() is None
        finally:
            stop(proc)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    lines = text.splitlines()
    # NOTE: unindented lines only: a traceback's source lines ("    raise RuntimeError(...)") come before its message
    record["first_error"] = next((line.strip()[:300] for line in lines
                                  if not line[:1].isspace() and any(m in line for m in ERROR_MARKS)), None)
    record["served"] = record["booted"] and all(a == "answered" for a in record["prompts"].values())
    if not record["served"]:  # NOTE: a scheduler can die under a live HTTP process: keep the end
        record["log_tail"] = [line[:300] for line in lines[-uneven.LOG_TAIL_LINES:]]
    if record["booted"]:
        record["share_gpu_problem"] = shared_gpu.problem(startup_figures(text), name, log_path, cp_size)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="3,5,6,7", help="CP sizes (= --tp, no DP), comma-separated")
    ap.add_argument("--port", type=int, default=25000)  # (below the ephemeral range)
    ap.add_argument("--boot-timeout", type=int, default=300)
    ap.add_argument("--prompt-timeout", type=int, default=60, help="seconds for each prompt's answer")
    ap.add_argument("--parallel", type=int, default=1, help="sizes probed at once (default: one after another)")
    ap.add_argument("--launch-blocking", action="store_true",
                    help="CUDA_LAUNCH_BLOCKING=1 in the servers: a failing kernel is named where it was launched")
    ap.add_argument("--workdir", type=Path, default=Path("repro-cp-sizes-work"))
    ap.add_argument("--out", default="repro_cp_sizes.json")
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",") if n]
    if not sizes or min(sizes) < 2 or max(sizes) > 8:
        ap.error("--sizes: CP sizes from 2 to 8 (SGLang's in-seq split asserts --tp <= 8)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.launch_blocking:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # the servers' environment is this process's (e2e_env)
    names = [f"cp{n}" for n in sizes]
    done, lock = {}, threading.Lock()

    def report(runs, failed):
        text = json.dumps({
            "share_gpu": True, "flag": "off", "launch_blocking": args.launch_blocking, "sizes": sizes,
            "served": [run["tp"] for run in runs.values() if run["served"]],
            "not_served": [run["tp"] for run in runs.values() if not run["served"]],
            "runs": runs, "failed_runs": failed,
            "note": "ranks shared one GPU: a correctness probe, no time in it means anything"}, indent=1)
        Path(args.out).write_text(text)
        return text

    def one(name):
        record = probe(int(name[2:]), args)
        with lock:  # NOTE: rewritten after every size, so a call cut short keeps the sizes it finished
            done[name] = record
            report(done, {})
        return record

    # each size in turn (or --parallel at once); one that raises is reported and the next still starts
    runs, failed = accumulate_runs(args.workdir, "probe", names, names, one, "cp-sizes", parallel=args.parallel)
    print(report(runs, failed))
    return 0 if len(runs) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
