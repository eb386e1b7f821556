#!/usr/bin/env python3
"""A PD pair under load: a shared-KV CP prefill and its decode serve a few hundred concurrent
requests of every shape, and are whole afterwards -- every request ended, no page leaked,
the answers the ones a quiet server gives.

Phases (each one PD pair: prefill TPN + prefill CPN by the installed release's CP strategy
(``testing.pd_servers``: NSA in-seq-split on 0.5.12.post1, interleave on 0.5.23), decode TP1, Mooncake,
the tiny random DeepSeek-V3.2 of ``scripts/e2e_pd_gpu.py`` with 32K positions, the
deterministic top-k stand-in unless ``--stock-topk``, ``--chunked-prefill-size`` CHUNK,
the prefill's pool ``--pool`` tokens per rank, decode's DECODE_POOL = (2N - 1) / 2 x that;
``--share-gpu``: every rank of both servers on GPU 0, correctness only):

  on     the flag on the prefill and on decode (docs/deploy.md): the load, judged
  off    stock SGLang, the same CP layout, pools and load: recorded, not judged (stock
         refuses prompts over one rank's pool on the prefill and its decode answers them from
         KV that never arrived; it keeps a request its decode can never hold at the head of
         its queue for good, so the load puts those last: docs/troubleshooting.md)
  fault  the flag on; prefill CP rank ``--kill-rank`` is SIGKILLed once ``--kill-after``
         requests ended, mid-load (the first ``--fault-requests`` of the plan, decode's
         waiting timeout FAULT_WAITING_TIMEOUT_S): judged

``--hicache-ratio R``: every phase's prefill also runs HiCache's host tier (L2,
``--enable-hierarchical-cache``, write-through, a host pool of R x a rank's device pool): the
prefixes the small pool evicts stay in host memory, and a later request on them is loaded back
and sent to decode (PD with host hits, under load). The radix check then counts host hits
(``cached_tokens_details``) beside device hits, and the flag's phases must show every CP rank
backing pages up and loading pages back (``sglang:cp_shared_kv_hicache_pages_total``).

The load (``sglang_cp_shared_kv_testing.pd_load``, deterministic from ``--seed``):
``--requests`` requests (>= 200 to pass) from ``--clients`` concurrent clients (>= 8), each
request posted to both servers with its own bootstrap room and request id, decode generating
8 tokens greedily with their logprobs: fresh prompts from 16 tokens to one rank's pool,
prompts on four shared prefixes (the radix cache hits them and, the pool being small, evicts
them), prompts of several times one rank's pool up to what decode holds, prompts decode can
never hold (over its pool; within it but not with its reserved decode tokens); of these,
some are aborted on the prefill (``/abort_request``, decode's client waiting) or walked away
from (both connections closed) a seeded delay after posting, mid-prefill or mid-transfer.

Checks (``checks`` in the JSON, each with its figures; ``stock`` holds the off phase's):

* the load: >= 200 requests from >= 8 clients, every kind and client action in it, all posted;
* every request ended within the bound (BOUND_S; the fault phase FAULT_BOUND_S) on both
  servers, decode's failures with a message: the latency distribution of each side and its
  maximum;
* every request the pair can hold was answered; decode refused at once (AT_ONCE_S) what it
  can never hold, naming the flag for the window case;
* an aborted request failed on decode naming the prefill's abort, or was answered (an abort
  SGLang 0.5.12.post1 no longer honours: after the request's last chunk ran) with the answer
  it gets one at a time;
* the prefill's radix cache hit the shared prefixes and evicted them;
* no leaked page on any prefill CP rank and on decode, read from the allocators after the
  load, once every scheduler went idle: the plugin's idle pool audit
  (``sglang_cp_shared_kv.observability.idle_pool_audit``, each release's hooks beside it:
  SGLang's own idle check and the pool page by page, published on ``/metrics`` with
  ``--enable-metrics``), and no leak line of SGLang's
  own idle check in either log (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0``: a leak is
  logged and the server kept up to be measured, not stopped);
* both servers alive after the load and after the one-at-a-time requests;
* fresh prompts answered again one at a time after the load (the prefill's cache flushed
  before each): decode's tokens and logprobs equal the answers under load, bit for bit; and
  equal to stock's one-at-a-time answers where stock serves the prompt;
* every CP rank sent KV and index pages; every process took the stable top-k and (with
  ``--share-gpu``) GPU 0;
* fault: the rank was killed mid-load; every request ended on decode within FAULT_BOUND_S
  with a message (the prefill's clients give up FAULT_PREFILL_GRACE_S after decode's
  answer: that prefill never answers again); no answer from missing KV (every fresh or long
  prompt decode answered equals the on phase's answer); decode alive, no page leaked there.

Phases accumulate in --workdir (``--phases on`` in one device call, ``--phases off,fault``
in the next while the machine is warm; on a fresh machine copy the earlier JSON there
first: ``SOAK_SEED`` of ``scripts/gpu_session.sh``); the report covers every phase present
and passes when on and off are there and every judged check passes. JSON to --out and
stdout.

On 0.5.23 the same phases and checks run on 0.5.23's pair (``pd_servers._interleave_commands``,
as ``scripts/e2e_pd_gpu.py``), with its idle pool audit (``observability/idle_pool_audit_v0523.py``);
its records carry a tag of their own (``.interleave``), so a work folder shared with
0.5.12.post1's phases never mixes the two. What differs there: an abort lands on decode with
the plugin's bootstrap/in-flight text wherever it was aborted (0.5.23's waiting-queue abort calls
``sender.abort()`` too); stock (off, recorded) retires at intake, with no sender, a prompt its
prefill refuses, and its decode fails it at its waiting timeout (WAITING_TIMEOUT_S) instead of
answering it; decode frees a failed room's pages itself once every prefill rank acknowledged,
at most 30 s, so the fault phase's decode audit waits out that release. Not yet run on a GPU.

Usage: python scripts/soak_pd.py --out soak.json --cp-size 4 --share-gpu [--phases on,off,fault]
                                 [--parallel 2] [--kv-cache-dtype fp8_e4m3] [--requests 200]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.decode.admission import DEFAULT_RESERVED_DECODE_TOKENS
from sglang_cp_shared_kv.hicache.metrics import HICACHE_PAGES_METRIC
from sglang_cp_shared_kv.observability.idle_pool_audit import AUDIT_METRIC, leak_found
from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv_testing import pd_servers, shared_gpu
from sglang_cp_shared_kv_testing.pd_load import (
    LoadShape,
    PlannedRequest,
    latency_summary,
    plan_load,
    plan_summary,
    rid_of,
    run_load,
)
from sglang_cp_shared_kv_testing.pd_servers import (
    ABORT_CAUSE,
    AT_ONCE_S,
    PAGES_SENT_METRIC,
    PdRun,
    generate_pd,
    max_logprob_gap,
    pages_sent_by_rank,
    refused_at_once,
    same_answer,
)
from sglang_cp_shared_kv_testing.server import (
    TINY_DSV32,
    accumulate_runs,
    flush_cache,
    live_group_members,
    prometheus_labels,
    prometheus_samples,
    samples_by_rank,
    stable_topk_problem,
    start_server,
    startup_figures,
    stop,
    write_model,
    write_report,
)

CHUNK = 2048  # --chunked-prefill-size
POOL = 1024  # the prefill's --max-total-tokens per rank (--pool): small, so the radix cache evicts
MODEL = {**TINY_DSV32, "max_position_embeddings": 32768}
MIN_REQUESTS, MIN_CLIENTS = 200, 8
#: SGLang's PD timeouts in the on and off phases: a request decode refused leaves the
#: prefill's bootstrap queue after BOOTSTRAP_TIMEOUT_S; NOTE: decode's waiting timeout runs
#: from its preallocation, so under load it must cover the prefill's queue ahead of a request
BOOTSTRAP_TIMEOUT_S = 30
WAITING_TIMEOUT_S = 120
#: every request must end within this (SGLang's own timeouts end a lost one sooner)
BOUND_S = WAITING_TIMEOUT_S + 60
#: the fault phase: decode fails a request whose KV a dead rank never sends after this
FAULT_WAITING_TIMEOUT_S = 30
FAULT_BOUND_S = FAULT_WAITING_TIMEOUT_S + 30
FAULT_PREFILL_GRACE_S = 5
#: NOTE: the off phase's clients wait this long: stock decode holds a request it can never
#: hold, and every request behind it, until its client walks away (e2e_pd_gpu.py's HANG_PROBE_S)
STOCK_PATIENCE_S = 45
#: after the load: SGLang aborts a request whose client walked away within 4 s
#: (tokenizer_manager's wait loop); an idle audit counts from this long after the last answer
SETTLE_S = 6
#: how long the soak waits for every scheduler's idle audit after the load (a prefill request
#: decode refused waits out the bootstrap timeout first)
IDLE_WAIT_S = BOOTSTRAP_TIMEOUT_S + 60
#: a phase's prefill HTTP port is --port + PORTS_PER_PHASE x its place in PHASES; decode +1,
#: bootstrap +2, the prefill's NCCL +3, decode's +4. NOTE: every script's servers listen below
#: Linux's ephemeral range (32768-60999 by default), where any process's outgoing connection may
#: already hold the port: the off prefill of a CP4 fp8 soak (--parallel 2, 2026-12-06) failed to
#: bind 33010 and exited, with 33000 as the default then
PORTS_PER_PHASE = 10
#: rooms: each phase's own block; the one-at-a-time requests after the load's
ROOMS_PER_PHASE, SEQUENTIAL_ROOMS = 1_000_000, 500_000
#: what SGLang's own idle memory check logs when it finds a leak (scheduler_runtime_checker_mixin.py)
LEAK_LINE = "memory leak detected"
#: the title SGLang gives a scheduler process (managers/scheduler.py, configure_scheduler_process)
SCHEDULER_TITLE = re.compile(r"sglang::scheduler\S*?_TP(\d+)(?!\d)")
ANSWERABLE = ("fresh", "prefix", "long")  # kinds a flag-on pair holds
FRESH = ("fresh", "long")  # no shared prefix: computed alike under load and one at a time


class Phase(NamedTuple):
    flag_on: bool
    kill_rank: bool = False  # SIGKILL prefill CP rank --kill-rank mid-load


PHASES = {"on": Phase(True), "off": Phase(False), "fault": Phase(True, kill_rank=True)}


def decode_pool_for(cp_size: int, pool: int) -> int:
    """Decode's pool: (2N - 1) / 2 x one prefill rank's, whole pages: it holds prompts of
    several times one rank's pool and not the longest the prefill takes."""
    return (2 * cp_size - 1) * pool // 2 // 64 * 64


