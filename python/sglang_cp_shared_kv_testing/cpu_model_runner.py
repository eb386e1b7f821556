"""A model runner with what SGLang's ``ModelRunner`` gives its KV-cache mixin, for a tiny
NSA model whose pools live on the CPU.

Everything the mixin computes (profiling arithmetic, ``MemoryPoolConfig``, pool and
allocator construction, request pool sizing) is SGLang's own code; only
``_profile_available_bytes``, which measures free GPU memory, answers a fixed budget.
"""

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


class CpuNsaModelRunner(ModelRunnerKVCacheMixin):
    def __init__(self, server_args, *, available_bytes: int, attn_cp_rank: int = 0):
        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        self.device = "cpu"
        self.gpu_id = 0
        self.page_size = server_args.page_size
        self.kv_cache_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[
            server_args.kv_cache_dtype]
        self.attn_cp_size = server_args.attn_cp_size
        self.attn_cp_rank = attn_cp_rank
        self.use_mla_backend = True
        self.num_effective_layers = self.model_config.num_hidden_layers
        self.start_layer, self.end_layer = 0, self.num_effective_layers
        self.is_hybrid_swa = False
        self.mambaish_config = None
        self.hybrid_gdn_config = None
        self.spec_algorithm = SpeculativeAlgorithm.from_string(None)
        self.is_draft_worker = False
        self.enable_hisparse = False
        self.req_to_token_pool = None
        self.token_to_kv_pool_allocator = None
        self.memory_pool_config = None
        self.pp_size = 1
        self.dp_size = 1
        self._available_bytes = available_bytes

    def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
        return self._available_bytes
