"""Test-only process setup for scripts/e2e_cp_logprobs.py (inert unless CPSKV_E2E=1).

Python imports ``sitecustomize`` at start-up from PYTHONPATH, so this also runs in the
scheduler processes SGLang spawns. It

* makes SGLang's dummy weights non-degenerate: after the stock initializer, norm weights
  become 1 (biases 0) and every other >= 2-D float parameter N(0, 0.02) from a generator
  seeded by the parameter's name (every TP shard of a parameter gets the same values);
* with CPSKV_E2E_CORRUPT_RANK=r, zeroes the first gathered history page of every MLA
  dense view on CP rank r (``forward.materialize.finish_mla_view``, the one function every
  view goes through): the negative control that must land outside the flag-off run-to-run
  spread;
* with CPSKV_E2E_CORRUPT_SEND_RANK=r, prefill CP rank r sends each chunk's first two
  owned pages swapped (each lands on decode at the other's position): the PD negative
  control (scripts/e2e_pd_gpu.py), which decode's output must show;
* with CPSKV_E2E_STABLE_TOPK=1, replaces SGLang's NSA top-k kernels (``sgl_kernel``) by
  the deterministic stand-ins of ``sglang_cp_shared_kv_testing.stable_topk`` (same keys,
  in key order), so that repeated runs -- flag off and on alike -- are bit-identical
  past index_topk keys too;
* with CPSKV_E2E_SHARE_GPU=1, puts every TP rank of the server on ``cuda:0``: several CP
  ranks share one GPU (correctness runs only; see ``sglang_cp_shared_kv_testing.shared_gpu``);
* with CPSKV_E2E_STALL_WRITE_RANK=r, prefill CP rank r holds its first Mooncake write for
  CPSKV_E2E_STALL_WRITE_S seconds (default 30): a request aborted meanwhile is aborted
  mid-transfer (scripts/e2e_pd_gpu.py, run ``on_abort``).
* with CPSKV_E2E_CORRUPT_LOAD_RANK=r, CP rank r zeroes the first page of every HiCache
  load-back it copies into its device pool, after the copy (the flag's host pool,
  ``hicache.host_pool_v0512``): the negative control of scripts/e2e_hicache_logprobs.py,
  which the probe's logprobs must show;
* with CPSKV_E2E_DUMP_PAGES=dir, writes per-page checksums of every PD request (MLA and NSA
  index rows inside the prompt, every layer) as JSON lines under dir: on each prefill rank
  when it sends the request's last chunk (the pages that rank holds), on decode when the
  transfer is committed -- which page decode got wrong, and whether the prefill held it
  (docs/results/pd_radix_hit_page_checksums_cp2_h200.json).

On sglang 0.5.23 (read from its wheel; test/integration/test_e2e_sitecustomize_v0523.py imports
the real modules in a fresh process and checks each patch on the object the call path uses):
the dummy weights, SHARE_GPU (``run_scheduler_process`` kept its first four arguments),
CORRUPT_RANK (the 0.5.23 forward hook finishes every MLA view in ``finish_mla_view`` too:
``forward.steps.attend_on_dense_view``), CORRUPT_SEND_RANK and STALL_WRITE_RANK (the transfer
hooks are shared; the selfcheck with each on 0.5.23's Mooncake classes shows decode's KV wrong
at rank 1's pages only, and rank 1's first write held, the test's two selfcheck cases) and
DUMP_PAGES (same targets and signatures) patch the same names;
STABLE_TOPK also replaces the two top-k v2 JIT kernels 0.5.23's DSA backend routes to
(``sglang.kernels.ops.attention.dsv4.topk``: ``stable_topk.V2_STAND_INS``);
CORRUPT_LOAD_RANK wraps 0.5.23's host pool (``hicache.host_pool_v0523.CpSharedKVHostPool.
load_to_device_per_layer_physical``, the call 0.5.23's L2 transfer makes; checked on the CPU
HiCache rig, not yet on a GPU). A patch whose target name is missing prints
``[cpskv-e2e] NOT patched: ...`` and lets the import go on.
"""

import functools
import importlib.abc
import importlib.machinery
import os
import sys
import time
import zlib

