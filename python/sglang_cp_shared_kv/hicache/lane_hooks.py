"""The two allocation hooks of the sharded host tier, the same on every release (thin: they
choose lanes, SGLang's controller allocates and copies):

* a backup (0.5.12.post1 ``HybridCacheController.write``, 0.5.23 ``.allocate_host_transfers``)
  takes its host pages in the lanes of its device pages' owners;
* a load-back (``HybridCacheController.load``) takes its device pages in its host pages' lanes.

Both pass straight through unless the controller's KV host pool is the shared-KV one (a pool
carrying a :class:`~.host_lanes.HostPageRule`, either release's), or the copy is empty, or (a
load-back) the caller already gave the device pages.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.hicache.host_lanes import HostPageRule


def owner_local_host(host_pool) -> Optional[object]:
    """The shared-KV KV host pool behind ``host_pool`` (SGLang's pool group or a host pool), or None."""
    anchor = getattr(host_pool, "anchor_entry", None)
    pool = anchor.host_pool if anchor is not None else host_pool
    return pool if isinstance(getattr(pool, "rule", None), HostPageRule) else None


def backup_in_owner_lanes(original, controller, device_indices, *args, **kwargs):
    host = owner_local_host(controller.mem_pool_host)
    if host is None or device_indices.numel() == 0:
        return original(controller, device_indices, *args, **kwargs)
    # NOTE: one small device read per backup (the device pages' owners): a host page must be
    # in its device page's lane, and the radix tree holds device locations on the device
    owners = host.rule.layout.owner_for_logical_pages(host.rule.first_pages(device_indices), validate=False).cpu()
    with host.pages_in_lanes(owners):
        return original(controller, device_indices, *args, **kwargs)


def load_back_in_host_lanes(original, controller, host_indices, *args, **kwargs):
    host = owner_local_host(controller.mem_pool_host)
    if host is None or host_indices.numel() == 0 or kwargs.get("device_indices") is not None:
        return original(controller, host_indices, *args, **kwargs)
    allocator = controller.mem_pool_device_allocator
    allocator = getattr(allocator, "full_attn_allocator", allocator)
    lanes = host.rule.lanes(host.rule.first_pages(host_indices.cpu()))
    with allocator.pages_in_lanes(lanes):
        return original(controller, host_indices, *args, **kwargs)


__all__ = ["backup_in_owner_lanes", "load_back_in_host_lanes", "owner_local_host"]
