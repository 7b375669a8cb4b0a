"""The Prometheus text format of our small metrics registry."""

import pytest

from splitlm.metrics import Registry, parse


def test_counters_gauges_and_histograms_render_in_the_text_format():
    r = Registry()
    c = r.counter("x_requests_total", "Requests.", ["status"])
    g = r.gauge("x_in_flight", "In flight.")
    h = r.histogram("x_seconds", "Latency.", buckets=(0.1, 1.0))
    c.inc(status="200")
    c.inc(2, status='4"0\\0')
    g.inc()
    g.inc()
    g.dec()
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = r.render()
    assert "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\n" in text
    assert '# TYPE x_seconds histogram' in text
    values = parse(text)
    assert values['x_requests_total{status="200"}'] == 1
    assert values['x_requests_total{status="4\\"0\\\\0"}'] == 2  # quotes and backslashes escaped
    assert values["x_in_flight"] == 1
    assert [values[f'x_seconds_bucket{{le="{b}"}}'] for b in ("0.1", "1", "+Inf")] == [1, 2, 3]  # cumulative
    assert values["x_seconds_count"] == 3 and values["x_seconds_sum"] == pytest.approx(5.55)


def test_wrong_labels_and_negative_counts_are_refused():
    r = Registry()
    c = r.counter("y_total", "Y.", ["kind"])
    with pytest.raises(ValueError):
        c.inc(other="a")
    with pytest.raises(ValueError):
        c.inc(-1, kind="a")
    assert parse(r.render()) == {}  # nothing observed yet: no samples for a labelled counter
    assert parse(Registry().counter("z_total", "Z.").render()) == {"z_total": 0}
