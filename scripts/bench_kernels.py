#!/usr/bin/env python3
"""Kernel benchmark: each sgl-kernel Triton kernel beside its torch reference and SGLang's
stock path, at 8K / 32K / 128K tokens and CP sizes N = 2 / 4 / 8. JSON on stdout (or --out).

Per configuration and path: median GPU time (µs, CUDA events, median of --reps after
--warmup, L2 flushed and the work queued behind a GPU sleep, see ``Timer``), the host's
launch time of the same call, bytes moved (read + written), GB/s and the fraction of the
H200's 4.1 TB/s copy bandwidth (and of the copy bandwidth this run measured). Paths:

* ``mla_store`` (bf16, fp8) / ``index_store``: ``triton`` = fused store of the 1/N rows
  this rank owns; ``torch_reference`` = the package's torch reference of the same;
  ``sglang_owned_rows`` = today's plugin path (``index_select`` + SGLang's store of the
  owned rows); ``sglang_all_rows`` = SGLang's stock store of the whole chunk (what every
  rank of a replicated pool does); ``owner_copy`` = the owner write the plugin now does:
  the owned rows copied byte for byte from the layer's dense view, where the chunk was
  already quantised and stored (``row_copy``; the store into the view is not timed, every
  path but ``triton`` / ``sglang_owned_rows`` needs it anyway);
* ``page_pack`` (MLA bf16 / fp8 pages, index pages): ``triton`` vs ``index_select``;
* ``page_remap`` (page table of every token; top-k indices with -1 padding): ``triton``
  (inverse built once + remap) vs ``torch_reference`` vs ``sort_searchsorted``, the
  token-level baseline;
* ``rerange`` (rows of the latent cache 576 bf16, index key 128 bf16, hidden 7168 bf16):
  ``triton`` vs ``split_cat`` (SGLang's re-order, as ``cp_all_gather_rerange_output``
  performs it after its all-gather).

``--dry-run`` runs tiny shapes on the CPU with the torch paths only (timed with
perf_counter), so CI can prove the script runs.

Usage: python scripts/bench_kernels.py [--dry-run] [--reps 20] [--out kernels.json]
       python scripts/bench_kernels.py --markdown kernels.json   (tables for docs/performance.md)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as NOPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.kv_geometry import index_row_bytes, mla_row_bytes

LATENT_DIM = NOPE_DIM + ROPE_DIM  # 576 bf16 values
BF16_ROW, FP8_ROW, INDEX_ROW = mla_row_bytes("bf16"), mla_row_bytes("fp8_e4m3"), index_row_bytes()  # 1152, 656, 132

COPY_BANDWIDTH = 4.1e12  # bytes/s: contiguous copy on the H200 (docs/gpu-testing.md: 4,144 GB/s)
TOKENS = (1024, 8 * 1024, 32 * 1024, 128 * 1024)  # 1K: the short end of issue 11's "never slower" goal
CP_SIZES = (2, 4, 8)
DRY_TOKENS = (256, 1024)
DRY_CP_SIZES = (2, 4)


# ---------------------------------------------------------------------- timing
class Timer:
    """Median GPU time and host (launch) time of a callable.

    Each timed run is queued behind an L2 flush and a GPU sleep long enough for the host
    to enqueue the whole callable, so the CUDA events bracket the GPU's work alone: in a
    real forward the host runs ahead of the GPU and launch latency overlaps the previous
    kernels, so that is the cost the GPU pays. The host time of the same call (Python,
    Triton / torch launch path) is reported beside it; when it exceeds the sleep, the
    GPU time includes launch gaps and the entry says so.
    """

    SLEEP_US = 1000.0

    def __init__(self, device, reps, warmup):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.cuda = device.type == "cuda"
        # writing 256 MiB evicts the H200's 50 MiB L2 between timed runs
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if self.cuda else None
        self.sleep_cycles = self._cycles_per_us() * self.SLEEP_US if self.cuda else 0

    def _cycles_per_us(self) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return 1_000_000 / (start.elapsed_time(end) * 1e3)

    def __call__(self, fn):
        """(median GPU µs, median host µs) of ``fn()``."""
        for _ in range(self.warmup):
            fn()
        gpu, host = [], []
        for _ in range(self.reps):
            if self.cuda:
                self.flush.zero_()
                torch.cuda._sleep(int(self.sleep_cycles))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t) * 1e6)
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end) * 1e3)
            else:
                t = time.perf_counter()
                fn()
                gpu.append((time.perf_counter() - t) * 1e6)
                host.append(gpu[-1])
        return statistics.median(gpu), statistics.median(host)


def entry(timing, moved_bytes, copy_measured=None, sleep_us=None):
    us, host_us = timing
    result = {"us": round(us, 2), "host_us": round(host_us, 2), "bytes": int(moved_bytes),
              "GBps": round(moved_bytes / us / 1e3, 1) if us > 0 else None,
              "fraction_of_4_1_TBps": round(moved_bytes / (us * 1e-6) / COPY_BANDWIDTH, 3) if us > 0 else None}
    if copy_measured:
        result["fraction_of_measured_copy"] = round(moved_bytes / (us * 1e-6) / copy_measured, 3)
    if sleep_us and host_us > sleep_us:
        result["launch_gaps_included"] = True
    return result


def measure(timer, paths, moved_bytes, copy_measured):
    """{path: entry} for every callable path (a string records why a path is absent)."""
    out = {}
    for name, fn in paths.items():
        if isinstance(fn, str):
            out[name] = {"unavailable": fn}
            continue
        bytes_ = moved_bytes[name] if isinstance(moved_bytes, dict) else moved_bytes
        out[name] = entry(timer(fn), bytes_, copy_measured, timer.SLEEP_US if timer.cuda else None)
    return out


def copy_bandwidth(timer, device):
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timer(lambda: dst.copy_(src))[0] * 1e-6)


# ------------------------------------------------------------------ SGLang paths
def sglang_paths():
    """SGLang's stock store functions, or the reason they cannot be imported here."""
    found = {}
    try:
        from sglang.srt.mem_cache.memory_pool import quantize_k_cache_separate, set_mla_kv_buffer_triton
        found["mla"] = (set_mla_kv_buffer_triton, quantize_k_cache_separate)
    except Exception as exc:  # no sglang / sgl_kernel on this machine
        found["mla"] = f"{type(exc).__name__}: {exc}"
    try:
        from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store, fused_store_index_k_cache

        if not can_use_nsa_fused_store(torch.bfloat16, torch.int64, PAGE):
            raise RuntimeError("the fused index store JIT kernel does not build here")
        found["index"] = fused_store_index_k_cache
    except Exception as exc:
        found["index"] = f"{type(exc).__name__}: {exc}"
    return found


