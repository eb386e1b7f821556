"""Torch equivalents of SGLang Triton kernels that cannot run on a CPU.

Each stand-in reproduces one kernel's contract (inputs, outputs, in-place writes) in
plain torch, written from the contract, not from the kernel source. CPU tests install
them only through the ``triton_standins`` fixture (test/integration/conftest.py), and
the multi-process CP harness through :func:`install` with the same table;
test/gpu/test_standins_match_triton.py proves each one equal to the Triton kernel it
stands for on a GPU.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.releases import installed


def _ceil_pages(n: torch.Tensor, page_size: int) -> torch.Tensor:
    return (n + page_size - 1) // page_size


def alloc_extend_reference(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size):
    """``alloc_extend_kernel``: request i's new tokens fill the tail of its last prefix
    page (continuing after ``last_loc[i]``), then whole new pages taken from
    ``free_pages`` in order, requests one after another; ``out_indices`` receives the
    token locations of all extend tokens, request by request."""
    out_pos = 0
    next_free = 0
    for pre, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
        positions = torch.arange(pre, seq, dtype=torch.int64)
        first_new_page_pos = -(-pre // page_size) * page_size
        in_old_page = positions < first_new_page_pos
        locs = torch.empty_like(positions)
        locs[in_old_page] = last + 1 + (positions[in_old_page] - pre)
        new = positions[~in_old_page]
        page_slot = next_free + (new // page_size - first_new_page_pos // page_size)
        free = free_pages.cpu()
        # Past the free list the kernel reads garbage, which the allocator then discards
        # (it returns None); stay in bounds and write -1 instead.
        in_list = page_slot < len(free)
        locs[~in_old_page] = torch.where(
            in_list, free[page_slot.clamp(max=max(len(free) - 1, 0))] * page_size + new % page_size, -1
        ) if len(free) else -1
        out_indices[out_pos:out_pos + len(locs)] = locs.to(out_indices.device)
        out_pos += len(locs)
        next_free += int(_ceil_pages(torch.tensor(seq), page_size) - _ceil_pages(torch.tensor(pre), page_size))


def alloc_decode_reference(seq_lens, last_loc, free_pages, out_indices, page_size):
    """``alloc_decode_kernel``: one new token per request, after ``last_loc[i]`` when it
    stays in the same page, else at the start of the next free page (in order)."""
    next_free = 0
    for i, (seq, last) in enumerate(zip(seq_lens.tolist(), last_loc.tolist())):
        starts_page = (seq - 1) % page_size == 0
        if starts_page:
            out_indices[i] = free_pages[next_free] * page_size
            next_free += 1
        else:
            out_indices[i] = last + 1


class TritonLaunch:
    """Stands in for a ``@triton.jit`` allocator kernel launched as
    ``kernel[grid](*tensors, bs_upper, page_size)``; ``bs_upper`` only sizes Triton's
    block and has no meaning here."""

    def __init__(self, reference):
        self.reference = reference

    def __getitem__(self, grid):
        def launch(*args):
            *tensors, _bs_upper, page_size = args
            self.reference(*tensors, page_size)

        return launch


ALLOC_EXTEND_STANDIN = TritonLaunch(alloc_extend_reference)
ALLOC_DECODE_STANDIN = TritonLaunch(alloc_decode_reference)


# ------------------------------------------------------------------ MLA KV store
def set_mla_kv_buffer_reference(kv_buffer, loc, cache_k_nope, cache_k_rope):
    """``set_mla_kv_buffer_triton``: row ``loc[i]`` of ``kv_buffer`` (rows, 1, dim)
    becomes ``[nope_i | rope_i]`` (same element type as the buffer)."""
    rows = torch.cat([cache_k_nope.reshape(len(loc), -1), cache_k_rope.reshape(len(loc), -1)], dim=-1)
    kv_buffer[loc.long()] = rows.view(kv_buffer.dtype).reshape(len(loc), *kv_buffer.shape[1:])


FP8_E4M3_MAX = 448.0


def quantize_k_cache_separate_reference(k_nope, k_rope, tile_size: int = 128):
    """``quantize_k_cache_separate``: per token, each 128-value tile of the 512 nope
    values as fp8 with scale max|x|/448 (fp32), then the 4 scales, then the rope values
    as raw bf16 bytes; returns ((n, 1, 528) uint8, (n, 1, 128) uint8)."""
    nope = k_nope.reshape(k_nope.shape[0], -1).float()
    rope = k_rope.reshape(k_rope.shape[0], -1)
    tiles = nope.view(nope.shape[0], -1, tile_size)
    scale = tiles.abs().amax(dim=-1) / FP8_E4M3_MAX
    q = torch.clamp(tiles * (1.0 / scale)[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    nope_part = torch.cat([q.view(torch.uint8).reshape(nope.shape[0], -1), scale.view(torch.uint8)], dim=1)
    rope_part = rope.contiguous().view(torch.uint8)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


# ------------------------------------------------------------------ NSA index K
def act_quant_reference(x, block_size: int = 128, scale_fmt=None):
    """``nsa.triton_kernel.act_quant``: per 128-value block, scale = max(|x|, 1e-4)/448
    (rounded up to a power of two when ``scale_fmt`` is set), y = clamp(x/scale) as fp8."""
    blocks = x.float().reshape(*x.shape[:-1], -1, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / FP8_E4M3_MAX)))) if scale_fmt is not None \
        else amax * (1.0 / FP8_E4M3_MAX)
    y = torch.clamp(blocks / scale[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), scale


def _index_k_bytes(buf, page_size):
    return buf.shape[1] // page_size - 4  # K bytes per token (scales take 4)


def set_k_and_s_reference(buf, loc, index_k, index_k_scale, page_size):
    """``_set_k_and_s_triton``: token ``loc[i]``'s 128 K bytes at its slot in the page's K
    area, its fp32 scale at its slot in the page's scale area (after 64 x 128 K bytes)."""
    k_bytes = _index_k_bytes(buf, page_size)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    k_cols = slot[:, None] * k_bytes + torch.arange(k_bytes, device=buf.device)
    buf[page[:, None], k_cols] = index_k.reshape(len(loc), -1).view(torch.uint8)
    s_cols = page_size * k_bytes + slot[:, None] * 4 + torch.arange(4, device=buf.device)
    buf[page[:, None], s_cols] = index_k_scale.reshape(len(loc), 1).float().view(torch.uint8)


