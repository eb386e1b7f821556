"""SGLang 0.5.12.post1's real HiCache stack (``HiRadixCache`` over an NSA pool: a
``HybridCacheController`` driving a ``HostPoolGroup`` of ``MLATokenToKVPoolHost`` (KV, the
anchor) and ``NSAIndexerPoolHost`` (INDEXER)) on a CPU machine, and the scenario that
round-trips a request's KV through it: device -> host backup -> device eviction -> host hit
-> load back to new device locations.

What SGLang cannot do on a CPU, and what stands in (nothing else of SGLang is replaced):

* ``memory_pool_host`` imports ``sgl_kernel.kvcacheio`` at module level, and that package
  loads a CUDA library. :func:`hicache_on_cpu` imports it against :data:`KVCACHEIO_STANDINS`
  (torch, written from the ``direct`` copy functions' contract; the CUDA-pointer kernels
  of the ``kernel`` io backend raise ``NotImplementedError``), and rebinds the module's
  names to them for the block, also where SGLang imported the real package (a GPU box).
* Host pools pin their buffers (``cudaHostRegister``) by default; for the block,
  ``ALLOC_MEMORY_FUNCS["cpu"]`` (the allocator SGLang picks for a device pool on ``cpu``)
  allocates unpinned memory instead.
* Host pools refuse to build when less than 10 GiB of host RAM would stay free
  (``HICACHE_HOST_MEMORY_RESERVE_BYTES``); the rig's pools take a few MiB, so for the block
  that reserve is 0 (CI runners may have less than 10 GiB free).

Use (one process, one rank)::

    with hicache_on_cpu():
        pool = stock_nsa_pool(8 * PAGE)
        allocator = stock_allocator(pool)
        cache = build_hicache(pool, allocator, page_size=PAGE, hicache_ratio=2.0,
                              write_policy="write_through")
        trip = round_trip(cache, HiCacheRequest.seeded(pool, pages=3, seed=1))
        assert trip.device_bytes_after_load.equal(trip.written)

Build *and* drive the cache inside the block: the copy functions are rebound only there.
The flag-on variant passes the plugin's pool and allocator, a :class:`PoolAccess` that
reads and writes them at logical locations, and, across CP ranks, the attention-CP gloo
group (``group``); every rank then runs the same scenario (HiRadixCache all-reduces in
``writing_check``).
"""

from __future__ import annotations

import importlib
import sys
import time
import types
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from sglang_cp_shared_kv.pool.kv_geometry import NSA_INDEX_HEAD_DIM as INDEX_DIM
from sglang_cp_shared_kv.pool.kv_geometry import NSA_KV_LORA_RANK as KV_LORA_RANK
from sglang_cp_shared_kv.pool.kv_geometry import NSA_QK_ROPE_HEAD_DIM as ROPE_DIM
from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as PAGE
from sglang_cp_shared_kv.pool.kv_geometry import mla_kv_cache_dim
from sglang_cp_shared_kv.scoped import attributes_set

MEMORY_POOL_HOST = "sglang.srt.mem_cache.memory_pool_host"
KVCACHEIO = "sgl_kernel.kvcacheio"
#: the (kv dtype, kv_cache_dim) of each KV cache dtype the rig builds pools of
DTYPES = {"bf16": (torch.bfloat16, mla_kv_cache_dim("bf16")),
          "fp8_e4m3": (torch.float8_e4m3fn, mla_kv_cache_dim("fp8_e4m3"))}
#: the (io backend, host layout) pairs the stand-ins serve (``direct`` io)
SUPPORTED_IO = {("direct", "layer_first"), ("direct", "page_first_direct")}


