"""Capacity planner: what a CP group exposes with shared KV, per rank and per request, and
the HiCache host tier (``--enable-hierarchical-cache``) beside it.

Pure arithmetic over :mod:`kv_geometry` and :mod:`cp_shared_kv_layout`; used by
``python -m sglang_cp_shared_kv plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional

from sglang_cp_shared_kv.cp_shared_kv_layout import SHARD_POLICY, logical_tokens_for
from sglang_cp_shared_kv.decode.admission import DEFAULT_RESERVED_DECODE_TOKENS, decode_pool_tokens_for_context
from sglang_cp_shared_kv.pool.kv_geometry import DENSE_DUMMY_PAGES, GIB, PAGE_SIZE, NsaModelShape, normalize_kv_cache_dtype


@dataclass(frozen=True)
class RankSend:
    cp_rank: int
    pages: int
    kv_bytes: int
    index_bytes: int


@dataclass(frozen=True)
class RequestPlan:
    """One request of ``context_len`` tokens on freshly allocated consecutive logical pages."""

    context_len: int
    pages: int
    fits_replicated: bool
    fits_shared: bool
    #: pages of one rank's block in the dense view of the request's last layer-read
    scratch_pages_per_rank: int
    scratch_mla_bytes_per_layer: int
    scratch_index_bytes_per_layer: int
    #: MLA views alive at once with SGLANG_CP_SHARED_KV_PREFETCH=1: this layer's and the next
    scratch_mla_bytes_with_prefetch: int
    pd_bytes_replicated: int
    pd_send_per_rank: List[RankSend]
    #: the decode pool (tokens, per decode GPU) that admits every request of this context
    #: length with SGLang's default reserved decode tokens (decode_admission)
    decode_pool_tokens: int


@dataclass(frozen=True)
class HostTierPlan:
    """HiCache's host tier under the flag: each rank's host pool is the one stock builds for
    the rank's physical device pool and holds only the rank's pages, so the group's host tier
    is ``cp_size`` times one rank's (``hicache/host_lanes.py``). Replicated CP keeps the same
    tokens in every rank's host pool: its group holds one rank's."""

    #: the setting it was sized by: ``--hicache-ratio R`` or ``--hicache-size GB``
    sized_by: str
    host_tokens_per_rank: int
    #: the MLA host pool (SGLang logs this one: "Allocating X GB host memory ...")
    mla_host_bytes_per_rank: int
    #: the NSA index K + scale host pool, sized by the MLA host pool's pages
    index_host_bytes_per_rank: int
    logical_host_tokens: int
    replicated_logical_host_tokens: int

    @property
    def host_bytes_per_rank(self) -> int:
        return self.mla_host_bytes_per_rank + self.index_host_bytes_per_rank


def plan_host_tier(shape: NsaModelShape, cp_size: int, kv_cache_dtype: str, physical_tokens_per_rank: int, *,
                   hicache_ratio: Optional[float] = None, hicache_size_gb: Optional[float] = None) -> HostTierPlan:
    """The host tier of ``--hicache-ratio`` or ``--hicache-size`` (GB of the MLA host pool, in
    SGLang's 10**9 bytes), as SGLang 0.5.12.post1 sizes a rank's host pools
    (``HostKVCache.__init__``, ``NSAIndexerPoolHost``)."""
    if (hicache_ratio is None) == (hicache_size_gb is None):
        raise ValueError("give exactly one of hicache_ratio and hicache_size_gb")
    dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    mla_token_bytes = shape.mla_row_bytes(dtype) * shape.num_layers
    if hicache_size_gb is not None:
        if not hicache_size_gb > 0:
            raise ValueError(f"--hicache-size must be > 0 GB, got {hicache_size_gb}")
        tokens, sized_by = int(hicache_size_gb * 1e9 // mla_token_bytes), f"--hicache-size {hicache_size_gb:g}"
    else:
        if not hicache_ratio > 0:
            raise ValueError(f"--hicache-ratio must be > 0, got {hicache_ratio}")
        tokens, sized_by = int(physical_tokens_per_rank * hicache_ratio), f"--hicache-ratio {hicache_ratio:g}"
    # NOTE: SGLang adds a page to the floor (page_num = size // page + 1), whole pages either way
    pages = tokens // PAGE_SIZE + 1
    tokens = pages * PAGE_SIZE
    if tokens <= physical_tokens_per_rank:
        raise ValueError(f"{sized_by} gives a host pool of {tokens:,} tokens per rank, not more than the rank's "
                         f"device pool of {physical_tokens_per_rank:,}: SGLang refuses that (its host pool must be "
                         "larger than the device pool); raise --hicache-ratio above 1 or --hicache-size")
    return HostTierPlan(
        sized_by=sized_by,
        host_tokens_per_rank=tokens,
        mla_host_bytes_per_rank=tokens * mla_token_bytes,
        # NOTE: the index host buffer has (size + page + 1) // page pages (NSAIndexerPoolHost), one
        # more than the MLA host pool's: the device index buffer's formula (kv_geometry.pool_bytes)
        index_host_bytes_per_rank=shape.pool_bytes(tokens, dtype, PAGE_SIZE)[1],
        logical_host_tokens=cp_size * tokens,
        replicated_logical_host_tokens=tokens,
    )


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    num_layers: int
    cp_size: int
    kv_cache_dtype: str
    page_size: int
    shard_policy: str
    mla_row_bytes: int
    index_row_bytes: int
    physical_tokens_per_rank: int
    kv_bytes_per_rank: int
    mla_bytes_per_rank: int
    index_bytes_per_rank: int
    logical_tokens: int
    replicated_logical_tokens: int
    #: KV (MLA + index) a decode GPU needs to hold one request of ``logical_tokens``: a
    #: non-CP decode keeps a request's whole KV on every GPU of its attention TP group.
    decode_kv_bytes_for_logical_tokens: int
    request: Optional[RequestPlan]
    host: Optional[HostTierPlan] = None

    @property
    def kv_gb_per_rank(self) -> float:
        return self.kv_bytes_per_rank / GIB

    def to_dict(self) -> dict:
        out = asdict(self)
        out["kv_gb_per_rank"] = round(self.kv_gb_per_rank, 4)
        if self.host is not None:
            out["host"]["host_bytes_per_rank"] = self.host.host_bytes_per_rank
        return out


def pages_owned_per_rank(num_pages: int, cp_size: int) -> List[int]:
    """Pages each rank owns of ``num_pages`` consecutive logical pages starting at page 1."""
    return [num_pages // cp_size + (1 if r < num_pages % cp_size else 0) for r in range(cp_size)]


def plan_request(shape: NsaModelShape, cp_size: int, kv_cache_dtype: str,
                 logical_tokens: int, physical_tokens: int, context_len: int) -> RequestPlan:
    pages = -(-context_len // PAGE_SIZE)
    # NOTE: the dense view pads the history and the current chunk's pages to a rank block
    # each (forward.dense_layout), so with balanced ownership a block holds at most one page
    # more than ceil(pages / N); the view also starts with the dense dummy page.
    padded = -(-pages // cp_size) + 1
    dense_pages = DENSE_DUMMY_PAGES + cp_size * padded
    mla_page = PAGE_SIZE * shape.mla_row_bytes(kv_cache_dtype)
    index_page = PAGE_SIZE * shape.index_row_bytes
    sends = [
        RankSend(cp_rank=r, pages=n,
                 kv_bytes=n * mla_page * shape.num_layers,
                 index_bytes=n * index_page * shape.num_layers)
        for r, n in enumerate(pages_owned_per_rank(pages, cp_size))
    ]
    return RequestPlan(
        context_len=context_len,
        pages=pages,
        fits_replicated=pages * PAGE_SIZE <= physical_tokens,
        fits_shared=pages * PAGE_SIZE <= logical_tokens,
        scratch_pages_per_rank=padded,
        scratch_mla_bytes_per_layer=dense_pages * mla_page,
        scratch_index_bytes_per_layer=dense_pages * index_page,
        scratch_mla_bytes_with_prefetch=2 * dense_pages * mla_page,
        pd_bytes_replicated=pages * (mla_page + index_page) * shape.num_layers,
        pd_send_per_rank=sends,
        decode_pool_tokens=decode_pool_tokens_for_context(context_len),
    )


def plan_capacity(shape: NsaModelShape, cp_size: int, kv_cache_dtype: str, *,
                  kv_tokens_per_rank: Optional[int] = None,
                  kv_gb_per_rank: Optional[float] = None,
                  context_len: Optional[int] = None,
                  hicache_ratio: Optional[float] = None,
                  hicache_size_gb: Optional[float] = None) -> CapacityPlan:
    """Plan a CP group of ``cp_size`` ranks, sized by tokens or by GiB per rank; with
    ``hicache_ratio`` or ``hicache_size_gb``, its HiCache host tier too."""
    if (kv_tokens_per_rank is None) == (kv_gb_per_rank is None):
        raise ValueError("give exactly one of kv_tokens_per_rank and kv_gb_per_rank")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp size must be an integer >= 1, got {cp_size!r}")
    dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    if kv_tokens_per_rank is not None:
        if kv_tokens_per_rank < PAGE_SIZE:
            raise ValueError(f"kv tokens per rank must be >= {PAGE_SIZE}, got {kv_tokens_per_rank}")
        physical = kv_tokens_per_rank // PAGE_SIZE * PAGE_SIZE
    else:
        if not kv_gb_per_rank > 0:
            raise ValueError(f"kv GB per rank must be > 0, got {kv_gb_per_rank}")
        physical = shape.max_pool_tokens(int(kv_gb_per_rank * GIB), dtype, PAGE_SIZE)
        if physical < PAGE_SIZE:
            raise ValueError(f"{kv_gb_per_rank} GB per rank holds less than one {PAGE_SIZE}-token page")
    if context_len is not None and context_len < 1:
        raise ValueError(f"context length must be >= 1, got {context_len}")
    logical = logical_tokens_for(physical, PAGE_SIZE, cp_size)
    mla, index = shape.pool_bytes(physical, dtype, PAGE_SIZE)
    decode_mla, decode_index = shape.pool_bytes(logical, dtype, PAGE_SIZE)
    return CapacityPlan(
        model=shape.name,
        num_layers=shape.num_layers,
        cp_size=cp_size,
        kv_cache_dtype=dtype,
        page_size=PAGE_SIZE,
        shard_policy=SHARD_POLICY,
        mla_row_bytes=shape.mla_row_bytes(dtype),
        index_row_bytes=shape.index_row_bytes,
        physical_tokens_per_rank=physical,
        kv_bytes_per_rank=mla + index,
        mla_bytes_per_rank=mla,
        index_bytes_per_rank=index,
        logical_tokens=logical,
        replicated_logical_tokens=physical,
        decode_kv_bytes_for_logical_tokens=decode_mla + decode_index,
        request=None if context_len is None else plan_request(
            shape, cp_size, dtype, logical, physical, context_len),
        host=None if hicache_ratio is None and hicache_size_gb is None else plan_host_tier(
            shape, cp_size, dtype, physical, hicache_ratio=hicache_ratio, hicache_size_gb=hicache_size_gb),
    )


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GB"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def format_plan(plan: CapacityPlan) -> str:
    lines = [
        f"model                      {plan.model} ({plan.num_layers} layers, KV {plan.kv_cache_dtype}: "
        f"{plan.mla_row_bytes} B MLA + {plan.index_row_bytes} B index per token per layer)",
        f"cp_size                    {plan.cp_size}   shard_policy={plan.shard_policy}   page_size={plan.page_size}",
        f"physical_tokens_per_rank   {plan.physical_tokens_per_rank:,}",
        f"kv_per_rank                {_gib(plan.kv_bytes_per_rank)} "
        f"(MLA {_gib(plan.mla_bytes_per_rank)} + index {_gib(plan.index_bytes_per_rank)}; unchanged by the flag)",
        f"logical_tokens             {plan.logical_tokens:,}   "
        f"(replicated CP exposes {plan.replicated_logical_tokens:,})",
        f"decode KV per GPU          {_gib(plan.decode_kv_bytes_for_logical_tokens)} for one prompt of all "
        f"{plan.logical_tokens:,} tokens (the longest this group admits unless --context-length is lower; "
        f"a non-CP decode holds a whole request per GPU)",
    ]
    host = plan.host
    if host is not None:
        lines += [
            f"host_tokens_per_rank       {host.host_tokens_per_rank:,} ({host.sized_by}): "
            f"{_gib(host.host_bytes_per_rank)} of host memory per rank (MLA {_gib(host.mla_host_bytes_per_rank)} + "
            f"index {_gib(host.index_host_bytes_per_rank)}; what stock gives a rank"
            f"{'; --hicache-size counts 10**9 bytes, this table 2**30' if host.sized_by.startswith('--hicache-size') else ''})",
            f"host_logical_tokens        {host.logical_host_tokens:,}   "
            f"(replicated CP keeps {host.replicated_logical_host_tokens:,} in every rank's host memory)",
        ]
    req = plan.request
    if req is not None:
        lines += [
            f"request                    {req.context_len:,} tokens = {req.pages:,} pages; "
            f"fits replicated: {'yes' if req.fits_replicated else 'no'}, "
            f"fits shared: {'yes' if req.fits_shared else 'no'}",
            f"materialize scratch/layer  MLA {_mib(req.scratch_mla_bytes_per_layer)} + index "
            f"{_mib(req.scratch_index_bytes_per_layer)} (at most 1 + {plan.cp_size} x "
            f"{req.scratch_pages_per_rank:,} pages; MLA {_mib(req.scratch_mla_bytes_with_prefetch)} "
            "with SGLANG_CP_SHARED_KV_PREFETCH=1)",
            f"PD send, replicated        {_gib(req.pd_bytes_replicated)} from one sender "
            f"(decode holds the same per GPU for this request)",
            f"decode pool                >= {req.decode_pool_tokens:,} tokens per decode GPU for --context-length "
            f"{req.context_len:,} (its longest prompt + {DEFAULT_RESERVED_DECODE_TOKENS} reserved decode tokens, "
            "in whole pages; a smaller decode refuses the longest requests, at once with the flag on decode)",
        ]
        for send in req.pd_send_per_rank:
            lines.append(
                f"PD send, cp_rank {send.cp_rank:<3}       {send.pages:,} pages: KV {_gib(send.kv_bytes)} "
                f"+ index {_gib(send.index_bytes)}"
            )
    return "\n".join(lines)
