"""One scrape target for the whole cluster: every replica's Prometheus text with a ``replica``
label (and ``node``) on each of its samples, merged family by family, plus the ingress's own
metrics, in Prometheus' text format (``prometheus_client``'s writer)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


def merged(texts: Iterable[tuple[Mapping[str, str], str]], own: Iterable[Metric] = ()) -> bytes:
    """``texts``: (labels to add, Prometheus text) per replica. Families of the same name (one
    per replica) become one family; ``own`` (the ingress's) are written as they are."""
    families: dict[str, Metric] = {}
    for labels, text in texts:
        for family in text_string_to_metric_families(text):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), *own]))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