# ---------------------------------------------------------------- sgl_kernel.kvcacheio stand-ins
def _checked_indices(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int):
    """Both index tensors on the CPU, after the checks the C++ ops make (equal lengths, a
    whole number of pages, a positive page size) and the one their ``int64_t`` reads imply."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"source and destination indices differ in length "
                         f"({src_indices.numel()} != {dst_indices.numel()})")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if src_indices.numel() % page_size:
        raise ValueError(f"{src_indices.numel()} indices are not a whole number of pages of {page_size}")
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be int64 (the kernel reads int64_t), got {t.dtype}")
    return src_indices.reshape(-1).cpu(), dst_indices.reshape(-1).cpu()


def _page_runs(indices: torch.Tensor, page_size: int, what: str) -> List[int]:
    """The first index of each page of ``indices``. The C++ op reads only those and copies
    ``page_size`` rows from each; the stand-in also checks that the rest of each page
    follows its first index (the op does not), so a caller's mistake fails here."""
    pages = indices.view(-1, page_size)
    if page_size > 1 and not torch.equal(pages - pages[:, :1], torch.arange(page_size).expand_as(pages)):
        raise ValueError(f"{what}: each page's {page_size} indices must be consecutive")
    return pages[:, 0].tolist()


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``transfer_kv_direct``: for every (source, destination) layer pair, row
    ``dst_indices[i]`` of the destination becomes row ``src_indices[i]`` of the source
    (dimension 0; the op copies runs of consecutive indices as one slice each)."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers")
    src, dst = _checked_indices(src_indices, dst_indices, page_size)
    for s_layer, d_layer in zip(src_layers, dst_layers):
        rows = s_layer.index_select(0, src.to(s_layer.device))
        d_layer.index_copy_(0, dst.to(d_layer.device), rows.to(d_layer.device))


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """``transfer_kv_all_layer_direct_lf_pf`` (device, layer first -> host, page first;
    every layer): ``dst_ptrs`` holds one page-first host buffer per part (1: the MLA
    latent; 2: K then V), shaped ``(pages, layers, page_size, ...)``; ``src_ptrs`` the
    device layers of each part in turn. Page ``i`` of the indices copies the ``page_size``
    device rows from ``src_indices[i * page_size]`` into host page
    ``dst_indices[i * page_size] // page_size``, in every layer."""
    src, dst = _checked_indices(src_indices, dst_indices, page_size)
    device_rows = _page_runs(src, page_size, "source (device) indices")
    host_pages = [d // page_size for d in _page_runs(dst, page_size, "destination (host) indices")]
    _copy_pages(dst_ptrs, src_ptrs, device_rows, host_pages, page_size, to_host=True)


def _copy_pages(host_parts, device_layers, device_rows, host_pages, page_size, *, to_host, layer_id=0):
    """Page i between ``device_rows[i]`` (its first row, in each layer of ``device_layers``) and
    ``host_pages[i]`` of each page-first host buffer of ``host_parts`` (1: MLA; 2: K then V; layer
    ``layer_id + l`` there for device layer ``l``), in the direction ``to_host`` says."""
    parts = len(host_parts)
    if parts not in (1, 2) or len(device_layers) % parts:
        raise ValueError(f"{len(device_layers)} device layers cannot be split over {parts} host buffers")
    layers = len(device_layers) // parts
    for part, host in enumerate(host_parts):
        for layer in range(layers):
            device_layer = device_layers[part * layers + layer]
            for start, page in zip(device_rows, host_pages):
                rows, host_page = device_layer[start:start + page_size], host[page, layer_id + layer]
                (host_page.copy_(rows) if to_host else rows.copy_(host_page))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """``transfer_kv_per_layer_direct_pf_lf`` (host, page first -> device, layer first; one
    layer): ``src_ptrs`` holds one page-first host buffer per part (1: MLA; 2: K then V),
    ``dst_ptrs`` that part's device tensor of layer ``layer_id``. Page ``i`` of the indices
    copies host page ``src_indices[i * page_size] // page_size`` of layer ``layer_id`` to
    the ``page_size`` device rows from ``dst_indices[i * page_size]``."""
    src, dst = _checked_indices(src_indices, dst_indices, page_size)
    host_pages = [s // page_size for s in _page_runs(src, page_size, "source (host) indices")]
    device_rows = _page_runs(dst, page_size, "destination (device) indices")
    _copy_pages(src_ptrs, dst_ptrs, device_rows, host_pages, page_size, to_host=False, layer_id=layer_id)


def _cuda_kernel(name: str) -> Callable:
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.kvcacheio.{name} is a CUDA kernel of HiCache's 'kernel' io backend (raw device "
            "pointers or warp copies); it has no CPU stand-in: build the cache with io_backend='direct'")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


#: name -> stand-in, for every name ``memory_pool_host`` imports from ``sgl_kernel.kvcacheio``
KVCACHEIO_STANDINS: Dict[str, Callable] = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    **{name: _cuda_kernel(name) for name in (
        "transfer_kv_all_layer", "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_per_layer",
        "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
        "transfer_kv_per_layer_ph_lf")},
}


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator):
    """An ``ALLOC_MEMORY_FUNCS`` entry that ignores ``pin_memory`` (no CUDA to pin with)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


@contextmanager
def _modules_set(entries: Dict[str, types.ModuleType]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in entries}
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _import_memory_pool_host() -> types.ModuleType:
    """``memory_pool_host``, imported (the first time) against the stand-in
    ``sgl_kernel.kvcacheio`` where the real one does not load. The stand-in modules sit in
    ``sys.modules`` only while that one module's body runs; its dependencies are imported
    before, so none of them sees a stand-in ``sgl_kernel``."""
    if MEMORY_POOL_HOST in sys.modules:
        return sys.modules[MEMORY_POOL_HOST]
    for dependency in ("sglang.srt.utils", "sglang.jit_kernel.hicache", "sglang.srt.mem_cache.memory_pool"):
        importlib.import_module(dependency)
    try:
        importlib.import_module(KVCACHEIO)
        return importlib.import_module(MEMORY_POOL_HOST)
    except (ImportError, OSError):  # no CUDA library: "Could not load any common_ops library"
        pass
    kvcacheio = types.ModuleType(KVCACHEIO, "torch stand-ins (sglang_cp_shared_kv_testing.hicache_rig_v0512)")
    for name, standin in KVCACHEIO_STANDINS.items():
        setattr(kvcacheio, name, standin)
    entries = {KVCACHEIO: kvcacheio}
    if "sgl_kernel" not in sys.modules:
        package = types.ModuleType("sgl_kernel", "stand-in parent of the sgl_kernel.kvcacheio stand-in")
        package.__path__ = []
        package.kvcacheio = kvcacheio
        entries["sgl_kernel"] = package
    with _modules_set(entries):
        return importlib.import_module(MEMORY_POOL_HOST)


@contextmanager
def hicache_on_cpu() -> Iterator[types.ModuleType]:
    """SGLang's HiCache runnable on a CPU for the block (yields ``memory_pool_host``):
    ``memory_pool_host`` imported (against the stand-in ``sgl_kernel.kvcacheio`` where the
    real one does not load) and its copy functions bound to :data:`KVCACHEIO_STANDINS`;
    host buffers on ``cpu`` allocated unpinned; no host-RAM reserve. Everything is as it
    was afterwards, except that the module stays imported. Enter it before anything
    imports ``memory_pool_host`` or ``hiradix_cache`` (on a CPU box that import fails
    outside it), and build and drive the cache inside it."""
    mph = _import_memory_pool_host()
    with ExitStack() as stack:
        stack.enter_context(attributes_set(mph, **{n: f for n, f in KVCACHEIO_STANDINS.items() if hasattr(mph, n)}))
        stack.enter_context(attributes_set(mph, HICACHE_HOST_MEMORY_RESERVE_BYTES=0))
        funcs = mph.ALLOC_MEMORY_FUNCS  # a defaultdict: look the entry up without creating it
        saved = funcs["cpu"] if "cpu" in funcs else None
        funcs["cpu"] = _alloc_unpinned
        stack.callback(lambda: funcs.__setitem__("cpu", saved) if saved is not None else funcs.pop("cpu", None))
        yield mph


# ---------------------------------------------------------------- pools, groups, the cache
def stock_nsa_pool(size: int, *, dtype_name: str = "bf16", layers: int = 2, device: str = "cpu"):
    """A stock ``NSATokenToKVPool`` of ``size`` tokens (page 64), DeepSeek-V3.2's row shapes,
    ``layers`` layers."""
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    dtype, dim = DTYPES[dtype_name]
    return NSATokenToKVPool(size, page_size=PAGE, kv_lora_rank=KV_LORA_RANK, dtype=dtype, qk_rope_head_dim=ROPE_DIM,
                            layer_num=layers, device=device, index_head_dim=INDEX_DIM, enable_memory_saver=False,
                            kv_cache_dim=dim)


def stock_allocator(pool, *, need_sort: bool = True):
    """A stock ``PagedTokenToKVPoolAllocator`` over ``pool`` (its size, page, dtype, device).
    ``need_sort`` (as a PD server builds it): freed pages wait in ``release_pages`` until
    the free list runs short, so a load-back after an eviction gets new locations."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(pool.size, pool.page_size, pool.dtype, pool.device, pool, need_sort)


