#!/usr/bin/env python3
"""End to end inside a real SGLang server: prompt logprobs of an NSA CPN in-seq-split
prefill server with --enable-nsa-prefill-cp-shared-kv must match the same server
without it.

Needs N GPUs (``--tp N``, N = 2, 4 or 8), or one GPU with ``--share-gpu`` (all N ranks
on it: correctness only, ``sglang_cp_shared_kv_testing.shared_gpu``), sglang
0.5.12.post1 and this plugin installed. It writes a tiny DeepSeek-V3.2 config, then
launches four servers identical but for the flag and the pool (same parallel layout,
hence the same dummy weights, made non-degenerate by scripts/e2e/sitecustomize.py):

  off_a        flag off, a pool (BIG_POOL per rank) that holds every prompt: the reference
  off_b        flag off, POOL per rank: the repeat, and the stock capacity
  on           flag on, POOL physical per rank (N x POOL logical)
  on_corrupt   flag on, one history page zeroed on CP rank 1 (negative control)

Each answers the same prefill-only requests (max_new_tokens=1, return_logprob,
logprob_start_len=0; --chunked-prefill-size 2048, a multiple of 2 x N x 64 for N <= 16,
so every full chunk is stored where it is computed and every shorter one gathered): a
1.5K prompt (one short chunk), 3K and 6K prompts (history + current chunks, the last one
short), a prompt sharing the 3K prompt's first 2,048 tokens (a radix hit; logprobs of its
new tokens), and ``over_rank_pool``, (2N - 1) / 2 x POOL tokens: more than one rank's
physical pool (flag off, off_b must refuse it), less than N of them (flag on must serve
it). Then prompts of arbitrary length (UNEVEN_PROMPTS), whose chunks SGLang pads with rows
of its own to split them over the CP ranks: 1,500 and 1,501 tokens, 4,109 (a last chunk of
13 tokens), a prompt sharing the 4,109-token prompt's first 2,000 tokens (a radix prefix
that ends mid-page), 4,097 (a last chunk of one token) and 5,003. The flag-on servers run
with SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD=1: they need no decode server for this.

Pass (``verdict``, ``capacity_checks``): positions that see <= index_topk keys are
bit-identical on and off (top-k keeps every key there); beyond, the flag-on run's mean
deviation from off_a stays within the flag-off runs' own mean deviation (+25 %); on
prompts with history the negative control lands clearly outside the spread; off_b
refuses over_rank_pool and on serves it; the startup logs show POOL physical tokens per
rank and exactly N x POOL logical; every CP rank of the flag-on run stored some forwards
where they were computed and gathered others (Prometheus write-path counters).

--stable-topk makes the comparison exact: every server runs with SGLang's NSA top-k
kernels replaced by deterministic stand-ins (``sglang_cp_shared_kv_testing.stable_topk``:
the same keys, in key order; the stock kernel returns them in the order of its atomics,
which is what varies past index_topk). Then off_a and off_b must agree bit for bit at
every position, so must on and off_a, and the negative control must differ somewhere.

--tp 1 runs the flag-off servers only, without CP, on one GPU (off_a, off_b): the
determinism probe, with and without --stable-topk.

On sglang 0.5.23 (picked from the installed release, ``releases.installed``) the same runs
take 0.5.23's options (``_interleave_command``: --enable-prefill-cp --cp-strategy interleave,
--dsa-*-backend flashmla_sparse, the flag as --enable-prefill-cp-shared-kv; flag-off runs the
same command minus the flag) and the same prompts, plus a batch of four short prompts posted
as one request (BATCH_SOURCE's note: several requests in one prefill batch), which every run
must prefill as one batch (``batch_checks``, from the server log) and answer like the rest.
Interleave gathers every chunk on every rank, so the write-path check becomes "every CP rank
ran every forward through the shared pool" (``interleave_write_path_problem``); the report
adds ``cp_strategy``, ``prefill_batches`` and ``batch_checks`` (the in-seq-split report is
unchanged).

Each run's logprobs and startup figures are kept in --workdir, so the four servers can
be run in separate invocations (--runs off_a,on then --runs off_b,on_corrupt); the
report compares whatever runs the workdir holds and passes only when all four are there.
--parallel K boots K of the selected runs at once (each on its own ports).

Usage: python scripts/e2e_cp_logprobs.py --out e2e.json [--tp 2|4|8|1] [--runs off_a,...]
                                         [--kv-cache-dtype bfloat16] [--stable-topk]
                                         [--share-gpu] [--parallel 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
from pathlib import Path

from sglang_cp_shared_kv.settings.config import FLAG_ALIAS
from sglang_cp_shared_kv_testing import shared_gpu
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv_testing.server import (
    DSA_DENSE_THRESHOLD_ENV,
    INTERLEAVE,
    TINY_DSV32,
    WRITE_PATHS_METRIC,
    accumulate_runs,
    e2e_env,
    flush_cache,
    post,
    prefill_batches,
    prometheus_labels,
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
POOL = 8192  # --max-total-tokens (physical, per rank) of every run but off_a
BIG_POOL = 65536  # off_a's: it holds every prompt without the flag
MODEL = {**TINY_DSV32, "max_position_embeddings": BIG_POOL}
RUNS = {  # name: (flag on, corrupt rank, --max-total-tokens)
    "off_a": (False, None, BIG_POOL), "off_b": (False, None, POOL),
    "on": (True, None, POOL), "on_corrupt": (True, 1, POOL),
}
RUNS_WITHOUT_CP = ("off_a", "off_b")  # --tp 1: one GPU, no CP, so no flag
PORTS_PER_RUN = 10  # a run's HTTP port is --port + PORTS_PER_RUN x its place in RUNS; NCCL's + 5


PAGE = 64  # --page-size
#: the radix-hit prompt's prefix: the 3K prompt's first chunk, cached by the prefill before it
RADIX_PREFIX = CHUNK
#: NOTE: every chunk of the prompts before UNEVEN_PROMPTS is a multiple of 2 x 8 tokens (1,504;
#: 2,048 + 960; 2,048 + 1,008 after the prefix; 2,048 x 2 + 1,920): SGLang's in-seq split
#: cuts each into 2N equal segments, with no row of padding, up to CP8. Every chunk shorter
#: than CHUNK takes the gathered path.
SPLIT_MULTIPLE = 16
#: prompts whose chunks are no multiple of 2N: SGLang pads a chunk to a multiple of N
#: (``ForwardBatch.prepare_mlp_sync_batch``) before its in-seq split, and its indexer passes
#: the padding rows' top-k calls lengths past the request's page table. The deterministic
#: top-k stand-in indexed past it and stopped a CP8 server on a 1,500-token prompt (one
#: H200, 2026-12-04: docs/design.md, scripts/repro_cp_uneven_split.py); stock top-k reads on
#: in memory and SGLang drops those rows. The stand-in now reads what the kernel reads
#: (sglang_cp_shared_kv_testing/stable_topk.py), and these prompts keep it so: each is answered bit for bit
#: like the others. Posted after them, in this order (the radix prompt right after the
#: prompt it shares).
UNEVEN_PROMPTS = ("1.5k_uneven_1500", "1.5k_uneven_1501", "4k_last_chunk_13", "radix_mid_page",
                  "4k_last_chunk_1", "5k_uneven_907")
#: the mid-page radix prompt shares this many tokens with 4k_last_chunk_13: 31 pages and 16
#: tokens. SGLang's radix cache matches whole pages (``RadixKey.page_aligned``) and chunks
#: at page multiples, so its cache hit is the 31 pages and its extend starts with the 16
#: shared tokens of the 32nd page; its logprobs run from the hit on
MID_PAGE_SHARED = 2000
MID_PAGE_HIT = MID_PAGE_SHARED // PAGE * PAGE
#: prompt: the tokens it must find cached (``radix_checks``)
RADIX_HITS = {"radix_hit_3k_prefix": RADIX_PREFIX, "radix_mid_page": MID_PAGE_HIT}

#: The prefill CP strategy of the installed SGLang (``releases``: in-seq-split on 0.5.12.post1,
#: interleave on 0.5.23), which picks the command line and the checks; the GPU-verified
#: release's where no served SGLang is installed (the tests of this script's parts).
CP_STRATEGY = (installed.INSTALLED or installed.RECOMMENDED).cp_strategy


# --- interleave (0.5.23) only ------------------------------------------------------------------
#: NOTE: interleave CP deals a batch's tokens out round robin (``layers/cp/interleave.py``) and
#: pads them to a multiple of N; it gathers every chunk on every rank, so there is no
#: "stored where computed" path and no multiple of 2N to keep: CHUNK and the prompts above stay
#: as they are (a multi-chunk prompt, radix hits at a chunk boundary and mid-page, over_rank_pool,
#: uneven lengths and last chunks of 13 and 1 tokens all apply unchanged).
#:
#: Several requests in one prefill batch (``forward/several_requests_v0523.py``): BATCH_SOURCE is
#: posted alone after the prompts above (a fresh cache), then BATCH_PROMPTS in ONE /generate
#: request (a list of input_ids). NOTE on bit-exactness: a batch's logprobs depend on its
#: composition (GEMM shapes, the round-robin deal), so concurrent posts whose batching depends on
#: timing could differ from run to run for reasons that have nothing to do with the flag. One
#: request carrying the list reaches the scheduler as one message (``_send_batch_request``: input
#: ids without text, no DP attention), the scheduler is idle then (BATCH_SOURCE answered), and the
#: four fit one chunk (1,051 new tokens < CHUNK): they are admitted together, the same way in every
#: run. ``batch_checks`` reads each run's log to prove it (a prefill batch of exactly these
#: requests and tokens); only then are their logprobs compared (exactly, like the rest: the
#: same rule, ``verdict``), and a run that batched them otherwise fails that check by name.
BATCH_SOURCE = "batch_prefix_source"
BATCH_PREFIX = 16 * PAGE  # the tokens two batch-mates share with BATCH_SOURCE, cached by it
#: name: (tokens after the shared prefix (None: no prefix), fresh tokens); in the batch's order
BATCH_LAYOUT = {
    "batch_shares_prefix_a": (BATCH_PREFIX, 200),  # two requests of one batch on the same cached pages
    "batch_shares_prefix_b": (BATCH_PREFIX, 333),
    "batch_fresh_517": (None, 517),  # no history, an odd length
    "batch_one_token": (None, 1),  # shorter than N: absent from some ranks' tables
}
BATCH_PROMPTS = tuple(BATCH_LAYOUT)
#: prompt: the tokens it must find cached (``radix_checks``), interleave only
BATCH_RADIX_HITS = {name: BATCH_PREFIX for name, (prefix, _) in BATCH_LAYOUT.items() if prefix}


def over_rank_pool_tokens(cp_size: int) -> int:
    """More than one rank's physical pool, less than ``cp_size`` of them: (2N - 1) / 2 x POOL
    (1.5 x POOL without CP, where only the refusal is checked)."""
    return max(2 * cp_size - 1, 3) * POOL // 2


def tokens(seed: int, n: int) -> list:
    """``n`` token ids of the tiny model's vocabulary (ids 0 and 1 left out), seeded."""
    import numpy as np

    return np.random.default_rng(seed).integers(2, TINY_DSV32["vocab_size"], size=n).tolist()


