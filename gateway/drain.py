"""Readiness and graceful drain.

``/readyz`` answers 200 once the server has started (its config loaded, the app's start-up done),
the models marked ``preload`` have loaded or failed (:class:`Preload`), and the batch store
answers; 503 while draining, while they load, or while the store does not answer. ``/healthz``
(and ``/health``) stays the plain liveness probe.

On SIGTERM (or the first Ctrl+C) :class:`DrainingServer` drains before uvicorn shuts down:

1. :class:`Drain` flips to draining: ``DrainGate`` (ASGI middleware) refuses every new request
   but the probes and ``/metrics`` with 503 ``shutting_down`` and ``Retry-After``, and ``/readyz``
   turns 503, so load balancers stop sending traffic;
2. the drain's hooks run: the batch runner hands its in-flight lines back to the store (neither
   lost nor run twice: ``Store.release``);
3. requests already in flight, streams included, run to their end, for at most
   ``server.drain_timeout_s``; progress is logged every second. Every request counts, on any path
   (``/v1/...``, vLLM's ``/rerank``, ``/tokenize``, Cohere's ``/v2/embed``, the admin API's), but the
   probes and ``/metrics`` and the dashboard's event stream, which ends itself as the drain begins
   (and a reader that stopped reading would hold the drain to its timeout). Each Realtime session
   (a WebSocket: ``Drain.open_session``) takes no new work, lets its work under way (a reply, a
   committed turn's transcription) end, then says why it ends and closes; an idle one, at once;
4. then uvicorn shuts down as usual (what is still running past the timeout is cancelled) and
   the process exits 0. A second signal cuts what still runs at once, as the timeout does (each
   request answered 503 ``shutting_down``, or its stream ended), and shuts down the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from types import FrameType
from typing import Awaitable, Callable

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, speaks_anthropic
from gateway.request_log import note

log = logging.getLogger("tiergate.drain")

LIVENESS = ("/healthz", "/health")  # "alive": /health is the path `vllm serve` answers, for probes written for it
PROBES = frozenset({*LIVENESS, "/readyz", "/metrics"})  # answered while draining
RETRY_AFTER_S = 5
STORE_TIMEOUT_S = 2.0
CUT_AFTER_S = 1.0  # past the drain timeout, how long uvicorn waits before cancelling what is left


class Drain:
    """Whether the server is draining, the requests in flight (responses that have started
    sending count as streams), and the Realtime sessions open (ended as the drain begins)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.since: float | None = None
        self.inflight = 0
        self.streaming = 0
        self.hooks: list[Callable[[], Awaitable[str | None]]] = []  # run once draining starts; say what they did
        self.tasks: set[asyncio.Task] = set()  # the requests' tasks in flight (``DrainGate``)
        self.cut = False  # timed out, or a second signal: what is left in flight is cancelled (``cut_what_is_left``)
        self.sessions: set[Callable[[], Awaitable[None]]] = set()  # each open Realtime session's end (``open_session``)
        self.ending: set[asyncio.Task] = set()  # the sessions ending (the drain waits for them as for requests)
        self._sessions_told = False  # the drain told the sessions open to end: one opened since is told at once

    def begin(self) -> None:
        if not self.draining:
            self.draining, self.since = True, time.monotonic()

    def left_s(self) -> float:
        return 0.0 if self.since is None else max(0.0, self.timeout_s - (time.monotonic() - self.since))

    async def run(self) -> None:
        """Drain: stop admitting, tell the Realtime sessions to end, run the hooks, wait for the
        requests in flight and the sessions (at most ``timeout_s``), logging progress. Returns when
        the server may shut down."""
        self.begin()
        log.info("draining: no new requests; %s in flight; waiting up to %gs", self.describe(), self.timeout_s)
        self._sessions_told = True
        for end in list(self.sessions):
            self._end(end)
        for hook in self.hooks:
            try:
                said = await hook()
            except Exception:  # noqa: BLE001 - the drain goes on
                log.exception("draining: a shutdown step failed")
            else:
                if said:
                    log.info("draining: %s", said)
        last = -1.0
        while self.busy() and self.left_s() > 0:
            if time.monotonic() - last >= 1.0:
                last = time.monotonic()
                log.info("draining: %s in flight, %.0fs left", self.describe(), self.left_s())
            await asyncio.sleep(0.05)
        if self.busy():
            log.warning("draining: timed out after %gs with %s in flight; cutting them", self.timeout_s, self.describe())
            self.cut_what_is_left("the drain's timeout passed")
            if self.ending:  # each session cut says how its reply ended, and closes, before uvicorn's close (1012)
                await asyncio.wait(list(self.ending), timeout=CUT_AFTER_S)
        elif not self.cut:
            log.info("drained: nothing in flight")

    def cut_what_is_left(self, why: str) -> None:
        """Cancel the requests still in flight; each answers for itself (``DrainGate``): one not yet
        answered with a 503 ``shutting_down`` in OpenAI's shape, a response under way is ended where
        it is. (Left to uvicorn's cancellation, the first got its bare text 500.) A session ending
        cuts its work under way, says so and closes."""
        self.cut = True
        for task in [*self.tasks, *self.ending]:
            task.cancel(why)

    def open_session(self, end: Callable[[], Awaitable[None]]) -> None:
        """A Realtime session opened; ``end()`` ends it once the drain begins (a session opened as it
        began, at once): its work under way first, for as long as the drain waits for requests (its
        task cancelled by the drain's cut)."""
        self.sessions.add(end)
        if self._sessions_told:
            self._end(end)

    def close_session(self, end: Callable[[], Awaitable[None]]) -> None:
        self.sessions.discard(end)

    def _end(self, end: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.get_running_loop().create_task(end())
        self.ending.add(task)
        task.add_done_callback(self.ending.discard)

    def busy(self) -> bool:
        """Whether a request is in flight or a session ending (the drain waits for either)."""
        return bool(self.inflight or self.ending)

    def describe(self) -> str:
        said = f"{self.inflight} request{'s' * (self.inflight != 1)} ({self.streaming} streaming)"
        sessions = len(self.ending) if self._sessions_told else len(self.sessions)
        return f"{said} and {sessions} realtime session{'s' * (sessions != 1)}" if sessions else said


class DrainGate:
    """ASGI middleware: counts the requests in flight (every path's but the probes' and
    ``unwaited``'s); while draining, refuses new ones."""

    def __init__(self, app: ASGIApp, drain: Drain, unwaited: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.drain = drain
        self.unwaited = unwaited  # long-lived event streams that end themselves as the drain begins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            retry = max(RETRY_AFTER_S, math.ceil(drain.left_s()))
            error = APIError(503, "the server is shutting down; retry on another instance", "shutting_down",
                             headers={"retry-after": str(retry), "connection": "close"})
            note(reason=error.code)
            await error.response(speaks_anthropic(scope["path"], scope["headers"]))(scope, receive, send)
            return
        if scope["path"] in self.unwaited:
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                drain.streaming += 1
            await send(message)

        drain.inflight += 1
        task = asyncio.current_task()
        drain.tasks.add(task)
        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            if not drain.cut:
                raise
            task.uncancel()  # cut by the drain (``Drain.cut_what_is_left``): answered here, then done
            if started:
                note(reason="interrupted")
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                error = APIError(503, "the server shut down before this request was served (its drain was "
                                 "cut short); retry on another instance", "shutting_down",
                                 headers={"retry-after": str(RETRY_AFTER_S), "connection": "close"})
                note(reason=error.code)
                await error.response(speaks_anthropic(scope["path"], scope["headers"]))(scope, receive, send)
        finally:
            drain.tasks.discard(task)
            drain.inflight -= 1
            if started:
                drain.streaming -= 1


class Preload:
    """The models tiers.yaml marks ``preload: true``, loaded one after another once the server has
    started (a task of its own: ``/healthz`` answers meanwhile, ``/readyz`` says "loading"). One
    that fails to load is logged and named by ``/readyz``, and the server serves the rest."""

    def __init__(self, models: list[str]) -> None:
        self.pending = list(models)
        self.failed: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    async def start(self, load: Callable[[str], Awaitable[None]]) -> None:
        if self.pending:
            self._task = asyncio.get_running_loop().create_task(self._run(load))

    async def _run(self, load: Callable[[str], Awaitable[None]]) -> None:
        while self.pending:
            model = self.pending[0]
            started = time.monotonic()
            try:
                await load(model)
                log.info("preloaded %s in %.1f s", model, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - the others still load; /readyz names it
                self.failed[model] = f"{type(exc).__name__}: {exc}"[:300]
                log.error("preloading %s failed: %s", model, self.failed[model])
            self.pending.pop(0)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def readyz(request: Request) -> Response:
    """200 when serving; 503 while draining, while the preloaded models load, or when the batch
    store does not answer."""
    drain: Drain = request.app.state.drain
    if drain.draining:
        return JSONResponse({"status": "draining", "seconds_left": round(drain.left_s(), 1)}, status_code=503)
    preload: Preload = request.app.state.preload
    if preload.pending:
        return JSONResponse({"status": "loading", "models": preload.pending}, status_code=503)
    store = request.app.state.batches.store
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):  # not wait_for: it can swallow a cancel on 3.11
            await store.get_batch("batch_readyz")  # a read: None, if it answers
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        request.app.state.store_watch.failed(exc)
        return JSONResponse({"status": "store_unavailable", "store": type(store).__name__,
                             "error": f"{type(exc).__name__}: {exc}"[:300]}, status_code=503)
    request.app.state.store_watch.answered()
    failed = {"preload_failed": preload.failed} if preload.failed else {}
    return JSONResponse({"status": "ready", "config": str(request.app.state.services.config.source),
                         "store": type(store).__name__, **failed})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM or SIGINT drains (:meth:`Drain.run`)
    before shutting down, and the process then exits normally (status 0) instead of re-raising
    the signal; a second signal cuts what still runs and shuts down."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None or not self.started:
            # second signal, or not started yet: cut what runs (the app's shutdown still stops the engines);
            # the drain cuts the requests itself, before uvicorn's cancel, so that they answer as its timeout's do
            if self.drain.draining and self._loop is not None:
                self._loop.call_soon_threadsafe(self._cut)
            self.config.timeout_graceful_shutdown = CUT_AFTER_S
            self.should_exit = True
            return
        self.drain.begin()  # refuse from this instant on
        self._loop.call_soon_threadsafe(self._start_draining)

    def _cut(self) -> None:
        if self.drain.busy():
            log.warning("draining: a second signal; cutting %s", self.drain.describe())
        self.drain.cut_what_is_left("a second signal came")

    def _start_draining(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.config.timeout_graceful_shutdown = CUT_AFTER_S
            self.should_exit = True
