"""One CP rank's fault, every rank's error: the rig side of test/integration/test_rank_agreement.py.

For each rank-local check of the forward path (``forward.agreement.CHECKS``) a
:class:`FaultCase` makes it fail on **one** rank by real means -- the rows, locations or
metadata a broken SGLang path would hand the plugin's hooks, a corrupted batch state or
owner copy for the debug checks, a prefetched history of another layer -- and runs one
forward through the plugin's real hooks on N gloo ranks (the harness rigs of both releases,
:class:`.cp_rig_nsa.InSeqRig` and :class:`.cp_rig_dsa.InterleaveRig`). Each rank reports
what it raised and how long after the faulted forward began, then meets the others at a
barrier on the CP group's CPU group: a rank left waiting in a collective would never get
there, and the parent's deadline fails the run instead of hanging it.

A kernel case makes one hot-path kernel raise on one rank: the forward must complete,
bit-exact, and from the next forward every rank must run that kernel's reference.

:data:`UNAGREED_RAISE` is the control: the old behaviour, one rank raising inside a hook
before a collective; the group then hangs, which the parent's deadline must catch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.page_split import page_by_page_chunk_unit
from sglang_cp_shared_kv.scoped import attributes_set

_BOTH = ("v0512", "v0523")  # ``Release.name``


@dataclass(frozen=True)
class FaultCase:
    """One check tripped on one rank: the forwards before (``setup``), the faulted forward
    (``forward``), what the faulty rank gets (``inject(rig, n)``, a context manager)."""

    name: str
    check: str  #: the check of ``forward.agreement.CHECKS`` it trips; "" for a kernel case
    setup: Callable
    forward: Callable
    inject: Callable
    debug: str = "off"
    prefetch: bool = False
    releases: Tuple[str, ...] = _BOTH
    kernel: str = ""  #: a kernel case: the kernel that raises on the faulty rank
    #: a disagreement case (debug mode): what the agreed error must say instead of a check
    disagreement: str = ""


# ------------------------------------------------------------------ forwards
def _nothing_before(rig):
    return rig.new_request()


def _one_chunk_before(rig):
    req = rig.new_request()
    rig.extend(req, 200, pad_rows=200 % 3)
    return req


def _gathered_chunk(rig, req):
    """A phase-3 chunk (SGLang gathers it; every rank stores it into the views): after
    ``_one_chunk_before`` it has history, so the prefetch has something to gather."""
    if req.seq_len:
        rig.extend(req, 130, pad_rows=130 % 3)
    else:
        rig.extend(req, 437, pad_rows=3)


def _local_chunk(rig, req):
    """A chunk SGLang cuts page by page from a page boundary: 0.5.12's local writes."""
    rig.extend(req, page_by_page_chunk_unit(rig.n, PAGE))


# ------------------------------------------------------------------ injections
def _wrapped(obj, name: str, wrap):
    """``obj.name`` replaced, within the block, by ``wrap(original)``."""
    return attributes_set(obj, **{name: wrap(getattr(obj, name))})


def _local_rows_short(rig, n):
    """SGLang hands this rank one local row fewer than its split gives it."""
    return _wrapped(rig, "_local", lambda real: lambda fb, full: real(fb, full)[:-1])


def _chunk_row_short(rig, n):
    """The chunk handed to the index store lacks its last row (0.5.12: the key SGLang's
    all-gather returns; 0.5.23: every chunk interleave gathers)."""
    if hasattr(rig, "_index_key"):
        return _wrapped(rig, "_index_key", lambda real: lambda fb, key: real(fb, key)[:-1])
    return _wrapped(rig, "_gathered", lambda real: lambda fb, full, gather: real(fb, full, gather)[:-1])


def _other_locations(rig, n):
    """0.5.23's index store is asked to store at locations other than the batch's."""
    from sglang_cp_shared_kv.forward import hooks_v0523 as hooks_dsa

    def wrap(real):
        def store(original, indexer, forward_batch, layer_id, key, **kwargs):
            kwargs["out_cache_loc"] = forward_batch.out_cache_loc.flip(0)
            return real(original, indexer, forward_batch, layer_id, key, **kwargs)
        return store

    return _wrapped(hooks_dsa, "store_index_k_owned_and_dense", wrap)


