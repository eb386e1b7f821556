"""Real SGLang servers for the end-to-end scripts (``scripts/e2e_cp_logprobs.py``,
``scripts/bench_e2e_ttft.py``): a small model directory, one server process per call
(its own process group, its log in a file), a health wait with a deadline, JSON over HTTP,
and a stop that always ends the process group.

The servers run with ``scripts/e2e`` on ``PYTHONPATH`` and ``CPSKV_E2E=1``
(:func:`e2e_env`), whose ``sitecustomize`` makes SGLang's dummy weights non-degenerate, so
logits depend on the KV the kernels read.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from sglang_cp_shared_kv_testing.shared_gpu import SHARED_GPU_LINE

#: 0.5.23's prefill CP strategy, as its command line names it
INTERLEAVE = "interleave"
#: 0.5.23 (interleave): what turns off the short-prompt dense MHA path (0.5.12.post1's
#: SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD, renamed with NSA -> DSA). NOTE: under prefill
#: CP SGLang never takes it (``set_dsa_prefill_impl``: ``not is_dsa_enable_prefill_cp()``); it
#: matters without CP (--tp 1), where that path would call FlashAttention 3, which the GPU
#: bundle lacks. Set explicitly in every run (else SGLang sets it to index_topk and says so).
DSA_DENSE_THRESHOLD_ENV = "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"

ROOT = Path(__file__).resolve().parents[2]
E2E_SITE = ROOT / "scripts" / "e2e"

#: A tiny random DeepSeek-V3.2 (2 dense layers, index_topk 2048) that SGLang 0.5.12.post1
#: serves on one or two H200s (bf16 and fp8 KV); ``--load-format dummy`` gives its weights.
TINY_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "num_hidden_layers": 2,
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256, "first_k_dense_replace": 2,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 2048, "vocab_size": 8192, "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    # read by the in-seq-split (deepep) layer construction even though every layer is dense
    "moe_layer_freq": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


def write_model(directory: Path, config: Dict) -> Path:
    """A model directory holding only ``config.json`` (weights: ``--load-format dummy``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # NOTE: written beside and renamed: scripts running at once (gpu_session.sh's SOAK sets)
    # share a work folder, and a server of one must never read the other's half-written file
    staged = directory / f".config.json.{os.getpid()}"
    staged.write_text(json.dumps(config))
    os.replace(staged, directory / "config.json")
    return directory


def e2e_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment with the e2e ``sitecustomize`` switched on, plus ``extra``."""
    env = dict(os.environ, CPSKV_E2E="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(E2E_SITE), os.environ.get("PYTHONPATH", "")] if p))
    env.update(extra or {})
    return env


def post(port: int, path: str, body=None, timeout: float = 600):
    """POST (GET without ``body``) to 127.0.0.1:``port``; the JSON answer (plain text as is)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read()
    try:
        return json.loads(text or b"null")
    except ValueError:  # /flush_cache answers in plain text
        return text.decode(errors="replace")


def flush_cache(port: int, within_s: float = 30.0) -> None:
    """``/flush_cache``, asked again until the server takes it (within ``within_s``).

    NOTE: SGLang refuses a flush while any request is pending (HTTP 400, "Cache not flushed
    because there are pending requests"), and a request counts as pending for a moment after
    its answer came back (seen on a CP4 server: #queue-req 0, #running-req 0, refused)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            post(port, "/flush_cache")
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


#: the plugin's count of prefill forwards by how their chunk reached the shards
WRITE_PATHS_METRIC = "sglang:cp_shared_kv_prefill_forwards_total"


def prometheus_samples(port: int, name: str) -> Dict[str, float]:
    """The samples of metric ``name`` on the server's ``/metrics`` (a server started with
    ``--enable-metrics``): ``{'{label="value",...}': value}``; empty when it has none."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as resp:
        text = resp.read().decode(errors="replace")
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            samples[labels] = samples.get(labels, 0.0) + float(value)  # one line per process of a server
    return samples


def prometheus_labels(labels: str) -> Dict[str, str]:
    """``'{cp_rank="0",kind="kv"}'`` (a key of :func:`prometheus_samples`) as a dict."""
    return {key: value.strip('"') for key, value in (part.split("=", 1) for part in labels.strip("{}").split(","))}