def shape_of(args) -> LoadShape:
    return LoadShape(cp_size=args.cp_size, pool=args.pool, decode_pool=decode_pool_for(args.cp_size, args.pool),
                     reserved_decode_tokens=DEFAULT_RESERVED_DECODE_TOKENS, vocab=MODEL["vocab_size"],
                     abort_window_s=args.abort_window)


def pair_run(name: str, args) -> PdRun:
    flag = PHASES[name].flag_on
    return PdRun(flag, args.pool, decode_pool=decode_pool_for(args.cp_size, args.pool), decode_flag=flag)


def phase_ports(args, name: str) -> Dict[str, int]:
    port = args.port + PORTS_PER_PHASE * list(PHASES).index(name)
    return {"prefill": port, "decode": port + 1, "bootstrap": port + 2, "prefill_nccl": port + 3,
            "decode_nccl": port + 4}


def server_commands(args, name: str, ports):
    """(prefill cmd, decode cmd) of a phase: ``testing.pd_servers``'s pair, both servers with
    ``--enable-metrics`` (the idle pool audit is published there)."""
    run = pair_run(name, args)
    prefill, decode = pd_servers.server_commands(args, run, ports, chunk=CHUNK, default_decode_pool=run.decode_pool)
    for cmd in (prefill, decode):
        if "--enable-metrics" not in cmd:
            cmd.append("--enable-metrics")
    if args.decode_max_running_requests:
        decode += ["--max-running-requests", str(args.decode_max_running_requests)]
    if args.hicache_ratio:
        prefill += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
                    "--hicache-write-policy", "write_through"]
    return prefill, decode