def _prefetch_of_another_layer(rig, n):
    """The next layer's prefetched MLA history arrives labelled with a layer after it."""
    from sglang_cp_shared_kv.forward.in_flight import ForwardInFlight

    def wrap(real):
        def put(in_flight, history):
            history.layer_id += 1
            return real(in_flight, history)
        return put

    return _wrapped(ForwardInFlight, "put_prefetched", wrap)


def _group_rank_lies(rig, n):
    """The attention-CP group answers another rank than the pool's layout."""
    from sglang_cp_shared_kv.forward import batch_state

    def wrap(real):
        def check(state):
            true_rank = torch.distributed.get_rank
            with attributes_set(torch.distributed, get_rank=lambda group=None: (true_rank(group) + 1) % n):
                return real(state)
        return check

    return _wrapped(batch_state, "check_cp_group", wrap)


def _segments_swapped(rig, n):
    """SGLang's in-seq metadata lists this rank's two segments the other way round."""
    def wrap(real):
        def metadata(*args):
            out = real(*args)
            if out is not None:
                out.zigzag_index = list(reversed(out.zigzag_index))
            return out
        return metadata

    return _wrapped(rig, "_cp_metadata", wrap)


def _dense_locations_off(rig, n):
    """The batch state's dense chunk locations point one row further (debug mode catches it)."""
    from sglang_cp_shared_kv.forward import batch_state

    def wrap(real):
        def build(*args, **kwargs):
            state = real(*args, **kwargs)
            return dataclasses.replace(state, dense_out_locs=state.dense_out_locs + 1)
        return build

    return _wrapped(batch_state, "build_batch_state", wrap)


def _local_plan_rolled(rig, n):
    """The local-writes plan's physical locations are rolled by one (debug mode catches it)."""
    from sglang_cp_shared_kv.forward import local_writes_v0512 as local_writes

    def wrap(real):
        def plan(*args):
            out = real(*args)
            return dataclasses.replace(out, physical_locs=out.physical_locs.roll(1)) if out.index else out
        return plan

    return _wrapped(local_writes, "plan_local_writes", wrap)


def _gather_plan_off(rig, n):
    """This rank sizes its gathers from another page sum (debug mode's agreement catches it
    before the first gather)."""
    from sglang_cp_shared_kv.forward import batch_state

    return _wrapped(batch_state, "gather_plan", lambda real: lambda state: (*real(state)[:-1], real(state)[-1] + 1))


def _local_decision_flipped(rig, n):
    """This rank decides to gather a chunk the others store locally (debug mode's agreement
    catches it before SGLang's all-gathers would differ)."""
    from sglang_cp_shared_kv.forward import local_writes_v0512 as local_writes

    return _wrapped(local_writes, "plan_local_writes",
                    lambda real: lambda *args: local_writes._phase3("flipped on this rank"))


def _owner_copy_skipped(rig, n):
    """The owner copy of the MLA rows into the shard does nothing (debug mode catches it)."""
    return attributes_set(rig.shared.context.kernels, copy_mla_rows=lambda *args, **kwargs: None)


INJECTED_KERNEL_ERROR = "injected kernel failure"


def kernel_raises(rig, kernel: str):
    """``kernel`` raises on this rank's dispatch, as a kernel that fails to compile or launch
    would: the dispatch's real failure path runs (the tensors pass as CUDA ones for it)."""
    from sglang_cp_shared_kv import kernels as kernels_module

    dispatch = rig.shared.context.kernels

    def wrap(real):
        def run(name, tensors, kernel_fn, fallback):
            if name != kernel:
                return real(name, tensors, kernel_fn, fallback)

            def failing(package):
                raise RuntimeError(INJECTED_KERNEL_ERROR)

            with attributes_set(kernels_module, _all_on_cuda=lambda tensors: True):
                return real(name, tensors, failing, fallback)
        return run

    return _wrapped(dispatch, "_run", wrap)