def samples_by_rank(samples: Dict[str, float], field_label: str) -> Dict[int, Dict[str, int]]:
    """``{cp rank: {value of field_label: count}}`` of a per-CP-rank counter's samples (a result
    of :func:`prometheus_samples`), e.g. ``field_label="direction"`` of the HiCache pages."""
    ranks: Dict[int, Dict[str, int]] = {}
    for labels, value in samples.items():
        fields = prometheus_labels(labels)
        ranks.setdefault(int(fields["cp_rank"]), {})[fields[field_label]] = int(value)
    return dict(sorted(ranks.items()))


def start_server(name: str, cmd: List[str], env: Dict[str, str], port: int, log_path: Path,
                 boot_timeout: float) -> subprocess.Popen:
    """Start ``cmd`` (logging to ``log_path``) and wait until ``/health`` on ``port``
    answers; raise, with the log's name, when it exits or is not healthy in time."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()  # the child holds its own descriptor
    deadline = time.monotonic() + boot_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop(proc)  # the launcher is gone; its scheduler processes may not be
            raise RuntimeError(f"{name}: server exited with {proc.returncode}; see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{name}: server not healthy within {boot_timeout}s; see {log_path}")


#: SGLang's line for each KV pool it allocates, "KV Cache is allocated. #tokens: N, ..." in
#: 0.5.12.post1 and "KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, ..." in 0.5.23
#: (``MLATokenToKVPool._finalize_allocation_log``); the group is N
POOL_LINE = r"KV Cache is allocated\.(?: dtype: [^,]*,)? #tokens: (\d+)"
#: SGLang's line for each prefill batch it runs (0.5.23, ``metrics_reporter.report_prefill_stats``:
#: "Prefill batch, #new-seq: 4, #new-token: 1051, #cached-token: 2048, ..."): requests, tokens
#: computed, tokens found in the radix cache
PREFILL_BATCH_LINE = r"Prefill batch\b[^#\n]*#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)"


def prefill_batches(log_text: str) -> List[Tuple[int, int, int]]:
    """Every prefill batch a server log reports, in order: (requests, new tokens, cached
    tokens). NOTE: each process that logs scheduler stats writes its own line (with attention
    CP every rank may), so a batch can appear more than once."""
    return [(int(a), int(b), int(c)) for a, b, c in re.findall(PREFILL_BATCH_LINE, log_text)]


def startup_figures(log_text: str) -> Dict:
    """What a server log says: the KV pool sizes SGLang allocated, the shared-KV split
    (physical per rank, logical), and how many processes took each e2e switch of
    ``scripts/e2e/sitecustomize.py``."""
    physical = re.findall(POOL_LINE, log_text)
    shared = re.findall(r"physical_tokens_per_rank=(\d+) logical_tokens=(\d+)", log_text)
    return {"pool_tokens": sorted({int(x) for x in physical}),
            "shared": sorted({(int(a), int(b)) for a, b in shared}),
            "stable_topk_processes": log_text.count("[cpskv-e2e] deterministic NSA top-k"),
            "corrupting_processes": log_text.count(CORRUPTING_SENDS_LINE),
            "corrupting_load_processes": log_text.count(CORRUPTING_LOADS_LINE),
            "shared_gpu_processes": log_text.count(SHARED_GPU_LINE),
            "stalled_write_processes": log_text.count(STALLED_WRITE_LINE),
            # a switch whose target the installed SGLang lacks (sitecustomize imports on without it)
            "not_patched": sorted(set(re.findall(re.escape(NOT_PATCHED_LINE) + r" ([\w.]+)", log_text)))}


#: what ``scripts/e2e/sitecustomize.py`` prints in each process whose sends it corrupts
CORRUPTING_SENDS_LINE = "sends a page twice"
#: ... in each process whose HiCache load-backs it corrupts
CORRUPTING_LOADS_LINE = "zeroes the first page of each HiCache load-back"
#: ... and in each process whose first Mooncake write it holds
STALLED_WRITE_LINE = "holds its first write"
#: ... and for each module it was to patch and could not, naming it
NOT_PATCHED_LINE = "[cpskv-e2e] NOT patched:"


def stable_topk_problem(figures: Dict, name: str, log_path: Path, min_processes: int) -> Optional[str]:
    """Why a run started with the deterministic top-k cannot be compared exactly: fewer than
    ``min_processes`` of its server processes (one per TP rank at least) reported taking it
    (its :func:`startup_figures`); None when enough did."""
    seen = figures["stable_topk_processes"]
    if figures.get("not_patched"):  # e.g. one top-k entry point replaced, another left stock
        return (f"{name}: started with the e2e switches, but some found nothing to patch: "
                f"{', '.join(figures['not_patched'])}; see {log_path}")
    if seen >= min_processes:
        return None
    return (f"{name}: started with the deterministic top-k, but {seen} server process(es) reported it, "
            f"fewer than its {min_processes} TP rank(s) (scripts/e2e on PYTHONPATH?); see {log_path}")


def accumulate_runs(work: Path, tag: str, selected, known, run_one: Callable[[str], Dict],
                    label: str, parallel: int = 1) -> Tuple[Dict[str, Dict], Dict[str, str]]:
    """Run each of ``selected`` (``run_one(name)`` -> its record, kept as
    ``work/<name>.<tag>.json``), then read back every run of ``known`` present there (this
    call's and earlier calls'): ``(runs, failed)``. A run that raises is reported in
    ``failed`` and the next one still starts; an earlier call's record of it is dropped.

    ``parallel``: how many runs go at once (threads; ``run_one`` must give each run its own
    ports). NOTE: only where the runs' servers fit the machine together, e.g. ``--share-gpu``
    runs on one large GPU; a run's record does not depend on what ran beside it."""
    failed = {}

    def run_and_keep(name):
        path = work / f"{name}.{tag}.json"
        try:
            run = run_one(name)
        except Exception as exc:  # noqa: BLE001 -- reported; the other runs still go
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"[{label}] {name} FAILED: {failed[name]}", flush=True)
            path.unlink(missing_ok=True)  # no stale run of an earlier call
            return
        path.write_text(json.dumps(run))

    if parallel <= 1:
        for name in selected:
            run_and_keep(name)
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(run_and_keep, selected))
    runs = {name: json.loads((work / f"{name}.{tag}.json").read_text())
            for name in known if (work / f"{name}.{tag}.json").exists()}
    return runs, {name: failed[name] for name in selected if name in failed}


