"""The parts of the Mooncake PD rig (:mod:`sglang_cp_shared_kv_testing.pd_rig`, which
starts the processes and is what tests and benchmarks import).

Modules (imports point one way: ``geometry`` <- ``sglang_side`` <- ``prefill``,
``decode`` <- ``process`` <- ``..pd_rig``; this package module imports nothing):

* :mod:`.geometry` -- the pool shape (:class:`.geometry.Geometry`) and the deterministic
  page content every process derives (numpy only);
* :mod:`.sglang_side` -- what the rig builds around SGLang's Mooncake classes: the
  plugin's transfer hooks, the attention-CP identity, server/KV args, metadata buffers,
  and deadline-bounded waits;
* :mod:`.prefill` -- one CP rank of a prefill instance (:class:`.prefill.PrefillInstance`):
  fills its pool and sends a room through the real ``send_kv_chunk``;
* :mod:`.decode` -- the decode (:class:`.decode.DecodeSide`): preallocates, receives and
  checks every byte;
* :mod:`.process` -- one rig process's main: runs its role over the plan's rooms and
  writes its JSON results.
"""
