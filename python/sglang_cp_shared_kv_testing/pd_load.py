"""A PD load, deterministic from a seed, and the clients that post it
(``scripts/soak_pd.py``).

The plan (:func:`plan_load`) is a list of requests drawn from ``numpy``'s generator seeded
by ``(seed, ...)``: their kinds, lengths, shared prefixes, what their clients do, and the
order they are posted in. Kinds, sized against one prefill rank's pool ``P``, the CP size
``N`` (logical pool ``N x P``) and decode's pool ``D``:

* ``fresh``: random tokens, log-uniform from a few tokens (the split multiple) to ``P``;
* ``prefix``: one of :data:`PREFIXES` shared prefixes (``P / 4 .. P``, whole pages) and a
  random suffix up to ``P / 2`` (less where decode would not hold it): the prefill's radix
  cache hits them, and evicts them when the small pool fills;
* ``long``: random tokens over one rank's pool, up to what decode holds (``D`` minus its
  reserved decode tokens): several times ``P`` from N = 4;
* ``decode_over``: longer than decode's pool, under the logical pool (the prefill takes it;
  decode refuses it at once, stock SGLang as well);
* ``decode_window``: shorter than decode's pool but not with its reserved decode tokens: the
  flag on decode refuses it at once, stock decode keeps it at the head of its queue for good
  (``decode/admission.py``). NOTE: these come last in the order (the last tenth of the
  load), so that a stock pair serves the rest before its decode stops.

Every length is a multiple of :data:`SPLIT_MULTIPLE` (every chunk then splits evenly over
up to 8 CP ranks: ``scripts/e2e_cp_logprobs.py``). Of the fresh, prefix and long requests,
some are aborted on the prefill (``/abort_request`` with the request id, the decode client
waiting for its answer: ``abort``) or walked away from (both clients close their
connections: ``abandon``) a seeded delay after posting, mid-prefill or mid-transfer
depending on where that delay lands.

:func:`run_load` posts the plan from ``clients`` threads, each taking the next request in
plan order when its last one ended (so which client posts which request varies, the order
of posting does not), each request to both servers with one bootstrap room
(:func:`.pd_servers.generate_pd`); a request not started within ``deadline_s`` is not
posted (listed). Every request records both servers' outcomes and times.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

from sglang_cp_shared_kv_testing.pd_servers import NEW_TOKENS, generate_pd
from sglang_cp_shared_kv_testing.server import post

#: every prompt length is a multiple of 2 x 8 tokens: SGLang's in-seq split gives every CP
#: rank as many rows up to CP8 (scripts/e2e_cp_logprobs.py, SPLIT_MULTIPLE)
SPLIT_MULTIPLE = 16
PAGE = 64
KINDS = ("fresh", "prefix", "long", "decode_over", "decode_window")
#: the share of each kind but decode_window (placed in the load's last tenth)
KIND_WEIGHTS = {"fresh": 0.37, "prefix": 0.45, "long": 0.12, "decode_over": 0.03}
DECODE_WINDOW_SHARE = 0.01
#: of the fresh, prefix and long requests: the share whose client aborts / walks away
ACTION_SHARES = {"abort": 0.08, "abandon": 0.06}
#: the shared prefixes, in quarters of one rank's pool
PREFIXES = 4


@dataclass(frozen=True)
class LoadShape:
    """The sizes a plan is drawn against."""

    cp_size: int
    pool: int  # one prefill rank's --max-total-tokens
    decode_pool: int  # decode's --max-total-tokens
    reserved_decode_tokens: int  # decode's --num-reserved-decode-tokens
    vocab: int
    abort_window_s: float = 3.0  # an abort or walk-away lands this long after posting, at most

    @property
    def logical(self) -> int:
        return self.cp_size * self.pool

    @property
    def prefill_limit(self) -> int:
        """The longest prompt drawn for the prefill: the logical pool less two pages (the
        prefill needs the prompt, the new tokens and a page free at once)."""
        return _down(self.logical - 2 * PAGE)

    @property
    def decode_limit(self) -> int:
        """The longest prompt decode holds with its reserved decode tokens."""
        return _down(self.decode_pool - self.reserved_decode_tokens)

    def prefix_tokens(self, k: int) -> int:
        return max(PAGE, (self.pool * (k + 1) // PREFIXES) // PAGE * PAGE)


def _down(n: int) -> int:
    return n // SPLIT_MULTIPLE * SPLIT_MULTIPLE


def _log_uniform(rng, low: int, high: int) -> int:
    value = math.exp(rng.uniform(math.log(low), math.log(high)))
    return max(low, min(high, _down(int(value))))


def _uniform(rng, low: int, high: int) -> int:
    """A multiple of SPLIT_MULTIPLE in ``[low, high]`` (both multiples)."""
    return low + SPLIT_MULTIPLE * int(rng.integers(0, (high - low) // SPLIT_MULTIPLE + 1))


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    kind: str
    tokens: int
    prefix: Optional[int]  # which shared prefix (``prefix`` kind)
    action: str  # "none" | "abort" | "abandon"
    action_after_s: float

    def ids(self, seed: int, shape: LoadShape) -> List[int]:
        """The prompt's token ids (regenerated from the seed: the plan stays small)."""
        import numpy as np

        if self.prefix is None:
            return np.random.default_rng((seed, 1, self.index)).integers(2, shape.vocab, size=self.tokens).tolist()
        head = prefix_ids(seed, shape, self.prefix)
        tail = np.random.default_rng((seed, 2, self.index)).integers(2, shape.vocab, size=self.tokens - len(head))
        return head + tail.tolist()

    def record(self) -> Dict:
        return asdict(self)


