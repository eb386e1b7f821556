"""The rig's per-release seam: what differs between SGLang 0.5.12.post1's and 0.5.23's
Mooncake PD classes around the parts the rig drives, one class per release
(:func:`release` picks the installed one; the rest of the rig is the same for both).

* the process's parallel and config state: 0.5.12.post1 reads the attention ranks from
  ``dp_attention`` functions (the rig answers them in ``common.conn`` while a manager is
  built); 0.5.23 reads a published runtime context (``runtime_context.publish`` of a real
  ``ServerArgs`` for a tiny DeepSeek-V3.2 config, once per process, then SGLang's own
  scoped ``get_parallel().override`` with one rank's coherent topology and the instance's
  bootstrap port while its manager is built);
* the pool classes (``NSATokenToKVPool`` / ``DSATokenToKVPool`` and the plugin's), the
  ``KVArgs`` and ``MetadataBuffers`` fields, the sender's constructor;
* what ``send_kv_chunk`` reads of the scheduler and the request (0.5.23 reads more);
* the DSA index page list: over the whole sequence on 0.5.12.post1, decode's suffix after
  its cached prefix on 0.5.23 (decode keeps the prefix's index pages it holds).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace


class Release0512:
    """SGLang 0.5.12.post1."""

    #: decode's NSA index page list starts at token 0 (prefill sends the prefix's index pages too)
    index_pages_from_prefix = False
    #: the plugin's allocator hands a chunk's pages to the ranks that compute them (in-seq split)
    compute_owner_allocation = True
    #: stock prefill sends a one-token stand-in for a prompt it refused (Req.set_finish_with_abort)
    stock_sends_refused_prompt_standin = True

    def setup_process(self, workdir: str, role: str) -> None:
        """Nothing to publish: 0.5.12.post1's managers read no process-wide config."""

    @contextmanager
    def identity(self, cp_rank: int, cp_size: int, bootstrap_port: int):
        """What SGLang's connection layer reads from the model-parallel state, for one rank
        (there is no torch.distributed world here)."""
        import sglang.srt.disaggregation.common.conn as common

        from sglang_cp_shared_kv.scoped import attributes_set

        values = dict(get_attention_tp_size=lambda: 1, get_attention_tp_rank=lambda: 0,
                      get_attention_cp_size=lambda: cp_size, get_attention_cp_rank=lambda: cp_rank,
                      get_attention_dp_size=lambda: 1, get_attention_dp_rank=lambda: 0,
                      get_pp_group=lambda: SimpleNamespace(rank_in_group=0, world_size=1))
        with attributes_set(common, **values):
            yield

    def pool_classes(self):
        """(stock pool class, the plugin's shared pool class)."""
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        from sglang_cp_shared_kv.pool.kv_pool_v0512 import CpSharedNSATokenToKVPool

        return NSATokenToKVPool, CpSharedNSATokenToKVPool

    def kv_args(self, pool, metadata_buffers):
        """``KVArgs`` for ``pool`` and ``metadata_buffers``, as SGLang's scheduler fills them."""
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import setup_state_kv_args

        args = KVArgs()
        args.engine_rank, args.pp_rank, args.system_dp_rank, args.gpu_id = 0, 0, 0, 0
        args.prefill_start_layer = pool.start_layer
        args.prefill_end_layer = getattr(pool, "end_layer", None)
        args.mla_compression_ratios = None
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
        args.page_size = pool.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata_buffers.get_buf_infos()
        args.ib_device = None
        setup_state_kv_args(args, pool, None, pool.layer_num)
        return args

    def metadata_buffers(self, slots: int):
        """SGLang's aux ``MetadataBuffers`` with ``slots`` request slots."""
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        return MetadataBuffers(slots, hidden_size=16, hidden_states_dtype=torch.float32)

    def sender(self, kv_mgr, bootstrap_addr: str, room: int):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        return MooncakeKVSender(kv_mgr, bootstrap_addr, room, [0], 0)

    def request(self, room, sender, seq_len: int, first_token: int):
        """The request fields ``send_kv_chunk`` and ``MetadataBuffers.set_buf`` read."""
        return SimpleNamespace(
            rid=f"room-{room}", bootstrap_room=room, origin_input_ids=[1] * seq_len, output_ids=[first_token],
            req_pool_idx=0, start_send_idx=0, metadata_buffer_index=None, disagg_kv_sender=sender, cached_tokens=0,
            cached_tokens_device=0, cached_tokens_host=0, cached_tokens_storage=0, return_logprob=False,
            hidden_states_tensor=None)

    def bootstrapped(self, req, decode_prefix_len: int) -> None:
        """What ``PrefillBootstrapQueue.pop_bootstrapped`` sets on the request."""
        req.start_send_idx = decode_prefix_len

    def scheduler_extras(self) -> dict:
        """Scheduler attributes ``send_kv_chunk`` reads beyond the pools and buffers."""
        return {}

    def send_kv_chunk(self, scheduler, req, last_chunk: bool, end_idx):
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=last_chunk, end_idx=end_idx)

    def page_list(self, req_to_token_row, start: int, stop: int, page_size: int):
        """The pages of tokens [start, stop) of a request's page table row (numpy)."""
        from sglang.srt.mem_cache.common import kv_to_page_indices

        return kv_to_page_indices(req_to_token_row[start:stop].numpy(), page_size)

    def decode_index_pages(self, req_to_token_row, prefix_len: int, seq_len: int, page_size: int):
        """The NSA index page list decode sends (``DecodePreallocQueue``): the whole sequence."""
        return self.page_list(req_to_token_row, 0, seq_len, page_size)

    def refuse_at_intake(self, kv_mgr, room: int, message: str) -> bool:
        """0.5.12.post1 keeps a refused prompt as a one-token stand-in (``room["prefill_refused"]``)."""
        raise NotImplementedError("sglang 0.5.12.post1 sends a refused prompt's one-token stand-in")


