"""Webhooks: signed events for work that ends while no client waits for it, so that clients need
not poll. ``webhooks:`` in tiers.yaml lists the endpoints; each gets, as a JSON ``POST``, the
events it asked for (``events``, all by default) of the keys it names (``keys``, key ids; every
key's by default):

* ``response.completed``, ``response.incomplete``, ``response.failed``, ``response.cancelled``: a
  background response ended;
* ``batch.completed``, ``batch.failed``, ``batch.expired``, ``batch.cancelled``: a batch ended.

Each is written to the outbox by the write that ends its work (``along``: a batch's
compare-and-set, a response's ending record, or another process's cancel of it): so once, and no
crash or stop just after that write loses it.

The body is OpenAI's event, ``{"id": "evt_...", "object": "event", "created_at", "type", "data":
{"id": <the response or batch id>}}``, signed as OpenAI signs its webhooks (the Standard Webhooks
scheme): ``webhook-id`` (the event's id, the same on every attempt: a receiver drops repeats by
it), ``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``
with the endpoint's secret (``whsec_`` then base64, as OpenAI's are; read from the environment
variable ``secret_env`` names). The openai SDK's ``client.webhooks.unwrap(body, headers,
secret=...)`` checks and parses them. The signing is the scheme's few lines of ``hmac``, by hand:
the ``standardwebhooks`` package does the same and brings an API client's dependencies with it.

Delivery is at least once, and outlives the process: each event for each endpoint is first
written to the outbox (``gateway.webhook_outbox``, on the batch store: SQLite or Redis), and a
process's delivery loop claims what is due there, tries it, and removes it once the endpoint
answers 2xx. An answer other than 2xx, or none within ``TIMEOUT_S`` (the whole try, up to the
answer's status and headers; its body is not read), is tried again after 1, 2, 4... s (at most an
hour apart), each try signed afresh, until ``RETRY_WINDOW_S`` (72 hours, as
OpenAI retries) after the event was made; then it is dropped (logged). At shutdown the tries in
flight get ``STOP_WAIT_S`` and the rest stay in the outbox for the next start; what a crashed
process had claimed is taken by any process serving that endpoint once the claim (``HOLD_S``)
runs out, found by the loop's poll (``POLL_S``). While the store fails, the work's end waits with
its event (written once the store answers): no event waits in a process's memory. A process has
at most ``MAX_TRYING`` tries in flight, and ``MAX_TRYING_EACH`` of them to one endpoint, each
endpoint's claimed apart: one that is slow to answer or down delays only its own deliveries.
``/metrics`` counts tries by endpoint and outcome
(``tiergate_webhook_deliveries_total``) and what waits in the outbox (``tiergate_webhook_pending``:
a growing count is an endpoint down).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass

import anyio
import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.config import Config, ConfigError
from gateway.webhook_outbox import Delivery, Outbox, open_outbox
from storage import Along
from storage.redis import honour_cancel

log = logging.getLogger("tiergate.webhooks")

RETRY_WINDOW_S = 72 * 3600.0  # an event is tried until this long after it was made
FIRST_RETRY_S = 1.0  # the wait after the first failed try; it doubles after each
MAX_RETRY_S = 3600.0  # and is at most this
TIMEOUT_S = 10.0  # one try's, whole: connecting, sending and the answer's status line and headers
HOLD_S = TIMEOUT_S + 20.0  # a claim: one try, with room to record its outcome
POLL_S = 2.0  # how often a process looks for deliveries it was not told of (another's, a crashed one's)
MAX_TRYING = 64  # tries in flight per process
MAX_TRYING_EACH = 16  # of them to one endpoint: one that is slow to answer leaves room for the others
STOP_WAIT_S = 5.0


def next_try_s(tries: int) -> float:
    """The wait before the next try after ``tries`` failed ones: 1, 2, 4... s, at most an hour."""
    return min(FIRST_RETRY_S * 2 ** (tries - 1), MAX_RETRY_S)


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
    entry whose variable is unset or not a secret, or a URL listed twice (an endpoint's deliveries
    wait in the outbox under its URL, to be signed with its secret)."""
    out: list[Endpoint] = []
    for i, hook in enumerate(config.webhooks):
        where = f"{config.source}: webhooks[{i}] ({hook.url})"
        if any(e.url == hook.url for e in out):
            raise ConfigError(f"{where}: this URL is listed twice; list it once, with the events and keys of both")
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
    """The process's deliveries: ``along`` makes an event's deliveries as writes on the outbox's
    backend, made with the change the event tells of, and the delivery loop (one task, started
    with the app when any endpoint is configured) claims the due ones and tries each in a task of
    its own."""

    def __init__(self, endpoints: list[Endpoint], outbox: Outbox) -> None:
        self.endpoints = endpoints
        self.by_url = {e.url: e for e in endpoints}
        self.outbox = outbox
        self.runner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.pending: set[asyncio.Task] = set()  # events being written, and tries in flight
        self.trying: Counter[str] = Counter()  # per endpoint, tries in flight
        self._turn = 0  # which endpoint is offered room first this turn of the loop
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (url, delivered|retried|dropped)
        self.waiting: dict[str, int] = {}  # per endpoint, deliveries in the outbox (read by each turn of the loop)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        if self.endpoints:
            await self.outbox.open()
            self._client = httpx.AsyncClient(timeout=TIMEOUT_S)
            self._loop = asyncio.create_task(self._deliver_loop())

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
        if self.pending:  # the tries cut short here are released, for the next process to make at once
            _, late = await asyncio.wait(set(self.pending), timeout=STOP_WAIT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            await self.outbox.close()

    def deliveries(self, kind: str, object_id: str, owner: str) -> list[Delivery]:
        """A new event ``kind`` about ``object_id``, one delivery per endpoint that wants it."""
        wanting = [e for e in self.endpoints if e.wants(kind, owner)]
        if not wanting:
            return []
        event_id, now = f"evt_{uuid.uuid4().hex}", time.time()
        body = json.dumps({"id": event_id, "object": "event", "created_at": int(now), "type": kind,
                           "data": {"id": object_id}}, separators=(",", ":"))
        return [Delivery(f"whd_{uuid.uuid4().hex}", e.url, event_id, body, now) for e in wanting]

    def along(self, kind: str, object_id: str, owner: str) -> Along | None:
        """The event ``kind`` about ``object_id`` (a response's or batch's id), made by the key
        ``owner``, for every endpoint that wants it, as writes to make in the same atomic step as the
        change it tells of (``storage.Along``: a batch's or response's end, on the outbox's
        backend), so that no crash or stop between the two leaves the change without its event;
        None when no endpoint wants it. Call ``written`` once the change is made."""
        made = self.deliveries(kind, object_id, owner)
        return self.outbox.along(made, time.time()) if made else None

    def written(self) -> None:
        """Deliveries were written to the outbox along with a change: the loop claims them now."""
        self._wake.set()

    def _spawn(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def _rooms(self) -> dict[str, int]:
        """How many deliveries each endpoint may claim now: up to ``MAX_TRYING_EACH`` of its tries
        in flight, and ``MAX_TRYING`` of all, offered from another endpoint first each turn, so
        that no endpoint's backlog (a slow one's retries) waits on another's."""
        urls = list(self.by_url)
        first = self._turn % len(urls)
        self._turn += 1
        left, rooms = MAX_TRYING - sum(self.trying.values()), {}
        for url in urls[first:] + urls[:first]:
            room = min(MAX_TRYING_EACH - self.trying[url], left)
            if room > 0:
                rooms[url] = room
                left -= room
        return rooms

    async def _deliver_loop(self) -> None:
        urls = list(self.by_url)
        while True:
            self._wake.clear()
            rooms = self._rooms()
            claimed: list[Delivery] = []
            if rooms:
                now = time.time()
                try:
                    claimed = await self.outbox.claim(rooms, self.runner, now, now + HOLD_S, now - RETRY_WINDOW_S)
                except Exception as exc:  # noqa: BLE001 - a store that is down: the next turn tries again
                    log.warning("webhooks: the outbox could not be read: %s", exc)
            for delivery in claimed:
                self.trying[delivery.url] += 1
                self._spawn(self._try(delivery))
            try:
                self.waiting = await self.outbox.pending(urls)
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("webhooks: the outbox could not be counted: %s", exc)
            honour_cancel()
            taken = Counter(d.url for d in claimed)
            if any(taken[url] == room for url, room in rooms.items()):
                continue  # more may be due
            try:
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _try(self, d: Delivery) -> None:
        """One try of ``d`` (claimed by this process), and its outcome recorded in the outbox."""
        try:
            endpoint, timestamp = self.by_url[d.url], int(time.time())
            headers = {"content-type": "application/json", "webhook-id": d.event_id,
                       "webhook-timestamp": str(timestamp), "webhook-signature": sign(endpoint.secret, d.event_id, timestamp, d.body)}
            try:
                status = await self._post(d.url, d.body, headers)
                ok, why = 200 <= status < 300, f"HTTP {status}"
            except httpx.HTTPError as exc:
                ok, why = False, type(exc).__name__
            except TimeoutError:
                ok, why = False, f"no answer in {TIMEOUT_S:g}s"
            except asyncio.CancelledError:  # shutdown: released, so the next start sends it at once
                await self._record(self.outbox.reschedule(d, self.runner, d.attempt, time.time()))
                raise
            tries = d.attempt + 1
            wait_s = next_try_s(tries)
            if ok:
                outcome = "delivered"
                await self._record(self.outbox.finish(d, self.runner))
            elif time.time() + wait_s < d.created_at + RETRY_WINDOW_S:
                outcome = "retried"
                log.info("webhooks: %s to %s failed (%s); again in %gs", d.event_id, d.url, why, wait_s)
                await self._record(self.outbox.reschedule(d, self.runner, tries, time.time() + wait_s))
                asyncio.get_running_loop().call_later(wait_s, self._wake.set)
            else:
                outcome = "dropped"
                log.warning("webhooks: %s to %s failed %d times over %gs; dropped", d.event_id, d.url, tries,
                            time.time() - d.created_at)
                await self._record(self.outbox.finish(d, self.runner))
            self.outcomes[d.url, outcome] += 1
        finally:
            full = self.trying[d.url] >= MAX_TRYING_EACH or sum(self.trying.values()) >= MAX_TRYING
            self.trying[d.url] -= 1
            if full:  # the loop offered no room that this try's end makes: it may claim again now
                self._wake.set()

    async def _post(self, url: str, body: str, headers: dict[str, str]) -> int:
        """The status an endpoint answers ``body`` with; TimeoutError past ``TIMEOUT_S`` for the
        whole try (httpx's timeout is per read: an endpoint that trickles would hold the try for
        ever). The answer's body is not read: the status is the answer, and a body sent slowly
        (a proxy's) cannot hold the try either."""
        with anyio.fail_after(TIMEOUT_S):
            async with self._client.stream("POST", url, content=body, headers=headers) as answer:
                return answer.status_code

    async def _record(self, change) -> None:
        """An outcome written to the outbox; a store that fails here leaves the claim to run out,
        and the delivery is tried again then (at least once)."""
        try:
            await change
        except Exception as exc:  # noqa: BLE001
            log.warning("webhooks: the outbox could not be written: %s", exc)

    def collect(self):
        named = {e.url: shown_url(e.url, i) for i, e in enumerate(self.endpoints)}
        family = CounterMetricFamily("tiergate_webhook_deliveries", "Webhook deliveries by endpoint and outcome",
                                     labels=["url", "outcome"])
        for (url, outcome), n in sorted(self.outcomes.items()):
            family.add_metric([named.get(url, shown_url(url)), outcome], n)
        yield family
        waiting = GaugeMetricFamily("tiergate_webhook_pending", "Webhook deliveries waiting in the outbox, by endpoint "
                                    "(all processes' on a shared store; counted every few seconds)", labels=["url"])
        for url, n in sorted(self.waiting.items()):
            waiting.add_metric([named.get(url, shown_url(url))], n)
        yield waiting


def shown_url(url: str, index: int | None = None) -> str:
    """An endpoint's URL as /metrics names it: its scheme and host, and its place in ``webhooks:``
    (``https://hooks.example.com #0``), never its path, query or user info: receivers often take a
    token there, and /metrics may be open to anyone who can reach the port."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    shown = f"{parts.scheme}://{f'[{host}]' if ':' in host else host}{f':{parts.port}' if parts.port else ''}"
    return shown if index is None else f"{shown} #{index}"


def webhooks_for(services) -> Webhooks:
    """The configured webhooks, started and stopped with the app, their outbox on the batch
    store's backend (no endpoints: ``along`` makes nothing, and no outbox is opened)."""
    config = services.config
    hooks = Webhooks(endpoints_of(config), open_outbox(config.batch.store, config.data_dir(), RETRY_WINDOW_S))
    services.on_startup.append(hooks.start)
    services.on_shutdown.append(hooks.stop)
    services.metrics.registry.register(hooks)
    return hooks