def write_report(report: Dict, out) -> int:
    """The report as JSON to ``out`` and stdout; the exit status its ``pass`` gives."""
    text = json.dumps(report, indent=1)
    Path(out).write_text(text)
    print(text)
    return 0 if report["pass"] else 1


def live_group_members(group: int) -> List[int]:
    """Processes of process group ``group`` that still run (zombies left out: they hold no
    memory, and a container's PID 1 may never reap them)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """End the server's whole process group and wait until every process of it is gone
    (SIGTERM, then SIGKILL after ``grace_s``).

    NOTE: waiting for the launcher alone is not enough: a scheduler process still holding
    its GPU memory makes the next server's TP memory check ("The memory capacity is
    unbalanced") or its memory fraction fail."""
    group = proc.pid  # start_new_session: the launcher leads its group
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:  # every process of the group is gone, reaped too
            proc.poll()
            return
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher
            if not live_group_members(group):
                return
            time.sleep(0.5)
        deadline = time.monotonic() + 30
    proc.poll()
    print(f"[server] WARNING: processes of group {group} outlived SIGKILL; the next server may lack GPU memory",
          flush=True)


__all__ = ["ROOT", "E2E_SITE", "TINY_DSV32", "write_model", "e2e_env", "post", "flush_cache", "prometheus_samples",
           "prometheus_labels", "samples_by_rank", "start_server", "stop", "startup_figures", "stable_topk_problem",
           "POOL_LINE", "PREFILL_BATCH_LINE", "prefill_batches",
           "CORRUPTING_SENDS_LINE", "STALLED_WRITE_LINE", "accumulate_runs", "write_report"]