def phase_env(args, name: str) -> Dict[str, str]:
    waiting = FAULT_WAITING_TIMEOUT_S if PHASES[name].kill_rank else WAITING_TIMEOUT_S
    env = pd_servers.run_env(args, pair_run(name, args), bootstrap_timeout_s=BOOTSTRAP_TIMEOUT_S,
                             waiting_timeout_s=waiting)
    # NOTE: SGLang's idle check raises on a leak by default, which stops the server; the soak
    # keeps it up to read its pools and counts the check's warning lines instead
    env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "0"
    return env


class Pair:
    """A started PD pair: its ports, server processes (each leading its process group) and logs."""

    def __init__(self, ports: Dict[str, int], procs: Dict, logs: Dict[str, Path]):
        self.ports, self.procs, self.logs = ports, procs, logs

    def stop(self) -> None:
        for side in ("decode", "prefill"):
            if side in self.procs:
                stop(self.procs[side])

    def alive(self) -> Dict[str, Dict]:
        """Each server's process running and its ``/health`` answering 200."""
        out = {}
        for side in ("prefill", "decode"):
            running = self.procs[side].poll() is None
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[side]}/health", timeout=60) as resp:
                    health = resp.status
            except Exception as exc:  # noqa: BLE001 -- recorded
                health = f"{type(exc).__name__}: {exc}"
            out[side] = {"process": running, "health": health, "alive": running and health == 200}
        return out


def launch_pair(name: str, args, ports, commands, env, logs) -> Pair:
    """Start the prefill, then decode (SGLang refuses the other order on one GPU)."""
    procs = {}
    try:
        for side, cmd in zip(("prefill", "decode"), commands):
            procs[side] = start_server(f"{name} {side}", cmd, env, ports[side], logs[side], args.boot_timeout)
    except BaseException:
        for proc in reversed(list(procs.values())):
            stop(proc)
        raise
    return Pair(ports, procs, logs)


def scheduler_pids(group: int) -> Dict[int, int]:
    """{TP rank: pid} of the scheduler processes in process group ``group`` (their titles)."""
    pids = {}
    for pid in live_group_members(group):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        match = SCHEDULER_TITLE.search(title)
        if match:
            pids[int(match.group(1))] = pid
    return pids


class RankKiller:
    """``run_load``'s ``on_done``: SIGKILL the prefill's scheduler of ``rank`` once ``after``
    requests ended (its record: ``record``)."""

    def __init__(self, group: int, rank: int, after: int):
        self.group, self.rank, self.after = group, rank, after
        self.record: Dict = {}
        self._lock = threading.Lock()

    def __call__(self, done: int) -> None:
        with self._lock:
            if self.record or done < self.after:
                return
            pids = scheduler_pids(self.group)
            self.record = {"rank": self.rank, "requests_ended": done, "scheduler_pids": pids,
                           "at_unix": time.time()}
            pid = pids.get(self.rank)
            if pid is None:
                self.record["error"] = f"no scheduler process of TP rank {self.rank} in group {self.group}"
                return
            os.kill(pid, signal.SIGKILL)
            self.record["pid"] = pid
            print(f"[soak] killed prefill CP rank {self.rank} (pid {pid}) after {done} requests", flush=True)


def idle_audits(port: int) -> Dict[int, Dict[str, float]]:
    """{rank: {field: value}} of the idle pool audit on a server's ``/metrics``."""
    audits: Dict[int, Dict[str, float]] = {}
    for labels, value in prometheus_samples(port, AUDIT_METRIC).items():
        fields = prometheus_labels(labels)
        audits.setdefault(int(fields["rank"]), {})[fields["field"]] = value
    return dict(sorted(audits.items()))


def wait_for_idle_audits(ports: Dict[str, int], ranks: Dict[str, int], after_unix: float, wait_s: float) -> Dict:
    """Every rank's idle audit taken after ``after_unix``, waited for up to ``wait_s``:
    ``{"audits": {side: {rank: fields}}, "complete", "missing", "waited_s"}``."""
    t0 = time.monotonic()
    while True:
        audits, missing = {}, []
        for side, count in ranks.items():
            try:
                audits[side] = idle_audits(ports[side])
            except Exception as exc:  # noqa: BLE001 -- a server that died: recorded
                audits[side] = {"error": f"{type(exc).__name__}: {exc}"}
            for rank in range(count):
                record = audits[side].get(rank)
                if not isinstance(record, dict) or record.get("checked_at_unix_s", 0) < after_unix:
                    missing.append(f"{side} rank {rank}")
        waited = round(time.monotonic() - t0, 1)
        if not missing or waited >= wait_s:
            return {"audits": audits, "complete": not missing, "missing": missing, "waited_s": waited}
        time.sleep(1)


def choose_one_at_a_time(plan: List[PlannedRequest], answered: Dict[int, Dict], limit: int) -> List[PlannedRequest]:
    """The fresh prompts answered under load to post again one at a time: up to a quarter
    whose client aborted (their answer came anyway), the longest of the long ones (a sixth),
    the rest fresh ones in plan order (the same in every phase that answered them: the
    flag-on and stock one-at-a-time answers meet there)."""
    candidates = [r for r in plan if r.kind in FRESH and r.index in answered]
    aborted = [r for r in candidates if r.action != "none"][:math.ceil(limit / 4)]
    longest = sorted((r for r in candidates if r.kind == "long" and r not in aborted),
                     key=lambda r: -r.tokens)[:math.ceil(limit / 6)]
    fresh = [r for r in candidates if r.kind == "fresh" and r not in aborted]
    return (aborted + longest + fresh)[:limit]


