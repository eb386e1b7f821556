"""Run the selfcheck: start the processes, show progress, collect, decide.

N rank processes and one decode process start from a forkserver that has imported SGLang
once (so N = 8 still starts in seconds on a small machine); with ``--device cuda`` they are
spawned instead (a process forked after CUDA was initialised cannot use it). Progress comes back on a queue:
one bar per phase (ranks ready, prefill forwards, shards sent, decode received). The run
has one deadline; a process that dies or outlives it fails the run instead of hanging it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.selfcheck import ranks as processes
from sglang_cp_shared_kv.selfcheck.options import SelfcheckOptions
from sglang_cp_shared_kv.selfcheck.report import build_report
from sglang_cp_shared_kv_testing.pd_rig import BASE_ENV
from sglang_cp_shared_kv_testing.support import free_port, supervise

#: after one process failed, the others get this long to report before they are stopped
#: (a rank waiting on a collective its failed peer never issues would wait forever)
FAILURE_GRACE_S = 15

#: imported once by the forkserver, so every process starts warm (and the installed release's
#: attention backend, its largest import: ``Release.attention_backend_module``)
PRELOAD = ["sglang.srt.disaggregation.mooncake.conn", "sglang.srt.mem_cache.memory_pool",
           "sglang_cp_shared_kv_testing.cp_rig", "sglang_cp_shared_kv_testing.pd.prefill",
           "sglang_cp_shared_kv_testing.pd.decode"]


class _Progress:
    """One bar per phase with ``rich`` when stderr is a terminal, else one line per phase."""

    def __init__(self, options: SelfcheckOptions, quiet: bool):
        n = options.cp_size
        forwards = n * (options.chunks + (1 if options.prefix_len else 0))
        self.totals = {"ready": n + 1, "forward": forwards, "sent": n, "received": 1}
        self.labels = {"ready": "processes ready", "forward": "prefill forwards (all ranks)",
                       "sent": "shards sent", "received": "decode received and compared"}
        self.done = dict.fromkeys(self.totals, 0)
        self.rich = None
        if not quiet and sys.stderr.isatty():
            try:
                from rich.progress import Progress

                self.rich = Progress(transient=False)
                self.tasks = {k: self.rich.add_task(self.labels[k], total=t) for k, t in self.totals.items()}
                self.rich.start()
            except ImportError:
                self.rich = None
        self.quiet = quiet

    def update(self, phase: str) -> None:
        if phase not in self.done:
            return
        self.done[phase] += 1
        if self.rich is not None:
            self.rich.update(self.tasks[phase], completed=self.done[phase])
        elif not self.quiet and self.done[phase] == self.totals[phase]:
            print(f"selfcheck: {self.labels[phase]}: {self.done[phase]}/{self.totals[phase]}", file=sys.stderr,
                  flush=True)

    def stop(self) -> None:
        if self.rich is not None:
            self.rich.stop()


def run_selfcheck(options: SelfcheckOptions, *, quiet: bool = False, workdir: Optional[Path] = None) -> Dict[str, Any]:
    """Run every phase and return the report (``report["verdict"]`` is PASS or FAIL)."""
    started = time.monotonic()
    os.environ.update(BASE_ENV)  # what a PD deployment with the flag sets (the processes inherit it)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cp-shared-kv-selfcheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if options.device == "cuda":
        # NOTE: importing SGLang on a GPU machine initialises CUDA, and a process forked from
        # one that did cannot use CUDA: with GPUs every process starts fresh (a few s each)
        ctx = multiprocessing.get_context("spawn")
    else:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD + [installed.INSTALLED.attention_backend_module])
    events = ctx.Queue()
    port, bootstrap_port = free_port(), free_port()
    procs = [ctx.Process(target=processes.rank_main, args=(r, options, str(workdir), port, bootstrap_port, events),
                         daemon=True) for r in range(options.cp_size)]
    procs.append(ctx.Process(target=processes.decode_main, args=(options, str(workdir), bootstrap_port, events),
                             daemon=True))
    progress = _Progress(options, quiet)
    try:
        for proc in procs:
            proc.start()
        problem = supervise(procs, timeout_s=options.timeout_s, grace_s=FAILURE_GRACE_S,
                            on_tick=lambda: _drain(events, progress), what="process")
    finally:
        progress.stop()
    results = [_load(workdir / f"rank{r}.json") for r in range(options.cp_size)]
    return build_report(options, results, _load(workdir / "decode.json"), time.monotonic() - started, problem,
                        str(workdir))


def _drain(events, progress: _Progress) -> None:
    while True:
        try:
            phase, _ = events.get_nowait()
        except Exception:  # queue.Empty
            return
        progress.update(phase)


def _load(path: Path) -> Optional[Dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else None
