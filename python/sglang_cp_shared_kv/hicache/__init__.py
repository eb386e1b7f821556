"""Sharded HiCache: each CP rank backs up to host memory, and loads back, only its own pages.

SGLang's HiCache keeps evicted KV in host memory (L2). Under the flag every rank's host
pool is sized like stock's per rank and holds only the pages that rank owns, so the group's
logical host capacity is N times one rank's:

* :mod:`.host_lanes`: the rule (logical host page -> owner rank, physical host page; the
  device layout's rule, shifted by the one page the host tier does not reserve) and the
  rank-identical allocator of logical host pages, lane by lane;
* :mod:`.host_pool_v0512`: SGLang 0.5.12.post1's MLA host pool sized per rank, exposing the
  logical capacity, allocating through the lanes; :mod:`.host_pool_v0523`: 0.5.23's, a facade
  around the KV host pool stock builds for a rank's physical pool (the DSA index-K sidecar
  follows it), which stock's sharded controller narrows through;
* :mod:`.metrics`: the pages each rank copied and its host tokens (Prometheus, both releases);
* :mod:`.storage`: the storage tier (L3) as one rank uses it (its own pages at physical rows,
  keys naming the CP size; both releases); :mod:`.storage_v0512`: what 0.5.12.post1's prefetch
  needs besides (the existence query narrowed to the rank's lane, a page without its index K
  not fetched, the host pages of prefetches freed in the same order on every rank);
* :mod:`.lane_hooks`: a host page in its device page's lane at backup, a device page in its
  host page's lane at load-back (both releases);
* :mod:`.hooks_v0512`: the other hooks of 0.5.12.post1 (each copy narrowed to this rank's rows
  in physical terms, load-back completion agreed by the group, the storage tier);
  :mod:`.hooks_v0523`: 0.5.23's (the host pool's size and facade, the controller marked
  sharded, the storage backend sharded; stock agrees the progress, narrows the copies and frees
  a prefetch's host pages from agreed counts).

The radix tree, ``node.value`` and ``node.host_value`` stay logical and identical on every
rank; no byte crosses ranks. This package's ``__init__`` imports nothing.
"""