def _gather_tokens(buf, page_indices, seq_len, page_size, column0, width, stride):
    tokens = torch.arange(seq_len, device=buf.device)
    pages = page_indices.long()[tokens // page_size]
    cols = column0 + (tokens % page_size)[:, None] * stride + torch.arange(width, device=buf.device)
    return buf[pages[:, None], cols]


def get_k_reference(buf, page_indices, seq_len, page_size, index_head_dim):
    """``_get_k_triton``: the K bytes of tokens 0..seq_len-1 of the pages ``page_indices``."""
    return _gather_tokens(buf, page_indices, seq_len, page_size, 0, index_head_dim, index_head_dim)


def get_s_reference(buf, page_indices, seq_len, page_size, index_head_dim):
    """``_get_s_triton``: the 4 scale bytes of tokens 0..seq_len-1."""
    return _gather_tokens(buf, page_indices, seq_len, page_size, page_size * index_head_dim, 4, 4)


def get_k_and_s_reference(buf, page_indices, seq_lens, seq_len_sum, max_seq_len, page_size, index_head_dim):
    """``_get_k_and_s_triton``: K and scale bytes of every sequence of the batch, concatenated
    (row b of ``page_indices`` holds sequence b's pages)."""
    ks, ss = [], []
    for b, seq_len in enumerate(seq_lens.tolist()):
        ks.append(get_k_reference(buf, page_indices[b], seq_len, page_size, index_head_dim))
        ss.append(get_s_reference(buf, page_indices[b], seq_len, page_size, index_head_dim))
    return torch.cat(ks), torch.cat(ss)


# (module, attribute, torch stand-in): every SGLang Triton entry point the CPU tests replace,
# per release (0.5.23 moved the index-K accessor to ``sglang.kernels``; its allocator has a
# CPU path of its own, and its indexer takes ``act_quant`` from the caller, the rigs).
STANDINS_0512 = (
    ("sglang.srt.mem_cache.allocator", "alloc_extend_kernel", ALLOC_EXTEND_STANDIN),
    ("sglang.srt.mem_cache.allocator", "alloc_decode_kernel", ALLOC_DECODE_STANDIN),
    ("sglang.srt.mem_cache.memory_pool", "set_mla_kv_buffer_triton", set_mla_kv_buffer_reference),
    ("sglang.srt.mem_cache.memory_pool", "quantize_k_cache_separate", quantize_k_cache_separate_reference),
    ("sglang.srt.layers.attention.nsa.triton_kernel", "act_quant", act_quant_reference),
    ("sglang.srt.layers.attention.nsa.index_buf_accessor", "_set_k_and_s_triton", set_k_and_s_reference),
    ("sglang.srt.layers.attention.nsa.index_buf_accessor", "_get_k_triton", get_k_reference),
    ("sglang.srt.layers.attention.nsa.index_buf_accessor", "_get_s_triton", get_s_reference),
    ("sglang.srt.layers.attention.nsa.index_buf_accessor", "_get_k_and_s_triton", get_k_and_s_reference),
)
STANDINS_0523 = (
    ("sglang.srt.mem_cache.memory_pool", "set_mla_kv_buffer_triton", set_mla_kv_buffer_reference),
    ("sglang.srt.mem_cache.memory_pool", "quantize_k_cache_separate", quantize_k_cache_separate_reference),
    ("sglang.kernels.ops.kvcache.dsa_index_k_cache", "_set_k_and_s_triton", set_k_and_s_reference),
    ("sglang.kernels.ops.kvcache.dsa_index_k_cache", "_get_k_and_s_triton", get_k_and_s_reference),
)
#: each release's, by ``Release.name``
STANDINS_BY_RELEASE = {"v0512": STANDINS_0512, "v0523": STANDINS_0523}


def install(setattr_fn=setattr):
    """Put every stand-in in place (``setattr_fn``: pytest's ``monkeypatch.setattr`` to undo it)."""
    import importlib

    for module, attribute, standin in STANDINS_BY_RELEASE[installed.INSTALLED.name]:
        setattr_fn(importlib.import_module(module), attribute, standin)

