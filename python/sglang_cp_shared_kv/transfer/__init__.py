"""PD transfer of each prefill CP rank's KV shard to a non-CP decode, over Mooncake.

With shared KV a prefill CP rank holds only the pages it owns (``owner(p) = (p - 1) mod N``),
at physical locations of its own pool. SGLang's Mooncake path, with
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1``, already makes every CP rank call
``MooncakeKVSender.send`` for every chunk of a request; stock, each rank then sends a
contiguous share of *logical* pages. Under the flag each rank instead sends:

* **MLA KV**: the pages of the chunk it owns; source = its physical page, destination =
  decode's preallocated page at the page's *position* in the request, counted from the
  decode prefix exactly as SGLang counts chunk positions (``MooncakeKVSender.curr_idx``).
  The positions travel as an integer array through ``TransferKVChunk.index_slice``; the
  transfer worker's ``req.dst_kv_indices[index_slice]`` then picks the destinations.
* **NSA index state** (last chunk): the index pages it owns, with positions in SGLang's
  index page list (on both sides over the *full* sequence from token 0 on 0.5.12.post1,
  even when decode has a prefix; from decode's cached prefix on 0.5.23), as
  :class:`.pages.OwnedStatePages`. SGLang 0.5.23 sends that list from CP rank 0 only; under
  the flag every rank sends its own.
* **aux** (last chunk), as stock: every rank, even one that owns nothing, completes the
  request so decode collects one response per prefill CP rank.

Decode stays stock. Pages 1.. of a request are owned by exactly one rank each, so the
ranks together write every position once and decode ends with the replicated layout.

What SGLang does not do and the hooks add (flag on; every hook passes straight through
otherwise, and the decode-side ones act only on a message a shared-KV prefill sent):

* rejection before enqueueing: positions outside decode's preallocated pages, physical
  pages outside this rank's registered buffers, the dummy page in a request, a HiSparse
  decode target. SGLang's worker would raise in its thread (killing the prefill
  instance) or silently drop pages;
* bounded Mooncake batches: SGLang writes all layers of a chunk in one
  ``batch_transfer_sync_write``; with interleaved ownership that is layers x owned pages
  descriptors (61 x 195 for a 100K-token prompt on CP8), beyond the 2,048 entries
  Mooncake's TCP lane admits by default. Writes are split into batches of at most
  ``SGLANG_CP_SHARED_KV_TRANSFER_BATCH_DESCRIPTORS`` (default 1,024, lowered to
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` when that is set lower);
* no swallowed failures: SGLang ignores ``maybe_send_extra``'s result, so a failed index
  write would still report success. A failed index write now fails the request (its aux
  write is withheld, which SGLang turns into ``KVPoll.Failed`` on both sides), and every
  failure names its cause in the prefill's failure record and, through one extra
  message, in decode's (:mod:`.failure_cause`).

Pages and descriptors per rank per chunk are logged at debug level and counted
(:func:`.prefill.transfer_stats`; Prometheus counters with ``--enable-metrics``).

Modules (imports point one way: ``pages``, ``failure_cause``, ``stats``, ``startup`` <-
``rooms`` <- ``chunk_admission``, ``shard_writes``, ``room_failures`` <- ``prefill``,
``decode`` <- ``hooks``, ``hooks_v0523``; this package module imports nothing):

* :mod:`.pages` -- page, run and descriptor arithmetic: the chunk filter, the checks
  before enqueueing, index-state ownership, bounded batches, the batch-size setting
  (pure: no SGLang, no torch);
* :mod:`.failure_cause` -- the cause message's wire format and the bounded room -> text
  map (pure);
* :mod:`.stats` -- :class:`.stats.TransferStats` and the Prometheus counters;
* :mod:`.startup` -- what the transfer checks and reads once when a prefill manager starts:
  the manager's problems, this rank's layout, :class:`.startup.RegisteredBuffers`, the
  check against the rank's pool;
* :mod:`.rooms` -- a room's decode targets read safely, the failed mark, the write-failure
  hand-off, and the cause and abort messages to decode;
* :mod:`.chunk_admission` -- which pages of a chunk a rank sends, checked, counted and
  replaced in place before SGLang enqueues them (:class:`.chunk_admission.ChunkAdmission`);
* :mod:`.shard_writes` -- the Mooncake writes: bounded batches, the NSA index state by
  sequence position, aux withheld for a failed room (:class:`.shard_writes.ShardWrites`);
* :mod:`.room_failures` -- when a prefill rank tells decode a room failed (an abort; the
  cause ahead of SGLang's Failed status);
* :mod:`.prefill` -- the shard transfer of one prefill manager, validated at startup
  (:class:`.prefill.PrefillShardTransfer`, whose bases are the three above;
  ``prefill_transfer``, ``transfer_stats``);
* :mod:`.decode` -- decode keeps the cause and names it in its failure;
* :mod:`.hooks` -- the thin hook functions ``plugin.HOOKS`` registers (and 0.5.23's table
  where the target kept its shape);
* :mod:`.hooks_v0523` -- the SGLang 0.5.23 hooks whose targets changed shape.
"""