def world_of_one():
    """SGLang's model-parallel state for this one process over gloo (as the
    ``sglang_world_of_one`` fixture sets it up; initialised here if nothing has), and its
    TP CPU group."""
    from sglang.srt.distributed import parallel_state as ps

    from sglang_cp_shared_kv_testing.support import free_port

    if not ps.model_parallel_is_initialized():
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")
    return ps.get_tp_group().cpu_group


def _server_args(**overrides):
    """The ServerArgs fields HiRadixCache and its NSA assembler read (every ``hicache_*``
    field, ``served_model_name``, ``extra_metric_labels``), at ServerArgs' own defaults, then
    ``overrides``; ServerArgs itself is not built (its checks want a model and a GPU)."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    values = {}
    for f in dataclasses.fields(ServerArgs):
        if f.name.startswith("hicache_") or f.name in ("served_model_name", "extra_metric_labels"):
            values[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    unknown = set(overrides) - set(values)
    if unknown:
        raise TypeError(f"not a ServerArgs field HiRadixCache reads: {sorted(unknown)}")
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _cpu_group(group):
    """A gloo ProcessGroup from a ProcessGroup or an SGLang ``GroupCoordinator``."""
    return getattr(group, "cpu_group", group)


def build_hicache(pool, allocator, req_to_token_pool=None, *, page_size: int = PAGE, hicache_ratio: float = 2.0,
                  write_policy: str = "write_through", io_backend: str = "direct",
                  mem_layout: str = "layer_first", group=None, attn_tp_group=None, **server_args):
    """A real ``HiRadixCache`` over ``allocator`` (whose ``get_kvcache()`` is ``pool``), as the
    scheduler builds it with ``--enable-hierarchical-cache``; call inside :func:`hicache_on_cpu`.

    ``pool``: an ``NSATokenToKVPool`` (or subclass): HiRadixCache then builds the
    ``HostPoolGroup`` (KV + INDEXER) and ``HybridCacheController`` path; the host pools are
    sized from ``pool.size`` × ``hicache_ratio`` (or ``hicache_size`` GB, a
    ``server_args`` keyword). ``req_to_token_pool``: only ``cache_finished_req`` /
    ``cache_unfinished_req`` read it; the scenario does not. ``io_backend`` and
    ``mem_layout``: ``direct`` with ``layer_first`` or ``page_first_direct`` (the pairs
    the stand-ins serve; ServerArgs' ``_handle_hicache`` would turn ``page_first`` +
    ``direct`` into ``page_first_direct``). ``group``: the gloo group HiRadixCache keeps
    cache-state decisions rank-identical over, given as the scheduler does under 0.5.12's
    in-seq CP (``tp_cache_group`` = ``attn_cp_cache_group`` = the TP CPU group, attention-CP
    = TP); a ``ProcessGroup`` or a ``GroupCoordinator``; None: :func:`world_of_one`'s.
    ``attn_tp_group``: the attention-TP CPU group (size 1 under in-seq CP; None skips it,
    as a size-1 group is). ``server_args``: other ``hicache_*`` ServerArgs fields.
    """
    if (io_backend, mem_layout) not in SUPPORTED_IO:
        raise ValueError(f"io_backend={io_backend!r} with mem_layout={mem_layout!r}: the CPU stand-ins serve "
                         f"{sorted(SUPPORTED_IO)}")
    if allocator.get_kvcache() is not pool:
        raise ValueError("the allocator's get_kvcache() is not the pool: HiRadixCache takes the pool from it")
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    cpu_group = _cpu_group(group) if group is not None else world_of_one()
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, tp_cache_group=cpu_group, attn_cp_cache_group=cpu_group,
                             attn_tp_cache_group=_cpu_group(attn_tp_group) if attn_tp_group is not None else None)
    args = _server_args(hicache_ratio=hicache_ratio, hicache_write_policy=write_policy,
                        hicache_io_backend=io_backend, hicache_mem_layout=mem_layout, **server_args)
    return HiRadixCache(params=params, server_args=args)


def host_pools(cache):
    """(the KV host pool, the indexer host pool) of an NSA HiRadixCache."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    group = cache.token_to_kv_pool_host
    return group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)


