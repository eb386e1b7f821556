"""SGLang's real Mooncake PD classes on one CPU machine, loopback only: the launcher.

One *plan* (JSON) describes prefill instances (CP size N, shared or replicated KV),
the processes that host their ranks, one decode, and a list of requests ("rooms") run
one after another. Every process runs this module
(``python -m sglang_cp_shared_kv_testing.pd_rig --plan plan.json --proc NAME``):

* a prefill process hosts rank r of each instance that lists it (its pool, SGLang's
  ``MooncakeKVManager`` in PREFILL mode, and for rank 0 the instance's
  ``MooncakeKVBootstrapServer``), fills its pool with each room's content, and sends the
  room as SGLang's prefill scheduler does: ``MooncakeKVSender`` + the real
  ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` per chunk;
* the decode process holds a stock ``NSATokenToKVPool``, preallocates each room's pages as
  ``DecodePreallocQueue`` does (decode prefix first), sends the metadata with
  ``MooncakeKVReceiver``, polls to Success/Failed and checks every byte it received.

Nothing of SGLang is replaced except what has no CPU equivalent: the attention
parallel state (each process reports its own CP rank) and the scheduler/request objects
around ``send_kv_chunk`` (stand-ins with the attributes it reads). Only the plugin's
transfer hooks are applied (the forward-path hook targets import the attention stack, ~4 s
per process, and this harness does not run a forward).

This module owns starting the processes and collecting their JSON results
(:func:`run_plan`, which the tests and ``scripts/bench_pd_transfer.py`` use;
:func:`log_tails`) and re-exports what a plan is written with (:class:`Geometry`,
:data:`TEST_GEOMETRY`, :func:`model_geometry`, :func:`free_port`). The processes
themselves are :mod:`sglang_cp_shared_kv_testing.pd` (imports point one way: this module
-> ``pd.process`` -> ``pd.prefill`` / ``pd.decode`` -> ``pd.sglang_side`` ->
``pd.geometry``). Every wait has a deadline; processes that outlive the plan's deadline
are killed by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

from sglang_cp_shared_kv_testing.pd.geometry import TEST_GEOMETRY, Geometry, model_geometry  # noqa: F401
from sglang_cp_shared_kv_testing.pd.process import main
from sglang_cp_shared_kv_testing.support import free_port  # noqa: F401 (plans take their ports from rig.free_port)

#: Every process of a plan runs ``python -m RIG_MODULE``.
RIG_MODULE = "sglang_cp_shared_kv_testing.pd_rig"

BASE_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "PYTHONUNBUFFERED": "1",
}


def run_plan(plan: Dict[str, Any], workdir: Path, deadline_s: float = 300.0) -> Dict[str, Any]:
    """Run every process of ``plan``; return ``{"results": {proc: json}, "returncodes",
    "logs", "wall_s"}``. Processes that outlive the deadline are killed (by pid)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    plan = dict(plan, workdir=str(workdir))
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    finished = workdir / "finished"
    finished.unlink(missing_ok=True)
    env_base = dict(os.environ, **BASE_ENV)
    # The children import what this process imports (the package is installed editable in
    # .venv; elsewhere python/ may only be on this process's path).
    env_base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    procs: Dict[str, subprocess.Popen] = {}
    logs: Dict[str, Path] = {}
    start = time.monotonic()
    try:
        for name, spec in plan["processes"].items():
            env = dict(env_base, **spec.get("env", {}))
            logs[name] = workdir / f"{name}.log"
            with open(logs[name], "wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", RIG_MODULE, "--plan", str(plan_path), "--proc", name],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(workdir), start_new_session=True)
        decode = procs[plan["decode"]["proc"]]
        try:
            decode.wait(timeout=max(1.0, deadline_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            pass
        finished.write_text("done")
        for proc in procs.values():
            try:
                proc.wait(timeout=max(1.0, min(30.0, deadline_s + 30 - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    results = {}
    for name in procs:
        path = workdir / f"results-{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    return {"results": results, "returncodes": {n: p.returncode for n, p in procs.items()},
            "logs": {n: str(p) for n, p in logs.items()}, "wall_s": time.monotonic() - start}


def log_tails(run: Dict[str, Any], chars: int = 3000) -> str:
    """The last ``chars`` of every process's log in ``run`` (for assertion messages)."""
    out = []
    for name, path in run["logs"].items():
        text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
        out.append(f"----- {name} (rc={run['returncodes'].get(name)}) -----\n{text[-chars:]}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
