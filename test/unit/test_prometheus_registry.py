"""The plugin's one home for Prometheus objects: one object per name and process, created
in the default registry (the one SGLang's ``/metrics`` serves), refused when asked again
with another kind or other label names."""

from __future__ import annotations

import itertools

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from sglang_cp_shared_kv.observability.prometheus_registry import prometheus_metric  # noqa: E402

_fresh = itertools.count()


def fresh_name(stem: str) -> str:
    # NOTE: the registry is process-wide, so every test takes names no other test uses.
    return f"sglang:cp_shared_kv_test_{stem}_{next(_fresh)}"


def sample(name: str, labels: dict):
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_second_request_returns_the_same_counter_and_counts_on():
    name = fresh_name("pages")
    first = prometheus_metric("counter", name, "doc", ("cp_rank", "kind"))
    first.labels(cp_rank="0", kind="kv").inc(3)
    again = prometheus_metric("counter", name, "other doc is ignored", ("cp_rank", "kind"))
    assert again is first
    again.labels(cp_rank="0", kind="kv").inc(2)
    again.labels(cp_rank="1", kind="kv").inc()
    assert sample(name + "_total", {"cp_rank": "0", "kind": "kv"}) == 5
    assert sample(name + "_total", {"cp_rank": "1", "kind": "kv"}) == 1


def test_a_gauge_takes_its_options_and_is_served_by_the_default_registry():
    name = fresh_name("tokens")
    gauge = prometheus_metric("gauge", name, "doc", ("model_name",), multiprocess_mode="mostrecent")
    gauge.labels(model_name="m").set(4096)
    assert sample(name, {"model_name": "m"}) == 4096
    assert gauge._multiprocess_mode == "mostrecent"


@pytest.mark.parametrize("kind, labels", [("gauge", ("cp_rank",)), ("counter", ("cp_rank", "kind"))])
def test_another_kind_or_other_labels_for_a_known_name_is_refused(kind, labels):
    name = fresh_name("clash")
    prometheus_metric("counter", name, "doc", ("cp_rank",))
    with pytest.raises(ValueError, match=f"{name} is already a counter with labels"):
        prometheus_metric(kind, name, "doc", labels)


def test_an_unknown_kind_is_refused_before_anything_is_registered():
    name = fresh_name("histogram")
    with pytest.raises(ValueError, match="kind must be one of"):
        prometheus_metric("histogram", name, "doc", ())
    assert prometheus_metric("gauge", name, "doc", ()) is not None
