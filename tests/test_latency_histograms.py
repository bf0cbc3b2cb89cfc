"""The gateway's latency histograms (gateway.metrics.Histogram) are exposed exactly as
prometheus_client's own ``Histogram`` exposes the same observations: every ``_bucket`` (bounds
inclusive, +Inf last), ``_count``, ``_sum`` and one ``_created`` per label set, in the same order."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram as Reference, generate_latest

from gateway.metrics import _BUCKETS, Histogram


def test_exposition_equals_prometheus_clients_histogram():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    args = ("tiergate_request_seconds", "Request latency from arrival to the last byte", ["tier", "endpoint"])
    mine = Histogram(*args, buckets=_BUCKETS, registry=ours)
    reference = Reference(*args, buckets=_BUCKETS, registry=theirs)
    rng = random.Random(7)
    edges = [0.0, 0.005, 0.0050001, 0.01, 1, 120, 120.5, 1e-9]  # on a bound counts in that bound's bucket
    for value in edges + [rng.expovariate(2.0) for _ in range(2000)]:
        labels = (rng.choice(["paid", "free", "batch"]), rng.choice(["chat", "embeddings"]))
        mine.observe(value, *labels)
        reference.labels(*labels).observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:  # _created is each series' creation time
        return [line.rsplit(" ", 1)[0] if "_created" in line else line
                for line in generate_latest(registry).decode().splitlines()]

    assert lines(ours) == lines(theirs)
    assert sum(line.startswith("tiergate_request_seconds_created{") for line in lines(ours)) == 6  # 3 tiers x 2


def test_a_histogram_without_observations_has_no_series():
    registry = CollectorRegistry()
    Histogram("tiergate_queue_wait_seconds", "Time spent waiting at the gate", ["tier"], _BUCKETS, registry)
    text = generate_latest(registry).decode()
    assert text.splitlines() == ["# HELP tiergate_queue_wait_seconds Time spent waiting at the gate",
                                 "# TYPE tiergate_queue_wait_seconds histogram"]
