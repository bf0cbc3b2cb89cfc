"""Which Ray Serve deployments a tiers.yaml becomes, and the config each replica and ingress
runs with, as pure functions (no Ray imported).

Every device (``nodes x replicas_per_node`` of them) is one replica. A tensor-parallel model
(``cluster.tensor_parallel: {model: N}``) is its own deployment: one replica spanning ``N``
devices (``num_gpus: N`` on CUDA), serving that model only, pinned, so it is never swapped and
its devices are outside the swap pool. The devices left form the pool: the ``replica``
deployment, one replica per device, serving every other model under the tier-aware router.
"""

from __future__ import annotations

from dataclasses import dataclass

from batch.uploads import MAX_PART_BYTES
from gateway.config import BatchConfig, Config, LimitsConfig
from gateway.multipart import FORM_SLACK

POOL = "replica"


@dataclass(frozen=True)
class Deployment:
    name: str
    models: tuple[str, ...]  # the models its replicas serve
    num_replicas: int
    num_gpus: int  # per replica: devices it reserves (0 on CPU, where budgets are simulated)
    num_cpus: float  # per replica
    max_replicas_per_node: int
    pinned: bool  # its models are pinned: loaded once, never evicted


def deployments(config: Config) -> list[Deployment]:
    """The pool deployment (when any model is left for it), then one per tensor-parallel model."""
    cluster = config.cluster
    on_cuda = cluster.devices == "cuda"
    spanned = cluster.tensor_parallel
    out = []
    pooled = tuple(m.name for m in config.models if m.name not in spanned)
    devices = cluster.nodes * cluster.replicas_per_node - sum(spanned.values())
    if pooled:
        out.append(Deployment(POOL, pooled, devices, 1 if on_cuda else 0, cluster.replica_cpus,
                              cluster.replicas_per_node, pinned=False))
    for model, span in spanned.items():
        out.append(Deployment(tp_name(model), (model,), 1, span if on_cuda else 0, cluster.replica_cpus, 1,
                              pinned=True))
    return out


def tp_name(model: str) -> str:
    return f"tp-{model}"


def shared_store(config: Config) -> Config:
    """``cluster.redis_url``, when set, is every replica's batch store, and so their accounts' too
    (keys, quotas, usage and the batch backlog in one Redis)."""
    url = config.cluster.redis_url
    if url is None:
        return config
    return config.model_copy(update={"batch": config.batch.model_copy(update={"store": url})})


def serving_only(config: Config, models: list[str] | None, pinned: bool) -> Config:
    """The replica's config: only ``models`` (and their adapters); a pinned deployment's budget is
    its models' declared size, so nothing else ever fits beside them."""
    if models is None:
        return config
    keep = set(models)
    update: dict = {"models": [m for m in config.models if m.name in keep],
                    "adapters": [a for a in config.adapters if a.model in keep],
                    "adapter_dirs": [d for d in config.adapter_dirs if d.model in keep]}
    if pinned:
        budget = sum(m.vram or 0 for m in update["models"])
        update["gpu"] = config.gpu.model_copy(update={"vram_budget": budget})
    return config.model_copy(update=update)


def largest_body(limits: LimitsConfig, batch: BatchConfig) -> int:
    """The largest request body any endpoint of ``tiergate serve`` accepts with these limits: a JSON
    body (``limits.max_body``), an uploaded image, audio or batch file (each with its form's slack),
    an upload's part or a Message Batches body. The ingress refuses a larger one (413) and forwards
    anything up to it to a replica in one message (``cluster.settings.message_limit``)."""
    files = [limits.image_edit_max_bytes, limits.transcription_max_bytes, batch.max_file_bytes, MAX_PART_BYTES]
    return max(limits.max_body, batch.max_file_bytes, *(f + FORM_SLACK for f in files))
