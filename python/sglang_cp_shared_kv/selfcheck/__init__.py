"""``python -m sglang_cp_shared_kv selfcheck``: the whole shared-KV path on this machine, with
a verdict.

A prefill CP group of N processes runs one chunked request that hits a radix-cache prefix
through the plugin's real code -- the capacity formula, the shared-KV pool and its
compute-owner allocator, the per-batch state, the owner writes, the per-layer materialize
of the dense view, the hooks the stock NSA kernels run behind -- beside a replicated
(flag-off) pool in every rank, and compares what the stock kernels would read and a
reference attention over it, byte for byte. Then every rank sends its shard over the real
Mooncake engine on 127.0.0.1, through SGLang's own PD classes, to a decode process with a
stock pool, which compares every byte it received with the replicated pool.

Modules: :mod:`.options` (the arguments and their ranges), :mod:`.ranks` (what the rank and
decode processes run), :mod:`.report` (the checks, the table and the JSON),
:mod:`.run` (processes, progress, verdict). It drives the plugin through the test rigs of
:mod:`sglang_cp_shared_kv_testing`.
"""
