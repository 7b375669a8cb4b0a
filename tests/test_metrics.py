"""Both servers' metrics come from prometheus_client registries of their own, and docs/api.md names
exactly the metrics they export."""

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest

from conftest import scrape_metrics
from splitlm.cloud.metrics import CloudMetrics
from splitlm.edge.api_metrics import EdgeMetrics, PrefixPoolCollector
from splitlm.edge.prefix_pool import PoolCounters, PoolUsage

DOC = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def exported(registry) -> set[str]:
    return {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}


def documented(side: str) -> set[str]:
    return set(re.findall(rf"`(splitlm_{side}_[a-z0-9_]+)", DOC))


def edge_registry():
    """serve-edge's registry as `EdgeAPI` builds it: `EdgeMetrics` and the prefix pool's collector
    (over an idle pool's figures)."""
    metrics = EdgeMetrics()
    idle = SimpleNamespace(counters=PoolCounters(), usage=PoolUsage)
    metrics.registry.register(PrefixPoolCollector(idle))
    return metrics.registry


def test_docs_name_every_metric_and_no_other():
    assert documented("edge") == exported(edge_registry())
    assert documented("cloud") == exported(CloudMetrics().registry)


def test_registries_are_per_server_and_parse():
    a, b = CloudMetrics(), CloudMetrics()
    a.requests.labels(type="FORWARD").inc(3)
    a.tokens_per_round_trip.observe(5)
    values = scrape_metrics(generate_latest(a.registry).decode())
    assert values['splitlm_cloud_requests_total{type="FORWARD"}'] == 3
    assert values['splitlm_cloud_tokens_per_round_trip_bucket{le="8.0"}'] == 1
    assert values["splitlm_cloud_tokens_per_round_trip_count"] == 1
    assert 'splitlm_cloud_requests_total{type="FORWARD"}' not in scrape_metrics(generate_latest(b.registry).decode())


def test_a_pass_is_counted_by_phase():
    from splitlm.cloud.metrics import PassTiming

    metrics = CloudMetrics()
    metrics.on_pass(PassTiming(sessions=2, rows=40, begin_s=0.001, layers_s=0.02, finish_s=0.005))
    metrics.on_pass(PassTiming(sessions=1, rows=8, begin_s=0.002, layers_s=0.01, finish_s=0.001))
    values = scrape_metrics(generate_latest(metrics.registry).decode())
    assert values["splitlm_cloud_pass_seconds_count"] == 2
    assert abs(values["splitlm_cloud_pass_seconds_sum"] - 0.039) < 1e-9
    assert abs(values["splitlm_cloud_pass_begin_seconds_total"] - 0.003) < 1e-9
    assert abs(values["splitlm_cloud_pass_layers_seconds_total"] - 0.03) < 1e-9
    assert abs(values["splitlm_cloud_pass_finish_seconds_total"] - 0.006) < 1e-9
    assert values["splitlm_cloud_batch_rows_sum"] == 48
