"""A real PD pair for the end-to-end scripts (``scripts/e2e_pd_gpu.py``, ``scripts/soak_pd.py``):
the prefill and decode commands of one pair, their environment, and one request posted to
both servers with one bootstrap room, decode's answer summarised for exact comparison.

The pair is the deployment of docs/deploy.md in small: prefill TPN + NSA prefill CPN
in-seq-split (``--cp-size 1``: TP1, no CP), decode TP1 on GPU 0, Mooncake; bf16 runs
``flashmla_sparse`` on both servers, fp8 runs it on the CP prefill only (stock fp8's
``flashmla_kv`` fails with in-seq-split; decode keeps SGLang's fp8 default, whose
``flashmla_sparse`` decode reads the cache without dequantizing it). ``--share-gpu`` puts
every rank of both servers on GPU 0 (:mod:`.shared_gpu`). The flag on the prefill brings
``--enable-metrics`` (the plugin's counters); with the flag on either server every CP rank
sends (``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on both), otherwise stock's default
(CP rank 0 sends everything) even where the caller's environment sets the variable.

On SGLang 0.5.23 (picked from the installed release, :data:`CP_STRATEGY`: its prefill CP is
interleave) the same pair takes 0.5.23's options (:func:`_interleave_commands`): ``--tp-size``,
``--enable-prefill-cp --cp-strategy interleave``, the DSA backends (FlashAttention 3, 0.5.23's
bf16 decode default on Hopper, is not in the GPU bundle), ``--disable-decode-cuda-graph
--disable-prefill-cuda-graph --disable-flashinfer-autotune`` on both servers, the flag as
``--enable-prefill-cp-shared-kv`` and the short-prompt dense-attention threshold under its DSA
name (:data:`DSA_DENSE_THRESHOLD_ENV`); the every-CP-rank variable means the same there
(``disaggregation/common/conn.py``: CP ranks but 0 are dummies without it, and decode pulls
from CP rank 0 alone).

A request's answers are read with ``http.client`` so that a client can also walk away from
one (close its connection after a delay, as an impatient user does: SGLang's HTTP server
aborts a request whose client disconnected) or stop waiting for the prefill's answer once
decode's came (a prefill whose rank was killed never answers).
"""

from __future__ import annotations

import http.client
import json
import select
import sys
import threading
import time
from typing import Dict, NamedTuple, Optional

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.settings.config import FLAG_ALIAS
from sglang_cp_shared_kv_testing import shared_gpu
# DSA_DENSE_THRESHOLD_ENV: set to 0 on both servers of an interleave pair (server.py says why)
from sglang_cp_shared_kv_testing.server import DSA_DENSE_THRESHOLD_ENV, INTERLEAVE, e2e_env, samples_by_rank

#: tokens decode generates for every request (greedy, ``ignore_eos``, with their logprobs)
NEW_TOKENS = 8
#: a refusal "at once": well under every timeout of these runs
AT_ONCE_S = 10
#: how decode's error names a shared-KV prefill's failure cause (transfer/decode.py)
CAUSE_PREFIX = "cause: prefill CP rank"
#: how that cause names an abort on the prefill (transfer/hooks.py)
ABORT_CAUSE = "the prefill aborted the request"

#: The prefill CP strategy of the installed SGLang (``releases``: in-seq-split on the GPU-verified
#: release, interleave on 0.5.23), which picks the pair's options; the GPU-verified release's
#: where no served SGLang is installed (the CPU tests of the scripts' parts).
CP_STRATEGY = (installed.INSTALLED or installed.RECOMMENDED).cp_strategy
#: interleave (0.5.23): decode's DSA backend per KV dtype. bf16: flashmla_sparse (SGLang's Hopper
#: default there is fa3, not in the GPU bundle). fp8: flashmla_kv, SGLang's Hopper fp8 default,
#: named so that no other GPU changes it: 0.5.23's flashmla_sparse decode hands the pool's raw
#: fp8 rows to ``flash_mla_sparse_fwd`` without dequantizing them (``dsa_backend.py``
#: ``forward_decode`` -> ``_forward_flashmla_sparse``), as 0.5.12.post1's does. A decode server
#: runs no prefill forward: its prefill backend is set to the same so both are named.
INTERLEAVE_DECODE_BACKEND = {"bfloat16": "flashmla_sparse", "fp8_e4m3": "flashmla_kv"}