def add_same_size_copy(paths, moved, moved_bytes, device, dry):
    """A contiguous device copy of the bytes the owned-row store moves: the bandwidth a
    transfer of that size can reach at all (small transfers are latency-bound)."""
    if dry:
        return
    src = torch.empty(moved_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    paths["contiguous_copy_same_bytes"] = lambda: dst.copy_(src)
    moved["contiguous_copy_same_bytes"] = 2 * src.numel()


# ------------------------------------------------------------------- workloads
def chunk(tokens, n, device, generator):
    """out_cache_loc of a ``tokens``-row chunk on random logical pages, rank 0's owned rows
    and their physical locations (as the batch state computes them)."""
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout

    layout = CpSharedKVLayout(PAGE, n, 0)
    pages = -(-tokens // PAGE)
    seq_pages = torch.randperm(4 * pages, generator=generator)[:pages] + 1
    positions = torch.arange(tokens)
    out_cache_loc = (seq_pages[positions // PAGE] * PAGE + positions % PAGE).to(device)
    rows = layout.owned_by_this_rank(out_cache_loc, validate=False).nonzero().squeeze(1)
    physical = layout.logical_locs_to_physical(out_cache_loc[rows], validate=False)
    return out_cache_loc, rows, physical, (4 * pages // n + 2) * PAGE


def dense_view_of(tokens, rows, device):
    """Dense locations of a chunk's rows (page 0 is the dummy page, the chunk follows) and
    of its owned ``rows``: the owner copy's source."""
    dense_locs = torch.arange(PAGE, PAGE + tokens, device=device)
    return dense_locs, dense_locs.index_select(0, rows)


def bench_mla_store(K, timer, sglang, tokens, n, packed_fp8, device, g, copy_measured, dry):
    out_cache_loc, rows, physical, slots = chunk(tokens, n, device, g)
    latent = torch.randn(tokens, LATENT_DIM, generator=g).bfloat16().to(device)
    k_nope, k_rope = latent[:, :NOPE_DIM].unsqueeze(1), latent[:, NOPE_DIM:].unsqueeze(1)
    row_bytes = FP8_ROW if packed_fp8 else BF16_ROW
    shard = torch.zeros(slots, 1, row_bytes // (1 if packed_fp8 else 2),
                        dtype=torch.uint8 if packed_fp8 else torch.bfloat16, device=device)
    logical_slots = int(out_cache_loc.max()) + PAGE  # a replicated pool holds every row
    full = torch.zeros(logical_slots, 1, shard.shape[-1], dtype=shard.dtype, device=device) if not dry else None
    store = K.store_mla_rows_fp8 if packed_fp8 else K.store_mla_rows
    reference = K.store_mla_rows_fp8_reference if packed_fp8 else K.store_mla_rows_reference
    owned = rows.numel()
    dense_locs, owned_dense_locs = dense_view_of(tokens, rows, device)
    dense = torch.zeros(PAGE + tokens, 1, shard.shape[-1], dtype=shard.dtype, device=device)
    reference(dense, None, dense_locs, k_nope, k_rope)
    copy = K.copy_mla_rows_reference if dry else K.copy_mla_rows
    paths = {"torch_reference": lambda: reference(shard, rows, physical, k_nope, k_rope),
             "owner_copy": lambda: copy(shard, physical, dense, owned_dense_locs)}
    if not dry:
        paths["triton"] = lambda: store(shard, rows, physical, k_nope, k_rope)
        if isinstance(sglang["mla"], str):
            paths["sglang_owned_rows"] = paths["sglang_all_rows"] = sglang["mla"]
        else:
            set_rows, quantize = sglang["mla"]

            def stock(buffer, locs, nope, rope):
                if packed_fp8:
                    nope, rope = quantize(nope, rope)
                set_rows(buffer, locs, nope, rope)

            paths["sglang_owned_rows"] = lambda: stock(shard, physical, k_nope.index_select(0, rows),
                                                       k_rope.index_select(0, rows))
            paths["sglang_all_rows"] = lambda: stock(full, out_cache_loc, k_nope, k_rope)
    moved = {name: owned * (BF16_ROW + row_bytes + 16) for name in paths}
    moved["owner_copy"] = owned * (2 * row_bytes + 16)
    moved["sglang_all_rows"] = tokens * (BF16_ROW + row_bytes + 8)
    add_same_size_copy(paths, moved, moved["torch_reference"], device, dry)
    return {"owned_rows": owned, "row_bytes": row_bytes, "paths": measure(timer, paths, moved, copy_measured)}


def bench_index_store(K, timer, sglang, tokens, n, device, g, copy_measured, dry):
    out_cache_loc, rows, physical, slots = chunk(tokens, n, device, g)
    key = torch.randn(tokens, INDEX_DIM, generator=g).bfloat16().to(device)
    shard = torch.zeros(slots // PAGE + 1, PAGE * INDEX_ROW, dtype=torch.uint8, device=device)
    owned = rows.numel()
    dense_locs, owned_dense_locs = dense_view_of(tokens, rows, device)
    dense = torch.zeros(tokens // PAGE + 2, PAGE * INDEX_ROW, dtype=torch.uint8, device=device)
    K.store_index_rows_reference(dense, None, dense_locs, key)
    copy = K.copy_index_rows_reference if dry else K.copy_index_rows
    paths = {"torch_reference": lambda: K.store_index_rows_reference(shard, rows, physical, key),
             "owner_copy": lambda: copy(shard, physical, dense, owned_dense_locs)}
    if not dry:
        full = torch.zeros(int(out_cache_loc.max()) // PAGE + 1, PAGE * INDEX_ROW, dtype=torch.uint8, device=device)
        paths["triton"] = lambda: K.store_index_rows(shard, rows, physical, key)
        if isinstance(sglang["index"], str):
            paths["sglang_owned_rows"] = paths["sglang_all_rows"] = sglang["index"]
        else:
            jit = sglang["index"]
            paths["sglang_owned_rows"] = lambda: jit(key.index_select(0, rows), shard, physical, PAGE)
            paths["sglang_all_rows"] = lambda: jit(key, full, out_cache_loc, PAGE)
    moved = {name: owned * (2 * INDEX_DIM + INDEX_ROW + 16) for name in paths}
    moved["owner_copy"] = owned * (2 * INDEX_ROW + 16)
    moved["sglang_all_rows"] = tokens * (2 * INDEX_DIM + INDEX_ROW + 8)
    add_same_size_copy(paths, moved, moved["torch_reference"], device, dry)
    return {"owned_rows": owned, "paths": measure(timer, paths, moved, copy_measured)}


KERNELS = ("mla_store_bf16", "mla_store_fp8", "index_store", "page_pack", "page_remap", "rerange")
PAGE_KINDS = {"mla_bf16": PAGE * BF16_ROW, "mla_fp8": PAGE * FP8_ROW, "index": PAGE * INDEX_ROW}


def bench_pack(K, timer, tokens, n, page_bytes, device, g, copy_measured, dry):
    pages = -(-tokens // PAGE)
    send = -(-pages // n)
    shard_pages = 4 * send + 1
    shard = torch.randint(-2**62, 2**62, (shard_pages, page_bytes // 8), dtype=torch.int64, generator=g).to(device)
    send_pages = (torch.randperm(shard_pages - 1, generator=g)[:send] + 1).to(device)
    out = torch.empty(send, page_bytes // 8, dtype=torch.int64, device=device)
    paths = {"index_select": lambda: torch.index_select(shard, 0, send_pages, out=out)}
    if not dry:
        paths["triton"] = lambda: K.pack_pages(shard, send_pages, out=out)
    return {"send_pages": send, "send_MB": round(send * page_bytes / 1e6, 2),
            "paths": measure(timer, paths, 2 * send * page_bytes, copy_measured)}


def sort_searchsorted_remap(seq_pages, dense_page, locs):
    """The token-level baseline: find each location's page among the sequence's pages."""
    sorted_pages, order = torch.sort(seq_pages)
    logical = locs.long()
    index = torch.searchsorted(sorted_pages, (logical // PAGE).clamp_min(0)).clamp_max(seq_pages.numel() - 1)
    dense = dense_page[order[index]]
    return torch.where(logical < 0, logical, dense * PAGE + logical % PAGE).to(locs.dtype)


def bench_remap(K, timer, tokens, n, device, g, copy_measured, dry):
    from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.forward.dense_layout import build_dense_page_map

    pages = -(-tokens // PAGE)
    logical_pages = 4 * pages * n
    seq_pages = (torch.randperm(logical_pages - 1, generator=g)[:pages] + 1).to(device)
    page_map = build_dense_page_map(CpSharedKVLayout(PAGE, n, 0), seq_pages, history_pages=pages // 2)
    dense_page = page_map.dense_page
    positions = torch.arange(tokens, device=device)
    page_table = (seq_pages[positions // PAGE] * PAGE + positions % PAGE).to(torch.int32)
    queries = min(tokens, 8 if dry else 4096)
    topk = page_table[torch.randint(0, tokens, (queries, 2048), generator=g).to(device)]
    topk[:, -(2048 // 4):] = -1
    inverse = torch.empty(logical_pages, dtype=torch.int32, device=device)
    results = {}
    for name, locs in (("page_table", page_table), ("topk_indices", topk)):
        out = torch.empty_like(locs)
        paths = {
            "torch_reference": lambda locs=locs, out=out: K.remap_locs_reference(
                locs, K.build_page_inverse_reference(seq_pages, dense_page, logical_pages, out=inverse),
                PAGE, out=out),
            "sort_searchsorted": lambda locs=locs: sort_searchsorted_remap(seq_pages, dense_page, locs),
        }
        if not dry:
            paths["triton"] = lambda locs=locs, out=out: K.remap_locs(
                locs, K.build_page_inverse(seq_pages, dense_page, logical_pages, out=inverse), PAGE, out=out)
            built = K.build_page_inverse(seq_pages, dense_page, logical_pages, out=inverse)
            paths["triton_remap_only"] = lambda locs=locs, out=out: K.remap_locs(locs, built, PAGE, out=out)
        moved = locs.numel() * 2 * locs.element_size()
        results[name] = {"entries": locs.numel(), "paths": measure(timer, paths, moved, copy_measured)}
        if "triton" in paths and "sort_searchsorted" in results[name]["paths"]:
            ours, theirs = results[name]["paths"]["triton"]["us"], results[name]["paths"]["sort_searchsorted"]["us"]
            results[name]["speedup_vs_sort_searchsorted"] = round(theirs / ours, 1)
    return results


ROW_KINDS = {"latent_576_bf16": 576, "index_key_128_bf16": 128, "hidden_7168_bf16": 7168}


def bench_rerange(K, timer, tokens, n, width, device, copy_measured, dry):
    q, extra = divmod(tokens, 2 * n)
    blocks = [q + (j < extra) for j in range(2 * n)]
    max_len = -(-tokens // n)
    lists = ([max_len] * n, [blocks[r] + blocks[2 * n - 1 - r] for r in range(n)],
             [blocks[j] for r in range(n) for j in (r, 2 * n - 1 - r)],
             [2 * r for r in range(n)] + [2 * (n - 1 - r) + 1 for r in range(n)])
    gathered = torch.randn(n * max_len, width, device=device).bfloat16()
    paths = {"split_cat": lambda: K.rerange_in_seq_reference(gathered, *lists)}
    if not dry:
        segments = K.in_seq_segments(*lists)
        table = K.segment_table(segments, device)
        longest = max(rows for *_, rows in segments)
        out = torch.empty(tokens, width, dtype=gathered.dtype, device=device)
        paths["triton"] = lambda: K.rerange_rows(gathered, table, longest, tokens, out=out)
        paths["contiguous_copy_same_bytes"] = lambda: out.copy_(gathered[:tokens])  # the one-copy floor
    result = {"paths": measure(timer, paths, 2 * tokens * width * 2, copy_measured)}
    if "triton" in paths:
        result["speedup_vs_split_cat"] = round(result["paths"]["split_cat"]["us"] / result["paths"]["triton"]["us"], 2)
    return result


# -------------------------------------------------------------------- markdown
def _cell(path):
    if path is None:
        return "–"
    if "unavailable" in path:
        return "n/a"
    return f"{path['us']:.1f} ({100 * path['fraction_of_4_1_TBps']:.0f}%)"


def _table(title, rows, columns, extra=None):
    head = ["tokens", "N", *columns] + ([extra[0]] if extra else [])
    lines = [f"**{title}** — µs (share of 4.1 TB/s on the bytes each path moves)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tokens, n, result in rows:
        cells = [f"{tokens // 1024}K" if tokens >= 1024 else str(tokens), str(n)]
        cells += [_cell(result["paths"].get(c)) for c in columns]
        if extra:
            cells.append(str(result.get(extra[1], "–")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_markdown(report) -> str:
    """The benchmark's tables, as docs/performance.md shows them."""
    results = report["results"]
    clock = ("perf_counter, dry run" if report["dry_run"] else
             "GPU time: CUDA events, L2 flushed, work queued behind a GPU sleep; host launch µs in the JSON")
    out = [f"Device: {report['device']}; median of {report['reps']} runs ({clock}); "
           f"measured copy bandwidth {report['copy_bandwidth_measured_GBps']} GB/s.\n"]
    store_paths = ["owner_copy", "triton", "torch_reference", "sglang_owned_rows", "sglang_all_rows",
                   "contiguous_copy_same_bytes"]
    present = set(results[0]) if results else set()
    for kernel in ("mla_store_bf16", "mla_store_fp8", "index_store"):
        if kernel not in present:
            continue
        out.append(_table(kernel, [(r["tokens"], r["cp_size"], r[kernel]) for r in results], store_paths))
    for kind in PAGE_KINDS if "page_pack" in present else ():
        out.append(_table(f"page_pack {kind}", [(r["tokens"], r["cp_size"], r["page_pack"][kind]) for r in results],
                          ["triton", "index_select"], ("MB sent", "send_MB")))
    for table in ("page_table", "topk_indices") if "page_remap" in present else ():
        out.append(_table(f"page_remap {table}", [(r["tokens"], r["cp_size"], r["page_remap"][table]) for r in results],
                          ["triton", "triton_remap_only", "torch_reference", "sort_searchsorted"],
                          ("× vs sort+searchsorted", "speedup_vs_sort_searchsorted")))
    for kind in ROW_KINDS if "rerange" in present else ():
        out.append(_table(f"rerange {kind}", [(r["tokens"], r["cp_size"], r["rerange"][kind]) for r in results],
                          ["triton", "split_cat", "contiguous_copy_same_bytes"],
                          ("× vs split/cat", "speedup_vs_split_cat")))
    return "\n".join(out)


# ------------------------------------------------------------------------ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, torch paths only, CPU")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the JSON here instead of stdout")
    parser.add_argument("--only", default=",".join(KERNELS),
                        help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--markdown", type=Path, metavar="JSON", help="print the tables of a finished run")
    args = parser.parse_args(argv)
    if args.markdown:
        print(render_markdown(json.loads(args.markdown.read_text())))
        return

    import sglang_cp_shared_kv_kernel as K

    dry = args.dry_run
    only = [name for name in args.only.split(",") if name]
    if set(only) - set(KERNELS):
        parser.error(f"--only: unknown {sorted(set(only) - set(KERNELS))}; choose from {', '.join(KERNELS)}")
    if dry:
        torch.set_num_threads(1)  # CI proves the script runs; threads only contend there
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    reps, warmup = (3, 1) if dry else (max(args.reps, 20), args.warmup)
    timer = Timer(device, reps, warmup)
    g = torch.Generator().manual_seed(0)
    copy_measured = copy_bandwidth(timer, device)
    sglang = {"mla": "dry run", "index": "dry run"} if dry else sglang_paths()
    tokens_list, cp_sizes = (DRY_TOKENS, DRY_CP_SIZES) if dry else (TOKENS, CP_SIZES)

    results = []
    for tokens in tokens_list:
        for n in cp_sizes:
            row = {"tokens": tokens, "cp_size": n}
            benches = {
                "mla_store_bf16": lambda: bench_mla_store(K, timer, sglang, tokens, n, False, device, g,
                                                          copy_measured, dry),
                "mla_store_fp8": lambda: bench_mla_store(K, timer, sglang, tokens, n, True, device, g,
                                                         copy_measured, dry),
                "index_store": lambda: bench_index_store(K, timer, sglang, tokens, n, device, g, copy_measured, dry),
                "page_pack": lambda: {kind: bench_pack(K, timer, tokens, n, page_bytes, device, g, copy_measured, dry)
                                      for kind, page_bytes in PAGE_KINDS.items()},
                "page_remap": lambda: bench_remap(K, timer, tokens, n, device, g, copy_measured, dry),
                "rerange": lambda: {kind: bench_rerange(K, timer, tokens, n, width, device, copy_measured, dry)
                                    for kind, width in ROW_KINDS.items()},
            }
            for name in only:
                row[name] = benches[name]()
            results.append(row)
            print(f"done: {tokens} tokens, N={n}", file=sys.stderr)

    report = {
        "dry_run": dry,
        "device": torch.cuda.get_device_name() if not dry else platform.processor() or "cpu",
        "torch": torch.__version__,
        "reps": reps, "warmup": warmup, "statistic": "median",
        "copy_bandwidth_reference_GBps": COPY_BANDWIDTH / 1e9,
        "copy_bandwidth_measured_GBps": round(copy_measured / 1e9, 1) if copy_measured else None,
        "sglang_stock_paths": {k: ("available" if not isinstance(v, str) else v) for k, v in sglang.items()},
        "results": results,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
