"""One device's serving stack as a Ray Serve replica: the gate, the arbiter, the workers and the
batch runner of ``tiergate serve``, built from the same tiers.yaml by ``gateway.app``.

The ingress forwards each request (``forward``); the replica runs it through its own Starlette app
in-process (``cluster.asgi``), so every endpoint and SSE behave exactly as in ``tiergate serve``.
Before that it re-checks the router's choice on its fresh stats: a request its arbiter would refuse
is answered "redirect", and the ingress tries elsewhere; a cluster-wide 429 or 503 verdict that
travels with the request is answered as such unless this replica can take the request after all
(the reports were stale). Every ``stats_period_s`` Ray asks
``record_routing_stats`` for the report the router reads (``cluster.stats``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from cluster.asgi import Forwarded, Head, Lifespan, call
from cluster.router import admits
from cluster.stats import replica_stats
from gateway.app import build_services, create_app
from gateway.auth import KeyRing
from gateway.config import Config, load_config
from gateway.errors import APIError

REPLICA_HEADER = b"x-tiergate-replica"
NODE_HEADER = b"x-tiergate-node"


def replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class TierReplica:
    """A Ray Serve deployment class (``cluster.app`` decorates it with its resources)."""

    def __init__(self, config_path: str, keys: dict[str, list[str]], admin_keys: list[str]) -> None:
        self.config = shared_store(load_config(Path(config_path)))
        self.services = build_services(self.config, KeyRing(keys, admin_keys))
        self.app = create_app(self.services)
        self.rank = {t.name: i for i, t in enumerate(self.config.tiers)}
        self.id = replica_id()
        self.node = node_id()
        self._lifespan = Lifespan(self.app)
        self._started: asyncio.Future | None = None

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.start())
        await asyncio.shield(self._started)

    def record_routing_stats(self) -> dict:
        return replica_stats(self.id, self.services.arbiter, self.services.gate).to_dict()

    async def forward(self, request: dict, model: str | None = None, tier: int = 0,
                      avoid: list[str] | None = None, verdict: dict | None = None) -> AsyncIterator[dict | bytes]:
        """Serve one forwarded request: yield ``{"status", "headers"}`` then body chunks, or
        ``{"redirect": replica}`` when this replica's arbiter would refuse it now."""
        await self._start()
        known = model is not None and model in self.services.arbiter.states
        fresh = replica_stats(self.id, self.services.arbiter, self.services.gate) if known else None
        if verdict is not None and fresh is not None and admits(fresh, model, tier):
            verdict = None  # the reports were stale: this replica can take it now
        if verdict is not None:  # the router found no replica: answer for the cluster
            error = APIError(verdict["status"], verdict["message"], verdict["code"],
                             headers=_retry(verdict.get("retry_after")), type=verdict.get("type"))
            response = error.response()
            yield {"status": response.status_code, "headers": self._headers(response.raw_headers)}
            yield bytes(response.body)
            return
        if fresh is not None and not admits(fresh, model, tier):
            yield {"redirect": self.id}
            return
        async for item in call(self.app, Forwarded(**request)):
            if isinstance(item, Head):
                yield {"status": item.status, "headers": self._headers(item.headers)}
            else:
                yield item

    def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [*headers, (REPLICA_HEADER, self.id.encode()), (NODE_HEADER, self.node.encode())]

    async def __del__(self) -> None:
        await self._lifespan.stop()


def shared_store(config: Config) -> Config:
    """``cluster.redis_url``, when set, is every replica's batch store, and so their accounts' too
    (keys, quotas, usage and the batch backlog in one Redis)."""
    url = config.cluster.redis_url
    if url is None:
        return config
    return config.model_copy(update={"batch": config.batch.model_copy(update={"store": url})})


def _retry(seconds: int | None) -> dict[str, str] | None:
    if not seconds:
        return None
    return {"retry-after": str(seconds), "retry-after-ms": str(seconds * 1000)}