class PdRun(NamedTuple):
    """What differs between the PD pairs the scripts start."""

    flag_on: bool  # the flag on the prefill (and, with it, on decode: the deployment of docs/deploy.md)
    prefill_pool: int  # the prefill's --max-total-tokens (per rank)
    corrupt_rank: Optional[int] = None  # the CP rank whose sends scripts/e2e/sitecustomize.py corrupts
    decode_pool: Optional[int] = None  # decode's --max-total-tokens (None: what its memory fraction gives)
    decode_flag: bool = False
    stall_rank: Optional[int] = None  # the CP rank whose first write scripts/e2e/sitecustomize.py holds
    all_cp_ranks: bool = False  # SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 with the flag off

    @property
    def every_cp_rank_sends(self) -> bool:
        """The flag needs every CP rank to send (on both servers); stock keeps rank 0 sending."""
        return self.flag_on or self.decode_flag or self.all_cp_ranks

    @property
    def small_decode(self) -> bool:
        return self.decode_pool is not None


def server_commands(args, run: PdRun, ports, *, chunk: int, default_decode_pool: int,
                    cp_strategy: Optional[str] = None):
    """(prefill cmd, decode cmd) of one pair. ``args``: ``model``, ``kv_cache_dtype``,
    ``cp_size``, ``share_gpu``; ``ports``: ``prefill``, ``decode``, ``bootstrap`` and, where
    several pairs run at once, ``prefill_nccl``, ``decode_nccl``. ``default_decode_pool``:
    decode's pool under ``--share-gpu`` when ``run`` names none (every pool fixed there).
    ``cp_strategy``: the installed release's (:data:`CP_STRATEGY`) unless given; interleave
    takes :func:`_interleave_commands`."""
    if (cp_strategy or CP_STRATEGY) == INTERLEAVE:
        return _interleave_commands(args, run, ports, chunk=chunk, default_decode_pool=default_decode_pool)
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model), "--load-format",
            "dummy", "--skip-tokenizer-init", "--trust-remote-code", "--page-size", "64", "--disable-cuda-graph",
            "--disable-piecewise-cuda-graph", "--sampling-backend", "pytorch", "--random-seed", "0",
            "--kv-cache-dtype", args.kv_cache_dtype, "--disaggregation-transfer-backend", "mooncake",
            "--host", "127.0.0.1"]
    backends = ["--nsa-prefill-backend", "flashmla_sparse", "--nsa-decode-backend", "flashmla_sparse"]
    if args.kv_cache_dtype == "bfloat16":
        base += backends
    prefill = base + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["bootstrap"]),
                      "--port", str(ports["prefill"]), "--chunked-prefill-size", str(chunk),
                      "--max-total-tokens", str(run.prefill_pool)]
    decode = base + ["--disaggregation-mode", "decode", "--port", str(ports["decode"]), "--base-gpu-id", "0"]
    if "prefill_nccl" in ports:
        prefill += ["--nccl-port", str(ports["prefill_nccl"])]
        decode += ["--nccl-port", str(ports["decode_nccl"])]
    if args.cp_size > 1 and args.kv_cache_dtype != "bfloat16":
        # NOTE: the prefill only: flashmla_kv fails with in-seq-split fp8; decode is not CP
        # and keeps SGLang's fp8 default (its flashmla_sparse decode has no fp8 read)
        prefill += backends
    if args.cp_size > 1:
        prefill += ["--tp", str(args.cp_size), "--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode",
                    "in-seq-split", "--disable-custom-all-reduce"]
    else:
        prefill += ["--tp", "1"]
    decode += ["--tp", "1"]
    _place(args, prefill, decode)
    if run.flag_on:  # --enable-metrics: the run reports how its chunks reached the shards
        prefill += ["--enable-nsa-prefill-cp-shared-kv", "--enable-metrics"]
    if run.decode_flag:
        decode.append("--enable-nsa-prefill-cp-shared-kv")
    return prefill, _with_decode_pool(decode, args, run, default_decode_pool)


def _place(args, prefill, decode) -> None:
    """Both servers' GPU memory, added to their commands: ``--share-gpu`` (every rank of both
    on GPU 0, every pool fixed: shared_gpu.py), else decode on GPU 0 beside prefill rank 0 (CP),
    else both on GPU 0 with what the prefill leaves."""
    if args.share_gpu:
        fractions = (shared_gpu.MEM_FRACTION_STATIC,) * 2
        prefill += shared_gpu.server_args()
        decode += shared_gpu.server_args()
    elif args.cp_size > 1:
        fractions = (0.45, 0.85)
    else:
        fractions = (0.3, 0.3)
    prefill += ["--mem-fraction-static", str(fractions[0])]
    decode += ["--mem-fraction-static", str(fractions[1])]


