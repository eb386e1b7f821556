"""The per-process state of one shared-KV model runner, in one object.

A :class:`CpSharedKVContext` is created when the scheduler process builds its KV pool
(``capacity.build_pools``), bound to that pool (``pool.context``) and reached from there:
by the forward hooks through ``forward_batch.token_to_kv_pool``, by the metrics through
the scheduler's model runner, by the PD transfer through the pool its bootstrap queue
registers. Nothing of it lives in a module global, so two engines in one process -- or a
test building two configurations side by side -- each have their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from sglang_cp_shared_kv import sglang_api as sg
from sglang_cp_shared_kv.settings.config import nvtx_enabled
from sglang_cp_shared_kv.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.forward.agreement import ForwardAgreement
from sglang_cp_shared_kv.kernels import KernelDispatch
from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric
from sglang_cp_shared_kv.observability.stage_timer import StageTimer


@dataclass(frozen=True)
class CapacitySplit:
    """What one CP rank stores and what its group exposes (set once the pool exists)."""

    physical_tokens_per_rank: int
    logical_tokens: int
    cp_size: int
    cp_rank: int
    page_size: int
    kv_gb_per_rank: float
    max_running_requests: int


@dataclass(eq=False)
class CpSharedKVContext:
    """One CP rank's shared-KV state for the lifetime of its pool."""

    layout: CpSharedKVLayout
    #: kernel or reference per call, and the kernels that raised in this process
    kernels: KernelDispatch = field(default_factory=KernelDispatch)
    #: the capacity figures, once ``init_memory_pool`` has built the pool (None before)
    split: Optional[CapacitySplit] = None
    #: the second process group over the CP ranks that carries the one-layer-ahead MLA
    #: history gathers (``forward.prefetch``; :func:`new_prefetch_group`); None: prefetch off
    prefetch_group: Optional[object] = None
    #: time per stage of this rank's work (``SGLANG_CP_SHARED_KV_NVTX=1`` at startup); None: off
    stage_timer: Optional[StageTimer] = None
    #: forwards by how their chunk rows reached the shards, (index, MLA) -> count, each
    #: "local" (stored by the computing rank, ``forward.local_writes_v0512``) or "gathered" (phase 3)
    write_paths: Counter = field(default_factory=Counter)
    #: with ``--enable-metrics``: ``write_paths`` is also counted in Prometheus,
    #: ``sglang:cp_shared_kv_prefill_forwards_total{cp_rank,index,mla}``
    metrics_enabled: bool = False
    #: the problems this rank found during the forward in flight and the kernels that raised
    #: here, until its CP group agrees on them (``forward.agreement``); built from the above
    agreement: ForwardAgreement = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, CpSharedKVLayout):
            raise TypeError(f"CpSharedKVContext needs a CpSharedKVLayout, got {type(self.layout).__name__}")
        if self.stage_timer is None and nvtx_enabled():
            self.stage_timer = StageTimer.from_env(self.layout.cp_rank)
        self.agreement = ForwardAgreement(self.layout.cp_rank, self.layout.cp_size, self.kernels,
                                          metrics_enabled=self.metrics_enabled)

    def count_write_path(self, index: str, mla: str) -> None:
        """One more forward whose index keys / MLA latent reached the shards by ``index`` /
        ``mla`` ("local" or "gathered")."""
        self.write_paths[(index, mla)] += 1
        if self.metrics_enabled:
            _forwards_counter().labels(cp_rank=str(self.layout.cp_rank), index=index, mla=mla).inc()

    def write_path_counts(self) -> Dict[str, int]:
        """:attr:`write_paths` labelled as the reports show them, ``"index=<i>,mla=<m>"`` -> forwards."""
        return {f"index={index},mla={mla}": count for (index, mla), count in self.write_paths.items()}


def _forwards_counter():
    return prometheus_metric(
        "counter", "sglang:cp_shared_kv_prefill_forwards_total",
        "Prefill forwards of a CP rank under shared KV, by how the chunk's index keys and MLA "
        "latent reached the shards: local (stored by the rank that computed them, SGLang's "
        "all-gather left out) or gathered (SGLang's all-gather, then the owned rows copied out).",
        ("cp_rank", "index", "mla"))


def new_prefetch_group(cp_group=None):
    """A second process group over the attention-CP group's ranks (``cp_group``: SGLang's
    ``GroupCoordinator``, default the server's), with its backend. Collective over those
    ranks only: every CP rank calls it once, at pool construction."""
    cp_group = cp_group or sg.get_attention_cp_group()
    backend = torch.distributed.get_backend(cp_group.device_group)
    return torch.distributed.new_group(ranks=list(cp_group.ranks), backend=backend, use_local_synchronization=True)
