"""Webhooks: signed events for work that ends while no client waits for it, so that clients need
not poll. ``webhooks:`` in tiers.yaml lists the endpoints; each gets, as a JSON ``POST``, the
events it asked for (``events``, all by default) of the keys it names (``keys``, key ids; every
key's by default):

* ``response.completed``, ``response.incomplete``, ``response.failed``, ``response.cancelled``: a
  background response ended (sent by the process that ran it);
* ``batch.completed``, ``batch.failed``, ``batch.expired``, ``batch.cancelled``: a batch ended (sent
  by the process whose compare-and-set ended it, so once).

The body is OpenAI's event, ``{"id": "evt_...", "object": "event", "created_at", "type", "data":
{"id": <the response or batch id>}}``, signed as OpenAI signs its webhooks (the Standard Webhooks
scheme): ``webhook-id`` (the event's id, the same on every attempt: a receiver drops repeats by
it), ``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``
with the endpoint's secret (``whsec_`` then base64, as OpenAI's are; read from the environment
variable ``secret_env`` names). The openai SDK's ``client.webhooks.unwrap(body, headers,
secret=...)`` checks and parses them. The signing is the scheme's few lines of ``hmac``, by hand:
the ``standardwebhooks`` package does the same and brings an API client's dependencies with it.

Delivery is at least once while the process runs: an answer other than 2xx, or none within
``TIMEOUT_S``, is tried again after 1, 2, 4... s (``ATTEMPTS`` in all, each signed afresh); at
shutdown what is still pending gets ``STOP_WAIT_S`` and is then dropped (logged). Events are not
kept across restarts. ``/metrics`` counts deliveries by endpoint and outcome
(``tiergate_webhook_deliveries_total``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import httpx
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gateway.config import Config, ConfigError

log = logging.getLogger("tiergate.webhooks")

ATTEMPTS = 8
FIRST_RETRY_S = 1.0
TIMEOUT_S = 10.0
STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    secret: bytes
    events: frozenset[str] | None  # None: every event
    keys: frozenset[str] | None  # None: every key's

    def wants(self, kind: str, owner: str) -> bool:
        return (self.events is None or kind in self.events) and (self.keys is None or owner in self.keys)


def secret_bytes(secret: str) -> bytes:
    """The signing key of a secret as OpenAI's SDK reads it: ``whsec_`` then base64, else its bytes."""
    return base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()


def sign(secret: bytes, webhook_id: str, timestamp: int, body: str) -> str:
    digest = hmac.new(secret, f"{webhook_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def endpoints_of(config: Config) -> list[Endpoint]:
    """The configured endpoints with their secrets from the environment; ConfigError naming the
    entry whose variable is unset or not a secret."""
    out = []
    for i, hook in enumerate(config.webhooks):
        where = f"{config.source}: webhooks[{i}] ({hook.url})"
        secret = os.environ.get(hook.secret_env)
        if not secret:
            raise ConfigError(f"{where}: the environment variable {hook.secret_env} (its secret) is not set")
        try:
            key = secret_bytes(secret)
        except ValueError:
            raise ConfigError(f"{where}: {hook.secret_env} starts with whsec_ but the rest is not base64") from None
        out.append(Endpoint(hook.url, key, frozenset(hook.events) if hook.events is not None else None,
                            frozenset(hook.keys) if hook.keys is not None else None))
    return out


class Webhooks(Collector):
    """The process's deliveries: ``emit`` starts one task per endpoint that wants the event."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints
        self.pending: set[asyncio.Task] = set()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (url, delivered|retried|dropped)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        if self.endpoints:
            self._client = httpx.AsyncClient(timeout=TIMEOUT_S)

    async def stop(self) -> None:
        if self.pending:
            _, late = await asyncio.wait(set(self.pending), timeout=STOP_WAIT_S)
            for task in late:
                task.cancel()
                log.warning("webhooks: an event was still undelivered at shutdown; dropped")
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def emit(self, kind: str, object_id: str, owner: str) -> None:
        """Send the event ``kind`` about ``object_id`` (a response's or batch's id), made by the
        key ``owner``, to every endpoint that wants it; returns at once."""
        wanting = [e for e in self.endpoints if e.wants(kind, owner)]
        if not wanting or self._client is None:
            return
        event_id = f"evt_{uuid.uuid4().hex}"
        body = json.dumps({"id": event_id, "object": "event", "created_at": int(time.time()), "type": kind,
                           "data": {"id": object_id}}, separators=(",", ":"))
        for endpoint in wanting:
            task = asyncio.get_running_loop().create_task(self._deliver(endpoint, event_id, body))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def _deliver(self, endpoint: Endpoint, event_id: str, body: str) -> None:
        for attempt in range(ATTEMPTS):
            timestamp = int(time.time())
            headers = {"content-type": "application/json", "webhook-id": event_id,
                       "webhook-timestamp": str(timestamp), "webhook-signature": sign(endpoint.secret, event_id, timestamp, body)}
            try:
                answer = await self._client.post(endpoint.url, content=body, headers=headers)
                if 200 <= answer.status_code < 300:
                    self.outcomes[endpoint.url, "delivered"] += 1
                    return
                why = f"HTTP {answer.status_code}"
            except httpx.HTTPError as exc:
                why = type(exc).__name__
            if attempt + 1 < ATTEMPTS:
                self.outcomes[endpoint.url, "retried"] += 1
                log.info("webhooks: %s to %s failed (%s); again in %gs", event_id, endpoint.url, why,
                         FIRST_RETRY_S * 2 ** attempt)
                await asyncio.sleep(FIRST_RETRY_S * 2 ** attempt)
        self.outcomes[endpoint.url, "dropped"] += 1
        log.warning("webhooks: %s to %s failed %d times; dropped", event_id, endpoint.url, ATTEMPTS)

    def collect(self):
        family = CounterMetricFamily("tiergate_webhook_deliveries", "Webhook deliveries by endpoint and outcome",
                                     labels=["url", "outcome"])
        for (url, outcome), n in sorted(self.outcomes.items()):
            family.add_metric([url, outcome], n)
        yield family


def webhooks_for(services) -> Webhooks:
    """The configured webhooks, started and stopped with the app (no endpoints: emit does nothing)."""
    hooks = Webhooks(endpoints_of(services.config))
    services.on_startup.append(hooks.start)
    services.on_shutdown.append(hooks.stop)
    services.metrics.registry.register(hooks)
    return hooks
