"""The Ray Serve application for a tiers.yaml: its deployments (``cluster.deployments``: the
pool of ``nodes x replicas_per_node`` replicas, one per device, less the devices of tensor-parallel
models, which get a deployment each), all under the tier-aware router, and the ingress in front.
``tiergate cluster`` runs it."""

from __future__ import annotations

from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.deployments import Deployment, deployments, largest_body
from cluster.ingress import Dispatch, Ingress
from cluster.replica import TierReplica
from cluster.settings import SERVE_LOGGING, ingress_settings, serve_settings
from gateway.config import BatchConfig, Config, LimitsConfig

ROOT = Path(__file__).resolve().parents[1]  # on every worker's path, for a source checkout
REALTIME_SESSIONS = 256  # realtime sessions a replica may hold open beside its gate's requests


def runtime_env(ingress_port: int | None = None, ports: int = 1, config: Config | None = None) -> dict:
    """The job's runtime_env: tiergate's Serve settings (``cluster.settings``; with
    ``ingress_port``, each ingress serves HTTP itself on the first free port of
    ``[ingress_port, ingress_port + ports)``; gRPC messages as large as ``config``'s largest body,
    the default limits' without one), and what Ray's workers need to import tiergate from this
    checkout (a pip install needs no ``PYTHONPATH``)."""
    limits, batch = (config.limits, config.batch) if config is not None else (LimitsConfig(), BatchConfig())
    return {"env_vars": {"PYTHONPATH": str(ROOT), **serve_settings(ingress_port, ports, largest_body(limits, batch))}}


def build(config: Config, keys: dict[str, list[str]], admin_keys: list[str]) -> serve.Application:
    cluster = config.cluster
    source = str(config.source.resolve())
    gate_capacity = config.gate.slots + sum(t.max_queued + config.max_inflight(t) for t in config.tiers)
    router = RequestRouterConfig(
        request_router_class="cluster.ray_router.TierRouter",
        request_router_kwargs={"paid_target_s": config.tiers[0].latency_target_s, "max_copies": dict(cluster.max_copies)},
        request_routing_stats_period_s=cluster.stats_period_s,
        request_routing_stats_timeout_s=max(cluster.stats_period_s, 5.0),
    )
    handles = {}
    for d in deployments(config):
        handles[d.name] = {"models": list(d.models), "replicas": d.num_replicas,
                           "handle": _replica(d, gate_capacity, router).bind(source, keys, admin_keys, list(d.models),
                                                                             d.pinned)}
    ingress = serve.deployment(serve.ingress(Dispatch())(Ingress)).options(
        name="ingress", num_replicas=cluster.nodes, max_replicas_per_node=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0.1, "runtime_env": {"env_vars": ingress_settings()}},
        logging_config=SERVE_LOGGING,
    )
    return ingress.bind(source, keys, admin_keys, handles)


def _replica(d: Deployment, gate_capacity: int, router: RequestRouterConfig):
    return serve.deployment(TierReplica).options(
        name=d.name,
        num_replicas=d.num_replicas,
        max_replicas_per_node=d.max_replicas_per_node,  # so they spread over the nodes' devices
        # above what the gate holds (Ray never queues, the gate does), and the realtime sessions
        # open there: each holds one call for its whole life, its utterances queue in the gate
        max_ongoing_requests=gate_capacity + 16 + REALTIME_SESSIONS,
        ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus},
        request_router_config=router, logging_config=SERVE_LOGGING,
    )
