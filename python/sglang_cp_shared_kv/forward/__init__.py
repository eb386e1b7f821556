"""The shared-KV prefill forward path, one module per step; imports point down this list:

1. :mod:`.dense_layout` -- where each page of a sequence sits in the dense scratch;
2. :mod:`.batch_state` -- the per-batch state, built once per forward (owned rows, the
   dense placement, the page inverse, the remapped page tables), and :mod:`.in_flight`,
   what one forward carries from hook to hook (that state, the layer's dense views, the
   prefetched history, the local-writes decision);
3. :mod:`.writes` -- stores into this rank's shard (its own rows, or its owned rows of a
   view), and stores of the current chunk into a dense view;
4. :mod:`.local_writes_v0512` -- whether a forward's chunk is stored where it was computed, with
   SGLang's all-gathers of its KV left out;
5. :mod:`.materialize` -- the dense views the stock NSA kernels read, layer by layer;
6. :mod:`.in_seq_rerange_v0512` -- SGLang's in-seq CP all-gather, re-ordered by one kernel;
7. :mod:`.hooks` -- the hook functions ``plugin.HOOKS`` names; they translate SGLang's
   arguments and call the modules above.

What a forward carries between hooks has one home: its :class:`.in_flight.ForwardInFlight`,
set on the shared-KV pool as ``pool.in_flight`` by :func:`.steps.begin_forward` and dropped by
:func:`.steps.end_forward` (every hook reaches the pool through
``forward_batch.token_to_kv_pool``; SGLang's attention reads the dense views through the
pool as ``self``). The pool imports nothing from this package; this package's ``__init__``
imports nothing.
"""
