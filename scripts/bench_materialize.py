#!/usr/bin/env python3
"""Materialize cost per layer for a GLM-5-shaped model: bytes and time, printed as JSON.

For a request whose history is 8K / 32K / 128K tokens and whose current chunk is
--chunk tokens, at CP sizes N = 2 / 4 / 8, bf16 and fp8 KV, per rank and per layer:

* bytes sent / received by
  (a) the phase-2 full view: all-gather of owned pages of the whole sequence,
  (b) the alternative of zero-filling a dense view and all-reducing it (ring all-reduce
      moves 2 (N-1)/N of the buffer each way),
  (c) phase 3: all-gather of owned *history* pages only (the current chunk is stored
      locally from the all-gathered chunk SGLang already has);
* measured time of the plugin's own materialize collective (``gather_region``) over
  gloo on CPU processes (``--cpu-time``), and, when a GPU is present, the pack
  (``index_select`` of owned pages into the send buffer) time and GB/s.

Usage: python scripts/bench_materialize.py [--chunk 4096] [--cpu-time] > out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from sglang_cp_shared_kv.kv_geometry import NsaModelShape  # noqa: E402

PAGE = 64
HISTORIES = (8 * 1024, 32 * 1024, 128 * 1024)
CP_SIZES = (2, 4, 8)


def analytic(shape, dtype, n, history, chunk):
    page_bytes = PAGE * (shape.mla_row_bytes(dtype) + shape.index_row_bytes)
    hist_pages = -(-history // PAGE)
    all_pages = -(-(history + chunk) // PAGE)
    full_pad, hist_pad = -(-all_pages // n), -(-hist_pages // n)
    dense = all_pages * page_bytes
    return {
        "history_tokens": history, "chunk_tokens": chunk, "cp_size": n, "kv_cache_dtype": dtype,
        "history_bytes": hist_pages * page_bytes,
        "allgather_full_view": {"send": full_pad * page_bytes, "recv": (n - 1) * full_pad * page_bytes},
        "allreduce_zero_fill": {"send": 2 * (n - 1) * dense // n, "recv": 2 * (n - 1) * dense // n},
        "phase3_history_allgather": {"send": hist_pad * page_bytes, "recv": (n - 1) * hist_pad * page_bytes},
        "phase3_recv_over_history": round((n - 1) * hist_pad / hist_pages, 4) if hist_pages else 0.0,
    }


def _cpu_worker(rank, n, port, history, row_bytes, reps, out_path):
    import torch
    import torch.distributed as dist

    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.dense_layout import build_dense_page_map
    from sglang_cp_shared_kv.materialize import gather_region, page_words

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    layout = CpSharedKVLayout(PAGE, n, rank)
    pages = -(-history // PAGE)
    page_map = build_dense_page_map(layout, torch.arange(1, pages + 1), pages)
    words = PAGE * row_bytes // 8
    shard = torch.randint(0, 2**62, (page_map.history_pad + 1, words), dtype=torch.int64)
    dense = torch.empty((page_map.num_dense_pages, words), dtype=torch.int64)
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        gather_region(page_words(dense, page_map.num_dense_pages), page_map.history_region,
                      shard, page_map.history_send, dist.group.WORLD)
        times.append(time.perf_counter() - t)
    if rank == 0:
        Path(out_path).write_text(json.dumps(sorted(times)[len(times) // 2]))
    dist.destroy_process_group()


def cpu_gloo_time(n, history, row_bytes, reps=5):
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "t.json"
    mp.start_processes(_cpu_worker, args=(n, port, history, row_bytes, reps, str(out)), nprocs=n,
                       start_method="spawn")
    return json.loads(out.read_text())


def gpu_pack(shape, dtype, n, history):
    import torch

    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.dense_layout import build_dense_page_map

    pages = -(-history // PAGE)
    page_map = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), torch.arange(1, pages + 1, device="cuda"), pages)
    words = PAGE * shape.mla_row_bytes(dtype) // 8
    shard = torch.empty((page_map.history_pad + 1, words), dtype=torch.int64, device="cuda")
    send = page_map.history_send
    for _ in range(3):
        shard.index_select(0, send)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(20):
        start.record()
        shard.index_select(0, send)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    t = sorted(samples)[len(samples) // 2]
    moved = 2 * send.numel() * words * 8  # read + write
    return {"pack_us": round(t * 1e6, 1), "pack_gb_per_s": round(moved / t / 1e9, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", default="glm-5")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--cpu-time", action="store_true", help="time the gloo collective on CPU processes")
    ap.add_argument("--cpu-max-history", type=int, default=32 * 1024,
                    help="skip CPU timing above this history (memory/time on small machines)")
    args = ap.parse_args()
    shape = NsaModelShape.load(args.model_config)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    rows = []
    for dtype in ("bf16", "fp8_e4m3"):
        for n in CP_SIZES:
            for history in HISTORIES:
                row = analytic(shape, dtype, n, history, args.chunk)
                if args.cpu_time and history <= args.cpu_max_history:
                    t = cpu_gloo_time(n, history, shape.mla_row_bytes(dtype))
                    row["cpu_gloo_mla_history_allgather_ms"] = round(t * 1e3, 2)
                if has_gpu:
                    row["gpu_mla"] = gpu_pack(shape, dtype, n, history)
                rows.append(row)
    print(json.dumps({"model": shape.name, "layers": shape.num_layers, "page_size": PAGE,
                      "gpu": has_gpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
