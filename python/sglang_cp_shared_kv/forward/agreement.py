"""Rank-agreed failure: a problem one CP rank finds during a forward fails every rank of
its group together, with the same error -- never one rank raising while the others wait
for it in a collective.

Every layer of a shared-KV prefill forward issues collectives over the attention-CP group
(SGLang's in-seq all-gathers, the plugin's view gathers). A rank that raised between two
of them would leave the others blocked in the next one: the group hangs, with no answer,
instead of failing. So a check of the forward path that can fail on one rank alone does
not raise where it fails. It records the problem (:meth:`ForwardAgreement.record`, or
:meth:`ForwardAgreement.carried` around a check function that raises), and the rank
carries on in step with the others: the same collectives with the same sizes (they derive
from the batch's page list, identical on every rank), zeros in place of rows it could not
trust, no store at locations it could not vouch for. Then, at a fixed point that every
rank reaches in the same order, the **agreement point** (:meth:`ForwardAgreement.agree`),
the ranks exchange what they found, and when any rank found a problem every rank raises
the same :class:`CpSharedKVRankFault`, naming each rank that found one, the check and
its message. SGLang's scheduler then handles it as any forward error.

The agreement points:

* once per forward, right after ``ModelRunner.forward`` returns (a hook in each release's
  table; ``forward.hooks.agree_after_forward``), on every CP rank of a forward that began a
  shared-KV batch -- a condition every rank shares (the same batch on every rank);
* in debug mode also at the batch's start, after the batch-state checks and before the
  first layer's collectives (the plan's sizes travel with it: every rank must size its
  gathers identically).

What travels: in the common case one int64 per rank -- 1 when the rank recorded a check or
saw a kernel raise since the last agreement point -- all-reduced (MAX) over the CP group's
CPU (gloo) group: one small host collective per forward and no device synchronisation.
When the result is 1 (a rank-identical decision: every rank sees the same value) the ranks
also exchange what they found (``all_gather_object``: check, layer, message, kernels and
their causes). Debug mode's agreements also carry integers every rank must hold identically
(the gather plan, the local-writes decision); those all-gather them instead of reducing.

Checks whose inputs are the same on every rank (the forward mode, the batch size, a path
of SGLang's that every rank takes alike) keep raising where they are: every rank raises
there together, no rank waits. :data:`CHECKS` lists the others, the rank-local ones.

Kernel fallbacks travel the same way. A hot-path kernel that raises on one rank runs its
torch reference there for the rest of the forward (the same bytes; no collective depends
on it); at the agreement point the group learns of it, and from the next forward **every**
rank runs that kernel's reference: logged once per kernel with the cause and the rank that
saw it, and counted in ``sglang:cp_shared_kv_kernel_fallbacks_total{cp_rank,kernel}``
(with ``--enable-metrics``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from sglang_cp_shared_kv.settings.config import FLAG
from sglang_cp_shared_kv.kernels import KERNEL_NAMES, KernelDispatch
from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric

logger = logging.getLogger(__name__)

#: The rank-local checks of a forward, by name, with what each checks (a name travels between
#: the ranks in the agreement's messages).
CHECKS: Tuple[Tuple[str, str], ...] = (
    ("local_rows", "a local-writes forward: SGLang handed this rank another number of local rows than planned"),
    ("chunk_rows", "a chunk handed to a store holds other than one row per out_cache_loc row"),
    ("chunk_locations", "SGLang asked to store the chunk at locations other than the batch's out_cache_loc"),
    ("prefetch_layer", "a layer found another layer's prefetched MLA history"),
    ("cp_group", "the attention-CP group's rank or size differs from the pool's layout"),
    ("in_seq_segments", "SGLang's in-seq split gave this rank other segments than r and 2N-1-r"),
    ("debug:batch_state", "debug mode: the batch state, SGLang's page tables and their dense translation"),
    ("debug:local_writes", "debug mode: this rank's local rows against SGLang's own split"),
    ("debug:owned_rows", "debug mode: the owned rows copied into the shard against the dense view's"),
)
_CHECK_NAMES = frozenset(name for name, _ in CHECKS)


class CpSharedKVRankFault(RuntimeError):
    """A check failed on some CP rank during a forward; raised on every rank of the group
    with the same message, at the agreement point."""


@dataclass(frozen=True)
class Fault:
    """The first problem one rank recorded since the last agreement point."""

    check: str
    message: str
    layer: Optional[int] = None

    def where(self) -> str:
        return "outside a layer" if self.layer is None else f"at layer {self.layer}"


class ForwardAgreement:
    """One CP rank's side of the agreement (module docstring): what it found since the last
    agreement point, and the agreement itself. One per shared-KV pool (its context's)."""

    def __init__(self, cp_rank: int, cp_size: int, kernels: KernelDispatch, *, metrics_enabled: bool = False):
        self.cp_rank, self.cp_size, self.kernels = cp_rank, cp_size, kernels
        self.fault: Optional[Fault] = None
        #: a shared-KV batch began and its forward has not reached the agreement point yet
        self.forward_open = False
        #: with ``--enable-metrics``: kernel fallbacks counted in Prometheus
        self.metrics_enabled = metrics_enabled
        #: agreement points reached (every rank counts the same)
        self.agreements = 0

    # ------------------------------------------------------------------ recording
    def record(self, check: str, message: str, layer: Optional[int] = None) -> None:
        """Record that ``check`` failed on this rank (the first record until the next
        agreement point wins; later ones are logged only). Never raises for the failure."""
        if check not in _CHECK_NAMES:
            raise ValueError(f"unknown check {check!r}; the rank-local checks are {sorted(_CHECK_NAMES)}")
        fault = Fault(check, message, layer)
        logger.error("CP shared KV: CP rank %d of %d: check '%s' failed %s: %s; the group fails this forward "
                     "together at its agreement point", self.cp_rank, self.cp_size, check, fault.where(), message)
        if self.fault is None:
            self.fault = fault

    @contextmanager
    def carried(self, check: str, layer: Optional[int] = None):
        """Within the block, an ``AssertionError`` (a failed check) is recorded as ``check``
        instead of raised; the block ends there and the caller carries on."""
        try:
            yield
        except AssertionError as exc:
            self.record(check, str(exc), layer)

    def begin_forward(self) -> None:
        """A shared-KV batch begins: its forward must reach :meth:`end_forward`."""
        if self.forward_open:
            # NOTE: every forward that began a batch reaches the hook after ModelRunner.forward;
            # only a caller that drives the forward hooks itself (a test rig) can miss it
            logger.error("CP shared KV: a shared-KV forward ended without reaching its agreement point%s",
                         f" (its fault is dropped: {self.fault})" if self.fault else "")
            self._reset()
        self.forward_open = True

    def end_forward(self, group) -> None:
        """The agreement point after a forward (every rank, the same forwards): :meth:`agree`
        when this forward began a shared-KV batch, nothing otherwise (an idle batch)."""
        if self.forward_open:
            self.forward_open = False
            self.agree(group)

    # ------------------------------------------------------------------ agreeing
    @property
    def has_news(self) -> bool:
        """This rank recorded a check or saw a kernel raise since the last agreement point."""
        return self.fault is not None or bool(self.kernels.failed_here)

    def agree(self, group, *, extra: Sequence[int] = (), extra_names: Sequence[str] = (),
              extra_what: str = "") -> None:
        """The agreement point: every rank of ``group`` (the CP group's CPU group) calls it
        at the same point of the same forward. Kernels that raised on any rank fall back on
        every rank; a fault recorded on any rank raises :class:`CpSharedKVRankFault` on
        every rank. ``extra``: integers every rank must hold identically (``extra_what``,
        each named by ``extra_names``: debug mode's gather plan or local-writes decision), a
        difference failing every rank too."""
        words = torch.tensor([int(self.has_news), *extra], dtype=torch.int64)
        self.agreements += 1
        if extra:  # debug mode: every rank's plan, to compare
            gathered = [torch.empty_like(words) for _ in range(self.cp_size)]
            torch.distributed.all_gather(gathered, words, group=group)
            table = torch.stack(gathered)
            news, plans = bool(table[:, 0].any()), table[:, 1:]
            plan_differs = bool((plans != plans[0]).any())
        else:
            torch.distributed.all_reduce(words, op=torch.distributed.ReduceOp.MAX, group=group)
            news, plan_differs = bool(words[0]), False
        if not news and not plan_differs:
            return
        # some rank has something to say: every rank knows it, so every rank exchanges what it found
        details: List[Optional[dict]] = [None] * self.cp_size
        torch.distributed.all_gather_object(details, self._details(), group=group)
        self._reset()
        self._fall_back_together(details)
        problems = [f"CP rank {rank} of {self.cp_size}: check '{detail['check']}' failed {detail['where']}: "
                    f"{detail['message']}"
                    for rank, detail in enumerate(details) if detail["check"] is not None]
        if plan_differs:
            rows = {rank: dict(zip(extra_names, plans[rank].tolist())) for rank in range(self.cp_size)}
            problems.append(f"the CP ranks disagree on {extra_what}: {rows}")
        if problems:
            raise CpSharedKVRankFault(f"{FLAG}: the forward failed on every CP rank together: " + "; ".join(problems))

    def _details(self) -> dict:
        fault = self.fault
        return {"check": fault.check if fault else None, "message": fault.message if fault else None,
                "where": fault.where() if fault else None, "kernels": dict(self.kernels.failed_here)}

    def _fall_back_together(self, details: List[dict]) -> None:
        """Every kernel that raised on some rank: its reference on every rank from now on,
        logged once with the cause and counted."""
        for name in KERNEL_NAMES:
            seen = {rank: detail["kernels"][name] for rank, detail in enumerate(details) if name in detail["kernels"]}
            if not seen or name in self.kernels.failed:
                continue
            self.kernels.fall_back(name)
            logger.warning("CP shared KV: kernel %s raised on CP rank(s) %s (%s); every rank of the CP group runs "
                           "its torch reference from the next forward on (the same bytes, slower)", name,
                           sorted(seen), "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(seen.items())))
            if self.metrics_enabled:
                _fallbacks_counter().labels(cp_rank=str(self.cp_rank), kernel=name).inc()

    def _reset(self) -> None:
        self.fault = None
        self.kernels.failed_here.clear()


def _fallbacks_counter():
    return prometheus_metric(
        "counter", "sglang:cp_shared_kv_kernel_fallbacks_total",
        "Hot-path kernels of a CP rank under shared KV that every rank of its CP group runs as their torch "
        "reference since one rank's kernel raised (decided for the group at a forward's agreement point).",
        ("cp_rank", "kernel"))


__all__ = ["CHECKS", "CpSharedKVRankFault", "Fault", "ForwardAgreement"]
