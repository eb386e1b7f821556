#!/usr/bin/env python3
"""Does stock SGLang 0.5.12.post1 serve a chunk that its NSA in-seq split cannot give every
CP rank the same number of rows? Flag off, CP8, on one GPU (``--share-gpu``).

Why ask: the first CP8 server runs of ``scripts/e2e_cp_logprobs.py`` (one H200, 2026-12-03)
stopped on a 1,500-token prompt with a device-side index assert, flag off and on, all with the
deterministic top-k stand-in. This script separates the two: one flag-off server with SGLang's
own top-k, one with the stand-in, each posting a 1,504-token prompt (L % 16 = 0: the control)
and then a 1,500-token one; it records what each answered and whether the server survived.
Answer (2026-12-04, ``docs/results/repro_cp_uneven_split_h200.json``): stock survives, the old
stand-in did not. Why, found since: in-seq split pads the chunk to a multiple of N (1,500 ->
1,504 rows, 188 on every rank) and the indexer asks the 4 padding rows for page-table entries
past the request's table copy, which the stock kernel reads unchecked and the old stand-in
indexed (``sglang_cp_shared_kv_testing/stable_topk.py`` follows the kernel since; an earlier reading here, "ranks
0-3 one row short", was wrong).

Usage (one GPU, as scripts/gpu_session.sh prepares it): python scripts/repro_cp_uneven_split.py
       [--tp 8] [--out repro.json] [--workdir dir]
JSON to --out and stdout; exit 0 once both servers were probed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import urllib.error
from pathlib import Path

import e2e_cp_logprobs as e2e  # this script's own folder is on sys.path

from sglang_cp_shared_kv_testing.server import stop, write_model


#: what a stopped scheduler leaves in its log: a CUDA assert, the exception it raised, running out of
#: memory. NOTE: not a bare "Error": every 0.5.12.post1 server logs "Can not initialize
#: OpenAIServingResponses, error: Traceback" at boot (no openai_harmony), and the first run took that
ERROR_MARKS = ("Assertion", "AcceleratorError", "RuntimeError", "IndexError", "OutOfMemoryError", "Killed")
#: lines of a dead server's log kept in the JSON
LOG_TAIL_LINES = 40


def probe(name: str, stable_topk: bool, args, model, port: int):
    run_args = argparse.Namespace(tp=args.tp, share_gpu=True, kv_cache_dtype="bfloat16", stable_topk=stable_topk,
                                  boot_timeout=args.boot_timeout)
    log_path = args.workdir / f"{name}.log"
    record = {"stable_topk": stable_topk}
    proc = e2e.launch(name, False, None, e2e.POOL, str(model), port, run_args, log_path)
    try:
        import numpy as np

        for label, length in (("even_1504", 1504), ("uneven_1500", 1500)):
            ids = np.random.default_rng(1).integers(2, e2e.TINY_DSV32["vocab_size"], size=length).tolist()
            try:
                answer, _ = e2e.logprobs(port, ids, 0)
                record[label] = "answered" if isinstance(answer, list) else answer
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                record[label] = f"no answer: {type(exc).__name__}: {exc}"
        record["server_alive"] = proc.poll() is None
    finally:
        stop(proc)
    lines = log_path.read_text(errors="replace").splitlines()
    record["first_error"] = next((line.strip()[:300] for line in lines if any(m in line for m in ERROR_MARKS)), None)
    # NOTE: a scheduler can die under a live HTTP process (the 2026-12-04 stand-in server did):
    # a prompt left unanswered keeps the log's end too, whatever the process says
    unanswered = any(record.get(label) != "answered" for label in ("even_1504", "uneven_1500"))
    if unanswered or not record["server_alive"]:
        record["log_tail"] = [line[:300] for line in lines[-LOG_TAIL_LINES:]]
    return name, record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--port", type=int, default=26000)  # (below the ephemeral range)
    ap.add_argument("--boot-timeout", type=int, default=420)
    ap.add_argument("--workdir", type=Path, default=Path("repro-uneven-work"))
    ap.add_argument("--out", default="repro_cp_uneven_split.json")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = write_model(args.workdir / "tiny-dsv32-64k", e2e.MODEL)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(probe, "stock_topk", False, args, model, args.port),
                   pool.submit(probe, "stable_topk", True, args, model, args.port + e2e.PORTS_PER_RUN)]
        records = dict(f.result() for f in futures)
    report = {"tp": args.tp, "share_gpu": True, "flag": "off", "servers": records,
              "note": "ranks shared one GPU: a correctness probe, no time in it means anything"}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