def one_at_a_time(pair: Pair, name: str, args, plan, load, patience_s: float) -> List[Dict]:
    """The chosen prompts again, one at a time, the prefill's cache flushed before each; stops
    after a request nobody answered within ``patience_s`` (a decode that stopped serving)."""
    answered = {r["index"]: r for r in load["requests"] if r["decode"]["status"] == "ok"}
    base = ROOMS_PER_PHASE * (list(PHASES).index(name) + 1) + SEQUENTIAL_ROOMS
    out = []
    for req in choose_one_at_a_time(plan, answered, args.sequential):
        entry = {"index": req.index, "kind": req.kind, "tokens": req.tokens}
        try:
            flush_cache(pair.ports["prefill"])  # NOTE: fresh: not from what the load left cached
        except Exception as exc:  # noqa: BLE001 -- recorded; the request still goes
            entry["flush_error"] = f"{type(exc).__name__}: {exc}"
        answer = generate_pd(pair.ports, req.ids(args.seed, shape_of(args)), base + req.index, timeout=patience_s,
                             rid=rid_of(f"soak-{name}-seq", req.index))
        entry.update(decode=answer["decode"], prefill=answer["prefill"])
        out.append(entry)
        if answer["decode"]["status"] == "error":
            break
    return out


def leak_lines(log_path: Path) -> Dict:
    """SGLang's own idle-check leak lines in a server log: their number and the first."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if LEAK_LINE in line] \
        if log_path.exists() else []
    return {"count": len(lines), "first": lines[0][-600:] if lines else None}


def plan_for(args, name: str) -> List[PlannedRequest]:
    plan = plan_load(args.seed, args.requests, shape_of(args))
    return plan[:args.fault_requests] if PHASES[name].kill_rank else plan


def run_phase(name: str, args, work: Path) -> Dict:
    phase = PHASES[name]
    ports = phase_ports(args, name)
    commands = server_commands(args, name, ports)
    logs = {side: args.logdir / f"soak-{name}.{args.tag}.{side}.log" for side in ("prefill", "decode")}
    plan = plan_for(args, name)
    record = {"phase": name, "flag_on": phase.flag_on, "prefill_pool": args.pool,
              "decode_pool": decode_pool_for(args.cp_size, args.pool), "chunk": CHUNK,
              "commands": {"prefill": commands[0], "decode": commands[1]}, "plan": plan_summary(plan),
              "bound_s": FAULT_BOUND_S if phase.kill_rank else args.bound if phase.flag_on else STOCK_PATIENCE_S}
    t0 = time.monotonic()
    pair = launch_pair(name, args, ports, commands, phase_env(args, name), logs)
    ports = pair.ports
    try:
        record["boot_s"] = round(time.monotonic() - t0, 1)
        print(f"[soak] {name}: servers up in {record['boot_s']} s; {len(plan)} requests from {args.clients} clients",
              flush=True)
        killer = RankKiller(pair.procs["prefill"].pid, args.kill_rank, args.kill_after) if phase.kill_rank else None
        load = run_load(plan, args.seed, shape_of(args), ports, clients=args.clients, bound_s=record["bound_s"],
                        deadline_s=args.load_deadline, rid_prefix=f"soak-{name}",
                        room_base=ROOMS_PER_PHASE * (list(PHASES).index(name) + 1),
                        prefill_grace_s=FAULT_PREFILL_GRACE_S if phase.kill_rank else None, on_done=killer)
        record["load"] = load
        if killer is not None:
            record["kill"] = killer.record
        ended = [r["decode"]["status"] for r in load["requests"]]
        print(f"[soak] {name}: load ended in {load['wall_s']} s: " + ", ".join(
            f"{s} {ended.count(s)}" for s in sorted(set(ended))), flush=True)
        if phase.flag_on:  # the audit is the flag's (observability/idle_pool_audit*.py)
            ranks = {"decode": 1} if phase.kill_rank else {"prefill": args.cp_size, "decode": 1}
            record["idle_audit"] = wait_for_idle_audits(ports, ranks, load["t_end_unix"] + SETTLE_S,
                                                        args.idle_wait if args.idle_wait is not None else IDLE_WAIT_S)
            if not phase.kill_rank:
                record["pages_sent"] = pages_sent_by_rank(prometheus_samples(ports["prefill"], PAGES_SENT_METRIC))
                if args.hicache_ratio:
                    record["hicache_pages"] = samples_by_rank(
                        prometheus_samples(ports["prefill"], HICACHE_PAGES_METRIC))
        record["alive_after_load"] = pair.alive()
        if not phase.kill_rank:
            record["one_at_a_time"] = one_at_a_time(pair, name, args, plan, load, record["bound_s"])
            record["alive_after_one_at_a_time"] = pair.alive()
    finally:
        pair.stop()
    record["startup"] = {side: startup_figures(path.read_text(errors="replace")) for side, path in logs.items()}
    record["leak_lines"] = {side: leak_lines(path) for side, path in logs.items()}
    sides = (("prefill", args.cp_size), ("decode", 1))
    if not args.stock_topk:  # every TP rank of both servers must have taken it
        problems = [stable_topk_problem(record["startup"][side], f"{name} {side}", logs[side], tp) for side, tp in sides]
        record["stable_topk_problems"] = [p for p in problems if p]
    if args.share_gpu:
        problems = [shared_gpu.problem(record["startup"][side], f"{name} {side}", logs[side], tp) for side, tp in sides]
        record["share_gpu_problems"] = [p for p in problems if p]
    return record


# ------------------------------------------------------------------------------------ verdict
def _message(entry) -> str:
    return (entry.get("error") or "").strip()


def ended_within_bound(record) -> Dict:
    """Every request ended on both servers within the phase's bound; decode's failures say
    why; the latency distribution of each side."""
    bound, fault = record["bound_s"], "kill" in record
    problems, decode_s, prefill_s, statuses = [], [], [], {}
    for req in record["load"]["requests"]:
        for side in ("decode", "prefill"):
            entry = req[side]
            status, elapsed = entry["status"], entry.get("elapsed_s", math.inf)
            statuses.setdefault(side, {}).setdefault(status, 0)
            statuses[side][status] += 1
            if status == "abandoned" and req["action"] == "abandon":
                continue
            (decode_s if side == "decode" else prefill_s).append(elapsed)
            if side == "prefill" and fault:  # NOTE: a prefill that lost a rank answers nothing again
                continue
            ok = status in ("ok", "aborted", "http_error") and elapsed <= bound
            if side == "decode" and status != "ok":
                ok = ok and bool(_message(entry))
            if not ok:
                problems.append({"index": req["index"], "side": side, "status": status, "elapsed_s": elapsed,
                                 "error": _message(entry)[-300:]})
    return {"pass": not problems, "bound_s": bound, "statuses": statuses, "decode_latency": latency_summary(decode_s),
            "prefill_latency": latency_summary(prefill_s), "problems": problems[:20], "problem_count": len(problems)}


def load_composition(record, args) -> Dict:
    load, plan = record["load"], record["plan"]
    kinds = set(plan["kinds"])
    actions = {a for a, n in plan["actions"].items() if n}
    return {"pass": (plan["requests"] >= MIN_REQUESTS and load["clients"] >= MIN_CLIENTS and not load["not_posted"]
                     and {"fresh", "prefix", "decode_over", "decode_window"} <= kinds
                     and ("long" in kinds or args.cp_size < 3) and {"abort", "abandon"} <= actions),
            "requests": plan["requests"], "clients": load["clients"], "not_posted": len(load["not_posted"]),
            "kinds": plan["kinds"], "actions": plan["actions"], "load_wall_s": load["wall_s"],
            "minimum": {"requests": MIN_REQUESTS, "clients": MIN_CLIENTS}}


def answered_what_it_holds(record) -> Dict:
    failures = [{"index": r["index"], "kind": r["kind"], "tokens": r["tokens"], "status": r["decode"]["status"],
                 "error": _message(r["decode"])[-300:]}
                for r in record["load"]["requests"]
                if r["kind"] in ANSWERABLE and r["action"] == "none" and r["decode"]["status"] != "ok"]
    held = sum(1 for r in record["load"]["requests"] if r["kind"] in ANSWERABLE and r["action"] == "none")
    return {"pass": held > 0 and not failures, "requests": held, "failures": failures[:20],
            "failure_count": len(failures)}


def refused_what_decode_cannot_hold(record) -> Dict:
    refused, problems = [], []
    for r in record["load"]["requests"]:
        if r["kind"] not in ("decode_over", "decode_window") or r["action"] != "none":
            continue
        naming = FLAG if r["kind"] == "decode_window" and record["flag_on"] else None
        (refused if refused_at_once(r["decode"], naming=naming) else problems).append(
            {"index": r["index"], "kind": r["kind"], "tokens": r["tokens"], "status": r["decode"]["status"],
             "elapsed_s": r["decode"].get("elapsed_s"), "error": _message(r["decode"])[-300:]})
    return {"pass": bool(refused) and not problems, "at_once_s": AT_ONCE_S, "refused": len(refused),
            "slowest_s": max((x["elapsed_s"] or 0 for x in refused), default=None), "problems": problems[:20]}


def aborts_end_right(record) -> Dict:
    """Aborted requests: failed on decode naming the abort, or answered with their
    one-at-a-time answer (where it was asked again)."""
    again = {e["index"]: e for e in record.get("one_at_a_time", [])}
    landed, problems, after_abort = {}, [], []
    for r in record["load"]["requests"]:
        if r["action"] != "abort":
            continue
        decode = r["decode"]
        if decode["status"] == "ok":
            if r["index"] in again:
                where = "answered, = one at a time" if same_answer(decode, again[r["index"]]["decode"]) \
                    else "answered, != one at a time"
            else:
                where = "answered, not asked again"
        elif ABORT_CAUSE in _message(decode):
            # NOTE: the plugin's two abort texts (transfer/hooks.py): the waiting queue's, and the
            # bootstrap or in-flight queue's (aborted before or while its KV went out)
            where = ("failed, before it ran" if "before it ran" in _message(decode)
                     else "failed, bootstrapping or mid-transfer")
            sent = (r.get("abort") or {}).get("sent_at_s")
            if sent is not None:
                after_abort.append(round(decode["elapsed_s"] - sent, 3))
        else:
            where = "failed, other cause"
        landed[where] = landed.get(where, 0) + 1
        if where in ("answered, != one at a time", "failed, other cause"):
            problems.append({"index": r["index"], "landed": where, "error": _message(decode)[-300:]})
    return {"pass": bool(landed) and not problems, "landed": landed, "decode_failed_after_abort": latency_summary(
        after_abort), "problems": problems[:20]}


def radix_hits_and_evictions(record, args) -> Dict:
    """Prefix requests the prefill answered: cached tokens found (hits), and misses of a prefix
    another request had cached (finished on the prefill) before this one was posted. With
    HiCache an evicted prefix comes back from host memory: a hit with host tokens in
    ``cached_tokens_details`` (``host_hits``) stands for an eviction."""
    shape = shape_of(args)
    cached_by: Dict[int, float] = {}  # prefix -> the earliest time a request with it finished on the prefill
    hits = misses = cold = host_hits = 0
    prefix_requests = sorted((r for r in record["load"]["requests"] if r["kind"] == "prefix"),
                             key=lambda r: r["posted_at_s"])
    for r in prefix_requests:
        prefill = r["prefill"]
        if r["action"] == "none" and prefill["status"] == "ok":
            cached = prefill.get("cached_tokens") or 0
            if cached >= shape.prefix_tokens(r["prefix"]):
                hits += 1
                host_hits += bool((prefill.get("cached_tokens_details") or {}).get("host"))
            elif r["prefix"] in cached_by and cached_by[r["prefix"]] <= r["posted_at_s"]:
                misses += 1
            else:
                cold += 1
            done = r["posted_at_s"] + prefill["elapsed_s"]
            cached_by[r["prefix"]] = min(cached_by.get(r["prefix"], math.inf), done)
    evicted = misses + host_hits if args.hicache_ratio else misses
    return {"pass": hits > 0 and evicted > 0, "hits": hits, "host_hits": host_hits, "evicted_misses": misses,
            "cold_misses": cold}


def every_rank_used_the_host_tier(record, cp_size) -> Dict:
    """Every CP rank backed pages up to host memory and loaded pages back during the load."""
    # NOTE: a phase's record comes back from its JSON file: rank keys are strings there
    pages = {int(rank): v for rank, v in (record.get("hicache_pages") or {}).items()}
    short = [r for r in range(cp_size)
             if not (pages.get(r, {}).get("backed_up", 0) > 0 and pages.get(r, {}).get("loaded_back", 0) > 0)]
    return {"pass": bool(pages) and not short, "pages_by_rank": pages, "ranks_short": short}


def no_leaked_page(record, sides: Dict[str, int]) -> Dict:
    """The idle audits after the load: every rank of every side present, no page out of
    place, each rank's own pages free or cached, the prefill's ranks agreeing; and no leak
    line of SGLang's own idle check in the logs."""
    audit = record.get("idle_audit") or {}
    problems = list(audit.get("missing", ["no idle audit taken"] if not audit else []))
    figures = {}
    for side, count in sides.items():
        # NOTE: a phase's record comes back from its JSON file: rank keys are strings there
        per_rank = {str(k): v for k, v in ((audit.get("audits") or {}).get(side) or {}).items()}
        figures[side] = {}
        for rank in range(count):
            rec = per_rank.get(str(rank))
            if not isinstance(rec, dict):
                continue
            keep = ("total_tokens", "available_tokens", "evictable_tokens", "protected_tokens", "pages", "free_pages",
                    "cached_pages", "leaked_pages", "double_listed_pages", "rank_pages", "rank_free_pages",
                    "rank_cached_pages", "rank_leaked_pages", "sglang_leak", "leak_audits", "audits",
                    "req_slots_free", "req_slots_total")
            figures[side][rank] = {k: rec.get(k) for k in keep}
            try:
                bad = leak_found(rec) or rec["rank_leaked_pages"] or rec["leak_audits"] or (
                    rec["rank_free_pages"] + rec["rank_cached_pages"] != rec["rank_pages"])
            except KeyError as exc:
                bad = f"field {exc} missing"
            if bad:
                problems.append(f"{side} rank {rank}: {figures[side][rank]}")
        if side == "prefill" and len(figures[side]) > 1:
            views = {(r["available_tokens"], r["evictable_tokens"], r["free_pages"], r["cached_pages"])
                     for r in figures[side].values()}
            if len(views) > 1:
                problems.append(f"prefill ranks disagree on the logical pool: {sorted(views)}")
    lines = record.get("leak_lines", {})
    for side in ("prefill", "decode"):
        if side in sides and (lines.get(side) or {}).get("count"):
            problems.append(f"{side} log: {lines[side]['count']} leak line(s), first: {lines[side]['first']}")
    return {"pass": not problems, "audits": figures, "waited_s": audit.get("waited_s"),
            "sglang_leak_lines": {s: (lines.get(s) or {}).get("count") for s in sides}, "problems": problems[:20]}