def prefix_ids(seed: int, shape: LoadShape, k: int) -> List[int]:
    import numpy as np

    return np.random.default_rng((seed, 3, k)).integers(2, shape.vocab, size=shape.prefix_tokens(k)).tolist()


def kind_ranges(shape: LoadShape) -> Dict[str, tuple]:
    """(shortest, longest) prompt of each kind but prefix; empty ranges are left out (at
    N = 2 nothing is over one rank's pool and under what decode holds)."""
    ranges = {"fresh": (SPLIT_MULTIPLE, _down(shape.pool)),
              "long": (_down(shape.pool) + SPLIT_MULTIPLE, shape.decode_limit),
              "decode_over": (_down(shape.decode_pool) + SPLIT_MULTIPLE, shape.prefill_limit),
              "decode_window": (shape.decode_limit + SPLIT_MULTIPLE, _down(shape.decode_pool))}
    return {k: v for k, v in ranges.items() if v[0] <= v[1]}


def plan_load(seed: int, count: int, shape: LoadShape) -> List[PlannedRequest]:
    """``count`` requests (module docstring), the same for a seed and shape every time."""
    import numpy as np

    rng = np.random.default_rng((seed, 0))
    ranges = kind_ranges(shape)
    weights = {k: w for k, w in KIND_WEIGHTS.items() if k == "prefix" or k in ranges}
    kinds = list(weights)
    p = np.array([weights[k] for k in kinds]) / sum(weights.values())
    windows = max(1, round(count * DECODE_WINDOW_SHARE)) if "decode_window" in ranges else 0
    tail = max(windows, count // 10)
    window_at = set((count - tail + rng.choice(tail, size=windows, replace=False)).tolist()) if windows else set()
    plan = []
    for index in range(count):
        kind = "decode_window" if index in window_at else kinds[int(rng.choice(len(kinds), p=p))]
        prefix = None
        if kind == "prefix":
            prefix = int(rng.integers(0, PREFIXES))
            head = shape.prefix_tokens(prefix)
            longest = min(_down(shape.pool // 2), shape.decode_limit - head)  # decode holds it where it can
            tokens = head + _log_uniform(rng, SPLIT_MULTIPLE, max(SPLIT_MULTIPLE, longest))
        elif kind == "fresh":
            tokens = _log_uniform(rng, *ranges[kind])
        else:
            tokens = _uniform(rng, *ranges[kind])
        action, after = "none", 0.0
        draw = rng.uniform()
        if kind in ("fresh", "prefix", "long"):
            if draw < ACTION_SHARES["abort"]:
                action = "abort"
            elif draw < ACTION_SHARES["abort"] + ACTION_SHARES["abandon"]:
                action = "abandon"
        if action != "none":
            after = round(float(rng.uniform(0.05, shape.abort_window_s)), 3)
        plan.append(PlannedRequest(index, kind, int(tokens), prefix, action, after))
    return plan


def plan_summary(plan: List[PlannedRequest]) -> Dict:
    """How many requests of each kind and action, and the length range of each kind."""
    kinds: Dict[str, Dict] = {}
    for req in plan:
        entry = kinds.setdefault(req.kind, {"count": 0, "min_tokens": req.tokens, "max_tokens": req.tokens})
        entry["count"] += 1
        entry["min_tokens"] = min(entry["min_tokens"], req.tokens)
        entry["max_tokens"] = max(entry["max_tokens"], req.tokens)
    actions: Dict[str, int] = {}
    for req in plan:
        actions[req.action] = actions.get(req.action, 0) + 1
    return {"requests": len(plan), "kinds": kinds, "actions": actions}


def rid_of(prefix: str, index: int) -> str:
    """A request id no other of the run starts with (SGLang's ``/abort_request`` aborts every
    request whose id *starts with* the one given): a fixed width."""
    return f"{prefix}-{index:06d}"


def run_load(plan: List[PlannedRequest], seed: int, shape: LoadShape, ports: Dict[str, int], *, clients: int,
             bound_s: float, deadline_s: float, rid_prefix: str, room_base: int,
             prefill_grace_s: Optional[float] = None, on_done: Optional[Callable[[int], None]] = None,
             new_tokens: int = NEW_TOKENS) -> Dict:
    """Post ``plan`` from ``clients`` threads (module docstring). ``bound_s``: how long a
    client waits for an answer; ``prefill_grace_s``: how long the prefill's client waits
    once decode answered (None: for its answer); ``on_done(n)``: called after each request
    ended, ``n`` requests having ended. Returns ``{"requests": [...], "not_posted": [...],
    "t_start_unix", "t_end_unix", "wall_s"}``, the requests in plan order."""
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    records: Dict[int, Dict] = {}
    not_posted: List[int] = []
    t0, t0_unix = time.monotonic(), time.time()

    def one(req: PlannedRequest) -> Dict:
        rid = rid_of(rid_prefix, req.index)
        abort: Dict = {}

        def abort_later(posted_at):
            time.sleep(max(0.0, posted_at + req.action_after_s - time.monotonic()))
            abort["sent_at_s"] = round(time.monotonic() - posted_at, 3)
            try:
                post(ports["prefill"], "/abort_request", {"rid": rid}, timeout=30)
                abort["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 -- recorded
                abort["status"] = f"{type(exc).__name__}: {exc}"

        posted = round(time.monotonic() - t0, 3)
        entry = generate_pd(ports, req.ids(seed, shape), room_base + req.index, timeout=bound_s, rid=rid,
                            meanwhile=abort_later if req.action == "abort" else None, new_tokens=new_tokens,
                            abandon_after=req.action_after_s if req.action == "abandon" else None,
                            prefill_grace_s=prefill_grace_s)
        entry.update(req.record(), posted_at_s=posted)
        if abort:
            entry["abort"] = abort
        return entry

    def client():
        while True:
            with lock:
                if state["next"] >= len(plan):
                    return
                req = plan[state["next"]]
                state["next"] += 1
                late = time.monotonic() - t0 > deadline_s
                if late:
                    not_posted.append(req.index)
                    continue
            entry = one(req)
            with lock:
                records[req.index] = entry
                state["done"] += 1
                done = state["done"]
            if on_done is not None:
                on_done(done)

    threads = [threading.Thread(target=client, name=f"soak-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": [records[i] for i in sorted(records)], "not_posted": sorted(not_posted), "clients": clients,
            "t_start_unix": t0_unix, "t_end_unix": time.time(), "wall_s": round(time.monotonic() - t0, 3)}


def latency_summary(values: List[float]) -> Dict:
    """count, p50, p90, p99, max and mean of ``values`` (seconds); empty: count 0."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def pct(q):
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"count": len(ordered), "p50_s": pct(0.5), "p90_s": pct(0.9), "p99_s": pct(0.99), "max_s": ordered[-1],
            "mean_s": round(sum(ordered) / len(ordered), 3)}


__all__ = ["SPLIT_MULTIPLE", "KINDS", "LoadShape", "PlannedRequest", "plan_load", "plan_summary", "prefix_ids",
           "kind_ranges", "rid_of", "run_load", "latency_summary"]
