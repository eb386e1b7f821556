"""How long each stage of the plugin's work takes inside a running server.

On with the NVTX switch (``SGLANG_CP_SHARED_KV_NVTX=1``, read when the pool is built):
every range :func:`sglang_cp_shared_kv.observability.nvtx.marked` opens with the rank's timer is then
also timed here, per rank, per stage name (``batch_state``, ``materialize:<kind>:view``,
``materialize:<kind>:pack``, ``materialize:<kind>:gather``, ``materialize:<kind>:current``
with ``<kind>`` ``index`` or ``mla``, ``materialize:chunk``, ``owner_write``,
``prefetch:issue``, ``prefetch:wait``; :mod:`sglang_cp_shared_kv.observability.nvtx` says what each
covers)::

    stage time = end event - start event, both recorded on the stream the work was issued on

so it is the device time the stage held that stream (for ``prefetch:wait``: how long the
compute stream stalled on the prefetched gather -- the exposed part of it). So for an
asynchronous gather (the prefetch's, on its own communicator and stream) the
``materialize:mla:gather`` interval measures only its launch, not the transfer.
``prefetch:issue`` is a container: the ``materialize:mla:view/pack/gather`` of the
prefetched layer are timed inside it too, so the plugin's exposed time is the sum of the
other (leaf) stages, never with ``prefetch:issue``.

On a CPU pool the two marks are ``time.perf_counter()``. An interval is read once its end
event has completed (``Event.query()``, no host synchronisation), at the start of each
forward; so a forward's stages appear when the next one begins.

Out: :meth:`StageTimer.snapshot` (cumulative calls and milliseconds per stage, forwards
seen); with ``SGLANG_CP_SHARED_KV_TIMING_DIR`` set, each rank rewrites
``<dir>/stage-times-cp<rank>.json`` with it whenever new intervals were read (atomically:
a reader never sees half a file). ``scripts/bench_e2e_ttft.py`` reads those before and after
its requests. SGLang's own forward time is its ``--enable-metrics`` device timer.

One :class:`StageTimer` per CP rank, held by the rank's :class:`..context.CpSharedKVContext`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Deque, Dict, Iterator, Optional, Tuple

logger = logging.getLogger(__name__)

#: Where each rank writes its cumulative stage times (unset: nowhere).
TIMING_DIR_ENV = "SGLANG_CP_SHARED_KV_TIMING_DIR"
#: NOTE: intervals not yet complete are kept up to this many; beyond it the oldest are
#: dropped (and counted), so a stream that never drains cannot grow memory without bound.
MAX_PENDING_INTERVALS = 100_000


class StageTimer:
    """Cumulative device (or CPU) time per named stage of one CP rank."""

    def __init__(self, cp_rank: int, out_dir: Optional[str] = None):
        self.cp_rank = int(cp_rank)
        self.out_path = Path(out_dir) / f"stage-times-cp{self.cp_rank}.json" if out_dir else None
        self.forwards = 0
        self.dropped = 0
        self._cuda = False
        self._calls: Dict[str, int] = collections.defaultdict(int)
        self._total_ms: Dict[str, float] = collections.defaultdict(float)
        #: (stage, start mark, end mark): CUDA events, or perf_counter seconds on CPU
        self._pending: Deque[Tuple[str, object, object]] = collections.deque()

    @classmethod
    def from_env(cls, cp_rank: int) -> "StageTimer":
        return cls(cp_rank, os.environ.get(TIMING_DIR_ENV) or None)

    # ------------------------------------------------------------------ recording
    def begin_forward(self, device) -> None:
        """At the start of each forward on ``device``: read what has completed since (and
        write it: the file's ``forwards`` then counts the forwards before this one)."""
        self._cuda = getattr(device, "type", str(device)) == "cuda"
        if self.collect():
            self.write()
        self.forwards += 1

    @contextmanager
    def span(self, stage: str) -> Iterator[None]:
        """Time the work issued inside the ``with`` block as ``stage``."""
        if self._cuda:
            import torch

            if torch.cuda.is_current_stream_capturing():  # a graph replay has no interval to read
                yield
                return
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._keep(stage, start, end)
        else:
            start = time.perf_counter()
            try:
                yield
            finally:
                self._keep(stage, start, time.perf_counter())

    def _keep(self, stage: str, start, end) -> None:
        if len(self._pending) >= MAX_PENDING_INTERVALS:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((stage, start, end))

    # -------------------------------------------------------------------- reading
    def collect(self) -> int:
        """Add every interval whose end has completed, in order; how many were added."""
        added = 0
        while self._pending:
            stage, start, end = self._pending[0]
            if isinstance(end, float):
                elapsed_ms = (end - start) * 1000.0
            elif end.query():
                elapsed_ms = start.elapsed_time(end)
            else:
                break  # later intervals were recorded after it on the same stream
            self._pending.popleft()
            self._calls[stage] += 1
            self._total_ms[stage] += elapsed_ms
            added += 1
        return added

    def snapshot(self) -> dict:
        return {
            "cp_rank": self.cp_rank,
            "forwards": self.forwards,
            "pending": len(self._pending),
            "dropped": self.dropped,
            "clock": "cuda_events" if self._cuda else "perf_counter",
            "stages": {stage: {"calls": self._calls[stage], "total_ms": round(self._total_ms[stage], 6)}
                       for stage in sorted(self._calls)},
        }

    def write(self) -> None:
        """Rewrite ``out_path`` with :meth:`snapshot` (nothing without a directory)."""
        if self.out_path is None:
            return
        tmp = self.out_path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.out_path)
        except OSError as exc:  # timing is diagnostics: report once, never fail a forward
            logger.warning("CP shared KV: cannot write stage times to %s (%s); not writing them again",
                           self.out_path, exc)
            self.out_path = None


__all__ = ["TIMING_DIR_ENV", "MAX_PENDING_INTERVALS", "StageTimer"]
