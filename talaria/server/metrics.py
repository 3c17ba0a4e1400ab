"""Prometheus metrics of one server app, in a registry of its own (no global state).

Measured by the server: requests by endpoint, model and status; request duration; time to
first token (request receipt to the first generated chunk); session completion time (from the
summary the API returns when a session ends). Read from ``Talaria.stats()`` at scrape time by
:class:`StatsCollector`: queue depth, KV blocks per tier, reservations held, active model,
model switches, bytes moved, sessions, and whatever numeric counters the instances report.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

log = logging.getLogger("talaria.server")

Stats = Callable[[], Mapping[str, Any]]

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
SCT_BUCKETS_S = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


class ServerMetrics:
    """The metrics of one app. Not thread-safe beyond what ``prometheus_client`` guarantees
    (its metrics are); ``render`` calls ``stats`` on the caller's thread."""

    def __init__(self, stats: Stats) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "talaria_http_requests",
            "HTTP requests answered, by endpoint, model (empty when unknown) and status",
            ["endpoint", "model", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "talaria_http_request_duration_seconds",
            "Request receipt to the last byte of the answer, seconds",
            ["endpoint", "model"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "talaria_time_to_first_token_seconds",
            "Request receipt to the first generated chunk, seconds (streamed or not)",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.sct = Histogram(
            "talaria_session_completion_seconds",
            "Session completion time (first call sent to last call answered) of ended "
            "sessions, seconds",
            buckets=SCT_BUCKETS_S,
            registry=self.registry,
        )
        self.registry.register(StatsCollector(stats))

    def observe_request(self, endpoint: str, model: str, status: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        self.requests.labels(endpoint, model, str(status)).inc()
        self.duration.labels(endpoint, model).observe(max(seconds, 0.0))

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _num(value: Any) -> float | None:
    """``value`` as a finite float, or None for anything that is not a number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class StatsCollector(Collector):
    """Turns one ``Talaria.stats()`` snapshot into metric families at each scrape. Missing or
    non-numeric entries are skipped; if ``stats()`` raises, only ``talaria_stats_up 0`` is
    exported (and the failure logged), so a scrape never fails."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        """Yield the families of the current snapshot."""
        up = GaugeMetricFamily("talaria_stats_up", "1 if Talaria.stats() answered this scrape")
        try:
            snapshot = self._stats()
        except Exception:
            log.exception("Talaria.stats() failed during a metrics scrape")
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from _instance_families(_mapping(snapshot.get("instances")))
        yield from _cluster_families(snapshot)

    def describe(self) -> Iterable[Metric]:
        """Nothing: the families depend on the snapshot (keeps registration free of I/O)."""
        return []


def _instance_families(instances: Mapping[str, Any]) -> Iterator[Metric]:
    queue = GaugeMetricFamily(
        "talaria_queue_depth", "Calls waiting, per instance", labels=["instance"]
    )
    blocks = GaugeMetricFamily(
        "talaria_kv_blocks",
        "KV cache blocks per instance, tier (device, host) and state (used, free)",
        labels=["instance", "tier", "state"],
    )
    held = GaugeMetricFamily(
        "talaria_reservations_held",
        "Soft reservations held for sessions in a tool gap, per instance",
        labels=["instance"],
    )
    running = GaugeMetricFamily(
        "talaria_running_calls", "Calls being generated, per instance", labels=["instance"]
    )
    healthy = GaugeMetricFamily(
        "talaria_instance_healthy",
        "1 while an instance serves, 0 once taken out",
        labels=["instance"],
    )
    active = GaugeMetricFamily(
        "talaria_active_model",
        "1 for the model whose slot is running",
        labels=["instance", "model"],
    )
    counters = UnknownMetricFamily(
        "talaria_instance_counter",
        "Counters an instance reports (see Talaria.stats()), by name",
        labels=["instance", "counter"],
    )
    for name, raw in sorted(instances.items()):
        inst = _mapping(raw)
        _add(queue, [name], inst.get("queue_depth"))
        _add(held, [name], inst.get("reservations_held"))
        _add(running, [name], inst.get("running"))
        _add(healthy, [name], inst.get("healthy"))
        kv = _mapping(inst.get("kv_blocks"))
        for tier in ("device", "host"):
            for state in ("used", "free"):
                _add(blocks, [name, tier, state], kv.get(f"{tier}_{state}"))
        if isinstance(inst.get("active_model"), str):
            active.add_metric([name, inst["active_model"]], 1.0)
        for key, value in sorted(_mapping(inst.get("counters")).items()):
            _add(counters, [name, str(key)], value)
    yield from (queue, blocks, held, running, healthy, active, counters)


def _cluster_families(snapshot: Mapping[str, Any]) -> Iterator[Metric]:
    switches = CounterMetricFamily("talaria_model_switches", "Model switches on all instances")
    moved = CounterMetricFamily(
        "talaria_bytes_moved", "Bytes copied between tiers (weights and KV), all instances"
    )
    _add(switches, [], snapshot.get("model_switches"))
    _add(moved, [], snapshot.get("bytes_moved"))
    sessions = _mapping(snapshot.get("sessions"))
    active = GaugeMetricFamily("talaria_sessions_active", "Sessions started and not ended")
    ended = CounterMetricFamily("talaria_sessions_ended", "Sessions ended")
    started = CounterMetricFamily("talaria_sessions_started", "Sessions seen")
    _add(active, [], sessions.get("active"))
    _add(ended, [], sessions.get("ended"))
    _add(started, [], sessions.get("total"))
    expired = CounterMetricFamily("talaria_sessions_expired", "Sessions ended by idleness")
    _add(expired, [], sessions.get("expired"))
    calls = UnknownMetricFamily(
        "talaria_calls",
        "Call figures Talaria reports (see Talaria.stats()), by name",
        labels=["field"],
    )
    for key, value in sorted(_mapping(snapshot.get("calls")).items()):
        _add(calls, [str(key)], value)
    events = CounterMetricFamily(
        "talaria_session_events", "Session hints accepted, by event", labels=["event"]
    )
    for key, value in sorted(_mapping(snapshot.get("events")).items()):
        _add(events, [str(key)], value)
    gaps = GaugeMetricFamily(
        "talaria_tool_gap_expected_seconds",
        "The tool gap the server expects, learned per tool name (untold: gaps nothing named)",
        labels=["tool"],
    )
    for key, value in sorted(_mapping(snapshot.get("tool_gaps")).items()):
        _add(gaps, [str(key)], _mapping(value).get("expected_s"))
    yield from (switches, moved, active, ended, started, expired, calls, events, gaps)


def _add(
    family: GaugeMetricFamily | CounterMetricFamily | UnknownMetricFamily,
    labels: list[str],
    value: Any,
) -> None:
    """Add one sample if ``value`` is a finite number (skip it otherwise)."""
    number = _num(value)
    if number is not None:
        family.add_metric(labels, number)