def prompts(cp_size: int):
    """{name: (token ids, logprob start)}."""
    p3k = tokens(2, 3008)
    p4k = tokens(8, 2 * CHUNK + 13)
    return {  # NOTE: in the order they are posted: a radix hit right after the prompt it shares
        "1.5k_single_chunk": (tokens(1, 1504), 0),
        "3k_chunked": (p3k, 0),
        "radix_hit_3k_prefix": (p3k[:RADIX_PREFIX] + tokens(4, 1008), RADIX_PREFIX),
        "6k_chunked": (tokens(3, 6016), 0),
        "over_rank_pool": (tokens(5, over_rank_pool_tokens(cp_size)), 0),
        # UNEVEN_PROMPTS: SGLang's padding rows per chunk at CP2 / CP4 / CP8 in the comments
        "1.5k_uneven_1500": (tokens(6, 1500), 0),  # 0 / 0 / 4: the chunk that stopped the stand-in
        "1.5k_uneven_1501": (tokens(7, 1501), 0),  # 1 / 3 / 3
        "4k_last_chunk_13": (p4k, 0),  # 2,048 x 2 + 13: 1 / 3 / 3, at CP8 one row per segment
        # 1,984 cached (31 pages), then 16 shared tokens and 1,003 new: a 1,019-token chunk, 1 / 1 / 5
        "radix_mid_page": (p4k[:MID_PAGE_SHARED] + tokens(9, 1003), MID_PAGE_HIT),
        "4k_last_chunk_1": (tokens(10, 2 * CHUNK + 1), 0),  # a last chunk too short to split at any N
        "5k_uneven_907": (tokens(11, 2 * CHUNK + 907), 0),  # 1 / 1 / 5, rows over index_topk keys among them
    }


