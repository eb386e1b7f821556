#!/usr/bin/env python3
"""PD transfer of one long request, replicated (one sender) vs CP shards (N senders), with
interleaved pages and with compute-owner pages, side by side.

Runs SGLang's real Mooncake PD classes over loopback (the rig of the CPU tests,
``sglang_cp_shared_kv_testing.pd_rig``): for each CP size N, N prefill rank processes and
one decode process; N = 1 is a replicated prefill without CP and the flag off (one sender,
SGLang's stock path), N > 1 runs ``--enable-nsa-prefill-cp-shared-kv`` pools where each
rank holds and sends only the pages it owns. The request is shaped by a shipped model
config (default GLM-5, fp8 KV, 32K tokens, sent in 8K-token chunks). Decode checks every
byte it received. ``--pages`` picks the request's logical pages: ``interleaved`` (pages
1, 2, 3, ...: rank r owns every N-th) or ``compute-owner`` (the pages the plugin's
allocator hands the request chunk by chunk: each rank's pages of a chunk in two runs),
default both.

Prints JSON: per rank pages, bytes, Mooncake descriptors and batches (N > 1 from the
plugin's counters; N = 1 computed the way SGLang groups pages), wall time of the request
(first chunk sent by any rank to the last rank done, median over ``--repeats`` after one
warm-up request) and effective GB/s.

Loopback TCP on a small CPU box measures the software path (descriptor counts, batching,
per-rank parallelism), not RDMA bandwidth. ``--layers`` scales the model's layer count
down for wall time and memory; the JSON says when it did.

    .venv/bin/python scripts/bench_pd_transfer.py [--layers 16] [--cp-sizes 1,2,4] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE
from sglang_cp_shared_kv_testing import pd_rig as rig
from sglang_cp_shared_kv_testing.allocation import request_pages
from sglang_cp_shared_kv.transfer.pages import contiguous_runs, resolve_max_descriptors_per_batch

ROOT = Path(__file__).resolve().parents[1]

PAGE = PAGE_SIZE


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="glm-5",
                        help="shipped config name (glm-5, deepseek-v3.2) or a config.json path")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="chunked-prefill size")
    parser.add_argument("--layers", type=int, default=None, help="scale the layer count down (default: the model's)")
    parser.add_argument("--cp-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3, help="timed requests per CP size (after one warm-up)")
    parser.add_argument("--pages", default="interleaved,compute-owner",
                        help="comma-separated page layouts for N > 1: interleaved, compute-owner")
    parser.add_argument("--dst-order", default="contiguous", choices=["contiguous", "scattered"],
                        help="decode's preallocated pages: one run, or scattered as after cache churn")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--workdir", type=Path, help="keep process logs here (default: a temp dir)")
    return parser.parse_args(argv)


def config_path(name: str) -> Path:
    shipped = ROOT / "python" / "sglang_cp_shared_kv" / "model_configs" / f"{name}.json"
    return shipped if shipped.exists() else Path(name)


def chunk_ends(args) -> list:
    return list(range(args.chunk_tokens, args.tokens, args.chunk_tokens)) + [args.tokens]


def request_layout(n: int, pages: int, layout: str, args):
    """(logical pages of the request, physical pages per rank) for one page layout."""
    if n == 1 or layout == "interleaved":
        return list(range(1, pages + 1)), math.ceil(pages / n)
    ends = chunk_ends(args)
    physical = math.ceil(pages / n) + len(ends)  # per chunk a rank may take one page above an even share
    logical, _ = request_pages(n, physical, ends)
    return logical, physical


def plan_for(n: int, geometry, logical_pages: list, physical_pages: int, args) -> dict:
    procs = [f"P{i}" for i in range(n)]
    shared = n > 1
    instance = dict(cp_size=n, shared=shared, bootstrap_port=rig.free_port(), procs=procs,
                    physical_pages=physical_pages)
    ends = chunk_ends(args)
    pages = len(logical_pages)
    rooms = [dict(room=50_000 + i, name=f"N{n}/{'warm-up' if i == 0 else i}", instance="X", seq_len=args.tokens,
                  logical_pages=logical_pages, chunk_ends=ends, decode_prefix_pages=0,
                  dst_order=args.dst_order, seed=11, first_token=7, aux_slot=i % 8)
             for i in range(args.repeats + 1)]
    processes = {p: {"role": "prefill", "log_level": "WARNING"} for p in procs}
    processes["D"] = {"role": "decode", "log_level": "WARNING"}
    return dict(geometry=asdict(geometry), max_seq_len=args.tokens, instances={"X": instance},
                processes=processes, decode={"proc": "D", "pages": pages + 8}, rooms=rooms)


def replicated_descriptors(pages: int, ends, layers: int, dst_pages: np.ndarray):
    """What SGLang's stock path issues for one sender: per chunk, contiguous runs x layers."""
    src = np.arange(1, pages + 1)
    bounds = [0] + [e // PAGE for e in ends[:-1]] + [pages]
    kv = sum(contiguous_runs(src[a:b], dst_pages[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a) * layers
    return kv, contiguous_runs(src, dst_pages) * layers


def summarize(n: int, layout: str, run: dict, plan: dict, geometry, pages: int, args) -> dict:
    rooms = [r for r in plan["rooms"] if not r["name"].endswith("warm-up")]
    procs = plan["instances"]["X"]["procs"]
    decode = run["results"]["D"]["rooms"] if run["results"].get("D") else {}
    verified = all(decode.get(str(r["room"]), {}).get("verified") for r in rooms)
    walls = []
    for r in rooms:
        windows = [run["results"][p]["rooms"][str(r["room"])].get("send_window") for p in procs]
        if all(windows):
            walls.append(max(w[1] for w in windows) - min(w[0] for w in windows))
    kv_bytes, index_bytes = geometry.kv_page_bytes * geometry.layers, geometry.index_page_bytes * geometry.layers
    ranks = []
    for rank, proc in enumerate(procs):
        result = run["results"][proc]["rooms"][str(rooms[-1]["room"])]
        rank_walls = [w[1] - w[0] for w in
                      (run["results"][proc]["rooms"][str(r["room"])].get("send_window") for r in rooms) if w]
        if n > 1:
            stats = result["stats"]
            entry = dict(cp_rank=rank, kv_pages=stats["kv_pages"], state_pages=stats["state_pages"],
                         kv_descriptors=stats["kv_descriptors"], state_descriptors=stats["state_descriptors"],
                         write_batches=stats["write_batches"], bytes_written_with_aux=stats["write_bytes"],
                         max_descriptors_per_chunk=max(c["descriptors"] for c in result["chunks"]))
        else:
            dst = np.arange(1, pages + 1)  # decode pages of a contiguous preallocation
            kv_desc, state_desc = replicated_descriptors(pages, rooms[-1]["chunk_ends"], geometry.layers, dst)
            entry = dict(cp_rank=0, kv_pages=pages, state_pages=pages, kv_descriptors=kv_desc,
                         state_descriptors=state_desc, write_batches=None,
                         descriptors_note="computed as SGLang groups pages (flag off, no plugin counters)")
        entry["bytes"] = entry["kv_pages"] * kv_bytes + entry["state_pages"] * index_bytes
        entry["send_s_median"] = statistics.median(rank_walls) if rank_walls else None
        ranks.append(entry)
    logical = np.asarray(plan["rooms"][-1]["logical_pages"])
    owned = [CpSharedKVLayout(PAGE, n, r).owned_pages_mask_np(logical).sum() if n > 1 else pages for r in range(n)]
    total_bytes = sum(r["bytes"] for r in ranks)
    wall = statistics.median(walls) if walls else None
    return dict(
        cp_size=n, mode="shared KV shards" if n > 1 else "replicated, one sender (flag off)",
        pages=layout if n > 1 else "1..P (one sender)",
        verified_byte_for_byte=verified, wall_s_median=wall, wall_s_all=walls,
        total_bytes=total_bytes, effective_gb_per_s=(total_bytes / wall / 1e9) if wall else None,
        pages_per_rank=[r["kv_pages"] for r in ranks], ceil_pages_over_n=math.ceil(pages / n),
        sends_exactly_its_pages=[r["kv_pages"] for r in ranks] == [int(o) for o in owned],
        max_kv_descriptors_per_layer_per_chunk=max(
            (r.get("max_descriptors_per_chunk") or 0) for r in ranks) / geometry.layers if n > 1 else None,
        ranks=ranks, process_wall_s=run["wall_s"],
        errors={p: (r or {}).get("error") for p, r in run["results"].items() if not r or r.get("error")},
    )


def main(argv=None):
    args = parse_args(argv)
    path = config_path(args.model_config)
    full = rig.model_geometry(path, args.kv_cache_dtype)
    geometry = rig.model_geometry(path, args.kv_cache_dtype, layers=args.layers)
    pages = math.ceil(args.tokens / PAGE)
    out = dict(
        benchmark="PD transfer of one request over Mooncake TCP loopback (SGLang's real PD classes)",
        model_config=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        kv_cache_dtype=args.kv_cache_dtype, tokens=args.tokens, pages=pages, chunk_tokens=args.chunk_tokens,
        layers=geometry.layers, model_layers=full.layers,
        layers_scaled_down=geometry.layers != full.layers,
        bytes_per_page_all_layers=(geometry.kv_page_bytes + geometry.index_page_bytes) * geometry.layers,
        decode_pages=args.dst_order, repeats=args.repeats,
        max_descriptors_per_batch=resolve_max_descriptors_per_batch(),
        runs=[],
    )
    if out["layers_scaled_down"]:
        out["note"] = (f"layer count scaled from {full.layers} to {geometry.layers} for wall time and memory on "
                       "this machine: bytes and descriptors scale linearly with layers")
    with tempfile.TemporaryDirectory() as tmp:
        base = args.workdir or Path(tmp)
        for n in [int(x) for x in args.cp_sizes.split(",")]:
            for layout in (["interleaved"] if n == 1 else args.pages.split(",")):
                logical, physical = request_layout(n, pages, layout, args)
                plan = plan_for(n, geometry, logical, physical, args)
                run = rig.run_plan(plan, base / f"n{n}-{layout}", deadline_s=900)
                out["runs"].append(summarize(n, layout, run, plan, geometry, pages, args))
                print(f"N={n} {layout}: wall {out['runs'][-1]['wall_s_median']}", file=sys.stderr, flush=True)
    text = json.dumps(out, indent=2, default=int)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