def _with_decode_pool(decode, args, run: PdRun, default_decode_pool: int):
    """``decode`` with its pool: the run's, else ``default_decode_pool`` under ``--share-gpu``."""
    decode_pool = default_decode_pool if run.decode_pool is None and args.share_gpu else run.decode_pool
    return decode + ["--max-total-tokens", str(decode_pool)] if decode_pool is not None else decode


def _interleave_commands(args, run: PdRun, ports, *, chunk: int, default_decode_pool: int):
    """0.5.23's options for the same pair (see :func:`server_commands`), mapped from the
    in-seq-split pair option by option:

    * ``--tp`` -> ``--tp-size`` (``--tp`` is only an abbreviation there);
    * ``--disable-cuda-graph`` (deprecated) and ``--disable-piecewise-cuda-graph`` (gone) ->
      ``--disable-decode-cuda-graph --disable-prefill-cuda-graph`` on both servers, flag off and
      on alike: 0.5.23 turns the breakable prefill graph on for interleave DSA CP, the flag
      turns it off with a WARNING, and the flag-off runs must run the same eager forward;
    * ``--disable-flashinfer-autotune`` on both servers: the flag declares it off on the prefill
      (its warmup runs a decode-shaped dummy forward); said on every server so that the flag
      changes nothing else;
    * ``--nsa-*-backend`` -> the prefill: ``--dsa-prefill-backend flashmla_sparse
      --dsa-decode-backend flashmla_sparse`` for both KV dtypes (as scripts/e2e_cp_logprobs.py;
      SGLang's Hopper fp8 default flashmla_kv is not what the flag's CPU rigs ran; the flag
      refuses only trtllm as a prefill server's decode backend; no decode step runs there);
      decode: :data:`INTERLEAVE_DECODE_BACKEND` (bf16 flashmla_sparse, fp8 flashmla_kv) for both;
    * ``--enable-nsa-prefill-context-parallel --nsa-prefill-cp-mode in-seq-split`` ->
      ``--enable-prefill-cp --cp-strategy interleave``; the flag as ``--enable-prefill-cp-shared-kv``
      on both servers (one option, two spellings, on 0.5.23);
    * ``--enable-metrics`` on every prefill, so that a flag-off prefill's command is the flag-on
      one's minus the flag (the flag-on runs read the plugin's counters there);
    * the rest keep their names, the PD warm-up included (not skipped: a PD prefill's warm-up
      is a prefill-only request through SGLang's fake sender, a decode's a decode with its fake
      receiver, ``entrypoints/http_server._send_disaggregation_warmup_requests``), and so does
      the overlap schedule (on, as in 0.5.12.post1's pair: a PD prefill never decodes).
    """
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model), "--load-format",
            "dummy", "--skip-tokenizer-init", "--trust-remote-code", "--page-size", "64",
            "--disable-decode-cuda-graph", "--disable-prefill-cuda-graph", "--disable-flashinfer-autotune",
            "--sampling-backend", "pytorch", "--random-seed", "0",
            "--kv-cache-dtype", args.kv_cache_dtype, "--disaggregation-transfer-backend", "mooncake",
            "--host", "127.0.0.1"]
    decode_backend = INTERLEAVE_DECODE_BACKEND[args.kv_cache_dtype]
    prefill = base + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(ports["bootstrap"]),
                      "--port", str(ports["prefill"]), "--chunked-prefill-size", str(chunk),
                      "--max-total-tokens", str(run.prefill_pool),
                      "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "flashmla_sparse",
                      "--enable-metrics"]
    decode = base + ["--disaggregation-mode", "decode", "--port", str(ports["decode"]), "--base-gpu-id", "0",
                     "--dsa-prefill-backend", decode_backend, "--dsa-decode-backend", decode_backend]
    if "prefill_nccl" in ports:
        prefill += ["--nccl-port", str(ports["prefill_nccl"])]
        decode += ["--nccl-port", str(ports["decode_nccl"])]
    prefill += ["--tp-size", str(args.cp_size)]
    if args.cp_size > 1:
        prefill += ["--enable-prefill-cp", "--cp-strategy", INTERLEAVE, "--disable-custom-all-reduce"]
    decode += ["--tp-size", "1"]
    _place(args, prefill, decode)
    if run.flag_on:
        prefill.append(FLAG_ALIAS)
    if run.decode_flag:
        decode.append(FLAG_ALIAS)
    return prefill, _with_decode_pool(decode, args, run, default_decode_pool)