if os.environ.get("CPSKV_E2E") == "1":

    def _chain(first, second):
        """Both patches of one module, in order (``first`` may be None)."""
        return second if first is None else (lambda module: (first(module), second(module)))

    def _non_degenerate(original):
        def initialize(model, *args, **kwargs):
            import torch

            original(model, *args, **kwargs)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if not torch.is_floating_point(param):
                        continue
                    if "norm" in name:
                        param.fill_(0.0 if name.endswith("bias") else 1.0)
                    elif param.dim() >= 2:
                        gen = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
                        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                        param.copy_(values.normal_(0.0, 0.02, generator=gen).to(param.dtype))
            print(f"[cpskv-e2e] non-degenerate dummy weights (pid {os.getpid()})", flush=True)

        return initialize

    def _corrupting(original, rank):
        # NOTE: finish_mla_view is where every dense MLA view is completed, prefetched or not
        # (forward/hooks.py calls it through the module); materialize_mla is one caller of it
        def finish_mla_view(state, pool, layer, history, chunk):
            dense = original(state, pool, layer, history, chunk)
            start, end = state.page_map.history_region
            if state.layout.cp_rank == rank and end > start:
                page = state.layout.page_size
                dense[start * page: (start + 1) * page] = 0
            return dense

        return finish_mla_view

    _PATCHES = {
        "sglang.srt.model_loader.weight_utils": lambda m: setattr(
            m, "initialize_dummy_weights", _non_degenerate(m.initialize_dummy_weights)),
    }
    if os.environ.get("CPSKV_E2E_CORRUPT_RANK"):
        _PATCHES["sglang_cp_shared_kv.forward.materialize"] = lambda m: setattr(
            m, "finish_mla_view", _corrupting(m.finish_mla_view, int(os.environ["CPSKV_E2E_CORRUPT_RANK"])))

    def _duplicating_sends(module, rank):
        # NOTE: not a swap of two pages: attention and the top-k are blind to the order of
        # the keys they see, so two swapped pages of a prompt shorter than index_topk give
        # the same answer up to rounding. A page sent twice loses one page's keys for good.
        owned_pages = module.PrefillShardTransfer.owned_pages

        def duplicated(self, logical_pages, index_slice):
            physical, positions = owned_pages(self, logical_pages, index_slice)
            if self.layout.cp_rank == rank and len(physical) >= 2:
                physical = physical.copy()
                physical[1] = physical[0]
            return physical, positions

        module.PrefillShardTransfer.owned_pages = duplicated
        from sglang_cp_shared_kv_testing.server import CORRUPTING_SENDS_LINE

        print(f"[cpskv-e2e] CP rank {rank} {CORRUPTING_SENDS_LINE} (pid {os.getpid()})", flush=True)

    if os.environ.get("CPSKV_E2E_CORRUPT_SEND_RANK"):
        _PATCHES["sglang_cp_shared_kv.transfer.prefill"] = lambda m: _duplicating_sends(
            m, int(os.environ["CPSKV_E2E_CORRUPT_SEND_RANK"]))

    def _corrupting_loads(module, rank):
        host_pool = module.CpSharedMLATokenToKVPoolHost
        load = host_pool.load_to_device_per_layer

        def load_then_zero_first_page(self, device_pool, host_indices, device_indices, layer_id, io_backend):
            load(self, device_pool, host_indices, device_indices, layer_id, io_backend)
            # device_indices are this rank's physical rows here (move_indices narrowed them)
            if self.rule.layout.cp_rank == rank and device_indices.numel() > 0:
                device_pool.kv_buffer[layer_id][device_indices[:self.page_size]] = 0

        host_pool.load_to_device_per_layer = load_then_zero_first_page
        from sglang_cp_shared_kv_testing.server import CORRUPTING_LOADS_LINE

        print(f"[cpskv-e2e] CP rank {rank} {CORRUPTING_LOADS_LINE} (pid {os.getpid()})", flush=True)

    def _corrupting_loads_v0523(module, rank):
        # sglang 0.5.23: its L2 transfer engine calls the KV host pool (the flag's facade
        # around the anchor) per layer as load_to_device_per_layer_physical, with this rank's
        # physical rows (the controller narrowed the copy through the facade's owned_rows)
        host_pool = module.CpSharedKVHostPool
        load = host_pool.load_to_device_per_layer_physical

        def load_then_zero_first_page(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                      is_draft=False):
            load(self, device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft)
            if self.shard_rank == rank and not is_draft and device_indices.numel() > 0:
                device_pool.kv_buffer[layer_id][device_indices[:self.host_pool.page_size]] = 0

        host_pool.load_to_device_per_layer_physical = load_then_zero_first_page
        from sglang_cp_shared_kv_testing.server import CORRUPTING_LOADS_LINE

        print(f"[cpskv-e2e] CP rank {rank} {CORRUPTING_LOADS_LINE} (pid {os.getpid()})", flush=True)

    if os.environ.get("CPSKV_E2E_CORRUPT_LOAD_RANK"):
        _PATCHES["sglang_cp_shared_kv.hicache.host_pool_v0512"] = lambda m: _corrupting_loads(
            m, int(os.environ["CPSKV_E2E_CORRUPT_LOAD_RANK"]))
        _PATCHES["sglang_cp_shared_kv.hicache.host_pool_v0523"] = lambda m: _corrupting_loads_v0523(
            m, int(os.environ["CPSKV_E2E_CORRUPT_LOAD_RANK"]))

    _announced = []

    def _announce_stable_topk():
        """The line server.startup_figures counts: once per process, at its first patch."""
        if not _announced:
            _announced.append(True)
            print(f"[cpskv-e2e] deterministic NSA top-k (pid {os.getpid()})", flush=True)

    def _stable_topk(module):
        from sglang_cp_shared_kv_testing.stable_topk import STAND_INS

        for name, stand_in in STAND_INS.items():
            setattr(module, name, stand_in)
        _announce_stable_topk()

    def _stable_topk_v2(module):
        # SGLang 0.5.23's DSA top-k backend imports these at each call (``from
        # sglang.kernels.ops.attention.dsv4.topk import ...`` inside dsa_topk_backend's
        # helpers), dsv4/__init__ binds them right after this module runs
        from sglang_cp_shared_kv_testing.stable_topk import V2_STAND_INS

        for name, stand_in in V2_STAND_INS.items():
            if hasattr(module, name):
                setattr(module, name, stand_in)
        _announce_stable_topk()

    if os.environ.get("CPSKV_E2E_STABLE_TOPK") == "1":
        # sgl_kernel/__init__ binds the names from sgl_kernel.top_k right after it runs
        _PATCHES["sgl_kernel.top_k"] = _stable_topk
        _PATCHES["sglang.kernels.ops.attention.dsv4.topk"] = _stable_topk_v2  # sglang 0.5.23 only

    def _sharing_one_gpu(module):
        # NOTE: functools.wraps keeps the original's __module__ and __qualname__: SGLang hands
        # this function to a spawned process, which pickles it by that name (and finds this
        # wrapper there too, since this file runs in the child before it unpickles).
        original = module.run_scheduler_process

        @functools.wraps(original)
        def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, *args, **kwargs):
            from sglang_cp_shared_kv_testing.shared_gpu import SHARED_GPU_LINE, nccl_host_id

            # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected")
            # unless each believes it is a host of its own: then it uses its socket transport
            os.environ["NCCL_HOSTID"] = nccl_host_id(server_args.port, tp_rank)
            print(f"{SHARED_GPU_LINE} tp rank {tp_rank} (gpu {gpu_id}) on cuda:0, "
                  f"NCCL_HOSTID={os.environ['NCCL_HOSTID']} (pid {os.getpid()})", flush=True)
            return original(server_args, port_args, 0, tp_rank, *args, **kwargs)

        module.run_scheduler_process = run_scheduler_process

    if os.environ.get("CPSKV_E2E_SHARE_GPU") == "1":
        # NOTE: on 0.5.23 too (run_scheduler_process(server_args, port_args, gpu_id, tp_rank,
        # pp_rank, dp_rank, pipe_writer, ...)): the launcher binds the name at import time
        # (engine, http_server, data_parallel_controller: ``from ...scheduler import
        # run_scheduler_process``), after this patch; the process publishes the gpu_id it is
        # handed (runtime_context.SpawnRanks), which get_device().gpu_id answers from then on
        _PATCHES["sglang.srt.managers.scheduler"] = _sharing_one_gpu

    def _stalling_first_write(module, rank, seconds):
        write = module.PrefillShardTransfer.write
        stalled = []

        def stalling(self, original, kv_mgr, mooncake_session_id, transfer_blocks):
            if self.layout.cp_rank == rank and not stalled:
                from sglang_cp_shared_kv_testing.server import STALLED_WRITE_LINE

                stalled.append(True)
                print(f"[cpskv-e2e] CP rank {rank} {STALLED_WRITE_LINE} {seconds} s (pid {os.getpid()})", flush=True)
                time.sleep(seconds)
            return write(self, original, kv_mgr, mooncake_session_id, transfer_blocks)

        module.PrefillShardTransfer.write = stalling

    if os.environ.get("CPSKV_E2E_STALL_WRITE_RANK"):
        _PATCHES["sglang_cp_shared_kv.transfer.prefill"] = _chain(
            _PATCHES.get("sglang_cp_shared_kv.transfer.prefill"),
            lambda m: _stalling_first_write(m, int(os.environ["CPSKV_E2E_STALL_WRITE_RANK"]),
                                            float(os.environ.get("CPSKV_E2E_STALL_WRITE_S", "30"))))

    def _page_checksums(kv, index, pages, valid):
        """Position-weighted byte sums of each page's first ``valid`` rows (MLA, index K + scale)."""
        import torch

        from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as page

        def weighted(data):
            data = data.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
            return int((data * torch.arange(1, data.numel() + 1, device=data.device)).sum())

        key_bytes, scale_bytes = 128, 4  # per row of an index page: fp8 key, then (page-end) its fp32 scale
        out = []
        for p, v in zip(pages, valid):
            buf = index[p]
            out.append([weighted(kv[p * page: p * page + v]),
                        weighted(buf[: v * key_bytes])
                        + weighted(buf[page * key_bytes: page * key_bytes + v * scale_bytes])])
        return out

    def _dump(record):
        import json

        path = os.path.join(os.environ["CPSKV_E2E_DUMP_PAGES"], f"{record['side']}-{os.getpid()}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _request_pages(req_to_token, req):
        from sglang_cp_shared_kv.pool.kv_geometry import PAGE_SIZE as page

        seq = len(req.origin_input_ids)
        locs = req_to_token[req.req_pool_idx, :seq]
        pages = (locs[::page] // page).tolist()
        return seq, pages, [min(page, seq - page * i) for i in range(len(pages))]

    def _dumping_prefill_sends(module):
        send_kv_chunk = module.SchedulerDisaggregationPrefillMixin.send_kv_chunk

        def dumping(self, req, last_chunk=False, end_idx=None):
            if last_chunk and getattr(req, "bootstrap_room", None):
                seq, pages, valid = _request_pages(self.req_to_token_pool.req_to_token, req)
                pool = self.token_to_kv_pool_allocator.get_kvcache()
                positions = list(range(len(pages)))
                context = getattr(pool, "context", None)
                if context is not None:  # the pages this rank holds, where it holds them
                    physical, owned = context.layout.filter_owned_pages_np(pages, positions)
                    pages, positions = physical.tolist(), owned.tolist()
                    valid = [valid[i] for i in positions]
                for layer in range(pool.layer_num):
                    _dump({"side": "prefill", "room": req.bootstrap_room, "seq": seq, "layer": layer,
                           "cp_rank": context.layout.cp_rank if context is not None else None,
                           "positions": positions,
                           "sums": _page_checksums(pool.kv_buffer[layer], pool.index_k_with_scale_buffer[layer],
                                                   pages, valid)})
            return send_kv_chunk(self, req, last_chunk=last_chunk, end_idx=end_idx)

        module.SchedulerDisaggregationPrefillMixin.send_kv_chunk = dumping

    def _dumping_decode_commits(module):
        commit = module.DecodeTransferQueue._commit_transfer_to_req
        dumped = set()

        def dumping(self, decode_req):
            req = decode_req.req
            if req.bootstrap_room not in dumped:
                dumped.add(req.bootstrap_room)
                seq, pages, valid = _request_pages(self.scheduler.req_to_token_pool.req_to_token, req)
                pool = self.scheduler.token_to_kv_pool_allocator.get_kvcache()
                for layer in range(pool.layer_num):
                    _dump({"side": "decode", "room": req.bootstrap_room, "seq": seq, "layer": layer,
                           "positions": list(range(len(pages))),
                           "sums": _page_checksums(pool.kv_buffer[layer], pool.index_k_with_scale_buffer[layer],
                                                   pages, valid)})
            return commit(self, decode_req)

        module.DecodeTransferQueue._commit_transfer_to_req = dumping

    if os.environ.get("CPSKV_E2E_DUMP_PAGES"):  # diagnosis: per-page checksums, prefill at send, decode on arrival
        _PATCHES["sglang.srt.disaggregation.prefill"] = _dumping_prefill_sends
        _PATCHES["sglang.srt.disaggregation.decode"] = _dumping_decode_commits

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        """Patch a module right after it executes, before anything binds its names."""

        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                try:
                    _PATCHES[fullname](module)
                except AttributeError as e:  # a release without the patched name: say so, import on
                    print(f"[cpskv-e2e] NOT patched: {fullname}: {e!r} (pid {os.getpid()})", flush=True)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