def batch_prompts():
    """Interleave only: {name: (token ids, logprob start)}, BATCH_SOURCE first, then
    BATCH_PROMPTS in the batch's order (module constants above)."""
    source = tokens(20, BATCH_PREFIX + 256)
    out = {BATCH_SOURCE: (source, 0)}
    for seed, (name, (prefix, fresh)) in enumerate(BATCH_LAYOUT.items(), start=21):
        out[name] = ((source[:prefix] if prefix else []) + tokens(seed, fresh), prefix or 0)
    return out


def launch(name, flag_on, corrupt_rank, pool, model, port, args, log_path, extra_args=(), extra_env=None):
    """Start run ``name``'s server (``extra_args`` / ``extra_env`` on top: other scripts' runs)."""
    cmd, env = server_command(flag_on, corrupt_rank, pool, model, port, args, extra_args, extra_env)
    return start_server(name, cmd, env, port, log_path, args.boot_timeout)


def server_command(flag_on, corrupt_rank, pool, model, port, args, extra_args=(), extra_env=None,
                   cp_strategy=None):
    """(the command line, the environment) of a run's server: :func:`launch` without starting it.
    ``cp_strategy``: the installed release's (CP_STRATEGY) unless given."""
    if (cp_strategy or CP_STRATEGY) == INTERLEAVE:
        return _interleave_command(flag_on, corrupt_rank, pool, model, port, args, extra_args, extra_env)
    fraction = shared_gpu.MEM_FRACTION_STATIC if args.share_gpu else 0.5
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--trust-remote-code", "--tp", str(args.tp), "--page-size", "64",
           "--mem-fraction-static", str(fraction), "--max-total-tokens", str(pool),
           "--disable-cuda-graph", "--random-seed", "0", "--port", str(port), "--nccl-port", str(port + 5),
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
    # --enable-metrics: the run reports how its chunks reached the shards (WRITE_PATHS_METRIC)
    return _with_test_switches(cmd, e2e_env({"SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": "0"}), args,
                               ["--enable-nsa-prefill-cp-shared-kv", "--enable-metrics"] if flag_on else None,
                               corrupt_rank, extra_args, extra_env)


