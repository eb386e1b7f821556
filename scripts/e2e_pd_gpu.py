#!/usr/bin/env python3
"""End to end PD on GPUs: what a decode server answers from a shared-KV CP prefill must be
what it answers from a stock prefill, bit for bit.

``--cp-size N`` (default 2; N GPUs, the deployment of docs/deploy.md in small): prefill TPN
+ NSA prefill CPN in-seq-split on GPUs 0..N-1 (``--mem-fraction-static 0.45``, started
first), decode TP1 on GPU 0 (``--base-gpu-id 0 --mem-fraction-static 0.85``, started once
the prefill is up: SGLang refuses the other order as "memory capacity is unbalanced"),
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on both where the flag is on (the flag-off
runs keep stock SGLang's default, CP rank 0 sending everything: see ``off_all_ranks``), Mooncake (TCP where there is no
RDMA device); NSA backends: bf16 ``flashmla_sparse`` on both servers; fp8 with CP
``flashmla_sparse`` on the prefill (stock SGLang's fp8 default ``flashmla_kv`` fails with
in-seq-split, docs/troubleshooting.md) and SGLang's default on decode (its
``flashmla_sparse`` decode reads the cache without dequantizing fp8).
``--cp-size 1`` (one GPU): prefill TP1 and decode TP1 on GPU 0, flag-off runs only -- the
script, the Mooncake CUDA 13 install and stock PD on one H200. ``--share-gpu``: every rank
of both servers on GPU 0 (``sglang_cp_shared_kv_testing.shared_gpu``: correctness only,
no time it records means anything), every pool fixed (decode's at BIG_POOL when the run
names none); ``--parallel K`` runs K runs' server pairs at once, each on its own ports.

Runs (one prefill + one decode server each, the same tiny random DeepSeek-V3.2 as
``scripts/e2e_cp_logprobs.py`` with 32K positions, ``--chunked-prefill-size 2048``; "flag
on" is the deployment of docs/deploy.md: the flag on the prefill and on the decode server):

  off         flag off, prefill pool ``--max-total-tokens POOL`` (per rank)
  off_b       the same again: run-to-run determinism
  off_big     flag off, a prefill pool that holds the over-pool prompts: their reference
  on          flag on, POOL physical tokens per rank (N x POOL logical)       [N >= 2]
  on_corrupt  flag on, CP rank 1 sends each chunk's first page in place of its second [N >= 2]
  off_small_decode      flag off, decode pool ``--max-total-tokens DECODE_POOL``
  guarded_small_decode  the same with the flag on the decode server only (it needs no CP)
  on_small_decode       flag on, decode pool DECODE_POOL                 [N >= 2]
  on_abort    flag on, CP rank 1 holds its first Mooncake write STALL_S seconds; the chunked
              prompt is aborted on the prefill once its last chunk has run     [N >= 2]
  off_all_ranks  flag off with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1: stock SGLang
              0.5.12's every-CP-rank transfer, recorded, not judged: it splits a chunk's
              pages among the ranks by page *id*, so a radix hit's pages (not one run of
              ids) are partly sent twice and partly by no rank; decode answers from pages
              that never arrived (``stock_all_cp_ranks`` in the report)           [N >= 2]

Each of off, off_b, off_big, on, on_corrupt and off_all_ranks posts every prompt to both servers
with one bootstrap room:
``short`` (one chunk), ``chunked`` (4 chunks), ``radix_hit`` (the chunked prompt's first
4,096 tokens from the prefill's radix cache + 1,008 new), ``radix_again`` and
``chunked_again`` (the two prompts once more: what the prefill's cache holds of them, read
back), ``over_pool`` (1.5 x POOL
tokens: more than one prefill rank holds), ``over_logical`` (2.5 x POOL: more than N = 2
ranks hold, refused by the prefill). Decode generates 8 tokens greedily with their logprobs.
The small-decode runs probe a decode that cannot hold what the prefill admits
(decode/admission.py): ``decode_over`` (1.5 x DECODE_POOL: longer than decode's pool),
then ``decode_window`` (shorter than decode's pool, but its prompt + 512 reserved decode
tokens are not) and, while it waits, ``short_behind`` (the short prompt); the clients give
up after HANG_PROBE_S, the prefill after its bootstrap timeout (20 s in these runs).

Both servers run SGLang's NSA top-k kernels replaced by the deterministic stand-ins of
``sglang_cp_shared_kv_testing.stable_topk`` (``--stock-topk`` keeps the kernels; then
only positions <= index_topk are exact -- see docs/design.md), so the verdict is exact:

* off_b = off, on = off (short, chunked, radix_hit, radix_again), and over_pool and
  chunked_again of on = those of off_big: decode's token ids and logprobs bit-identical
  (prompts the baseline answered);
* on_corrupt: every prompt's decode answer differs from on's, or fails;
* on: over_logical, which its prefill refuses at N = 2, fails on decode at once, naming the
  cause (N >= 3: on = off_big, bit for bit); off_big answers it;
* guarded_small_decode, on_small_decode: decode refuses decode_over and decode_window at
  once (decode_window naming the flag), and answers short_behind (equal to off's short
  where off ran);
* on: every CP rank sent KV and index pages (Prometheus ``..._transfer_pages_total``);
* on_abort: the request aborted mid-transfer (rank 1's write held, every chunk computed)
  fails on decode within AT_ONCE_S of the abort, naming the prefill's abort (stock decode
  would hold it until its waiting timeout);
* over_pool in off (stock SGLang refuses the prompt on prefill), off_small_decode and
  off_all_ranks are recorded, not judged: stock decode answers the first from KV that never
  arrived, leaves decode_window and every request behind it waiting, and answers a radix hit
  from pages no CP rank sent with every CP rank sending (docs/troubleshooting.md).

On sglang 0.5.23 (picked from the installed release, ``releases.installed``: its prefill CP is
interleave) the pair takes 0.5.23's options (``pd_servers._interleave_commands``): prefill
``--tp-size N --enable-prefill-cp --cp-strategy interleave``, the flag as
``--enable-prefill-cp-shared-kv`` on both servers, ``--disable-decode-cuda-graph
--disable-prefill-cuda-graph --disable-flashinfer-autotune`` on both, DSA backends: the prefill
``flashmla_sparse`` (prefill and decode backend, bf16 and fp8), decode ``flashmla_sparse`` (bf16;
0.5.23's Hopper default fa3 is not in the GPU bundle) or ``flashmla_kv`` (fp8: its
``flashmla_sparse`` decode reads the fp8 cache without dequantizing it, as 0.5.12.post1's),
``--enable-metrics`` on every prefill, SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 (the
NSA variable renamed); the PD warm-up and the overlap schedule stay as stock has them. The
every-CP-rank variable means what it means on 0.5.12.post1 (without it CP ranks but 0 are dummy
senders and decode pulls from CP rank 0 alone; the flag refuses to start on either server
without it), so the flag-off runs keep stock's default again. Every run applies there and every
check is judged alike (read from its wheel: the every-CP-rank variable, the decode guard's
``DecodePreallocQueue`` hooks, ``sender.abort()`` on an in-flight request, the switches' targets,
the flag's notice of a prompt refused at intake on ``PrefillBootstrapQueue.add``), with two
differences in what is recorded
(over_logical at N = 2 is judged as on 0.5.12.post1: 0.5.23 retires a prompt its prefill refuses
at intake and makes no sender, and the flag's prefill ranks tell decode themselves, naming the
refusal; stock 0.5.23 leaves decode to fail it at its waiting timeout):

* off's over_pool: stock decode fails it at that timeout on 0.5.23 instead of answering it
  (recorded, not judged, as before);
* off_all_ranks records 0.5.23's every-CP-rank transfer, which splits a chunk's pages by
  position (``disaggregation/utils.filter_kv_indices_for_cp_rank``), CP rank 0 alone sending
  the index pages: ``stock_all_cp_ranks`` is expected all true there, still not judged.

The report adds ``cp_strategy`` (the in-seq-split report is unchanged);
runs are kept under a tag of their own (``.interleave``), so a work folder shared with
0.5.12.post1's runs never mixes the two.

Runs accumulate in --workdir (``--runs off,off_big`` now, ``--runs on,on_corrupt`` in a
later call while the machine is warm); the report compares what is there and passes only
when every run of the CP size is. A run that fails (a server that does not boot, a request
that raises) is reported with its error and the next run still starts; server logs go to
--logdir (default: --workdir). JSON to --out and stdout.

Usage: python scripts/e2e_pd_gpu.py --out pd.json [--cp-size N] [--runs off,on,...]
                                    [--kv-cache-dtype bfloat16|fp8_e4m3] [--stock-topk]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from sglang_cp_shared_kv.decode.admission import DEFAULT_RESERVED_DECODE_TOKENS
from sglang_cp_shared_kv_testing import pd_servers, shared_gpu
from sglang_cp_shared_kv_testing.pd_servers import (
    ABORT_CAUSE,
    AT_ONCE_S,
    CAUSE_PREFIX,
    NEW_TOKENS,  # noqa: F401 -- part of this script's interface (its tests read it here)
    PAGES_SENT_METRIC,
    generate_pd,
    max_logprob_gap,
    pages_sent_by_rank,
    refused_at_once,
    same_answer,
    summarize_decode,  # noqa: F401 -- as NEW_TOKENS
)
from sglang_cp_shared_kv_testing.pd_servers import PdRun as Run
from sglang_cp_shared_kv_testing.server import (
    TINY_DSV32,
    WRITE_PATHS_METRIC,
    accumulate_runs,
    flush_cache,
    post,
    prometheus_samples,
    stable_topk_problem,
    start_server,
    startup_figures,
    stop,
    write_model,
    write_report,
)

CHUNK = 2048  # --chunked-prefill-size
RADIX_PREFIX = 2 * CHUNK  # what the radix-hit prompt shares with the chunked prompt, posted before it
POOL = 8192  # --max-total-tokens of the prefill (per rank) in the runs the over-pool prompt exceeds
BIG_POOL = 32768
DECODE_POOL = 8192  # --max-total-tokens of decode in the small-decode runs
#: NOTE: every chunk of every prompt is a multiple of 2 x 8 tokens, so SGLang's in-seq split
#: gives every CP rank as many rows up to CP8 (why: scripts/e2e_cp_logprobs.py, SPLIT_MULTIPLE)
SHORT_TOKENS = 1504
MODEL = {**TINY_DSV32, "max_position_embeddings": 32768}
#: NOTE: longer than the small-decode runs' bootstrap timeout (20 s): by then the prefill has
#: given up on the request, so a decode that still holds it holds it for good
HANG_PROBE_S = 45
SMALL_DECODE_BOOTSTRAP_TIMEOUT_S = 20
#: NOTE: how long on_abort's CP rank 1 holds its first write: far longer than the abort takes
#: to reach decode, so the request is still in flight when it is aborted
STALL_S = 30
#: a run's prefill HTTP port is --port + PORTS_PER_RUN x its place in RUNS; decode +1,
#: bootstrap +2, the prefill's NCCL +3, decode's +4
PORTS_PER_RUN = 10
#: decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT in every run (``pd_servers.run_env``'s default)
WAITING_TIMEOUT_S = 60

#: The prefill CP strategy of the installed SGLang (``testing.server.CP_STRATEGY``), which picks
#: the pair's options and what is judged.
CP_STRATEGY = pd_servers.CP_STRATEGY
INTERLEAVE = pd_servers.INTERLEAVE

RUNS = {
    "off": Run(False, POOL), "off_b": Run(False, POOL), "off_big": Run(False, BIG_POOL),
    "on": Run(True, POOL, decode_flag=True), "on_corrupt": Run(True, POOL, corrupt_rank=1, decode_flag=True),
    "off_small_decode": Run(False, BIG_POOL, decode_pool=DECODE_POOL),
    "guarded_small_decode": Run(False, BIG_POOL, decode_pool=DECODE_POOL, decode_flag=True),
    "on_small_decode": Run(True, POOL, decode_pool=DECODE_POOL, decode_flag=True),
    "on_abort": Run(True, POOL, decode_flag=True, stall_rank=1),
    "off_all_ranks": Run(False, POOL, all_cp_ranks=True),
}
#: --cp-size 1: no CP, so no flag on the prefill (the decode server's flag needs none)
RUNS_WITHOUT_CP = ["off", "off_b", "off_big", "off_small_decode", "guarded_small_decode"]


def runs_for(cp_size: int):
    """The runs of a CP size (the same under both CP strategies)."""
    return list(RUNS) if cp_size > 1 else list(RUNS_WITHOUT_CP)
#: (run, baseline, prompts): decode answers that must be bit-identical
#: prompts posted right after the one they reuse, without a cache flush in between
CACHED_PROMPTS = ("radix_hit", "radix_again", "chunked_again")
#: NOTE: chunked_again against off_big: at POOL tokens stock evicts the chunked prompt's last
#: pages to fit the radix hit, where the flag's N x POOL logical tokens keep them cached
#: the prompts stock SGLang answers at POOL tokens (it refuses over_pool and over_logical)
STOCK_ANSWERED = ("short", "chunked", *CACHED_PROMPTS)
EXACT = (("off_b", "off", STOCK_ANSWERED),
         ("on", "off", ("short", "chunked", "radix_hit", "radix_again")),
         ("on", "off_big", ("over_pool", "chunked_again")))
SMALL_DECODE_RUNS = ("guarded_small_decode", "on_small_decode")


def tokens(seed, n):
    """A prompt of ``n`` random token ids, the same for a seed in every run."""
    import numpy as np

    return np.random.default_rng(seed).integers(2, MODEL["vocab_size"], size=n).tolist()


def prompts():
    chunked = tokens(2, 4 * CHUNK - 496)
    return {
        "short": tokens(1, SHORT_TOKENS),
        "chunked": chunked,
        "radix_hit": chunked[:RADIX_PREFIX] + tokens(3, 1008),
        # NOTE: the two below re-read from the prefill's cache what the prompts before them
        # stored: the radix hit's own pages, then every page of the chunked prompt -- a store
        # that went wrong (or was overwritten later) shows in their first token on prefill
        "radix_again": chunked[:RADIX_PREFIX] + tokens(3, 1008),
        "chunked_again": chunked,
        "over_pool": tokens(4, POOL * 3 // 2),
        "over_logical": tokens(5, POOL * 5 // 2),
    }


def small_decode_prompts():
    """The small-decode probe's prompts, in the order they are posted (module docstring);
    short_behind is ``prompts()``'s short prompt."""
    return {
        "decode_over": tokens(6, DECODE_POOL * 3 // 2),
        "decode_window": tokens(7, DECODE_POOL - DEFAULT_RESERVED_DECODE_TOKENS // 2),
        "short_behind": tokens(1, SHORT_TOKENS),
    }


def run_ports(args, name):
    port = args.port + PORTS_PER_RUN * list(RUNS).index(name)
    return {"prefill": port, "decode": port + 1, "bootstrap": port + 2, "prefill_nccl": port + 3,
            "decode_nccl": port + 4}


def server_commands(args, run: Run, ports, cp_strategy=None):
    """(prefill cmd, decode cmd) of one run (``testing.pd_servers.server_commands``;
    ``cp_strategy``: the installed release's unless given)."""
    return pd_servers.server_commands(args, run, ports, chunk=CHUNK, default_decode_pool=BIG_POOL,
                                      cp_strategy=cp_strategy or CP_STRATEGY)


def run_env(args, run: Run, cp_strategy=None):
    """Both servers' environment (``testing.pd_servers.run_env``): the small-decode runs'
    prefill gives up on a request decode never takes after SMALL_DECODE_BOOTSTRAP_TIMEOUT_S."""
    bootstrap_timeout = SMALL_DECODE_BOOTSTRAP_TIMEOUT_S if run.small_decode else 60
    return pd_servers.run_env(args, run, bootstrap_timeout_s=bootstrap_timeout, waiting_timeout_s=WAITING_TIMEOUT_S,
                              stall_s=STALL_S, cp_strategy=cp_strategy or CP_STRATEGY)


def verdict(runs, cp_size=2):
    """Checks over the runs present (see the module docstring); ``cp_size``: the prefill's. The
    same checks under both CP strategies (the flag tells decode of a prompt 0.5.23 refuses at intake)."""
    from sglang_cp_shared_kv.settings.config import FLAG

    checks = {}
    for run, base, names in EXACT:
        if run in runs and base in runs:
            for name in names:
                checks[f"{run}={base}:{name}"] = same_answer(runs[run]["prompts"][name]["decode"],
                                                             runs[base]["prompts"][name]["decode"])
    if "off_big" in runs:
        for name in ("over_pool", "over_logical"):
            checks[f"off_big answers {name}"] = runs["off_big"]["prompts"][name]["decode"]["status"] == "ok"
    if "on" in runs and cp_size * POOL < POOL * 5 // 2:
        # its prefill refuses the prompt: decode must fail it, with the cause, at once (0.5.12.post1:
        # every rank rejects the one-token stand-in; 0.5.23: every rank tells decode of the refusal)
        checks["on fails over_logical on decode at once"] = refused_at_once(
            runs["on"]["prompts"]["over_logical"]["decode"], naming=CAUSE_PREFIX)
    elif "on" in runs and "off_big" in runs:  # N >= 3 ranks hold it
        checks["on=off_big:over_logical"] = same_answer(runs["on"]["prompts"]["over_logical"]["decode"],
                                                        runs["off_big"]["prompts"]["over_logical"]["decode"])
    for name in SMALL_DECODE_RUNS:
        if name in runs:
            probe = runs[name]["prompts"]
            checks[f"{name} refuses decode_over at once"] = refused_at_once(probe["decode_over"]["decode"])
            checks[f"{name} refuses decode_window at once"] = refused_at_once(probe["decode_window"]["decode"],
                                                                              naming=FLAG)
            checks[f"{name} answers short_behind"] = probe["short_behind"]["decode"]["status"] == "ok"
            if "off" in runs:
                checks[f"{name}:short_behind=off:short"] = same_answer(probe["short_behind"]["decode"],
                                                                       runs["off"]["prompts"]["short"]["decode"])
    for name in ("off", "on"):
        if name in runs:
            cached = runs[name]["prompts"]["radix_hit"]["prefill"].get("cached_tokens") or 0
            checks[f"{name}: radix_hit found its {RADIX_PREFIX} tokens in the prefill's cache"] = cached >= RADIX_PREFIX
    if "on" in runs:
        sent = runs["on"].get("pages_sent", {})
        checks["on: every CP rank sent KV and index pages"] = (
            sorted(int(r) for r in sent) == list(range(cp_size))
            and all(v.get("kv", 0) > 0 and v.get("state", 0) > 0 for v in sent.values()))
    if "on_abort" in runs:
        entry = dict(runs["on_abort"]["prompts"]["chunked_aborted"],
                     stalled_write_processes=runs["on_abort"]["startup"]["prefill"].get("stalled_write_processes", 0))
        checks["on_abort fails on decode at once, naming the abort"] = aborted_at_once(entry)
    if "on_corrupt" in runs and "on" in runs:
        for name, answer in runs["on_corrupt"]["prompts"].items():
            checks[f"on_corrupt detected:{name}"] = not same_answer(answer["decode"],
                                                                    runs["on"]["prompts"][name]["decode"])
    return checks


def probe_small_decode(ports, room_base):
    """The small-decode runs' prompts (module docstring): decode_over, then decode_window and,
    2 s later while it waits, short_behind; every client gives up after HANG_PROBE_S."""
    ids = small_decode_prompts()
    out = {"decode_over": generate_pd(ports, ids["decode_over"], room_base, timeout=HANG_PROBE_S)}

    def post_one(name, room):
        out[name] = generate_pd(ports, ids[name], room, timeout=HANG_PROBE_S)

    window = threading.Thread(target=post_one, args=("decode_window", room_base + 1))
    window.start()
    time.sleep(2)
    post_one("short_behind", room_base + 2)
    window.join()
    return out


def forwards_done(port) -> int:
    """Prefill forwards every CP rank of the server on ``port`` has run (write-path counter)."""
    return int(sum(prometheus_samples(port, WRITE_PATHS_METRIC).values()))


def last_chunks_handed_over(port, stalled_rank) -> int:
    """Index pages every CP rank but ``stalled_rank`` has sent: SGLang sends them with a
    request's last chunk, which it hands to the sender right after it moves the request into
    its transfer (inflight) queue."""
    return sum(pages.get("state", 0) for rank, pages in
               pages_sent_by_rank(prometheus_samples(port, PAGES_SENT_METRIC)).items() if rank != stalled_rank)


def probe_abort(ports, room, cp_size):
    """on_abort (module docstring): the chunked prompt, aborted on the prefill once every CP
    rank has run its last chunk and the ranks whose writes run have handed it to their senders
    (CP rank 1's first write is held meanwhile); decode's answer and how long after the
    abort it came.

    NOTE: the abort waits for the hand-over because SGLang 0.5.12.post1 does not honour one
    that lands earlier: it marks a request of the running batch ``to_finish``, and its PD
    prefill moves the request into the transfer queue without looking at that mark, so the
    transfer completes once the held write is let go (flag on or off alike). The first CP4 and
    CP2-fp8 runs (2026-12-03) aborted on the forward count alone and hit that window."""
    ids = prompts()["chunked"]
    expected = -(-len(ids) // CHUNK) * cp_size
    stalled_rank = RUNS["on_abort"].stall_rank
    before = forwards_done(ports["prefill"])
    handed_before = last_chunks_handed_over(ports["prefill"], stalled_rank)
    rid = f"cpskv-e2e-abort-{room}"
    record = {}

    def abort_once_handed_over(t0):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                forwards_done(ports["prefill"]) - before < expected
                or last_chunks_handed_over(ports["prefill"], stalled_rank) <= handed_before):
            time.sleep(0.2)
        record["forwards_before_abort"] = forwards_done(ports["prefill"]) - before
        record["forwards_expected"] = expected
        record["last_chunk_handed_over"] = last_chunks_handed_over(ports["prefill"], stalled_rank) > handed_before
        record["abort_at_s"] = round(time.monotonic() - t0, 3)
        post(ports["prefill"], "/abort_request", {"rid": rid})

    entry = generate_pd(ports, ids, room, timeout=HANG_PROBE_S, rid=rid, meanwhile=abort_once_handed_over)
    entry["abort"] = record
    return entry


def aborted_at_once(entry) -> bool:
    """on_abort's check: a prefill process held its write, every chunk had run and been
    handed to the senders (the request was in SGLang's transfer queue), and decode failed the
    request within AT_ONCE_S of the abort, naming the prefill's abort."""
    record, answer = entry.get("abort", {}), entry["decode"]
    return (entry.get("stalled_write_processes", 0) >= 1
            and record.get("forwards_before_abort", -1) >= record.get("forwards_expected", 0) > 0
            and record.get("last_chunk_handed_over") is True
            and answer["status"] in ("http_error", "aborted")
            and answer.get("elapsed_s", AT_ONCE_S + 1e9) - record["abort_at_s"] < AT_ONCE_S
            and ABORT_CAUSE in (answer.get("error") or ""))


def run_servers(name, args, work, room_base):
    run_spec = RUNS[name]
    ports = run_ports(args, name)
    prefill_cmd, decode_cmd = server_commands(args, run_spec, ports)
    env = run_env(args, run_spec)
    logs = {side: args.logdir / f"{name}.{args.tag}.{side}.log" for side in ("prefill", "decode")}
    run = {"flag_on": run_spec.flag_on, "decode_flag": run_spec.decode_flag, "prefill_pool": run_spec.prefill_pool,
           "decode_pool": run_spec.decode_pool, "prompts": {},
           "commands": {"prefill": prefill_cmd, "decode": decode_cmd}}
    t0 = time.monotonic()
    procs = [start_server(f"{name} prefill", prefill_cmd, env, ports["prefill"], logs["prefill"], args.boot_timeout)]
    try:
        procs.append(start_server(f"{name} decode", decode_cmd, env, ports["decode"], logs["decode"],
                                  args.boot_timeout))
        run["boot_s"] = round(time.monotonic() - t0, 1)
        if run_spec.small_decode:
            run["prompts"] = probe_small_decode(ports, room_base)
        elif run_spec.stall_rank is not None:
            run["prompts"] = {"chunked_aborted": probe_abort(ports, room_base, args.cp_size)}
        else:
            for i, (prompt, ids) in enumerate(prompts().items()):
                if prompt not in CACHED_PROMPTS:  # those reuse what the prompts before them cached
                    flush_cache(ports["prefill"])
                run["prompts"][prompt] = generate_pd(ports, ids, room_base + i)
        for prompt, entry in run["prompts"].items():
            print(f"[e2e-pd] {name} {prompt}: decode {entry['decode']['status']} in {entry['decode']['elapsed_s']} s",
                  flush=True)
        if run_spec.flag_on:
            run["write_paths"] = prometheus_samples(ports["prefill"], WRITE_PATHS_METRIC)
            run["pages_sent"] = pages_sent_by_rank(prometheus_samples(ports["prefill"], PAGES_SENT_METRIC))
    finally:
        for proc in reversed(procs):
            stop(proc)
    run["startup"] = {side: startup_figures(path.read_text()) for side, path in logs.items()}
    sides = (("prefill", args.cp_size), ("decode", 1))
    if not args.stock_topk:  # every TP rank of both servers must have taken it
        problems = [stable_topk_problem(run["startup"][side], f"{name} {side}", logs[side], tp) for side, tp in sides]
        run["stable_topk_problems"] = [p for p in problems if p]
    if args.share_gpu:
        problems = [shared_gpu.problem(run["startup"][side], f"{name} {side}", logs[side], tp) for side, tp in sides]
        run["share_gpu_problems"] = [p for p in problems if p]
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="e2e_pd_gpu.json")
    ap.add_argument("--workdir", default="e2e-pd-work")
    ap.add_argument("--cp-size", type=int, default=2, help="prefill CP size = its GPUs (1: one GPU, flag off only)")
    ap.add_argument("--runs", default=None, help="runs to start now (comma-separated; default: all of the CP size)")
    ap.add_argument("--kv-cache-dtype", choices=("bfloat16", "fp8_e4m3"), default="bfloat16")
    ap.add_argument("--stock-topk", action="store_true", help="keep SGLang's top-k kernels (no exact verdict)")
    ap.add_argument("--port", type=int, default=22000, help="prefill port; decode +1, bootstrap +2 (below the ephemeral range)")
    ap.add_argument("--boot-timeout", type=int, default=480)
    ap.add_argument("--logdir", default=None, help="server logs (default: --workdir)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank of both servers on GPU 0 (correctness only: sglang_cp_shared_kv_testing/shared_gpu.py)")
    ap.add_argument("--parallel", type=int, default=1, help="runs whose server pairs go at once (default 1)")
    args = ap.parse_args()
    if not 1 <= args.cp_size <= 8:
        ap.error(f"--cp-size {args.cp_size}: choose 1 (one GPU, no CP) to 8 (one node)")
    cp_runs = runs_for(args.cp_size)
    selected = cp_runs if args.runs is None else [r for r in args.runs.split(",") if r]
    unknown = sorted(set(selected) - set(cp_runs))
    if unknown:
        ap.error(f"runs {unknown} are not part of --cp-size {args.cp_size}; choose from {cp_runs}")
    args.tag = (f"cp{args.cp_size}.{args.kv_cache_dtype}" + (".stock-topk" if args.stock_topk else "")
                + (".share-gpu" if args.share_gpu else "")
                # NOTE: a work folder shared with the other release's runs never mixes them
                + (f".{INTERLEAVE}" if CP_STRATEGY == INTERLEAVE else ""))
    work = Path(args.workdir)
    args.logdir = Path(args.logdir) if args.logdir else work
    args.logdir.mkdir(parents=True, exist_ok=True)
    args.model = write_model(work / "tiny-dsv32-32k", MODEL)
    runs, failed = accumulate_runs(
        work, args.tag, selected, cp_runs,
        lambda name: run_servers(name, args, work, room_base=1000 * (list(RUNS).index(name) + 1)), "e2e-pd",
        parallel=args.parallel)
    checks = verdict(runs, args.cp_size)
    for name, run in runs.items():
        if not args.stock_topk:
            checks[f"stable_topk:{name}"] = not run.get("stable_topk_problems", ["not recorded"])
        if args.share_gpu:
            checks[f"share_gpu:{name}"] = not run.get("share_gpu_problems", ["not recorded"])
    report = {"cp_size": args.cp_size, "kv_cache_dtype": args.kv_cache_dtype, "stable_topk": not args.stock_topk,
              "share_gpu": args.share_gpu,
              "runs": sorted(runs), "failed_runs": failed, "checks": checks,
              "decode": {name: {prompt: {k: v for k, v in entry["decode"].items() if k != "logprobs"}
                                for prompt, entry in run["prompts"].items()} for name, run in runs.items()},
              "max_logprob_gap": {f"{run}-{base}": {p: max_logprob_gap(runs[run]["prompts"][p]["decode"],
                                                                       runs[base]["prompts"][p]["decode"])
                                                    for p in runs[run]["prompts"]}
                                  for run, base in {(r, b) for r, b, _ in EXACT} | {("on_corrupt", "on")}
                                  if run in runs and base in runs},
              "prefill": {name: {p: e["prefill"] for p, e in run["prompts"].items()} for name, run in runs.items()},
              "startup": {name: run["startup"] for name, run in runs.items()},
              "boot_s": {name: run.get("boot_s") for name, run in runs.items()},
              "commands": {name: run.get("commands") for name, run in runs.items()},
              "pages_sent": {name: run["pages_sent"] for name, run in runs.items() if "pages_sent" in run},
              "write_paths": {name: run["write_paths"] for name, run in runs.items() if "write_paths" in run}}
    if args.share_gpu:
        report["note"] = ("every rank of both servers shared one GPU (--share-gpu): a correctness run; its times "
                          "(boot_s, elapsed_s) say nothing about a deployment")
    if "on_abort" in runs:
        report["abort"] = runs["on_abort"]["prompts"]["chunked_aborted"]["abort"]
    if "off_small_decode" in runs:  # stock SGLang and a request its decode can never take: recorded
        report["stock_small_decode"] = {
            prompt: {k: v for k, v in entry["decode"].items() if k in ("status", "elapsed_s", "error")}
            for prompt, entry in runs["off_small_decode"]["prompts"].items()}
    if "off" in runs and "off_big" in runs:  # stock SGLang and a prompt its prefill refused: recorded
        answer = runs["off"]["prompts"]["over_pool"]["decode"]
        reference = runs["off_big"]["prompts"]["over_pool"]["decode"]
        report["stock_refused_prompt"] = {
            "decode_status": answer["status"], "first_logprobs": answer.get("logprobs", [])[:2],
            "same_as_reference": same_answer(answer, reference),
            "note": "flag off, prompt over the prefill's input limit: what stock decode answered"}
    if "off" in runs and "off_all_ranks" in runs:  # stock SGLang's every-CP-rank transfer: recorded
        report["stock_all_cp_ranks"] = {
            prompt: same_answer(entry["decode"], runs["off"]["prompts"][prompt]["decode"])
            for prompt, entry in runs["off_all_ranks"]["prompts"].items() if prompt in STOCK_ANSWERED}
    if CP_STRATEGY == INTERLEAVE:  # NOTE: keys of the in-seq-split report unchanged
        report["cp_strategy"] = CP_STRATEGY
        if "stock_all_cp_ranks" in report:
            report["stock_all_cp_ranks_note"] = (
                "0.5.23's every-CP-rank transfer splits a chunk's pages by position "
                "(disaggregation/utils.filter_kv_indices_for_cp_rank), CP rank 0 alone sending the index pages: "
                "expected equal to off on every prompt; recorded, not judged")
    report["pass"] = set(runs) == set(cp_runs) and bool(checks) and all(checks.values())
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