def expected_host_size(device_size: int, ratio: float, page_size: int = PAGE) -> int:
    """Host tokens stock HiCache allocates for a device pool of ``device_size`` tokens:
    ``device_size × ratio`` rounded down to pages, plus one page (``HostKVCache.__init__``)."""
    return (int(device_size * ratio) // page_size + 1) * page_size


# ---------------------------------------------------------------- content at locations
@dataclass
class PoolBytes:
    """KV content of some token locations, as bytes, per layer: ``mla[l]`` the MLA rows
    ``(tokens, 1, row bytes)``, ``index[l]`` the index K+scale pages of those tokens
    ``(pages, 64 × 132)`` (the locations' pages, in order, one per 64 tokens)."""

    mla: List[torch.Tensor]
    index: List[torch.Tensor]

    def equal(self, other: "PoolBytes") -> bool:
        return self.mismatches(other) == []

    def prefix(self, tokens: int, page_size: int = PAGE) -> "PoolBytes":
        """The content of the first ``tokens`` tokens (whole pages)."""
        return PoolBytes(mla=[t[:tokens] for t in self.mla], index=[t[:tokens // page_size] for t in self.index])

    def mismatches(self, other: "PoolBytes") -> List[str]:
        """Where ``other`` differs (empty: bit-identical), for assertion messages."""
        out = []
        for what, mine, theirs in (("mla", self.mla, other.mla), ("index", self.index, other.index)):
            if len(mine) != len(theirs):
                out.append(f"{what}: {len(mine)} layers vs {len(theirs)}")
                continue
            for layer, (a, b) in enumerate(zip(mine, theirs)):
                if a.shape != b.shape:
                    out.append(f"{what} layer {layer}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                elif not torch.equal(a, b):
                    rows = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
                    out.append(f"{what} layer {layer}: rows {rows[:8]}{'...' if len(rows) > 8 else ''} differ")
        return out


def page_starts(locs: torch.Tensor, page_size: int = PAGE) -> torch.Tensor:
    """The page numbers of whole-page locations ``locs`` (one per ``page_size`` tokens)."""
    if locs.numel() % page_size:
        raise ValueError(f"{locs.numel()} locations are not whole pages of {page_size}")
    return locs.reshape(-1, page_size)[:, 0] // page_size


class PoolAccess:
    """How the scenario reads and writes a device pool's KV at (logical) token locations.
    This one is the stock pool's: ``kv_buffer[layer]`` rows and
    ``index_k_with_scale_buffer[layer]`` pages indexed by the locations themselves. The
    flag-on variant subclasses it with the sharded pool's translation (and, per rank, the
    pages the rank owns)."""

    def write(self, pool, locs: torch.Tensor, content: PoolBytes) -> None:
        pages = page_starts(locs, pool.page_size).to(pool.device)
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer].view(torch.uint8)[locs.to(pool.device)] = content.mla[layer].to(pool.device)
            pool.index_k_with_scale_buffer[layer][pages] = content.index[layer].to(pool.device)

    def read(self, pool, locs: torch.Tensor) -> PoolBytes:
        pages, rows = page_starts(locs, pool.page_size).to(pool.device), locs.to(pool.device)
        return PoolBytes(
            mla=[pool.kv_buffer[layer].view(torch.uint8)[rows].cpu() for layer in range(pool.layer_num)],
            index=[pool.index_k_with_scale_buffer[layer][pages].cpu() for layer in range(pool.layer_num)])


STOCK_ACCESS = PoolAccess()


def seeded_bytes(pool, tokens: int, seed: int) -> PoolBytes:
    """Random bytes (``torch.Generator`` seeded with ``seed``) shaped as ``tokens`` tokens'
    MLA rows and index pages of ``pool``, every layer."""
    gen = torch.Generator().manual_seed(seed)
    row_bytes = pool.kv_buffer[0].view(torch.uint8).shape[1:]
    page_bytes = pool.index_k_with_scale_buffer[0].shape[1:]

    def draw(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)

    return PoolBytes(mla=[draw(tokens, *row_bytes) for _ in range(pool.layer_num)],
                     index=[draw(tokens // pool.page_size, *page_bytes) for _ in range(pool.layer_num)])


def read_host(cache, host_indices: torch.Tensor) -> PoolBytes:
    """The bytes the host pools hold at ``host_indices`` (whole pages), in either host layout."""
    kv_host, index_host = host_pools(cache)
    layers, page = kv_host.layer_num, kv_host.page_size
    idx = host_indices.cpu()
    pages = page_starts(idx, page)
    if kv_host.layout == "layer_first":
        mla = [kv_host.kv_buffer[layer][idx] for layer in range(layers)]
        index = [index_host.index_k_with_scale_buffer[layer][pages] for layer in range(layers)]
    elif kv_host.layout == "page_first_direct":
        mla = [kv_host.kv_buffer[idx // page, layer, idx % page] for layer in range(layers)]
        index = [index_host.index_k_with_scale_buffer[pages, layer, 0] for layer in range(layers)]
    else:
        raise ValueError(f"host layout {kv_host.layout!r}")
    return PoolBytes(mla=[t.view(torch.uint8).clone() for t in mla], index=[t.clone() for t in index])


# ---------------------------------------------------------------- the scenario
@dataclass(frozen=True)
class HiCacheCase:
    """One case of the sharded host tier rigs (both releases): a request's round trip on a CP group."""
    name: str
    dtype_name: str
    write_policy: str
    mem_layout: str
    physical_pages: int  #: device pages per rank
    request_pages: int
    debug: bool = False  #: the plugin's debug checks (SGLANG_DEBUG_CP_SHARED_KV=1)
    #: the negative control: backups ignore their device pages' lanes (host pages dealt out
    #: cyclically), on a request whose first page is rank 1's -- must come back wrong
    lanes_ignored: bool = False
    #: ``fillers * N + 1`` requests of ``request_pages`` backed up and evicted from the device before
    #: the round trip, more than the host tier holds: backups then find lanes short and evict host
    #: pages (the 0.5.23 rig's pressure case)
    fillers: int = 0


@dataclass
class HiCacheRequest:
    """One request's tokens (its radix key) and KV content (whole pages)."""

    token_ids: List[int]
    content: PoolBytes

    @classmethod
    def seeded(cls, pool, *, pages: int, seed: int) -> "HiCacheRequest":
        gen = torch.Generator().manual_seed(seed + 1_000_003)
        tokens = pages * pool.page_size
        return cls(torch.randint(0, 32000, (tokens,), generator=gen).tolist(), seeded_bytes(pool, tokens, seed))


@dataclass
class RoundTrip:
    """What :func:`round_trip` saw. ``written``: the bytes put on the device; ``host_bytes``:
    what the host pools held after the backup; ``device_bytes_after_load``: the bytes at
    ``new_locs`` after the load-back. ``sync_calls``: HiRadixCache's rank-agreement calls
    (``_all_reduce_attn_groups`` / ``_barrier_attn_groups``) per scenario step; each reduces
    over every attention group of size > 1 (else the TP group), so none runs in a world
    of one."""

    old_locs: torch.Tensor
    new_locs: torch.Tensor
    host_indices: torch.Tensor
    host_hit_length: int
    device_hit_after_load: int
    written: PoolBytes
    host_bytes: PoolBytes
    device_bytes_after_load: PoolBytes
    evicted_tokens: int
    sync_calls: Dict[str, Counter] = field(default_factory=dict)


class HiCacheScenario:
    """Drives a HiRadixCache step by step as the scheduler would around one request, and
    counts the cache's rank-agreement calls per step (``sync_calls``). Every rank of a
    multi-rank run must call the same steps in the same order."""

    def __init__(self, cache, access: PoolAccess = STOCK_ACCESS):
        self.cache, self.access = cache, access
        self.pool = cache.kv_cache
        self.sync_calls: Dict[str, Counter] = {}

    @contextmanager
    def step(self, name: str):
        """Count the cache's rank-agreement calls made inside the block under ``name``."""
        counts = self.sync_calls.setdefault(name, Counter())
        wrapped = {}
        for method in ("_all_reduce_attn_groups", "_barrier_attn_groups"):
            original = getattr(self.cache, method)

            def counted(*args, _original=original, _method=method, **kwargs):
                counts[_method] += 1
                return _original(*args, **kwargs)

            wrapped[method] = counted
        with attributes_set(self.cache, **wrapped):
            yield

    def key(self, token_ids: Sequence[int]):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(token_ids=list(token_ids))

    def place(self, request: HiCacheRequest, locs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Device locations for the request (from the allocator, as a prefill's
        ``alloc_extend`` of whole pages; or ``locs``), with its content written there."""
        if locs is None:
            locs = self.cache.token_to_kv_pool_allocator.alloc(len(request.token_ids))
            if locs is None:
                raise RuntimeError(f"the allocator has no room for {len(request.token_ids)} tokens")
        self.access.write(self.pool, locs, request.content)
        return locs

    def insert(self, request: HiCacheRequest, locs: torch.Tensor):
        """``insert`` of the request's tokens at ``locs`` (as ``cache_finished_req`` would)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        with self.step("insert"):
            return self.cache.insert(InsertParams(key=self.key(request.token_ids), value=locs))

    def node(self, request: HiCacheRequest):
        """The tree node that ends at the request's last token (the whole request matched)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        match = self.cache.match_prefix(MatchPrefixParams(key=self.key(request.token_ids)))
        return match.last_host_node if match.host_hit_length else match.last_device_node

    def backup(self, request: HiCacheRequest, locs: torch.Tensor, max_inserts: int = 4) -> None:
        """Write-through backup (``write_through``: the first insert; ``write_through_selective``:
        the second): re-insert until the node is backed up, then ``writing_check`` until the
        controller's acks are drained. A ``write_back`` cache backs up in :meth:`evict`."""
        if self.cache.cache_controller.write_policy == "write_back":
            raise ValueError("write_back backs up on eviction: call evict()")
        for _ in range(max_inserts):
            node = self.node(request)
            if node is not self.cache.root_node and node.backuped:
                break
            self.insert(request, locs)
        else:
            raise AssertionError(f"not backed up after {max_inserts} inserts")
        with self.step("writing_check"):
            while self.cache.ongoing_write_through:
                self.cache.writing_check()

    def evict(self, tokens: int) -> int:
        """``evict`` of ``tokens`` device tokens (LRU leaves); returns how many were evicted."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        with self.step("evict"):
            return self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted

    def match(self, request: HiCacheRequest):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        with self.step("match_prefix"):
            return self.cache.match_prefix(MatchPrefixParams(key=self.key(request.token_ids)))

    def load_back(self, match) -> torch.Tensor:
        """The scheduler's load-back of a host hit: ``init_load_back`` (PrefillAdder),
        ``ready_to_load_host_cache`` (``start_loading``: every layer's H2D), then
        ``loading_check`` until the load is acked. Returns the new device locations."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        with self.step("init_load_back"):
            device_indices, _node = self.cache.init_load_back(
                InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length))
        with self.step("ready_to_load_host_cache"):
            self.cache.ready_to_load_host_cache()
        with self.step("loading_check"):
            while self.cache.ongoing_load_back:
                self.cache.loading_check()
        return device_indices

    def poison(self, locs: torch.Tensor, seed: int) -> None:
        """Overwrite freed locations with other bytes, so a load that copied nothing (or
        back to the old rows) cannot pass."""
        self.access.write(self.pool, locs, seeded_bytes(self.pool, locs.numel(), seed))


def round_trip(cache, request: HiCacheRequest, *, access: PoolAccess = STOCK_ACCESS,
               locs: Optional[torch.Tensor] = None) -> RoundTrip:
    """The whole round trip of one request through ``cache`` (built by :func:`build_hicache`,
    inside :func:`hicache_on_cpu`): place its content on the device, insert it, back it up
    (write-through: on insert + ``writing_check``; write-back: on eviction), evict it from
    the device, poison the freed rows, ``match_prefix`` (a host hit), load it back, and read
    the bytes at the new locations."""
    scenario = HiCacheScenario(cache, access)
    old_locs = scenario.place(request, locs)
    scenario.insert(request, old_locs)
    write_back = cache.cache_controller.write_policy == "write_back"
    if not write_back:
        scenario.backup(request, old_locs)
    evicted = scenario.evict(len(request.token_ids))
    node = scenario.node(request)
    host_indices = node.host_value.clone()
    host_bytes = read_host(cache, host_indices)
    scenario.poison(old_locs, seed=0xBAD)
    match = scenario.match(request)
    new_locs = scenario.load_back(match)
    after = scenario.match(request)
    return RoundTrip(old_locs=old_locs, new_locs=new_locs, host_indices=host_indices,
                     host_hit_length=match.host_hit_length, device_hit_after_load=len(after.device_indices),
                     written=request.content, host_bytes=host_bytes,
                     device_bytes_after_load=access.read(cache.kv_cache, new_locs), evicted_tokens=evicted,
                     sync_calls=scenario.sync_calls)


# ---------------------------------------------------------------- the storage tier (L3)
def settle(cache, done: Callable[[], bool], *, what: str, max_steps: int = 600, pause_s: float = 0.02) -> int:
    """Scheduler steps until ``done()``: each step runs ``check_hicache_events`` (the scheduler's
    per-step HiCache work, with its rank agreements), then ``done()``, whose answer must be the
    same on every rank (an agreed state), so every rank runs the same number of steps. Returns
    the steps taken; raises ``TimeoutError`` after ``max_steps`` (on every rank alike)."""
    for step in range(1, max_steps + 1):
        cache.check_hicache_events()
        if done():
            return step
        time.sleep(pause_s)
    raise TimeoutError(f"{what}: not done after {max_steps} scheduler steps")


def free_host_tokens(host) -> int:
    """Every free token of a host pool: the shared-KV pools' ``free_size`` (their
    ``available_size`` is the lane floor), stock's ``available_size``."""
    return host.free_size() if hasattr(host, "free_size") else host.available_size()


def host_tokens_in_tree(cache) -> int:
    """Host tokens the radix tree holds (every node's ``host_value``)."""
    held, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        if node is not cache.root_node and node.host_value is not None:
            held += len(node.host_value)
        stack.extend(node.children.values())
    return held


def poison_host(cache, seed: int) -> None:
    """Random bytes over both host pools (every row), so a prefetch that fetched nothing cannot pass."""
    gen = torch.Generator().manual_seed(seed)
    for pool in host_pools(cache):
        buffer = pool.kv_buffer if hasattr(pool, "kv_buffer") else pool.index_k_with_scale_buffer
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@dataclass
class StorageTrip:
    """What :func:`storage_round_trip` saw. ``stored_hashes``: the request's page keys as SGLang
    computed them; ``device_hit_before``/``host_hit_before``: the tree's match once the request
    left device and host memory; ``loaded_tokens``: what SGLang counted as fetched from storage;
    ``host_hit_length``: the host hit after the prefetch; ``device_bytes_after_load``: the bytes at
    ``new_locs`` after loading that hit back; ``host_tokens``: (free host tokens + host tokens in
    the tree, the host pool's size) once every prefetch page was released."""

    stored_hashes: List[str]
    device_hit_before: int
    host_hit_before: int
    loaded_tokens: int
    host_hit_length: int
    new_locs: torch.Tensor
    written: PoolBytes
    device_bytes_after_load: PoolBytes
    host_tokens: tuple
    steps: Dict[str, int]


def storage_round_trip(cache, request: HiCacheRequest, *, access: PoolAccess = STOCK_ACCESS, req_id: str = "req",
                       store: bool = True, before_prefetch: Optional[Callable[[List[str]], None]] = None,
                       released: Callable[[], bool] = lambda: True, prefetches: int = 1,
                       before_progress: Optional[Callable[[str], None]] = None) -> StorageTrip:
    """One request through the storage tier of ``cache`` (built with a storage backend): place
    and insert it, back it up to host (write-through) and from host to storage, evict it from
    device and host memory, poison both, prefetch it from storage (``prefetch_from_storage`` as
    the scheduler calls it for a request whose prefix left the tree; ``check_prefetch_progress``
    every step until done), load the host hit back and read it. ``store=False``: only the
    prefetch (what another group stored). ``before_prefetch(hashes)``: runs just before the
    prefetch (e.g. a lost object). ``released()``: an agreed "every prefetch page is free again",
    awaited before the host pool is audited. ``prefetches``: how many times the prefetch is
    started under the same request id (SGLang then tracks only the last). ``before_progress(req_id)``:
    runs after the prefetch is started and before the first scheduler step that checks it (a
    rank-local wait, say: no agreement may run in it)."""
    scenario = HiCacheScenario(cache, access)
    steps: Dict[str, int] = {}
    tokens = len(request.token_ids)
    hashes: List[str] = []
    if store:
        locs = scenario.place(request)
        scenario.insert(request, locs)
        scenario.backup(request, locs)
        steps["stored"] = settle(cache, lambda: not cache.ongoing_backup, what="the backup to storage")
        hashes = list(scenario.node(request).hash_value)
        scenario.evict(tokens)
        cache.evict_host(tokens)
        scenario.poison(locs, seed=0xBAD)
    poison_host(cache, seed=0xBAD + 1)
    before = scenario.match(request)
    if before_prefetch is not None:
        before_prefetch(hashes)
    for _ in range(prefetches):
        cache.prefetch_from_storage(req_id, cache.root_node, list(request.token_ids), None, None)
    if before_progress is not None:
        before_progress(req_id)
    steps["prefetched"] = settle(cache, lambda: cache.check_prefetch_progress(req_id), what="the prefetch")
    loaded = cache.pop_prefetch_loaded_tokens(req_id)
    match = scenario.match(request)
    if match.host_hit_length:
        new_locs = scenario.load_back(match)
    else:
        new_locs = torch.empty(0, dtype=torch.int64)
    steps["released"] = settle(cache, released, what="the release of the prefetch's host pages")
    host = host_pools(cache)[0]  # (the KV pool: a pool group's size is the anchor's at construction)
    return StorageTrip(stored_hashes=hashes, device_hit_before=len(before.device_indices),
                       host_hit_before=before.host_hit_length, loaded_tokens=loaded,
                       host_hit_length=match.host_hit_length, new_locs=new_locs,
                       written=request.content.prefix(len(new_locs), cache.page_size),
                       device_bytes_after_load=access.read(cache.kv_cache, new_locs),
                       host_tokens=(free_host_tokens(host) + host_tokens_in_tree(cache), host.size), steps=steps)


__all__ = ["hicache_on_cpu", "KVCACHEIO_STANDINS", "transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf",
           "transfer_kv_per_layer_direct_pf_lf", "stock_nsa_pool", "stock_allocator", "world_of_one",
           "build_hicache", "host_pools", "expected_host_size", "PoolBytes", "PoolAccess", "STOCK_ACCESS",
           "page_starts", "seeded_bytes", "read_host", "HiCacheRequest", "RoundTrip", "HiCacheScenario",
           "round_trip", "HiCacheCase", "PAGE", "DTYPES", "SUPPORTED_IO", "settle", "host_tokens_in_tree", "poison_host",
           "StorageTrip", "storage_round_trip", "free_host_tokens"]