def _with_test_switches(cmd, env, args, flag_args, corrupt_rank, extra_args, extra_env):
    """``cmd`` and ``env`` with what both releases' runs add the same way: the shared GPU, the
    deterministic top-k, the flag (``flag_args``; None: off) and its prefill-only testing
    switch, the negative control, then the caller's extras."""
    if args.share_gpu:
        cmd += shared_gpu.server_args()
        env.update(shared_gpu.env())
    if args.stable_topk:
        env["CPSKV_E2E_STABLE_TOPK"] = "1"
    if flag_args:
        cmd += flag_args
        env["SGLANG_CP_SHARED_KV_TESTING_ALLOW_NON_PD"] = "1"
    if corrupt_rank is not None:
        env["CPSKV_E2E_CORRUPT_RANK"] = str(corrupt_rank)
    cmd += list(extra_args)
    env.update(extra_env or {})
    return cmd, env


#: the flag in 0.5.23's words (the plugin registers this spelling on 0.5.23 only)
INTERLEAVE_FLAG = FLAG_ALIAS


def _interleave_command(flag_on, corrupt_rank, pool, model, port, args, extra_args, extra_env):
    """0.5.23's options for the same server (see :func:`server_command`). Mapped from the
    in-seq-split command option by option:

    * ``--tp`` -> ``--tp-size`` (``--tp`` is only an abbreviation there);
    * ``--disable-cuda-graph`` (deprecated) and ``--disable-piecewise-cuda-graph`` (gone: the
      piecewise graph is the prefill phase's graph) -> ``--disable-decode-cuda-graph
      --disable-prefill-cuda-graph``, flag off and on alike: 0.5.23 turns the breakable prefill
      graph on for interleave DSA CP, the flag turns it off with a WARNING, and the flag-off
      runs must run the same eager forward;
    * ``--nsa-*-backend`` -> ``--dsa-prefill-backend flashmla_sparse --dsa-decode-backend
      flashmla_sparse`` for both KV dtypes: SGLang's Hopper defaults are flashmla_kv for fp8 and
      fa3 for the bf16 decode (FlashAttention 3 is not in the GPU bundle); the flag refuses only
      trtllm as the decode backend of a prefill server; no decode step runs here;
    * ``--enable-nsa-prefill-context-parallel --nsa-prefill-cp-mode in-seq-split`` ->
      ``--enable-prefill-cp --cp-strategy interleave``; the flag as ``--enable-prefill-cp-shared-kv``;
    * ``--disable-flashinfer-autotune`` added: the flag declares it off (its warmup runs a
      decode-shaped dummy forward); said here so the flag-off runs match;
    * ``--enable-metrics`` in every run (the flag-on run's write-path counter; the others, so
      that a flag-off command is the flag-on one minus the flag);
    * the rest keep their names (``--page-size``, ``--mem-fraction-static``,
      ``--max-total-tokens``, ``--random-seed``, ``--nccl-port``, ``--kv-cache-dtype``,
      ``--chunked-prefill-size``, ``--sampling-backend pytorch``, ``--skip-server-warmup``,
      ``--disable-overlap-schedule``, ``--disable-custom-all-reduce``).
    """
    fraction = shared_gpu.MEM_FRACTION_STATIC if args.share_gpu else 0.5
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--trust-remote-code", "--tp-size", str(args.tp), "--page-size", str(PAGE),
           "--mem-fraction-static", str(fraction), "--max-total-tokens", str(pool),
           "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph", "--disable-flashinfer-autotune",
           "--random-seed", "0", "--port", str(port), "--nccl-port", str(port + 5),
           "--kv-cache-dtype", args.kv_cache_dtype, "--chunked-prefill-size", str(CHUNK),
           "--sampling-backend", "pytorch",
           # no decode here (as in-seq-split: a shared-KV prefill rank refuses decode)
           "--skip-server-warmup", "--disable-overlap-schedule",
           "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "flashmla_sparse",
           # every run, so that a flag-off run's command is the flag-on one's minus the flag
           "--enable-metrics"]
    if args.tp > 1:
        cmd += ["--enable-prefill-cp", "--cp-strategy", INTERLEAVE, "--disable-custom-all-reduce"]
    return _with_test_switches(cmd, e2e_env({DSA_DENSE_THRESHOLD_ENV: "0"}), args,
                               [INTERLEAVE_FLAG] if flag_on else None, corrupt_rank, extra_args, extra_env)