CASES: Tuple[FaultCase, ...] = (
    FaultCase("local_rows", "local_rows", _nothing_before, _local_chunk, _local_rows_short, releases=("v0512",)),
    FaultCase("chunk_rows", "chunk_rows", _nothing_before, _gathered_chunk, _chunk_row_short),
    FaultCase("chunk_locations", "chunk_locations", _nothing_before, _gathered_chunk, _other_locations,
              releases=("v0523",)),
    FaultCase("prefetch_layer", "prefetch_layer", _one_chunk_before, _gathered_chunk, _prefetch_of_another_layer,
              prefetch=True),
    FaultCase("cp_group", "cp_group", _nothing_before, _gathered_chunk, _group_rank_lies),
    FaultCase("in_seq_segments", "in_seq_segments", _nothing_before, _local_chunk, _segments_swapped,
              releases=("v0512",)),
    FaultCase("debug:batch_state", "debug:batch_state", _nothing_before, _gathered_chunk, _dense_locations_off,
              debug="on"),
    FaultCase("debug:local_writes", "debug:local_writes", _nothing_before, _local_chunk, _local_plan_rolled,
              debug="on", releases=("v0512",)),
    FaultCase("debug:owned_rows", "debug:owned_rows", _nothing_before, _gathered_chunk, _owner_copy_skipped,
              debug="on"),
    FaultCase("debug:gather_plan", "", _one_chunk_before, _gathered_chunk, _gather_plan_off, debug="on",
              disagreement="the CP ranks disagree on the gather plan"),
    FaultCase("debug:local_writes_decision", "", _nothing_before, _local_chunk, _local_decision_flipped,
              debug="on", releases=("v0512",), disagreement="the CP ranks disagree on the local-writes decision"),
    FaultCase("kernel:build_page_inverse", "", _nothing_before, _gathered_chunk, None, kernel="build_page_inverse"),
    # a kernel of every layer (the owner copy of phase 3): the faulty rank falls back mid-forward
    FaultCase("kernel:copy_mla_rows", "", _nothing_before, _gathered_chunk, None, kernel="copy_mla_rows"),
)


def cases_for(release: str) -> List[FaultCase]:
    return [case for case in CASES if release in case.releases]


def faulty_rank(case_index: int, n: int) -> int:
    """The rank a case breaks: it moves round the group from case to case (rank 0 included)."""
    return (case_index + 1) % n


# ------------------------------------------------------------------ rank side
def _eligible_kernel_calls(dispatch, kernel: str, counts: Dict[str, int]):
    """Count, per forward phase, the calls of ``kernel`` the dispatch would still try (not
    given up on by this rank or by the group)."""
    def wrap(real):
        def run(name, tensors, kernel_fn, fallback):
            if name == kernel and name not in dispatch.failed and name not in dispatch.failed_here:
                counts["eligible"] = counts.get("eligible", 0) + 1
            return real(name, tensors, kernel_fn, fallback)
        return run

    return _wrapped(dispatch, "_run", wrap)


def run_case(rig, case: FaultCase, faulty: bool, cpu_group) -> dict:
    """Run ``case`` on this rank's ``rig`` (broken here when ``faulty``); what it raised (or,
    for a kernel case, what every rank decided), then a barrier with the other ranks."""
    req = case.setup(rig)
    outcome: dict = {"raised": None, "message": None, "seconds": None}
    if case.kernel:
        return _run_kernel_case(rig, case, faulty, req, cpu_group, outcome)
    started = time.monotonic()
    try:
        with case.inject(rig, rig.n) if faulty else contextlib.nullcontext():
            case.forward(rig, req)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        outcome.update(raised=type(exc).__name__, message=str(exc), seconds=time.monotonic() - started)
        if type(exc).__name__ != "CpSharedKVRankFault":
            outcome["traceback"] = traceback.format_exc()[-3000:]
    torch.distributed.barrier(group=cpu_group)
    return outcome


