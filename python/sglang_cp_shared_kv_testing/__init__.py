"""Test rigs: what the test suite, the benchmarks and ``selfcheck`` drive the plugin with.

Nothing here is imported when SGLang serves; these modules drive SGLang's real classes on
one machine the way a server would (the rigs import SGLang directly, unlike the plugin,
which goes through :mod:`sglang_cp_shared_kv.sglang_api`):

* :mod:`.support` -- tiny NSA model configs, a free TCP port, N rank processes with a
  deadline, SGLang's attention-CP group over gloo;
* :mod:`.torch_standins` -- torch equivalents of SGLang's Triton kernels for CPU runs
  (each proven equal to its kernel on a GPU by ``test/gpu``);
* :mod:`.cpu_model_runner` -- SGLang's KV-cache mixin on a CPU model runner;
* :mod:`.cp_harness` -- N CP ranks (processes) running the forward path against a
  replicated pool: :mod:`.cp_rig` (one rank's pools and forwards), :mod:`.cp_scenarios`
  (what they run), :mod:`.attention_reference` (what the stock kernels would read and
  compute);
* :mod:`.rank_faults` -- one rank's fault at each rank-local check of the forward (and a
  kernel raising on one rank), on N gloo ranks of either release's rig: every rank must
  raise the same error (``forward.agreement``);
* :mod:`.pd_rig` -- prefill ranks and a decode over SGLang's Mooncake classes on loopback
  (the launcher; its parts in :mod:`.pd`);
* :mod:`.pd_servers`, :mod:`.pd_load` -- a real PD pair for the GPU scripts
  (``scripts/e2e_pd_gpu.py``, ``scripts/soak_pd.py``) and the soak's load.
"""
