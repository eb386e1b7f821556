"""Test-only process setup for scripts/e2e_cp2_logprobs.py (inert unless CPSKV_E2E=1).

Python imports ``sitecustomize`` at start-up from PYTHONPATH, so this also runs in the
scheduler processes SGLang spawns. It

* makes SGLang's dummy weights non-degenerate: after the stock initializer, norm weights
  become 1 (biases 0) and every other >= 2-D float parameter N(0, 0.02) from a generator
  seeded by the parameter's name (every TP shard of a parameter gets the same values);
* with CPSKV_E2E_CORRUPT_RANK=r, zeroes the first gathered history page of every MLA
  dense view on CP rank r: the negative control that must land outside the flag-off
  run-to-run spread;
* with CPSKV_E2E_CORRUPT_SEND_RANK=r, prefill CP rank r sends each chunk's first two
  owned pages swapped (each lands on decode at the other's position): the PD negative
  control (scripts/e2e_pd_gpu.py), which decode's output must show;
* with CPSKV_E2E_STABLE_TOPK=1, replaces SGLang's NSA top-k kernels (``sgl_kernel``) by
  the deterministic stand-ins of ``sglang_cp_shared_kv.testing.stable_topk`` (same keys,
  in key order), so that repeated runs -- flag off and on alike -- are bit-identical
  past index_topk keys too.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import zlib

if os.environ.get("CPSKV_E2E") == "1":

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
        def materialize_mla(state, pool, layer, chunk):
            dense = original(state, pool, layer, chunk)
            start, end = state.page_map.history_region
            if state.layout.cp_rank == rank and end > start:
                page = state.layout.page_size
                dense[start * page: (start + 1) * page] = 0
            return dense

        return materialize_mla

    _PATCHES = {
        "sglang.srt.model_loader.weight_utils": lambda m: setattr(
            m, "initialize_dummy_weights", _non_degenerate(m.initialize_dummy_weights)),
    }
    if os.environ.get("CPSKV_E2E_CORRUPT_RANK"):
        _PATCHES["sglang_cp_shared_kv.forward.materialize"] = lambda m: setattr(
            m, "materialize_mla", _corrupting(m.materialize_mla, int(os.environ["CPSKV_E2E_CORRUPT_RANK"])))

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
        print(f"[cpskv-e2e] CP rank {rank} sends a page twice (pid {os.getpid()})", flush=True)

    if os.environ.get("CPSKV_E2E_CORRUPT_SEND_RANK"):
        _PATCHES["sglang_cp_shared_kv.transfer.prefill"] = lambda m: _duplicating_sends(
            m, int(os.environ["CPSKV_E2E_CORRUPT_SEND_RANK"]))

    def _stable_topk(module):
        from sglang_cp_shared_kv.testing.stable_topk import STAND_INS

        for name, stand_in in STAND_INS.items():
            setattr(module, name, stand_in)
        print(f"[cpskv-e2e] deterministic NSA top-k (pid {os.getpid()})", flush=True)

    if os.environ.get("CPSKV_E2E_STABLE_TOPK") == "1":
        # sgl_kernel/__init__ binds the names from sgl_kernel.top_k right after it runs
        _PATCHES["sgl_kernel.top_k"] = _stable_topk

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
                _PATCHES[fullname](module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())