def servers_alive(record, stages=("alive_after_load", "alive_after_one_at_a_time"), sides=("prefill", "decode")):
    figures = {stage: record.get(stage) for stage in stages}
    return {"pass": all(figures[s] is not None and all(figures[s][side]["alive"] for side in sides) for s in stages),
            **figures}


def first_difference(a, b) -> Optional[int]:
    """The first output position whose token or logprob differs (0: the prefill's token)."""
    for i, pair in enumerate(zip(zip(a.get("ids") or [], a.get("logprobs") or []),
                                 zip(b.get("ids") or [], b.get("logprobs") or []))):
        if pair[0] != pair[1]:
            return i
    return None if len(a.get("ids") or []) == len(b.get("ids") or []) else min(len(a["ids"]), len(b["ids"]))


def one_at_a_time_equals_load(record) -> Dict:
    under_load = {r["index"]: r["decode"] for r in record["load"]["requests"]}
    compared, differing = 0, []
    for entry in record.get("one_at_a_time", []):
        compared += 1
        then = under_load[entry["index"]]
        if not same_answer(entry["decode"], then):
            differing.append({"index": entry["index"], "kind": entry["kind"], "tokens": entry["tokens"],
                              "status": entry["decode"]["status"], "first_difference": first_difference(
                                  entry["decode"], then), "max_logprob_gap": max_logprob_gap(entry["decode"], then)})
    return {"pass": compared > 0 and not differing, "compared": compared, "equal": compared - len(differing),
            "differing": differing}


