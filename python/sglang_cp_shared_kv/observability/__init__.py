"""What the plugin shows of itself in a running server: Prometheus figures
(:mod:`.prometheus_registry`, :mod:`.metrics`), NVTX ranges (:mod:`.nvtx`), stage timings
(:mod:`.stage_timer`) and the idle pool's page audit (:mod:`.idle_pool_audit`; per release
:mod:`.idle_pool_audit_v0512`, :mod:`.idle_pool_audit_v0523`). This
package's ``__init__`` imports nothing."""
