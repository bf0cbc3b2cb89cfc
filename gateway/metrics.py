"""Prometheus metrics. Counters that the gate and the arbiter already keep are read at scrape
time (a custom collector), so neither carries prometheus code; latencies are observed here."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from arbiter.residency import Arbiter
from gateway.admission import Gate

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _StateCollector(Collector):
    def __init__(self, gate: Gate, arbiter: Arbiter) -> None:
        self.gate = gate
        self.arbiter = arbiter

    def collect(self):
        g = self.gate
        admitted = CounterMetricFamily("tiergate_admitted", "Requests admitted by the gate", labels=["tier"])
        rejected = CounterMetricFamily("tiergate_rejected", "Requests refused by the gate", labels=["tier", "reason"])
        queued = GaugeMetricFamily("tiergate_queued", "Requests waiting at the gate", labels=["tier"])
        inflight = GaugeMetricFamily("tiergate_in_flight", "Requests holding a slot", labels=["tier"])
        limit = GaugeMetricFamily("tiergate_effective_max_inflight",
                                  "Slots a tier may hold now: max_inflight as the SLO guard has set it", labels=["tier"])
        for tier in g.tiers:
            limit.add_metric([tier], g.limits[tier])
            admitted.add_metric([tier], g.admitted[tier])
            queued.add_metric([tier], g.queued(tier))
            inflight.add_metric([tier], g.inflight[tier])
        for (tier, reason), n in g.rejected.items():
            rejected.add_metric([tier, reason], n)
        yield from (admitted, rejected, queued, inflight, limit)

        a = self.arbiter
        c = a.counters
        loads = CounterMetricFamily("tiergate_model_loads", "Model loads (cold or warm)", labels=["model"])
        evictions = CounterMetricFamily("tiergate_evictions", "Models moved off the device", labels=["model", "reason"])
        swap = CounterMetricFamily("tiergate_swap_seconds", "Seconds spent loading models", labels=["model"])
        resident = GaugeMetricFamily("tiergate_resident_bytes", "Device bytes per resident model", labels=["model", "place"])
        pauses = CounterMetricFamily("tiergate_batch_pauses", "Times batch work was made to yield")
        for name in a.states:
            loads.add_metric([name], c.loads.get(name, 0))
            swap.add_metric([name], c.swap_seconds.get(name, 0.0))
            s = a.states[name]
            resident.add_metric([name, s.place], s.footprint if s.place == "resident" else 0)
        for (name, reason), n in c.evictions.items():
            evictions.add_metric([name, reason], n)
        pauses.add_metric([], c.batch_pauses)
        yield from (loads, evictions, swap, resident, pauses)


class Metrics:
    def __init__(self, gate: Gate, arbiter: Arbiter) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(gate, arbiter))
        self.latency = Histogram(
            "tiergate_request_seconds", "Request latency from arrival to the last byte",
            ["tier", "endpoint"], buckets=_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "tiergate_queue_wait_seconds", "Time spent waiting at the gate",
            ["tier"], buckets=_BUCKETS, registry=self.registry,
        )
        self.ttft = Histogram(
            "tiergate_time_to_first_token_seconds", "Chat: arrival to the first token",
            ["tier"], buckets=_BUCKETS, registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