def every_rank_sent(record, cp_size) -> Dict:
    sent = record.get("pages_sent", {})
    ok = sorted(int(r) for r in sent) == list(range(cp_size)) and all(
        v.get("kv", 0) > 0 and v.get("state", 0) > 0 for v in sent.values())
    return {"pass": ok, "pages_sent": sent}


def flag_equals_stock_one_at_a_time(on, off, args) -> Dict:
    """Prompts stock serves (one rank's pool), answered one at a time by both pairs."""
    stock_limit = args.pool - 2 * 64
    off_answers = {e["index"]: e["decode"] for e in off.get("one_at_a_time", [])}
    pairs = [(e, off_answers[e["index"]]) for e in on.get("one_at_a_time", [])
             if e["index"] in off_answers and e["tokens"] <= stock_limit]
    differing = [{"index": e["index"], "tokens": e["tokens"], "first_difference": first_difference(e["decode"], o),
                  "max_logprob_gap": max_logprob_gap(e["decode"], o)} for e, o in pairs if not same_answer(e["decode"], o)]
    return {"pass": bool(pairs) and not differing, "compared": len(pairs), "differing": differing,
            "stock_limit_tokens": stock_limit}


def stock_answers_against_the_flags(off, on) -> Dict:
    """Recorded: stock's answers under load against the flag's, request by request (same
    plan); where stock answered a prompt over one rank's pool its prefill refused, decode
    answered from KV that never arrived (docs/troubleshooting.md)."""
    flag = {r["index"]: r["decode"] for r in on["load"]["requests"]}
    equal, differing = 0, []
    for r in off["load"]["requests"]:
        theirs = flag.get(r["index"])
        if r["decode"]["status"] != "ok" or theirs is None or theirs["status"] != "ok":
            continue
        if same_answer(r["decode"], theirs):
            equal += 1
        else:
            differing.append({"index": r["index"], "kind": r["kind"], "tokens": r["tokens"],
                              "first_difference": first_difference(r["decode"], theirs)})
    return {"pass": not differing, "both_answered": equal + len(differing), "equal": equal,
            "differing": differing[:30], "differing_over_one_rank_pool": sum(
                1 for d in differing if d["tokens"] > off["prefill_pool"] - 2 * 64)}


