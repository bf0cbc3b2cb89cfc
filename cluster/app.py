"""The Ray Serve application for a tiers.yaml: ``nodes x replicas_per_node`` replicas (one per
device) under the tier-aware router, and the ingress in front. ``tiergate cluster`` runs it."""

from __future__ import annotations

from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.ingress import Ingress
from cluster.replica import TierReplica
from gateway.config import Config

ROOT = Path(__file__).resolve().parents[1]  # on every worker's path, for a source checkout


def runtime_env() -> dict:
    """What Ray's workers need to import tiergate from this checkout (a pip install needs none)."""
    return {"env_vars": {"PYTHONPATH": str(ROOT)}}


def build(config: Config, keys: dict[str, list[str]], admin_keys: list[str]) -> serve.Application:
    cluster = config.cluster
    replicas = cluster.nodes * cluster.replicas_per_node
    on_cuda = cluster.devices == "cuda"
    gate_capacity = config.gate.slots + sum(t.max_queued + config.max_inflight(t) for t in config.tiers)
    paid = config.tiers[0]
    replica = serve.deployment(TierReplica).options(
        name="replica",
        num_replicas=replicas,
        max_replicas_per_node=cluster.replicas_per_node,  # so they spread over the nodes' devices
        max_ongoing_requests=gate_capacity + 16,  # above what the gate holds: Ray never queues, the gate does
        ray_actor_options={"num_cpus": cluster.replica_cpus, "num_gpus": 1 if on_cuda else 0},
        request_router_config=RequestRouterConfig(
            request_router_class="cluster.ray_router.TierRouter",
            request_router_kwargs={"paid_target_s": paid.latency_target_s, "max_copies": dict(cluster.max_copies)},
            request_routing_stats_period_s=cluster.stats_period_s,
            request_routing_stats_timeout_s=max(cluster.stats_period_s, 5.0),
        ),
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress", num_replicas=cluster.nodes, max_replicas_per_node=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0.1},
    )
    source = str(config.source.resolve())
    return ingress.bind(source, keys, admin_keys, replica.bind(source, keys, admin_keys), replicas)
