"""SGLang 0.5.23's ``KVCacheConfigurator`` for one scheduler process of a tiny DSA model, with
its pools on the CPU (the 0.5.23 twin of ``cpu_model_runner.py``).

Real (SGLang's own code): the runtime context a scheduler process publishes (role
``"scheduler"``, its ``SpawnRanks`` from ``spawn_world_rank``), so ``get_parallel()`` and the
config bags answer as they do on CP rank ``tp_rank``; the ``ModelConfig``, KV dtype, layer
range, speculation side config and post-capture decision, each built by the function
``ModelRunner`` calls; and all of ``configure``: ``_resolve_memory_pool_config`` (pool sizing,
``--max-total-tokens``, request count), ``_derive_pool_sizes`` and ``_init_pools``, which builds
the request pool, ``DSATokenToKVPool`` and ``PagedTokenToKVPoolAllocator`` on device ``"cpu"``.

Stubbed: ``_profile_available_bytes``, which measures free GPU memory (over the world group),
answers a fixed byte budget. No torch.distributed group is built: the configurator reads groups
only to profile GPU memory, for a PP size above 1 and for DeepSeek-V4 pools, so ``pp_group``
is None (``pp_size`` comes from the context: 1). There is no model (the DSA pool path reads
it only for fp4 KV scales) and no forward stream (only unified-memory pools use one).

The subclass is a slotted dataclass like ``KVCacheConfigurator`` itself, so a hook that tries
to set a new attribute on the configurator fails here as it would in a server.
"""

from contextlib import contextmanager
from dataclasses import dataclass

from sglang.srt.configs.model_config import AttentionArch, ModelConfig
from sglang.srt.mem_cache import kv_cache_dtype
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigResult, KVCacheConfigurator
from sglang.srt.model_executor.model_runner_components.kv_pool_runtime import is_post_capture_kv_active
from sglang.srt.model_executor.model_runner_components.layer_setup import resolve_layer_indices
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
    resolve_spec_aux_hidden_state_config,
)
from sglang.srt.runtime_context import (
    RuntimeContext,
    SpawnRanks,
    create_context,
    get_model,
    get_parallel,
    get_schedule,
    get_spec,
    spawn_world_rank,
    use_context,
)
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm


def interleave_prefill_server_args(model_path: str, *extra: str, tp: int = 2):
    """The (unresolved) ``ServerArgs`` of a PD prefill server with DSA interleave CP over ``tp``
    ranks (attention CP size ``tp``), as its command line gives them; ``extra`` adds flags.
    Resolution asks the GPU for its compute capability: fake it first on a CPU machine."""
    return prepare_server_args([
        "--model-path", model_path, "--load-format", "dummy", "--skip-tokenizer-init", "--device", "cuda",
        "--tp", str(tp), "--enable-prefill-cp", "--cp-strategy", "interleave", "--page-size", "64",
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake", *extra])


@dataclass(slots=True, kw_only=True)
class CpuKVCacheConfigurator(KVCacheConfigurator):
    """``KVCacheConfigurator`` whose GPU-memory profiling answers ``available_bytes``."""

    available_bytes: int

    def _profile_available_bytes(self, pre_model_load_memory: int) -> int:
        return self.available_bytes


class CpuDsaRank:
    """Scheduler process ``tp_rank`` (pipeline rank 0) of the server ``server_args`` describes:
    its runtime context and the KV-cache configurator its ``ModelRunner`` would build."""

    def __init__(self, server_args, *, available_bytes: int, tp_rank: int = 0):
        self.server_args = server_args
        self.available_bytes = available_bytes
        ranks = SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=0)
        self.context: RuntimeContext = create_context(server_args, role="scheduler", ranks=ranks)

    @contextmanager
    def active(self):
        """This rank's context as the process's (``get_parallel()``, ``get_schedule()``, ...)."""
        with use_context(self.context):
            yield self.context

    def configurator(self) -> CpuKVCacheConfigurator:
        """A fresh configurator, built as ``ModelRunner.init_kv_cache_configurator`` builds it;
        call inside ``active()``."""
        model_config = ModelConfig.from_server_args(self.server_args)
        spec_algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
        dtype_str, dtype = kv_cache_dtype.configure_kv_cache_dtype(
            server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=None,
            model_dtype=model_config.dtype, is_draft_worker=False, is_dflash=False,
            speculative_draft_attention_backend=None)
        return CpuKVCacheConfigurator(
            available_bytes=self.available_bytes,
            device="cpu",
            gpu_id=0,
            attn_dp_size=get_parallel().attn_dp_size,
            pp_size=get_parallel().pp_size,
            pp_group=None,
            model=None,
            model_config=model_config,
            server_args=self.server_args,
            kv_cache_dtype=dtype,
            kv_cache_dtype_str=dtype_str if dtype_str is not None else get_model().kv_cache_dtype,
            model_dtype=model_config.dtype,
            page_size=get_schedule().page_size,
            sliding_window_size=None,
            spec_algorithm=spec_algorithm,
            is_draft_worker=False,
            post_capture_kv_active=is_post_capture_kv_active(
                server_args=self.server_args, is_draft_worker=False, spec_algorithm=spec_algorithm,
                token_to_kv_pool_allocator=None),
            spec_aux_config=resolve_spec_aux_hidden_state_config(
                server_args=self.server_args, model_config=model_config, spec_algorithm=spec_algorithm,
                is_draft_worker=False),
            is_hybrid_swa=model_config.is_hybrid_swa,
            is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
            use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
            layer_info=resolve_layer_indices(model=None, model_config=model_config, is_draft_worker=False),
            forward_stream=None,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            memory_pool_config=None,
        )

    def configure(self) -> KVCacheConfigResult:
        """``configure`` of a fresh configurator, inside this rank's context."""
        with self.active():
            return self.configurator().configure(pre_model_load_memory=0)
