"""One device's serving stack as a Ray Serve replica: the gate, the arbiter, the workers and the
batch runner of ``tiergate serve``, built from the same tiers.yaml by ``gateway.app``.

The ingress forwards each request (``forward``); the replica runs it through its own Starlette app
in-process (``cluster.asgi``), so every endpoint and SSE behave exactly as in ``tiergate serve``;
a realtime session (``realtime``) runs the same way, its client's messages arriving through
``realtime_input``.
Before that it re-checks the router's choice on its fresh stats: a request its arbiter would refuse
is answered "redirect", and the ingress tries elsewhere; a cluster-wide 429 or 503 verdict that
travels with the request is answered as such unless this replica can take the request after all
(the reports were stale). The app starts with the replica (Serve's first health check), not at
its first request. Every ``stats_period_s`` Ray asks
``record_routing_stats`` for the report the router reads (``cluster.stats``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from cluster.asgi import Forwarded, Head, Lifespan, Opening, call, session
from cluster.deployments import serving_only, shared_store
from cluster.router import RANK
from cluster.settings import in_effect
from cluster.stats import option, replica_stats
from gateway.auth import KeyRing
from gateway.config import load_config
from gateway.errors import APIError

WHOLE_BODY_BYTES = 1 << 20  # an answer made whole (its length declared) up to this size goes back as one message
# a streamed body goes back in messages of at most this size, whatever the app sends at once (a
# file's content, a batch's output file: one chunk), so none nears the hop's gRPC message limit
CHUNK_BYTES = 1 << 20
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

    def __init__(self, config_path: str, keys: dict[str, list[str]], admin_keys: list[str],
                 models: list[str] | None = None, pinned: bool = False) -> None:
        # here, not at the top: the driver that builds the application (tiergate cluster, the
        # benchmark) imports this module too, and needs no torch, transformers or engines
        from gateway import collector, request_log
        from gateway.app import build_services, create_app

        # the request log and tiergate's other lines as tiergate serve writes them (text), on this
        # process's stderr, which Ray sends to the driver's output: nothing configured them here,
        # so the INFO request lines went nowhere (Ray's and Serve's loggers keep their own handlers)
        request_log.configure(json_lines=False)
        config = shared_store(load_config(Path(config_path)))
        self.config = serving_only(config, models, pinned)
        self.id = replica_id()
        self.services = build_services(self.config, KeyRing(keys, admin_keys), origin=self.id)  # its ids name it
        if pinned:  # a tensor-parallel deployment: its model spans the replica's devices, never swapped
            for name in self.config.cluster.tensor_parallel.keys() & set(self.services.arbiter.specs):
                _span(self.services.arbiter, name, self.config.cluster.tensor_parallel[name])
        self.collector = collector.attach(self.services)  # as tiergate serve: long-lived objects out of gc's walks
        self.app = create_app(self.services)
        self.rank = {t.name: i for i, t in enumerate(self.config.tiers)}
        self.node = node_id()
        self._lifespan = Lifespan(self.app)
        self._sessions: dict[str, asyncio.Queue] = {}  # realtime sessions: their client messages
        self._started: asyncio.Future | None = None

    async def check_health(self) -> None:
        """Serve's health check, first called as the replica starts: the app's start-up (its batch
        runner, reclaimers, stores) runs then, so a replica Serve puts in a dead one's place pulls
        batch lines and background work before any request reaches it; a start-up that failed
        keeps the replica unhealthy, and Serve replaces it."""
        await self._start()

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.start())
        await asyncio.shield(self._started)

    def metrics(self, avoid: list[str] | None = None) -> dict:
        """This replica's Prometheus text (``avoid`` is read by the router: the ingress's scrape
        asks each replica once)."""
        return {"replica": self.id, "node": self.node, "text": self.services.metrics.render().decode()}

    def devices(self) -> dict:
        """The GPUs this replica's process was given by Ray and sees through torch."""
        import ray
        import torch

        return {"ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()], "torch_devices": torch.cuda.device_count(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def serve_settings(self) -> dict:
        """The values of ``cluster.settings.SERVE_SETTINGS`` Ray Serve runs with in this replica's
        process (what reached it, as Serve read it)."""
        return in_effect()

    async def collector_freezes(self) -> dict:
        """How often this replica froze its long-lived objects out of the collector's walks
        (``gateway.collector``: at start, then after each worker class's first load)."""
        return {"replica": self.id, "freezes": self.collector.freezes}

    def name(self, avoid: list[str] | None = None) -> str:
        """This replica's id (``avoid`` is read by the router: asked once per replica, a caller
        learns every replica's, as ``cluster.cli.drain`` does)."""
        return self.id

    async def drain(self, replica: str | None = None) -> str:
        """Drain as ``tiergate serve`` drains on SIGTERM (``gateway.drain``): refuse new requests
        with 503 ``shutting_down``, hand the batch lines held here back to the store, let the
        requests in flight (streams included) finish for up to ``server.drain_timeout_s``, then
        cut what is left; returns once nothing runs. ``replica`` pins the call here (the router)."""
        await self._start()
        drain = self.app.state.drain
        await drain.run()
        return "cut what was left at the timeout" if drain.cut else "nothing left in flight"

    def record_routing_stats(self) -> dict:
        return replica_stats(self.id, self.services.arbiter, self.services.gate).to_dict()

    async def forward(self, request: dict, model: str | None = None, tier: int = 0,
                      avoid: list[str] | None = None, verdict: dict | None = None,
                      affinity: str | None = None, replica: str | None = None) -> AsyncIterator[dict | bytes]:
        """Serve one forwarded request: yield ``{"status", "headers", "body"}`` for a whole answer
        (one message back, the common case), or ``{"status", "headers"}`` then body chunks as the
        app sends them for a stream (SSE, any other body made as it is sent: streamed speech; or a
        body past ``WHOLE_BODY_BYTES``), or ``{"redirect": replica}`` when this replica's arbiter
        would refuse the request now. ``affinity`` is the router's (read there)."""
        await self._start()
        if (refused := self._routed(model, tier, verdict)) is not None:
            yield refused
            return
        head: dict | None = None
        held: list[bytes] = []
        size = 0
        async for item in call(self.app, Forwarded(**request)):
            if isinstance(item, Head):
                head = {"status": item.status, "headers": self._headers(item.headers)}
                if _streamed(item):
                    yield head
                    head = None
            elif head is None:
                for piece in _pieces(item):
                    yield piece
            else:
                held.append(item)
                size += len(item)
                if size > WHOLE_BODY_BYTES:  # too big to send whole: stream the rest
                    yield head
                    for piece in _pieces(b"".join(held)):
                        yield piece
                    head, held = None, []
        if head is not None:
            yield {**head, "body": b"".join(held)}

    async def answer(self, request: dict, model: str | None = None, tier: int = 0,
                     avoid: list[str] | None = None, verdict: dict | None = None,
                     affinity: str | None = None, replica: str | None = None) -> dict:
        """``forward`` as one reply, for a request that asked for no stream: ``{"redirect"}``, or
        ``{"status", "headers", "body"}`` with the whole body (a JSON answer: one gRPC message,
        within ``cluster.settings.ANSWER_BYTES`` at least)."""
        head: dict = {}
        chunks: list[bytes] = []
        async for item in self.forward(request, model, tier, avoid, verdict):
            if isinstance(item, dict):
                if "redirect" in item or "body" in item:
                    return item
                head = item
            else:
                chunks.append(item)
        return {**head, "body": b"".join(chunks)}

    async def realtime(self, opening: dict, model: str | None = None, tier: int = 0,
                       avoid: list[str] | None = None, verdict: dict | None = None,
                       affinity: str | None = None, replica: str | None = None) -> AsyncIterator[dict]:
        """Serve one Realtime API session (``/v1/realtime``, a WebSocket) through the app, as
        ``tiergate serve`` does: yield ``{"replica"}`` (where the ingress sends the client's
        messages: ``realtime_input``), then every ASGI message the app sends, its handshake
        answer first (``websocket.accept``, with this replica's headers, or its HTTP denial),
        until it closes; or, before any of that, ``{"redirect"}`` or a cluster-wide refusal
        (``{"status", "headers", "body"}``) as ``forward`` answers them. ``opening["session"]``
        names the session for ``realtime_input``; closing the stream is the client gone."""
        await self._start()
        if (refused := self._routed(model, tier, verdict)) is not None:
            yield refused
            return
        name = opening["session"]
        inbox: asyncio.Queue = asyncio.Queue()
        self._sessions[name] = inbox
        try:
            yield {"replica": self.id}
            async for message in session(self.app, Opening(**{k: v for k, v in opening.items() if k != "session"}), inbox):
                if message["type"] in ("websocket.accept", "websocket.http.response.start"):
                    message = {**message, "headers": self._headers(list(message.get("headers") or []))}
                yield message
        finally:
            del self._sessions[name]

    async def realtime_input(self, session: str, messages: list[dict], replica: str | None = None) -> bool:
        """The client's messages for a session this replica serves (``replica`` pins the call
        here: the router reads it); False when the session is not here (it ended, or this is not
        the replica it was on: that one died)."""
        inbox = self._sessions.get(session)
        if inbox is None:
            return False
        for message in messages:
            inbox.put_nowait(message)
        return True

    def _routed(self, model: str | None, tier: int, verdict: dict | None) -> dict | None:
        """None when this replica takes the request; else its answer: ``{"redirect"}`` when its
        arbiter would refuse now, or the cluster-wide refusal the router's ``verdict`` carries
        (unless this replica can take it after all: the reports were stale)."""
        arbiter = self.services.arbiter
        known = model is not None and model in arbiter.states
        here = option(arbiter.view(), model, tier, arbiter.batch_rank) if known else None
        takes = here is not None and here.need in RANK
        if verdict is not None and not takes:  # the router found no replica: answer for the cluster
            error = APIError(verdict["status"], verdict["message"], verdict["code"],
                             headers=_retry(verdict.get("retry_after")), type=verdict.get("type"))
            response = error.response()
            return {"status": response.status_code, "headers": self._headers(response.raw_headers),
                    "body": bytes(response.body)}
        if known and not takes:  # with when its protection ends, for the ingress's 429 if every replica says so
            return {"redirect": self.id, "retry_after": here.retry_after if here.need == "refuse" else None}
        return None

    def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [*headers, (REPLICA_HEADER, self.id.encode()), (NODE_HEADER, self.node.encode())]

    async def __del__(self) -> None:
        await self._lifespan.stop()


def _span(arbiter, model: str, devices: int) -> None:
    """Pin ``model`` and have its engine (vLLM) shard it over the replica's ``devices`` GPUs."""
    spec = arbiter.specs[model]
    if spec.engine == "vllm":
        engine_args = {**spec.options.get("engine_args", {}), "tensor_parallel_size": devices}
        arbiter.specs[model] = replace(spec, options={**spec.options, "engine_args": engine_args})
    arbiter.pin(model, True)


def _pieces(chunk: bytes) -> list[bytes]:
    """``chunk`` in slices of at most ``CHUNK_BYTES``, each one message of the hop."""
    if len(chunk) <= CHUNK_BYTES:
        return [chunk]
    view = memoryview(chunk)
    return [bytes(view[i:i + CHUNK_BYTES]) for i in range(0, len(chunk), CHUNK_BYTES)]


def _streamed(head: Head) -> bool:
    """Whether an answer goes back as the app sends it: an event stream, or any body whose length
    is not declared (a ``StreamingResponse``: speech's audio, sentence by sentence, which was held
    to its end or 1 MiB, so a voice client got it all at once; hunt CC, finding 3). One whose
    length is declared was made whole (JSON, a file's content) and is held to go back in one message."""
    if head.status < 200 or head.status in (204, 304):  # no body
        return False
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head.headers)
    return sse or not any(k.lower() == b"content-length" for k, _ in head.headers)


def _retry(seconds: int | None) -> dict[str, str] | None:
    if not seconds:
        return None
    return {"retry-after": str(seconds), "retry-after-ms": str(seconds * 1000)}