def generate(port, ids, start):
    """(the prompt's logprobs from ``start`` on, or ``{"refused": <the server's message>}``;
    the answer's ``meta_info``, empty when the server refused the request over HTTP)."""
    try:
        out = post(port, "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                   timeout=300)  # NOTE: a 60K-token prefill of ranks sharing a GPU takes tens of seconds
    except urllib.error.HTTPError as exc:
        return {"refused": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-500:]}"}, {}
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return {"refused": str(finish.get("message"))}, meta
    return [x[0] for x in meta["input_token_logprobs"]], meta


def logprobs(port, ids, start):
    """(:func:`generate`'s logprobs; the tokens it found in the radix cache)."""
    result, meta = generate(port, ids, start)
    return result, meta.get("cached_tokens")


def logprobs_of_batch(port, requests):
    """Interleave: ``requests`` ({name: (ids, start)}) in ONE /generate request (one message to
    the scheduler: BATCH_SOURCE's note): {name: (logprobs or {"refused": ...}, cached tokens)}."""
    names = list(requests)
    body = {"input_ids": [requests[n][0] for n in names], "return_logprob": True,
            "logprob_start_len": [requests[n][1] for n in names],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    try:
        outs = post(port, "/generate", body, timeout=300)
    except urllib.error.HTTPError as exc:
        refused = {"refused": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-500:]}"}
        return {n: (refused, None) for n in names}
    results = {}
    for name, out in zip(names, outs):
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            results[name] = ({"refused": str(finish.get("message"))}, meta.get("cached_tokens"))
        else:
            results[name] = ([x[0] for x in meta["input_token_logprobs"]], meta.get("cached_tokens"))
    return results