def killed_mid_load(record) -> Dict:
    kill, load = record.get("kill") or {}, record["load"]
    at = kill.get("at_unix", math.inf) - load["t_start_unix"]
    in_flight = [r["index"] for r in load["requests"]
                 if r["posted_at_s"] <= at < r["posted_at_s"] + r["decode"].get("elapsed_s", 0)]
    after = [r["index"] for r in load["requests"] if r["posted_at_s"] > at]
    return {"pass": "pid" in kill and 0 < kill.get("requests_ended", 0) < len(load["requests"]) and bool(in_flight),
            "kill": {k: v for k, v in kill.items() if k != "scheduler_pids"}, "at_s": round(at, 3) if kill else None,
            "in_flight": len(in_flight), "posted_after": len(after)}


def no_answer_from_missing_kv(fault, on) -> Dict:
    """Every fresh or long prompt decode answered in the fault phase equals the on phase's
    answer of the same request (one at a time where asked, else under load)."""
    if on is None:
        return {"pass": False, "problems": ["no on phase to compare with: run it (same seed and sizes)"]}
    reference = {r["index"]: r["decode"] for r in on["load"]["requests"]}
    reference.update({e["index"]: e["decode"] for e in on.get("one_at_a_time", [])})
    compared, problems, unverified = 0, [], 0
    for r in fault["load"]["requests"]:
        if r["decode"]["status"] != "ok":
            continue
        ref = reference.get(r["index"])
        if r["kind"] not in FRESH or ref is None or ref["status"] != "ok":
            unverified += 1
            continue
        compared += 1
        if not same_answer(r["decode"], ref):
            problems.append({"index": r["index"], "kind": r["kind"], "tokens": r["tokens"],
                             "first_difference": first_difference(r["decode"], ref),
                             "max_logprob_gap": max_logprob_gap(r["decode"], ref)})
    return {"pass": not problems, "compared": compared, "answered_not_compared": unverified, "problems": problems[:20]}


def phase_checks(name, record, args, phases) -> Dict[str, Dict]:
    ended = {f"{name}: every request ended within the bound": ended_within_bound(record)}
    if name == "fault":
        return {"fault: a prefill CP rank killed mid-load": killed_mid_load(record), **ended,
                "fault: no answer from missing KV": no_answer_from_missing_kv(record, phases.get("on")),
                "fault: no page leaked on decode": no_leaked_page(record, {"decode": 1}),
                "fault: decode alive after": servers_alive(record, ("alive_after_load",), ("decode",))}
    checks = {
        f"{name}: load": load_composition(record, args), **ended,
        f"{name}: every request it can hold was answered": answered_what_it_holds(record),
        f"{name}: decode refused at once what it can never hold": refused_what_decode_cannot_hold(record),
        f"{name}: aborted requests failed naming the abort or were answered right": aborts_end_right(record),
        f"{name}: the radix cache hit and evicted": radix_hits_and_evictions(record, args),
        f"{name}: both servers alive after": servers_alive(record),
        f"{name}: fresh prompts one at a time = under load, bit for bit": one_at_a_time_equals_load(record),
    }
    if record["flag_on"]:
        checks[f"{name}: no page leaked on any prefill rank or on decode"] = no_leaked_page(
            record, {"prefill": args.cp_size, "decode": 1})
        checks[f"{name}: every CP rank sent KV and index pages"] = every_rank_sent(record, args.cp_size)
        if args.hicache_ratio:
            checks[f"{name}: every CP rank backed pages up to host memory and loaded pages back"] = (
                every_rank_used_the_host_tier(record, args.cp_size))
    else:  # stock: no audit (the flag's); SGLang's own check's lines, recorded
        checks[f"{name}: SGLang's idle check logged no leak"] = {
            "pass": not any((record.get("leak_lines", {}).get(s) or {}).get("count") for s in ("prefill", "decode")),
            "leak_lines": record.get("leak_lines")}
    return checks


