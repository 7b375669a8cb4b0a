"""Counters, gauges and histograms, rendered in the Prometheus text format (version 0.0.4).

    registry = Registry()
    requests = registry.counter("splitlm_edge_requests_total", "Requests.", ["endpoint", "status"])
    requests.inc(endpoint="/v1/completions", status="200")
    latency = registry.histogram("splitlm_edge_request_seconds", "Latency.", buckets=SECONDS)
    latency.observe(0.25)
    text = registry.render()
"""

from __future__ import annotations

import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_ROUND_TRIP = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: list[str] | tuple[str, ...] = (), lock: threading.Lock | None = None):
        self.name, self.help, self.labels = name, help, tuple(labels)
        self._lock = lock or threading.Lock()
        self._values: dict[tuple[str, ...], object] = {}

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labels)

    def _label_text(self, key: tuple[str, ...], extra: str = "") -> str:
        parts = [f'{n}="{escape(v)}"' for n, v in zip(self.labels, key, strict=True)]
        if extra:
            parts.append(extra)
        return "{" + ",".join(parts) + "}" if parts else ""

    def samples(self) -> list[str]:
        raise NotImplementedError

    def render(self) -> str:
        with self._lock:
            lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()]
        return "\n".join(lines) + "\n"


class Counter(Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        if not self._values and not self.labels:
            return [f"{self.name} 0"]
        return [f"{self.name}{self._label_text(k)} {number(v)}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def inc(self, amount: float = 1.0, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels) -> None:
        self.inc(-amount, **labels)

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels=(), buckets=SECONDS, lock=None):
        super().__init__(name, help, labels, lock)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._values.get(key, ([0] * len(self.buckets), 0.0))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            self._values[key] = (counts, total + value)

    def count(self, **labels) -> int:
        with self._lock:
            entry = self._values.get(self._key(labels))
            return entry[0][-1] if entry else 0

    def sum(self, **labels) -> float:
        with self._lock:
            entry = self._values.get(self._key(labels))
            return entry[1] if entry else 0.0

    def samples(self) -> list[str]:
        lines = []
        for key, (counts, total) in sorted(self._values.items()):
            for bound, c in zip(self.buckets, counts, strict=True):
                le = 'le="' + number(bound) + '"'
                lines.append(f"{self.name}_bucket{self._label_text(key, le)} {c}")
            lines.append(f"{self.name}_sum{self._label_text(key)} {number(total)}")
            lines.append(f"{self.name}_count{self._label_text(key)} {counts[-1]}")
        return lines


class Registry:
    """The metrics of one process (one edge API server, or one cloud server)."""

    def __init__(self):
        self.metrics: list[Metric] = []

    def _add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def counter(self, name: str, help: str, labels=()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels=()) -> Gauge:
        return self._add(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, labels=(), buckets=SECONDS) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets))

    def render(self) -> str:
        return "".join(m.render() for m in self.metrics)


def parse(text: str) -> dict[str, float]:
    """Sample lines of the text format as {'name{labels}': value} (tests and tools)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
