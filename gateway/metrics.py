"""Prometheus metrics. Counters that the gate and the arbiter already keep are read at scrape
time (a custom collector), so neither carries prometheus code; latencies are observed here.

The llm-d / Gateway API Inference Extension model-server protocol (its endpoint picker scrapes
these per model server, i.e. per device: one gate and one arbiter) is served under vLLM's names:

* ``vllm:num_requests_waiting``: requests queued at the gate plus admitted requests waiting for
  their model's load;
* ``vllm:num_requests_running``: requests holding a slot and a resident model;
* ``vllm:kv_cache_usage_perc`` (0..1): tiergate keeps no KV-cache blocks of its own, so this is
  the engine occupancy: rows running on resident chat models over the rows those engines decode
  at once (their ``max_num_seqs``); 0 when no chat model is resident;
* ``vllm:lora_requests_info``: value the time of the last change (seconds since the epoch);
  labels ``max_lora`` (the largest ``lora_slots`` of the chat engines), ``running_lora_adapters``
  and ``waiting_lora_adapters`` (the adapters of running and of queued requests, comma-separated);
* ``tiergate_model_resident{model}``: 1 resident, 0.5 warm in host memory, 0 cold (or loading).

``tiergate_tokens_total{model, tier, type}`` counts the tokens requests used, as their usage rows
do: ``prompt`` (chat, completions and responses; cached ones included), ``cached`` (of those, what
vLLM's prefix cache served: the hit ratio is cached over prompt), ``completion``, ``embedding``.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:  # annotations only: the cluster's ingress imports this module (its loop watch) without torch
    from arbiter.residency import Arbiter
    from gateway.admission import Gate

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_RESIDENT = {"resident": 1.0, "warm": 0.5}  # tiergate_model_resident; anything else 0


class LoraActivity:
    """The adapters of queued and of running requests, for ``vllm:lora_requests_info``."""

    def __init__(self, clock=time.time) -> None:
        self.waiting: Counter[str] = Counter()
        self.running: Counter[str] = Counter()
        self.clock = clock
        self.updated = clock()

    def move(self, adapters: Iterable[str], src: Counter | None, dst: Counter | None) -> None:
        """Count ``adapters`` out of ``src`` and into ``dst`` (None: nowhere)."""
        for name in adapters:
            if src is not None:
                src[name] -= 1
                if src[name] <= 0:
                    del src[name]
            if dst is not None:
                dst[name] += 1
        self.updated = self.clock()


class _TokenCollector(Collector):
    def __init__(self, tokens: Counter[tuple[str, str, str]]) -> None:
        self.tokens = tokens

    def collect(self):
        family = CounterMetricFamily("tiergate_tokens", "Tokens requests used, by model, tier and type "
                                     "(prompt, cached: of the prompt's, what the prefix cache served; "
                                     "completion; embedding)", labels=["model", "tier", "type"])
        for labels, n in sorted(self.tokens.items()):
            family.add_metric(list(labels), n)
        yield family


class _SessionCollector(Collector):
    def __init__(self, sessions: Counter[str]) -> None:
        self.sessions = sessions

    def collect(self):
        family = GaugeMetricFamily("tiergate_realtime_sessions", "Realtime API sessions (WebSockets) open, by tier",
                                   labels=["tier"])
        for tier, n in sorted(self.sessions.items()):
            family.add_metric([tier], n)
        yield family


class _StateCollector(Collector):
    def __init__(self, gate: Gate, arbiter: Arbiter, lora: LoraActivity) -> None:
        self.gate = gate
        self.arbiter = arbiter
        self.lora = lora

    def collect(self):
        g = self.gate
        admitted = CounterMetricFamily("tiergate_admitted", "Requests admitted: a slot at the gate, their model held",
                                       labels=["tier"])
        rejected = CounterMetricFamily("tiergate_rejected", "Requests refused: at the gate (queue_full, "
                                       "latency_target), their model (model_protected, model_unavailable) or "
                                       "their key's own limits (key_limit)",
                                       labels=["tier", "reason"])
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
        yield from self._model_server()

    def _model_server(self):
        """The llm-d model-server protocol's gauges (see the module's docstring)."""
        g, a = self.gate, self.arbiter
        loading = sum(a.view().queued_by_tier.values())  # admitted at the gate, waiting for a load
        queued = sum(g.queued(t) for t in g.tiers) + loading
        running = max(g.total_inflight - loading, 0)
        rows = width = 0
        max_lora = 0
        for name, s in a.states.items():
            spec = a.specs[name]
            if spec.kind != "chat":
                continue
            max_lora = max(max_lora, int(spec.options.get("max_loras", 1)))
            if s.place == "resident":
                seqs = int(spec.options.get("max_num_seqs", 1))
                width += seqs
                rows += min(s.running_nonbatch + s.running_batch, seqs)
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued (gate and model loads)", value=queued)
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests running on a resident model", value=running)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                "Engine occupancy: running rows over resident chat engines' width (0-1)",
                                value=rows / width if width else 0.0)
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Adapters of running and waiting requests",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(max_lora), ",".join(sorted(self.lora.running)), ",".join(sorted(self.lora.waiting))],
                        self.lora.updated)
        yield lora
        place = GaugeMetricFamily("tiergate_model_resident", "1 resident, 0.5 warm in host memory, 0 cold",
                                  labels=["model"])
        for name, s in a.states.items():
            place.add_metric([name], _RESIDENT.get(s.place, 0.0))
        yield place


class Histogram(Collector):
    """A labelled latency histogram, exposed exactly as prometheus_client's ``Histogram`` is
    (``_bucket`` per bound, ``_count``, ``_sum``, ``_created`` per label set), observed for less:
    a bisect and two additions, where prometheus_client's takes a lock for the sum and for the
    bucket (~9 Python calls; three histograms per request). Observed on the event loop only."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str], buckets: Iterable[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self.children: dict[tuple[str, ...], _Series] = {}
        registry.register(self)

    def observe(self, value: float, *labels: str) -> None:
        series = self.children.get(labels)
        if series is None:
            series = self.children[labels] = _Series([0] * len(self.bounds), 0.0, time.time())
        series.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value, as le is
        series.sum += value

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        for labels, series in list(self.children.items()):
            base = dict(zip(self.labelnames, labels))
            total = 0
            for bound, count in zip(self.bounds, series.counts):
                total += count
                metric.add_sample(self.name + "_bucket", {**base, "le": floatToGoString(bound)}, float(total))
            metric.add_sample(self.name + "_count", base, float(total))
            metric.add_sample(self.name + "_sum", base, series.sum)
            metric.add_sample(self.name + "_created", base, series.created)
        return [metric]