def answered(results, *runs):
    return all(isinstance(results.get(run), list) for run in runs)


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
    ~1K noisy positions is not. With the stable top-k (``exact``) every difference counts.
    Without a spread (a prompt off_b refuses) there is no repeat to check, and with the
    stock top-k only the near positions are judged."""
    spread, on, corrupt = entry.get("spread"), entry.get("on"), entry.get("corrupt")
    identical = lambda d: d["near_max"] == 0.0 and d["far_max"] == 0.0  # noqa: E731
    checks = {}
    if spread is not None:
        checks["repeat_bit_identical" if exact else "repeat_near_bit_identical"] = (
            identical(spread) if exact else spread["near_max"] == 0.0)
    if on is not None:
        if exact:
            checks["on_bit_identical"] = identical(on)
        else:
            checks["near_bit_identical"] = on["near_max"] == 0.0
            if spread is not None:
                checks["far_within_spread"] = on["far_mean"] <= 1.25 * spread["far_mean"]
    if corrupt is not None and has_history:  # the control corrupts a gathered history page
        worst = max(corrupt["near_max"], corrupt["far_max"])
        noise = spread["far_max"] if spread is not None else 0.0
        checks["control_detected"] = worst > 0.0 if exact else worst > 5 * max(noise, 1e-3)
    return checks


def write_paths_by_rank(samples):
    """The flag-on run's Prometheus write-path samples (labels cp_rank, index, mla) as
    {cp rank: {"local": forwards whose index keys were stored where computed, "gathered":
    the others, "mla_local": forwards whose MLA latent was}}."""
    ranks = {}
    for labels, value in samples.items():
        fields = prometheus_labels(labels)
        counts = ranks.setdefault(int(fields["cp_rank"]), {"local": 0, "gathered": 0, "mla_local": 0})
        counts["local" if fields["index"] == "local" else "gathered"] += int(value)
        counts["mla_local"] += int(value) if fields["mla"] == "local" else 0
    return dict(sorted(ranks.items()))


def interleave_write_path_problem(samples, cp_size, min_forwards):
    """Interleave (0.5.23): why the flag-on run's write-path counter does not show the shared
    pool on every CP rank's every forward (None: it does). NOTE: interleave computes and gathers
    every chunk on every rank (``forward/hooks_v0523.attach_batch_state`` counts each forward
    ``index=gathered,mla=gathered``); in-seq-split's "some stored where computed, others
    gathered" has no counterpart there. What does: every rank counted, only gathered forwards,
    the same number on every rank (each runs every forward of the group), and at least
    ``min_forwards`` (the chunks the run answered: at least one forward each)."""
    counted = {}
    for labels, value in samples.items():
        fields = prometheus_labels(labels)
        if (fields.get("index"), fields.get("mla")) != ("gathered", "gathered"):
            return f"a forward counted as index={fields.get('index')},mla={fields.get('mla')}: {labels}"
        rank = int(fields["cp_rank"])
        counted[rank] = counted.get(rank, 0) + int(value)
    if sorted(counted) != list(range(cp_size)):
        return f"forwards counted on CP ranks {sorted(counted)}, expected 0..{cp_size - 1}"
    if len(set(counted.values())) != 1:
        return f"CP ranks counted different numbers of forwards: {counted}"
    if counted[0] < min_forwards:
        return f"{counted[0]} forwards counted per rank, fewer than the {min_forwards} chunks answered"
    return None


def chunks_answered(run, requests):
    """The prefill forwards run ``run`` needed at least: one per CHUNK of each prompt it
    answered, after its logprob start (its cache hit), the batch (BATCH_PROMPTS) one in all."""
    total, batch = 0, False
    for prompt, (ids, start) in requests.items():
        if not isinstance(run["logprobs"].get(prompt), list):
            continue
        if prompt in BATCH_PROMPTS:
            batch = True
            continue
        total += -(-(len(ids) - start) // CHUNK)
    return total + int(batch)


def capacity_checks(runs, cp_size, cp_strategy=None, requests=None):
    """The capacity side (module docstring) over the runs present (``cp_strategy``: the
    installed release's unless given; ``requests``: the prompts posted, interleave only)."""
    checks = {}
    refused = lambda run: isinstance(runs[run]["logprobs"]["over_rank_pool"], dict)  # noqa: E731
    if "off_b" in runs:
        checks["off_b refuses over_rank_pool"] = refused("off_b")
    if "off_a" in runs:
        checks["off_a serves over_rank_pool"] = not refused("off_a")
    if cp_size > 1 and "on" in runs:
        checks["on serves over_rank_pool"] = not refused("on")
        shared = runs["on"]["startup"]["shared"]
        checks[f"on: {POOL} physical tokens per rank, {cp_size} x as many logical"] = (
            bool(shared) and all(p == POOL and logical == cp_size * p for p, logical in shared))
        if (cp_strategy or CP_STRATEGY) == INTERLEAVE:
            problem = interleave_write_path_problem(runs["on"].get("write_paths", {}), cp_size,
                                                    max(1, chunks_answered(runs["on"], requests or {})))
            checks["on: every CP rank ran every forward through the shared pool (gathered)"] = problem is None
            return checks
        paths = write_paths_by_rank(runs["on"].get("write_paths", {}))
        checks["on: every CP rank stored some forwards where computed and gathered others"] = (
            sorted(paths) == list(range(cp_size)) and all(v["local"] > 0 and v["gathered"] > 0 for v in paths.values()))
    return checks


def radix_checks(runs, cp_strategy=None):
    """Each radix-hit prompt (RADIX_HITS; with interleave BATCH_RADIX_HITS too) found its prefix
    in every run's cache (else it is one more fresh prompt, and the path a prefix takes goes
    unchecked)."""
    hits = {**RADIX_HITS, **BATCH_RADIX_HITS} if (cp_strategy or CP_STRATEGY) == INTERLEAVE else RADIX_HITS
    return {f"{name}: {prompt} found its {cached} tokens cached":
            (run.get("cached_tokens", {}).get(prompt) or 0) >= cached
            for name, run in runs.items() for prompt, cached in hits.items()}


def batch_checks(runs, requests):
    """Interleave: every run prefilled BATCH_PROMPTS as one batch, its log says so (a prefill
    batch of exactly len(BATCH_PROMPTS) requests and their tokens, new plus cached), so their
    logprobs are comparable exactly (BATCH_SOURCE's note). ``run["prefill_batches"]``: the
    batches its log reported (``server.prefill_batches``)."""
    want_seqs = len(BATCH_PROMPTS)
    want_tokens = sum(len(requests[name][0]) for name in BATCH_PROMPTS)
    return {f"{name}: the {want_seqs} batch prompts prefilled in one batch ({want_tokens} tokens)":
            any(seqs == want_seqs and new + cached == want_tokens for seqs, new, cached in run.get("prefill_batches", []))
            for name, run in runs.items()}


def one_run(name, model, requests, args, log_path):
    """Boot run ``name``'s server, take every prompt's logprobs, stop it: the run's record."""
    flag_on, corrupt, pool = RUNS[name]
    port = args.port + PORTS_PER_RUN * list(RUNS).index(name)
    t0 = time.monotonic()
    proc = launch(name, flag_on, corrupt, pool, model, port, args, log_path)
    run = {"boot_s": round(time.monotonic() - t0, 1), "pool": pool, "logprobs": {}, "cached_tokens": {}}
    try:
        for prompt, (ids, start) in requests.items():
            if prompt in BATCH_PROMPTS:
                continue  # posted together below, with no flush before them
            if start == 0:  # fresh prompts run from an empty cache; the radix-hit one reuses it
                flush_cache(port)
            run["logprobs"][prompt], run["cached_tokens"][prompt] = logprobs(port, ids, start)
        batch = {prompt: requests[prompt] for prompt in BATCH_PROMPTS if prompt in requests}
        if batch:  # interleave: right after BATCH_SOURCE (no flush: its prefix is their cache hit)
            for prompt, (result, cached) in logprobs_of_batch(port, batch).items():
                run["logprobs"][prompt], run["cached_tokens"][prompt] = result, cached
        if flag_on:
            run["write_paths"] = prometheus_samples(port, WRITE_PATHS_METRIC)
    finally:
        stop(proc)
    log_text = log_path.read_text()
    run["startup"] = startup_figures(log_text)
    if CP_STRATEGY == INTERLEAVE:
        run["prefill_batches"] = prefill_batches(log_text)
    problems = []
    if args.stable_topk:  # every TP rank must have taken it, else the comparison is not exact
        problems.append(stable_topk_problem(run["startup"], name, log_path, args.tp))
    run["stable_topk_problems"] = [p for p in problems if p]
    if args.share_gpu:
        run["share_gpu_problems"] = [p for p in [shared_gpu.problem(run["startup"], name, log_path, args.tp)] if p]
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="e2e_cp_logprobs.json")
    ap.add_argument("--workdir", default="e2e-work")
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--boot-timeout", type=int, default=420)
    ap.add_argument("--runs", default=None, help="servers to run now (comma-separated; default: all of the layout)")
    ap.add_argument("--tp", type=int, choices=(1, 2, 4, 8), default=2,
                    help="N > 1: CPN in-seq-split on N GPUs (default 2); 1: one GPU, no CP, flag-off runs only")
    ap.add_argument("--stable-topk", action="store_true",
                    help="deterministic NSA top-k in every server: demand bit equality at every position")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank of every server on GPU 0 (correctness only: shared_gpu.py)")
    ap.add_argument("--parallel", type=int, default=1, help="runs booted at once (default 1)")
    ap.add_argument("--logdir", default=None, help="server logs (default: --workdir)")
    args = ap.parse_args()
    layout_runs = list(RUNS) if args.tp > 1 else list(RUNS_WITHOUT_CP)
    selected = layout_runs if args.runs is None else [r for r in args.runs.split(",") if r]
    unknown = sorted(set(selected) - set(layout_runs))
    if unknown:
        ap.error(f"runs {unknown} are not part of --tp {args.tp}; choose from {layout_runs}")
    tag = (f"{args.kv_cache_dtype}.tp{args.tp}" + (".stable-topk" if args.stable_topk else "")
           + (".share-gpu" if args.share_gpu else ""))
    work = Path(args.workdir)
    logdir = Path(args.logdir) if args.logdir else work
    logdir.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "tiny-dsv32-64k", MODEL)
    os.environ.setdefault("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    requests = prompts(args.tp)
    if CP_STRATEGY == INTERLEAVE:
        requests.update(batch_prompts())
    runs, failed = accumulate_runs(
        work, tag, selected, layout_runs,
        lambda name: one_run(name, str(model), requests, args, logdir / f"{name}.{tag}.log"), "e2e",
        parallel=args.parallel)
    run_problems = {name: run.get("stable_topk_problems", []) + run.get("share_gpu_problems", [])
                    for name, run in runs.items()}
    report = {"kv_cache_dtype": args.kv_cache_dtype, "tp": args.tp, "cp_size": args.tp if args.tp > 1 else 1,
              "stable_topk": args.stable_topk, "share_gpu": args.share_gpu, "index_topk": INDEX_TOPK,
              "pool": POOL, "big_pool": BIG_POOL, "chunk": CHUNK,
              "runs": sorted(runs), "failed_runs": failed,
              "run_problems": {name: p for name, p in run_problems.items() if p},
              "timings": {name: {"boot_s": run["boot_s"]} for name, run in runs.items()},
              "startup": {name: run["startup"] for name, run in runs.items()},
              # prefill forwards by write path and CP rank (flag-on runs)
              "write_paths": {name: write_paths_by_rank(run["write_paths"])
                              for name, run in runs.items() if "write_paths" in run},
              "refused": {name: {p: r["refused"] for p, r in run["logprobs"].items() if isinstance(r, dict)}
                          for name, run in runs.items()},
              "prompts": {}}
    if args.share_gpu:
        report["note"] = ("every rank of every server shared one GPU (--share-gpu): a correctness run; "
                          "its times (boot_s) say nothing about a deployment")
    complete = set(runs) == set(layout_runs)
    ok = complete and not any(run_problems.values())
    for prompt, (ids, start) in requests.items():
        results = {name: run["logprobs"][prompt] for name, run in runs.items()}
        entry = {"tokens": len(ids), "positions": len(next((r for r in results.values() if isinstance(r, list)), []))}
        # off_b refuses over_rank_pool (capacity_checks): there the flag-on runs answer to off_a alone
        spread_run = "off_b" if answered(results, "off_b") else None
        for label, run in (("spread", spread_run), ("on", "on"), ("corrupt", "on_corrupt")):
            if run and answered(results, run, "off_a"):
                entry[label] = compare(results, run, "off_a", start)
        if answered(results, "on", "off_b"):
            entry["on_vs_off_b"] = compare(results, "on", "off_b", start)
        if complete and prompt == "over_rank_pool" and args.tp == 1:
            entry["judged_by"] = "capacity_checks"  # nothing to compare: only off_a answers it
        elif complete:
            has_history = start > 0 or len(ids) > CHUNK
            entry["checks"] = verdict(entry, has_history, args.stable_topk)
            if prompt != "over_rank_pool" and "spread" not in entry:
                entry["checks"]["repeat answered"] = False
            if args.tp > 1 and "on" not in entry:
                entry["checks"]["on answered"] = False
            entry["pass"] = bool(entry["checks"]) and all(entry["checks"].values())
            ok &= entry["pass"]
        report["prompts"][prompt] = entry
    report["capacity_checks"] = capacity_checks(runs, report["cp_size"], requests=requests)
    ok &= all(report["capacity_checks"].values())
    report["cached_tokens"] = {name: run.get("cached_tokens", {}) for name, run in runs.items()}
    report["radix_checks"] = radix_checks(runs)
    ok &= all(report["radix_checks"].values())
    if CP_STRATEGY == INTERLEAVE:  # NOTE: keys of the in-seq-split report unchanged
        report["cp_strategy"] = CP_STRATEGY
        report["prefill_batches"] = {name: run.get("prefill_batches", []) for name, run in runs.items()}
        report["batch_checks"] = batch_checks(runs, requests)
        ok &= bool(report["batch_checks"]) and all(report["batch_checks"].values())
    report["pass"] = ok
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