def run_env(args, run: PdRun, *, bootstrap_timeout_s: float, waiting_timeout_s: float = 60,
            stall_s: Optional[float] = None, cp_strategy: Optional[str] = None) -> Dict[str, str]:
    """Both servers' environment: the e2e ``sitecustomize`` (:func:`.server.e2e_env`), SGLang's
    PD timeouts (a refused or lost request fails within them instead of SGLang's 300 s), who
    sends (:attr:`PdRun.every_cp_rank_sends`), the deterministic top-k unless
    ``args.stock_topk``, the run's corruption and stall switches, ``--share-gpu``'s settings.
    ``cp_strategy`` (the installed release's unless given) names the dense-attention threshold
    (interleave: :data:`DSA_DENSE_THRESHOLD_ENV`)."""
    threshold = (DSA_DENSE_THRESHOLD_ENV if (cp_strategy or CP_STRATEGY) == INTERLEAVE
                 else "SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD")
    env = e2e_env({threshold: "0",
                   "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(waiting_timeout_s),
                   "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(bootstrap_timeout_s)})
    if run.every_cp_rank_sends:
        env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    else:  # NOTE: not inherited either: stock's default is what the flag-off runs measure
        env.pop("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", None)
    if not args.stock_topk:
        env["CPSKV_E2E_STABLE_TOPK"] = "1"
    if run.corrupt_rank is not None:
        env["CPSKV_E2E_CORRUPT_SEND_RANK"] = str(run.corrupt_rank)
    if run.stall_rank is not None:
        env.update(CPSKV_E2E_STALL_WRITE_RANK=str(run.stall_rank), CPSKV_E2E_STALL_WRITE_S=str(stall_s))
    if args.share_gpu:
        env.update(shared_gpu.env())
    return env


#: how often a waiting client looks whether its answer started to arrive (or it should walk away)
_POLL_S = 0.05


def answer(port: int, body, timeout: float, *, abandon_after: Optional[float] = None,
           give_up: Optional[threading.Event] = None, give_up_grace_s: float = 0.0) -> Dict:
    """POST ``body`` to ``/generate`` on 127.0.0.1:``port`` and wait for the answer:
    ``{status, elapsed_s, ...}`` with status ``ok`` (``response``: the JSON), ``http_error``
    (``code``, ``error``: the body's end), ``error`` (no answer within ``timeout``, or the
    connection failed: ``error`` says which), ``abandoned`` (the client closed the connection
    ``abandon_after`` seconds after posting, before any answer came) or ``given_up`` (no
    answer ``give_up_grace_s`` after ``give_up`` was set)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    out: Dict = {}
    try:
        conn.request("POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        given_up_at = None
        while not select.select([conn.sock], [], [], _POLL_S)[0]:  # nothing read yet: wait for the first byte
            waited = time.monotonic() - t0
            if abandon_after is not None and waited >= abandon_after:
                out = {"status": "abandoned", "abandoned_at_s": round(waited, 3)}
                return out
            if give_up is not None and give_up.is_set():
                given_up_at = given_up_at or time.monotonic()
                if time.monotonic() - given_up_at >= give_up_grace_s:
                    out = {"status": "given_up"}
                    return out
            if waited >= timeout:
                out = {"status": "error", "error": f"no answer within {timeout} s"}
                return out
        resp = conn.getresponse()
        data = resp.read()
        if resp.status >= 400:
            out = {"status": "http_error", "code": resp.status, "error": data.decode(errors="replace")[-2000:]}
        else:
            out = {"status": "ok", "response": json.loads(data or b"null")}
    except Exception as exc:  # noqa: BLE001 -- recorded, judged by the verdict
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()  # NOTE: for "abandoned" this is the walk-away the server sees
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
    return out


def generate_pd(ports, ids, room, timeout=150, rid=None, meanwhile=None, *, new_tokens: int = NEW_TOKENS,
                abandon_after: Optional[float] = None, prefill_grace_s: Optional[float] = None):
    """Post one prompt to prefill and decode (one bootstrap room); decode's answer as
    {status, ids, logprobs, finish_reason, error} (:func:`summarize_decode`), and the
    prefill's status. ``timeout``: how long each client waits (NOTE: the default is well past
    SGLang's 60 s waiting and bootstrap timeouts of these runs, so a request lost in PD fails
    within it). ``rid``: the request id on both servers; ``meanwhile(t0)``: called once both
    are posted (``t0``: the monotonic time they were). ``abandon_after``: both clients walk
    away that many seconds after posting; ``prefill_grace_s``: the prefill's client stops
    waiting that long after decode's answer came."""
    body = {"input_ids": ids, "return_logprob": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": ports["bootstrap"], "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    if rid is not None:
        body["rid"] = rid
    out = {}
    decode_done = threading.Event()

    def post_side(side):
        give_up = decode_done if side == "prefill" and prefill_grace_s is not None else None
        out[side] = answer(ports[side], body, timeout, abandon_after=abandon_after, give_up=give_up,
                           give_up_grace_s=prefill_grace_s or 0.0)
        if side == "decode":
            decode_done.set()

    workers = [threading.Thread(target=post_side, args=(side,)) for side in ("prefill", "decode")]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    if meanwhile is not None:
        meanwhile(t0)
    for w in workers:
        w.join()
    prefill = out["prefill"]
    if prefill.get("status") == "ok":  # what the prefill found in its radix cache
        meta = (prefill["response"] or {}).get("meta_info") or {}
        prefill["cached_tokens"] = meta.get("cached_tokens")
        if meta.get("cached_tokens_details"):  # (HiCache: the tokens found in device memory, host memory, storage)
            prefill["cached_tokens_details"] = meta["cached_tokens_details"]
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            prefill.update(status="aborted", error=finish.get("message"))
    return {"decode": summarize_decode(out["decode"]), "prefill": {k: v for k, v in out["prefill"].items()
                                                                    if k != "response"}}


def summarize_decode(answer):
    """The parts of decode's answer the verdict compares."""
    if answer["status"] != "ok":
        return {k: answer[k] for k in ("status", "error", "elapsed_s", "abandoned_at_s") if k in answer}
    meta = answer["response"].get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    entry = {"status": "ok", "elapsed_s": answer["elapsed_s"], "ids": answer["response"].get("output_ids"),
             "logprobs": [x[0] for x in meta.get("output_token_logprobs", [])], "finish_reason": finish}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        entry["status"] = "aborted"
        entry["error"] = finish.get("message")
    return entry


def same_answer(a, b):
    """Bit-identical decode answers (both answered)."""
    return a["status"] == b["status"] == "ok" and a["ids"] == b["ids"] and a["logprobs"] == b["logprobs"]


def max_logprob_gap(a, b):
    if a.get("status") != "ok" or b.get("status") != "ok" or len(a["logprobs"]) != len(b["logprobs"]):
        return None
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)


def refused_at_once(answer, naming=None, at_once_s: float = AT_ONCE_S):
    """Decode failed the request (an HTTP error or an abort) within ``at_once_s``, its message
    naming ``naming`` when given."""
    return (answer["status"] in ("http_error", "aborted") and answer.get("elapsed_s", at_once_s) < at_once_s
            and (naming is None or naming in (answer.get("error") or "")))


def pages_sent_by_rank(samples):
    """{cp rank: {"kv": pages, "state": pages}} from the plugin's
    ``sglang:cp_shared_kv_transfer_pages_total`` samples (:func:`.server.prometheus_samples`)."""
    return samples_by_rank(samples, "kind")


#: the plugin's count of pages each prefill CP rank sent (labels cp_rank, kind=kv|state)
PAGES_SENT_METRIC = "sglang:cp_shared_kv_transfer_pages_total"


__all__ = ["NEW_TOKENS", "AT_ONCE_S", "CAUSE_PREFIX", "ABORT_CAUSE", "CP_STRATEGY", "INTERLEAVE",
           "DSA_DENSE_THRESHOLD_ENV", "INTERLEAVE_DECODE_BACKEND", "PdRun", "server_commands", "run_env", "answer", "generate_pd",
           "summarize_decode", "same_answer", "max_logprob_gap", "refused_at_once", "pages_sent_by_rank",
           "PAGES_SENT_METRIC"]
