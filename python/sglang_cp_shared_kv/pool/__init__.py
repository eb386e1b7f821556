"""The shared-KV pool: storage only. The page rule is :mod:`sglang_cp_shared_kv.cp_shared_kv_layout`;
here are the zigzag split (:mod:`.page_split`), the byte geometry (:mod:`.kv_geometry`), the
pools (:mod:`.kv_pool_base` and one subclass per release), the allocator (:mod:`.allocator`),
the capacity split at startup (:mod:`.capacity`) and the planner (:mod:`.planner`). This
package's ``__init__`` imports nothing."""