def verdict(phases: Dict[str, Dict], args):
    """(judged checks, the stock phase's checks): every check with its figures."""
    judged, stock = {}, {}
    for name, record in phases.items():
        checks = phase_checks(name, record, args, phases)
        harness = {f"stable_topk:{name}": {"pass": not record.get("stable_topk_problems", ["not recorded"]),
                                           "problems": record.get("stable_topk_problems")}} if not args.stock_topk else {}
        if args.share_gpu:
            harness[f"share_gpu:{name}"] = {"pass": not record.get("share_gpu_problems", ["not recorded"]),
                                            "problems": record.get("share_gpu_problems")}
        judged.update(harness)
        (judged if PHASES[name].flag_on else stock).update(checks)
    if "on" in phases and "off" in phases:
        judged["on one at a time = off one at a time (prompts stock serves)"] = flag_equals_stock_one_at_a_time(
            phases["on"], phases["off"], args)
        stock["off: answers under load = on's"] = stock_answers_against_the_flags(phases["off"], phases["on"])
    return judged, stock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="soak_pd.json")
    ap.add_argument("--workdir", default="soak-work")
    ap.add_argument("--logdir", default=None, help="server logs (default: --workdir)")
    release = installed.INSTALLED or installed.RECOMMENDED
    # NOTE: the flag needs prefill CP, within one node; a release that does not serve every size says which
    cp_sizes = release.served_cp_sizes or tuple(range(2, 9))
    ap.add_argument("--cp-size", type=int, default=4, help=f"prefill CP size ({', '.join(map(str, cp_sizes))})")
    ap.add_argument("--phases", default="on,off", help=f"phases to run now, of {','.join(PHASES)}")
    ap.add_argument("--kv-cache-dtype", choices=("bfloat16", "fp8_e4m3"), default="bfloat16")
    ap.add_argument("--stock-topk", action="store_true", help="keep SGLang's top-k kernels (no exact verdict)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank of both servers on GPU 0 (correctness only: sglang_cp_shared_kv_testing/shared_gpu.py)")
    ap.add_argument("--parallel", type=int, default=1, help="phases whose server pairs go at once (default 1)")
    ap.add_argument("--port", type=int, default=23000, help="the first phase's prefill port (below the ephemeral range)")
    ap.add_argument("--boot-timeout", type=int, default=480)
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--requests", type=int, default=MIN_REQUESTS)
    ap.add_argument("--clients", type=int, default=MIN_CLIENTS)
    ap.add_argument("--pool", type=int, default=POOL, help="the prefill's --max-total-tokens per rank")
    ap.add_argument("--sequential", type=int, default=12, help="fresh prompts answered again one at a time")
    ap.add_argument("--load-deadline", type=float, default=300, help="no request is posted after this (s)")
    ap.add_argument("--bound", type=float, default=BOUND_S, help="every request must end within this (s)")
    ap.add_argument("--abort-window", type=float, default=3.0, help="aborts land up to this long after posting (s)")
    ap.add_argument("--fault-requests", type=int, default=48, help="the fault phase posts the plan's first ones")
    ap.add_argument("--kill-after", type=int, default=None, help="requests ended before the kill (default: a third)")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--idle-wait", type=float, default=None,
                    help=f"how long to wait for every scheduler's idle audit after the load (default {IDLE_WAIT_S} s)")
    ap.add_argument("--decode-max-running-requests", type=int, default=None,
                    help="decode's --max-running-requests (default SGLang's)")
    ap.add_argument("--hicache-ratio", type=float, default=None,
                    help="the prefill with HiCache's host tier, R x a rank's device pool (PD with host hits)")
    args = ap.parse_args()
    if args.cp_size not in cp_sizes:
        ap.error(f"--cp-size {args.cp_size}: choose one of {cp_sizes} (sglang {release.version}"
                 + (": releases' served_cp_sizes)" if release.served_cp_sizes else ": prefill CP on one node)"))
    selected = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(selected) - set(PHASES))
    if unknown:
        ap.error(f"phases {unknown}: choose from {list(PHASES)}")
    if args.hicache_ratio is not None and args.hicache_ratio <= 1:  # NOTE: SGLang refuses a host pool <= the device's
        ap.error(f"--hicache-ratio {args.hicache_ratio}: more than 1 (the host tier holds more than the device pool)")
    if not 0 <= args.kill_rank < args.cp_size:
        ap.error(f"--kill-rank {args.kill_rank}: a CP rank of {args.cp_size}")
    args.kill_after = args.kill_after if args.kill_after is not None else max(1, args.fault_requests // 3)
    args.tag = (f"cp{args.cp_size}.{args.kv_cache_dtype}.seed{args.seed}.n{args.requests}.pool{args.pool}"
                + (".stock-topk" if args.stock_topk else "") + (".share-gpu" if args.share_gpu else "")
                + (f".hicache{args.hicache_ratio:g}" if args.hicache_ratio else "")
                # NOTE: decode's batch bound changes what "alone vs under load" can hold: its own records
                + (f".decode-max{args.decode_max_running_requests}" if args.decode_max_running_requests else "")
                # NOTE: a work folder shared with the other release's phases never mixes them
                + (f".{pd_servers.INTERLEAVE}" if pd_servers.CP_STRATEGY == pd_servers.INTERLEAVE else ""))
    work = Path(args.workdir)
    args.logdir = Path(args.logdir) if args.logdir else work
    args.logdir.mkdir(parents=True, exist_ok=True)
    args.model = write_model(work / "tiny-dsv32-32k", MODEL)
    phases, failed = accumulate_runs(work, args.tag, selected, list(PHASES),
                                     lambda name: run_phase(name, args, work), "soak", parallel=args.parallel)
    judged, stock = verdict(phases, args)
    report = {"cp_size": args.cp_size, "kv_cache_dtype": args.kv_cache_dtype, "seed": args.seed,
              "requests": args.requests, "clients": args.clients, "prefill_pool_per_rank": args.pool,
              "decode_pool": decode_pool_for(args.cp_size, args.pool), "chunk": CHUNK,
              "stable_topk": not args.stock_topk, "share_gpu": args.share_gpu, "hicache_ratio": args.hicache_ratio,
              "decode_max_running_requests": args.decode_max_running_requests,
              "phases": sorted(phases),
              "failed_phases": failed, "checks": judged, "stock": stock,
              "plan": plan_summary(plan_load(args.seed, args.requests, shape_of(args))),
              "boot_s": {name: r.get("boot_s") for name, r in phases.items()},
              "load_wall_s": {name: r["load"]["wall_s"] for name, r in phases.items()},
              "commands": {name: r.get("commands") for name, r in phases.items()}}
    if args.share_gpu:
        report["note"] = ("every rank of both servers shared one GPU (--share-gpu): a correctness run; its times "
                          "(latencies, boot_s) say nothing about a deployment")
    report["pass"] = ({"on", "off"} <= set(phases) and not failed and bool(judged)
                      and all(c["pass"] for c in judged.values()))
    return write_report(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