class Release0523(Release0512):
    """SGLang 0.5.23."""

    index_pages_from_prefix = True
    #: interleave computes rows of every page on every rank: the allocator leaves compute-owner
    #: pages out (docs/design.md, "The CP strategy on 0.5.23")
    compute_owner_allocation = False
    #: 0.5.23 retires a refused prompt at intake (``is_unadmitted_reject``): nothing is sent
    stock_sends_refused_prompt_standin = False

    def setup_process(self, workdir: str, role: str) -> None:
        """Publish this process's runtime context: a real ``ServerArgs`` (PD ``role``, Mooncake,
        page 64, TP 1) for a tiny DeepSeek-V3.2 config; each manager then states its own CP
        rank (:meth:`identity`)."""
        import torch
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import prepare_server_args

        model = write_tiny_dsv32(workdir)
        # NOTE: resolution asks the GPU for its compute capability (the DSA backend defaults);
        # the rig answers what the H200 this targets would. No kernel runs here.
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
        server_args = prepare_server_args([
            "--model-path", str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cuda",
            "--tp", "1", "--page-size", "64", "--host", "127.0.0.1", "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", "mooncake"])
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        # NOTE: no torch.distributed world: the managers read the pipeline group only when PP > 1
        get_parallel().override_permanently(pp_group=None)

    @contextmanager
    def identity(self, cp_rank: int, cp_size: int, bootstrap_port: int):
        """One CP rank of a TP = CP = ``cp_size`` prefill (attention TP 1), stated with SGLang's
        own scoped overrides (the topology must be coherent: TP and MoE TP widths follow)."""
        from sglang.srt.runtime_context import get_disagg, get_parallel

        with get_parallel().override(tp_size=cp_size, tp_rank=cp_rank, moe_tp_size=cp_size, attn_cp_size=cp_size,
                                     attn_cp_rank=cp_rank, attn_tp_size=1, attn_tp_rank=0), \
                get_disagg().override(disaggregation_bootstrap_port=bootstrap_port):
            yield

    def pool_classes(self):
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        from sglang_cp_shared_kv.pool.kv_pool_v0523 import CpSharedDSATokenToKVPool

        return DSATokenToKVPool, CpSharedDSATokenToKVPool

    def kv_args(self, pool, metadata_buffers):
        """As 0.5.23's ``PrefillBootstrapQueue._init_kv_manager`` fills them (no draft model)."""
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import (
            build_kv_layer_ids,
            get_kv_transfer_buf_infos,
            get_pd_kv_layout,
            setup_state_kv_args,
        )

        args = KVArgs()
        args.engine_rank, args.pp_rank, args.system_dp_rank, args.gpu_id = 0, 0, 0, 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "bf16" if pool.dtype.itemsize == 2 else "fp8_e4m3"
        args.kv_layout = get_pd_kv_layout(pool)
        args.prefill_start_layer = pool.start_layer
        args.prefill_end_layer = getattr(pool, "end_layer", None)
        args.mla_compression_ratios = None
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(pool)
        args.num_draft_entries = 0
        args.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                               num_draft_entries=0, num_hidden_layers=pool.layer_num)
        args.page_size = pool.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = metadata_buffers.get_buf_infos()
        args.ib_device = None
        setup_state_kv_args(args, pool, None, pool.layer_num, req_to_token_pool=None)
        return args

    def metadata_buffers(self, slots: int):
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        return MetadataBuffers(slots, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0)

    def sender(self, kv_mgr, bootstrap_addr: str, room: int):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

        return MooncakeKVSender(kv_mgr, bootstrap_addr, room)

    def request(self, room, sender, seq_len: int, first_token: int):
        req = super().request(room, sender, seq_len, first_token)
        req.kv = SimpleNamespace(req_pool_idx=0)
        req.extend_end = seq_len
        req.disagg_decode_prefix_len = 0
        req.return_sampling_mask = False
        req.get_mm_token_counts = lambda: (0, 0, 0)
        return req

    def bootstrapped(self, req, decode_prefix_len: int) -> None:
        req.start_send_idx = decode_prefix_len
        req.disagg_decode_prefix_len = decode_prefix_len

    def scheduler_extras(self) -> dict:
        return dict(kv_checksum_computer=None, enable_staging=False, disagg_prefill_pending_chunk_rids=set())

    def send_kv_chunk(self, scheduler, req, last_chunk: bool, end_idx):
        """0.5.23's ``send_kv_chunk`` (checksum) hands over to the mixin's ``_send_kv_chunk``."""
        import types

        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin

        scheduler._send_kv_chunk = types.MethodType(Mixin._send_kv_chunk, scheduler)
        Mixin.send_kv_chunk(scheduler, req, last_chunk=last_chunk, end_idx=end_idx)

    def page_list(self, req_to_token_row, start: int, stop: int, page_size: int):
        from sglang.srt.mem_cache.common import kv_to_page_indices

        return kv_to_page_indices(req_to_token_row[start:stop], page_size)  # 0.5.23 takes the tensor

    def decode_index_pages(self, req_to_token_row, prefix_len: int, seq_len: int, page_size: int):
        """0.5.23's decode sends the index pages after its cached prefix (``suffix_page_indices``)."""
        return self.page_list(req_to_token_row, prefix_len, seq_len, page_size)

    def refuse_at_intake(self, kv_mgr, room: int, message: str) -> bool:
        """What 0.5.23's scheduler does with a prompt its intake refuses: a real ``Req`` with
        ``set_finish_with_abort(message)`` (``validate_input_length``'s verdict) through the real
        ``PrefillBootstrapQueue.add`` (hooked in this process), on a queue holding what that reads;
        whether SGLang retired it (``is_unadmitted_reject`` -> ``retire_unadmitted_request``)."""
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(f"room-{room}", "", [1] * 8, SamplingParams(max_new_tokens=1))
        req.bootstrap_room, req.bootstrap_host = room, "127.0.0.1"
        with get_parallel().override(tp_rank=0):
            req.set_finish_with_abort(message)
        retired = []
        queue = SimpleNamespace(kv_manager=kv_mgr, queue=[],
                                scheduler=SimpleNamespace(retire_unadmitted_request=retired.append))
        PrefillBootstrapQueue.add(queue, req, 1)
        return retired == [req] and req.disagg_kv_sender is None and not queue.queue


def write_tiny_dsv32(workdir) -> Path:
    """``<workdir>/tiny-dsv32``, the tiny DeepSeek-V3.2 config SGLang 0.5.23 resolves server
    arguments from. NOTE: every process of a run calls this on one folder while others may
    already read it: the file appears whole (written beside it, then renamed), and is left
    alone when it already holds the config."""
    import os

    from sglang_cp_shared_kv_testing.support import TINY_DSV32

    model = Path(workdir) / "tiny-dsv32"
    model.mkdir(parents=True, exist_ok=True)
    config, text = model / "config.json", json.dumps(TINY_DSV32)
    if not config.exists() or config.read_text() != text:
        part = model / f"config.json.{os.getpid()}"
        part.write_text(text)
        os.replace(part, config)
    return model


def release():
    """The seam of the installed SGLang."""
    from sglang_cp_shared_kv.releases.installed import INSTALLED

    return {"v0512": Release0512, "v0523": Release0523}[INSTALLED.name]()


__all__ = ["Release0512", "Release0523", "release", "write_tiny_dsv32"]