def _run_kernel_case(rig, case, faulty, req, cpu_group, outcome) -> dict:
    dispatch = rig.shared.context.kernels
    agreement = rig.shared.context.agreement
    agreement.metrics_enabled = True
    first, second = {}, {}
    try:
        with _eligible_kernel_calls(dispatch, case.kernel, first), \
                (kernel_raises(rig, case.kernel) if faulty else contextlib.nullcontext()):
            case.forward(rig, req)
        after_first = sorted(dispatch.failed)
        with _eligible_kernel_calls(dispatch, case.kernel, second):
            rig.extend(req, 100, pad_rows=(-100) % rig.n)
    except Exception as exc:  # noqa: BLE001 - must not happen: reported
        outcome.update(raised=type(exc).__name__, message=str(exc), traceback=traceback.format_exc()[-3000:])
        after_first = sorted(dispatch.failed)
    import prometheus_client

    counted = prometheus_client.REGISTRY.get_sample_value(
        "sglang:cp_shared_kv_kernel_fallbacks_total", {"cp_rank": str(rig.rank), "kernel": case.kernel})
    outcome.update(failed_after_first=after_first, eligible_first=first.get("eligible", 0),
                   eligible_second=second.get("eligible", 0), counted=counted, errors=rig.errors[:5])
    torch.distributed.barrier(group=cpu_group)
    return outcome


@contextlib.contextmanager
def unagreed_raise(rig):
    """The control: this rank raises inside the index-store hook, before its view's gather
    (what a rank-local check did before the agreement point existed)."""
    from sglang_cp_shared_kv.forward import materialize

    def raising(*args, **kwargs):
        raise RuntimeError("a rank-local raise before a collective")

    with attributes_set(materialize, gather_history=raising):
        yield


UNAGREED_RAISE = FaultCase("control:unagreed_raise", "", _one_chunk_before, _gathered_chunk,
                           lambda rig, n: unagreed_raise(rig))
CASES_BY_NAME = {case.name: case for case in (*CASES, UNAGREED_RAISE)}


# ------------------------------------------------------------------ processes
def run_fault_cases(n: int, release: str, names: List[str], *, model_dir: str = "", timeout_s: float = 600.0,
                    dtype_name: str = "bf16") -> List[dict]:
    """Run the cases ``names`` on ``n`` gloo ranks of ``release`` ("v0512" or "v0523",
    the installed one; ``model_dir``: the tiny config 0.5.23's ranks resolve their server
    arguments from), each on a fresh rig; per rank, ``{"cases": {name: outcome}}``.
    Raises (``run_rank_processes``) when a rank died or the deadline passed."""
    import tempfile

    import torch.multiprocessing as mp

    from sglang_cp_shared_kv_testing.support import free_port, run_rank_processes

    out_dir = tempfile.mkdtemp(prefix=f"rank-faults-{n}-")
    return run_rank_processes(mp.get_context("spawn"), _rank_main, n, out_dir,
                              args=(n, free_port(), out_dir, release, list(names), model_dir, dtype_name),
                              timeout_s=timeout_s, what="rank-fault run")


def _rank_main(rank, n, port, out_dir, release, names, model_dir, dtype_name):
    from sglang_cp_shared_kv_testing.cp_harness import finish_rank

    result: dict = {"cases": {}}
    try:
        with contextlib.ExitStack() as stack:
            if release == "v0523":
                from sglang_cp_shared_kv_testing.cp_harness_v0523 import init_interleave_rank
                from sglang_cp_shared_kv_testing.cp_rig_v0523 import InterleaveRig

                group = init_interleave_rank(rank, n, port, model_dir, stack)

                def new_rig(case):
                    return InterleaveRig(rank, n, dtype_name, group, debug=case.debug, prefetch=case.prefetch)
            else:
                from sglang_cp_shared_kv_testing.cp_harness import init_rank_process
                from sglang_cp_shared_kv_testing.cp_rig_v0512 import InSeqRig

                group = init_rank_process(rank, n, port, "cpu")

                def new_rig(case):
                    return InSeqRig(rank, n, dtype_name, group, "cpu", debug=case.debug, prefetch=case.prefetch)
            for index, name in enumerate(names):
                case = CASES_BY_NAME[name]
                result["cases"][name] = run_case(new_rig(case), case, rank == faulty_rank(index, n), group.cpu_group)
                result["cases"][name]["faulty_rank"] = faulty_rank(index, n)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["fatal"] = traceback.format_exc()[-4000:]
    finish_rank(out_dir, rank, result)

__all__ = ["CASES", "CASES_BY_NAME", "FaultCase", "INJECTED_KERNEL_ERROR", "UNAGREED_RAISE", "cases_for",
           "faulty_rank", "kernel_raises", "run_case", "run_fault_cases"]