class _Series:
    """One label set's bucket counts (not cumulative), sum and creation time."""

    __slots__ = ("counts", "sum", "created")

    def __init__(self, counts: list[int], total: float, created: float) -> None:
        self.counts, self.sum, self.created = counts, total, created


class Metrics:
    def __init__(self, gate: Gate, arbiter: Arbiter) -> None:
        self.registry = CollectorRegistry()
        self.lora = LoraActivity()  # the serving core moves each request's adapters through it
        self.registry.register(_StateCollector(gate, arbiter, self.lora))
        self.tokens: Counter[tuple[str, str, str]] = Counter()  # (model, tier, type) -> tokens
        self.registry.register(_TokenCollector(self.tokens))
        self.realtime_sessions: Counter[str] = Counter()  # tier -> open sessions (gateway.realtime)
        self.registry.register(_SessionCollector(self.realtime_sessions))
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

    def count_tokens(self, model: str, tier: str, prompt: int, cached: int, completion: int, embedding: int) -> None:
        """A finished request's tokens into ``tiergate_tokens_total``."""
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion), ("embedding", embedding)):
            if n:
                self.tokens[(model, tier, kind)] += n

    @staticmethod
    def observe(histogram: Histogram, value: float, *labels: str) -> None:
        """``value`` into ``histogram``'s series for ``labels``."""
        histogram.observe(value, *labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
