"""What every endpoint shares: the services (config, keys, gate, arbiter, metrics), caller
authentication, and ``hold``: a slot at the gate plus a lease on a resident model, released
together. Endpoints are thin on top of this."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from arbiter.residency import Arbiter, Lease, Refused, Unavailable
from gateway.admission import Gate, Rejected, Ticket
from gateway.auth import Caller, KeyRing, bearer_token
from gateway.config import Config
from gateway.errors import APIError, bad_request, not_found
from gateway.metrics import Metrics
from workers.base import ModelSpec, StepContext

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Held:
    """A request's slot at the gate and its lease on the model; ``release`` frees both."""

    ticket: Ticket
    lease: Lease
    gate: Gate
    started: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self, ok: bool = True) -> None:
        if self.released:
            return
        self.released = True
        self.lease.release()
        self.gate.release(self.ticket, time.monotonic() - self.started if ok else None)


@dataclass
class Services:
    config: Config
    keys: KeyRing
    gate: Gate
    arbiter: Arbiter
    metrics: Metrics
    extras: dict[str, Any] = field(default_factory=dict)  # per-feature state (image urls, ...)
    on_startup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # run by the app's lifespan
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def tier_rank(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.config.tiers)}

    def authenticate(self, request: Request) -> Caller:
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        caller = self.keys.lookup(token)
        if caller is None:
            raise APIError(401, "incorrect API key provided", "invalid_api_key")
        return caller

    def admit_caller(self, request: Request) -> Caller:
        """Authenticate a model request and refuse it at once (429) if its tier can neither start
        nor queue: before its body is read or parsed."""
        caller = self.authenticate(request)
        try:
            self.gate.refuse_if_full(caller.tier)
        except Rejected as exc:
            raise _too_many(self.gate, caller.tier, exc) from None
        return caller

    def require_admin(self, request: Request) -> Caller:
        caller = self.authenticate(request)
        if not caller.admin:
            raise APIError(403, "this endpoint needs an admin key", "admin_only")
        return caller

    def spec(self, name: str, kind: str) -> ModelSpec:
        spec = self.arbiter.specs.get(name)
        if spec is None:
            raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
        if spec.kind != kind:
            raise bad_request(f"the model '{name}' is a {spec.kind} model, not {kind}", "model", "model_not_supported")
        return spec

    async def hold(self, tier: str, model: str, units: float) -> Held:
        """Admission then residency; 429 / 503 as OpenAI-shaped errors with Retry-After."""
        try:
            ticket = await self.gate.acquire(tier, model, units)
        except Rejected as exc:
            raise _too_many(self.gate, tier, exc) from None
        self.metrics.queue_wait.labels(tier).observe(ticket.queued_s)
        rank = self.tier_rank[tier]
        try:
            lease = await self.arbiter.acquire(model, rank, is_batch=self.gate.tiers[tier].is_batch)
        except Refused as exc:
            self.gate.release(ticket)
            raise APIError(429, str(exc), "model_protected", headers=_retry_headers(exc.retry_after), type="rate_limit_error") from None
        except Unavailable as exc:
            self.gate.release(ticket)
            headers = _retry_headers(exc.retry_after) if exc.retry_after else {}
            raise APIError(503, str(exc), "model_unavailable", headers=headers) from None
        except BaseException:
            self.gate.release(ticket)
            raise
        return Held(ticket, lease, self.gate)


def _too_many(gate: Gate, tier: str, exc: Rejected) -> APIError:
    headers = {**_retry_headers(exc.retry_after), **gate.rate_headers(tier, exc.retry_after)}
    return APIError(429, str(exc), exc.reason, headers=headers, type="rate_limit_error")


def _retry_headers(seconds: float) -> dict[str, str]:
    seconds = int(seconds)
    return {"retry-after": str(seconds), "retry-after-ms": str(seconds * 1000)}


async def unless_gone(request: Request | None, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(work)
    if request is None:
        return await task

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        late = await task
    except (asyncio.CancelledError, Exception):
        pass
    else:  # it finished just as the client left: give back what it holds
        if hasattr(late, "release"):
            late.release()
    raise ClientGone()


# Model work gets its own threads: on asyncio's default executor, long generations could starve
# the arbiter's loads and evictions (which run there) and deadlock the requests waiting on them.
_MODEL_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tiergate-model")


async def in_thread(work: Callable[[], T], ctx: StepContext) -> T:
    """Run blocking model ``work`` on a model thread. If the awaiting task is cancelled (client
    gone), cancel ``ctx`` so the work stops at its next step boundary, and wait for the thread to
    end before re-raising: nothing may release the model while a thread still runs on it."""
    running = _MODEL_THREADS.submit(work)
    done = asyncio.wrap_future(running)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        ctx.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({done})
        if not done.cancelled():
            done.exception()  # retrieved: the caller is gone, the result or error goes nowhere
        raise


class HeldStream(StreamingResponse):
    """A streamed response that releases its slot and lease however the stream ends, including
    when the client disconnects before the first byte."""

    def __init__(self, content: AsyncIterator[str | bytes], held: Held, svc: Services, tier: str, arrived: float,
                 endpoint: str, media_type: str, headers: dict[str, str]) -> None:
        super().__init__(content, media_type=media_type, headers={**headers, "cache-control": "no-cache"})
        self._held, self._svc, self._tier, self._arrived, self._endpoint = held, svc, tier, arrived, endpoint
        self._content = content

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
            self._held.release(ok=True)
            self._svc.metrics.latency.labels(self._tier, self._endpoint).observe(time.monotonic() - self._arrived)
