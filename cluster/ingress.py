"""The cluster's HTTP entry point, behind Ray Serve's proxy (one per node; an ASGI app for Serve,
``Dispatch``): what the gateway does before a model is needed, then the call to the replica the
router picks, streamed back.

* authentication with the tiers' keys and the managed keys (``gateway.accounts``: the store is
  ``cluster.redis_url``'s Redis when set, shared with every replica, read at Serve's first health
  check; 401 without a valid key, 503 ``store_unavailable`` while the store does not answer);
* validation: the body's ``model`` must be a configured model or adapter that the key may use
  (404 otherwise, as if it did not exist), a JSON body must parse (400);
* early 429s, before any replica is asked: a key that has used up a minute limit
  (``rate_limit_exceeded``) or its daily budget (``insufficient_quota``, ``cluster.quota``), and a
  tier that already has as many requests in flight through this ingress as all replicas' gates
  could hold (``max_inflight + max_queued`` each);
* the call: ``forward`` on the deployment that serves the model (the pool, or a tensor-parallel
  model's own, ``cluster.deployments``) with ``stream=True``; the router (a
  ``cluster.ray_router.TierRouter``) reads the model and tier from its arguments. A replica that
  answers "redirect" (its stats were stale) is avoided and the router is asked again, until a replica
  takes the request or the router refuses (at most once per replica); a model request whose replica
  died before answering is tried once more (Serve drops it from the router's candidates), and one
  that may have taken effect there (it needs no model: a file, a DELETE; or it writes what outlives
  it: a stored or background response, ``lasting``) is answered 502 ``replica_failed``.
* a replica that dies mid-answer: a stream (SSE) ends with an error event, which the client's SDK
  raises: OpenAI-shaped, or Anthropic's ``event: error`` on the Messages API; any other body is cut
  short.
* the Realtime API's WebSocket (``/v1/realtime``): the key, the model's access and the key's
  limits checked at the handshake, then the session runs on the replica the router picks for its
  model, its messages relayed both ways (``_realtime``; docs/CLUSTER.md, Realtime sessions);
* what one replica keeps in memory goes back to it: a client secret's session, an image url's
  file, a chat that sends a spoken reply back by its audio id go to the replica whose id is in
  theirs (``gateway.origin``), which checks them as ``tiergate serve`` does;
* ``GET /metrics``: the cluster's scrape target, every replica's metrics with a ``replica`` label
  plus this ingress's own (``cluster.scrape``).
* CORS (``server.cors_origins``): Starlette's middleware, as ``tiergate serve`` runs it, answers a
  browser's preflight before authentication and puts its headers on the answers the ingress
  makes itself (its refusals, ``/healthz``, ``/metrics``); a replica's answers carry their own, as
  the replicas run the same app.

The replica's serving core still admits each request against its key's limits (atomically, on a
shared Redis across processes) and meters its usage, as in ``tiergate serve``: the early refusal
only reads, so it spends nothing twice (docs/CLUSTER.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from ray import serve
from ray.exceptions import RayError
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.quota import early_refusal
from cluster.deployments import largest_body, shared_store
from cluster.scrape import merged
from cluster.settings import in_effect, reuse_address
from accounts.store import STORE_ERRORS
from arbiter.events import EventLog
from gateway.accounts import Accounts
from gateway.cors import cors
from gateway.drain import LIVENESS
from gateway.auth import Caller, KeyRing, bearer_token, subprotocol_key
from gateway.config import load_config
from gateway.errors import APIError, speaks_anthropic, store_unavailable
from gateway.loop_watch import LoopWatch
from gateway.origin import AUDIO, CLIENT_SECRET, IMAGE, origin_of
from gateway.schemas import read_body

log = logging.getLogger("tiergate.cluster")
READS = ("GET", "HEAD", "OPTIONS")  # methods that change nothing where they are served
SCRAPE_ASK_S = 3.0  # how long a scrape waits for one replica's metrics
SCRAPE_S = 8.0  # and for all of them
_DROPPED = {b"x-request-id", b"content-length"}  # the proxy writes the same id; the length is set here
# the ``model`` field of a form: its Content-Disposition, any headers of the part after it (RFC 7578
# allows a Content-Type: curl's ``-F 'model=x;type=text/plain'``), a blank line, the value
_FORM_MODEL = re.compile(rb'; *name="model"(?:\r\n[^\r\n]+)*\r\n\r\n([^\r\n]*)\r\n')


class Ingress:
    """A Ray Serve deployment class; ``replicas`` is the replica deployment's handle."""

    def __init__(self, config_path: str, keys: dict[str, list[str]], admin_keys: list[str],
                 deployments: dict[str, dict]) -> None:
        """``deployments``: name -> {"models", "replicas", "handle"} (``cluster.app``)."""
        # before Serve binds cluster.port for this ingress: a replacement binds it through the TIME_WAIT
        # connections of one that died (cluster.settings.reuse_address)
        self.reuses_address = reuse_address()
        self.config = shared_store(load_config(Path(config_path)))
        self.max_body = largest_body(self.config.limits, self.config.batch)  # what crosses to a replica whole
        self.keys = KeyRing(keys, admin_keys)
        self.accounts = Accounts.from_config(self.config)
        self._accounts_started: asyncio.Future | None = None
        self.deployments = [_Target.of(d["handle"], d["replicas"]) for d in deployments.values()]
        self.by_model = {m: t for t, d in zip(self.deployments, deployments.values()) for m in d["models"]}
        self.default = self.deployments[0]  # the pool (first when there is one): requests that need no model
        self.rank = {t.name: i for i, t in enumerate(self.config.tiers)}
        self.base = ({m.name: m.name for m in self.config.models} | {a.name: a.model for a in self.config.adapters}
                     | self.config.aliases)
        replicas = sum(t.replicas for t in self.deployments)
        self.capacity = {t.name: replicas * (self.config.max_inflight(t) + t.max_queued) for t in self.config.tiers}
        self.inflight = {t.name: 0 for t in self.config.tiers}
        self.sessions = {t.name: 0 for t in self.config.tiers}  # realtime sessions open through this ingress
        self.answered: Counter[tuple[str, str, int]] = Counter()  # (tier, where, status) -> responses
        self.id = serve.get_replica_context().replica_id.unique_id
        self.redirects = self.scrape_misses = 0
        self.cors = cors(self.config.server.cors_origins)  # [] when no origins are listed
        # This ingress's event loop, watched as a replica's is (gateway.loop_watch; server.loop_stall_s):
        # its lag and stalls in /metrics with its ``ingress`` label, each stall in its log
        self._own_registry = CollectorRegistry(auto_describe=False)
        stall_s = self.config.server.loop_stall_s
        self.loop_watch = LoopWatch(stall_s, EventLog(), self._own_registry) if stall_s else None
        self._watching = False

    async def asgi(self, scope: dict, receive, send) -> None:
        """An HTTP request or a WebSocket (the Realtime API), as Serve hands it over (``Dispatch``)."""
        if self.loop_watch is not None and not self._watching:
            self._watching = True
            await self.loop_watch.start()  # on the loop Serve runs this ingress's requests on
        if scope["type"] == "websocket":
            await self._realtime(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self.handle(request)
        except Exception:  # noqa: BLE001 - a bug here: a clean 500, as Serve gave one
            log.exception("the ingress failed on a request")
            error = APIError(500, "the ingress failed on this request", "internal_error")
            response = error.response(speaks_anthropic(_app_path(scope), request.headers))
        await response(scope, receive, send)

    async def handle(self, request: Request) -> Response:
        if self.cors and request.method == "OPTIONS" and "access-control-request-method" in request.headers:
            return self._own(Response())  # a preflight: the CORS middleware answers it, before authentication
        path = _app_path(request.scope)
        if path in LIVENESS:
            return self._own(JSONResponse({"status": "ok"}))
        if path == "/metrics" and request.method == "GET" and not self.config.server.metrics_need_admin:
            return self._own(Response(await self._scrape(), media_type="text/plain; version=0.0.4"))
        tier = "-"
        try:
            if path == "/readyz":  # a probe, keyless as on tiergate serve: a replica's readiness
                return await self._serve(request, path, None)
            caller = await self._caller(request)
            tier = caller.tier
            if path == "/metrics" and request.method == "GET":  # (server.metrics_need_admin)
                if not caller.admin:
                    raise APIError(403, "this endpoint needs an admin key", "admin_only")
                return self._own(Response(await self._scrape(), media_type="text/plain; version=0.0.4"))
            if path in RUNTIME_LORA_PATHS:  # one replica would know the adapter, and this ingress none
                raise APIError(400, f"{path} changes one process's adapters: in a cluster, put adapters in the "
                               "adapter_dirs folders every node reads (README, Adapter folders)", "unsupported_in_cluster")
            if path.startswith("/v1/fine_tuning/"):  # a job runs on its model's trainer, which replicas do not share
                raise APIError(400, "fine-tuning runs on tiergate serve, not in a cluster: train on one server, "
                               "whose adapters the cluster's adapter_dirs folders then serve", "unsupported_in_cluster")
            return await self._serve(request, path, caller)  # the replica's answer, its CORS headers in it
        except APIError as exc:
            self.answered[(tier, "ingress", exc.status)] += 1
            return self._own(exc.response(speaks_anthropic(path, request.headers)))  # the Messages API's shape

    def _own(self, response: Response) -> Response:
        """An answer the ingress makes itself, through the CORS middleware when there is one."""
        return _WithCors(response, self.cors[0]) if self.cors else response

    def serve_settings(self) -> dict:
        """The Serve settings in this ingress's process (``cluster.settings``), how its calls to the
        replicas travel ("grpc" or "actor task": by reference) and whether its port is bound with
        SO_REUSEADDR (``cluster.settings.reuse_address``)."""
        by_reference = {t.answer.handle_options._by_reference for t in self.deployments}
        return {**in_effect(), "replica_calls": sorted("actor task" if r else "grpc" for r in by_reference),
                "reuses_address": self.reuses_address}

    async def _serve(self, request: Request, path: str, caller: Caller | None) -> Response:
        """``caller`` None: a keyless probe (``/readyz``), carried as the top tier's."""
        # 413 past the largest body any endpoint takes (the replica judges each endpoint's own), before it is all held
        body = await read_body(request, self.max_body)
        routing = Routing(None, False, None, None, True) if caller is None else self._model(request, body, path)
        model, streamed, affinity, origin = routing.model, routing.streamed, routing.affinity, routing.origin
        if model is not None and not self.accounts.allows(caller, model):
            raise APIError(404, f"the model '{model}' does not exist", "model_not_found", "model")
        tier = caller.tier if caller is not None else self.config.tiers[0].name
        if model is not None and (early := await early_refusal(self.accounts, caller)) is not None:
            raise early
        if self.inflight[tier] >= self.capacity[tier]:
            raise APIError(429, f"the {tier} tier's queues are full on every replica", "queue_full",
                           headers={"retry-after": "1", "retry-after-ms": "1000"}, type="rate_limit_error")
        forwarded = {"method": request.method, "path": path, "query": request.url.query.encode(),
                     "headers": _with_request_id(request.headers.raw), "body": body}
        self.inflight[tier] += 1
        try:
            head, rest, redirects = await self._call(forwarded, model, self.rank[tier], streamed, affinity, origin=origin,
                                                     once=routing.once)
        except BaseException:
            self.inflight[tier] -= 1
            raise
        self.answered[(tier, "replica", head["status"])] += 1
        self.redirects += redirects
        headers = [(k, v) for k, v in head["headers"] if k.lower() not in _DROPPED]  # Serve's proxy writes the id
        headers.append((b"x-tiergate-redirects", str(redirects).encode()))
        if "body" in head:  # the whole answer in one message
            self.inflight[tier] -= 1
            response = Response(head["body"], status_code=head["status"])
            response.raw_headers = headers + [(b"content-length", str(len(head["body"])).encode())]
            return response
        sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        anthropic = sse and speaks_anthropic(path, request.headers)
        response = StreamingResponse(self._body(rest, tier, sse, anthropic), status_code=head["status"])
        response.raw_headers = headers
        return response

    async def check_health(self) -> None:
        """Serve's health check, first called as the ingress starts: the managed keys are read
        (``Accounts.start``) before any request comes; while their store does not answer the
        ingress is unhealthy (and Serve replaces it)."""
        await self._accounts()

    async def _accounts(self) -> None:
        """Start the accounts once; a start that failed is tried again by the next caller."""
        if self._accounts_started is None:
            self._accounts_started = asyncio.ensure_future(self.accounts.start())
        started = self._accounts_started
        try:
            await asyncio.shield(started)
        except Exception:
            if self._accounts_started is started:  # the first of its waiters (a retry may have begun since)
                self._accounts_started = None
                await self.accounts.store.close()  # the next start opens it again
            raise

    async def _caller(self, request: HTTPConnection, token: str | None = None) -> Caller:
        """The key's caller (``token``, when given, is the key a browser's WebSocket offers as a
        subprotocol); 401 without a valid key, 503 while the key store does not answer."""
        try:
            await self._accounts()
        except STORE_ERRORS as exc:  # Redis down: a clean 503, and the next caller tries again
            log.warning("the key store did not answer: %s: %s", type(exc).__name__, exc)
            raise store_unavailable() from exc
        token = bearer_token(request.headers.get("authorization")) or request.headers.get("x-api-key") or token
        if token is None:  # as tiergate serve answers (gateway.service.authenticate)
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        caller = self.keys.lookup(token) or self.accounts.lookup(token)
        if caller is None:
            raise APIError(401, "incorrect API key provided", "invalid_api_key")
        return caller

    async def _call(self, forwarded: dict, model: str | None, tier: int, streamed: bool, affinity: str | None = None,
                    method: str = "", origin: str | None = None, via: "_Target | None" = None, once: bool = False):
        """The first reply of the replica that takes the request (``{"status", "headers"}``, with
        ``"body"`` when it is the whole answer), the rest of a streamed one, and the redirects.
        A request that did not ask for a stream is one plain call (``answer``), cheaper in Ray
        than a streaming call. ``method="realtime"``: a realtime session's opening (the first
        reply is ``{"replica"}`` or a refusal). ``origin``: the replica that made an id the
        request names (``gateway.origin``), asked first (unless it answered "redirect"); ``via``:
        the deployment to call when it is not ``model``'s. ``once``: a request that may have taken effect
        on a replica that died before answering (a file, a background response stored: ``Routing.once``)
        is answered 502 ``replica_failed``, not tried again."""
        target = via or self.target(model)
        avoid: list[str] = []
        ends: list[int | None] = []  # each redirecting replica's protection end (None: no protection in the way)
        for _ in range(max(2, target.replicas)):  # until a replica takes it or the router refuses
            stream = None  # (a plain call's answer has no rest)
            pin = origin if origin not in avoid else None
            try:
                if streamed:
                    call = target.realtime if method == "realtime" else target.forward
                    stream = call.remote(forwarded, model=model, tier=tier, avoid=avoid, affinity=affinity, replica=pin)
                    first = await stream.__anext__()
                else:
                    first = await target.answer.remote(forwarded, model=model, tier=tier, avoid=avoid, affinity=affinity,
                                                       replica=pin)
            except RayError as exc:  # died before answering: Serve stops routing to it
                log.warning("replica failed before answering: %s", type(exc).__name__)
                if once:  # a file, a key, a stored response: it may have been made (whether its answer streams or not)
                    raise APIError(502, "the replica serving this request failed; retry it", "replica_failed") from None
                continue  # a model request: once more elsewhere
            if "redirect" not in first:
                return first, stream, len(avoid)
            avoid.append(first["redirect"])
            ends.append(first.get("retry_after"))
        # every replica asked would refuse (their reports were stale): Retry-After the earliest protection end
        # among them, as the router's own cluster-wide 429 (1 s where some replica's refusal was no protection)
        wait = min((s or 1 for s in ends), default=1)
        raise APIError(503 if not avoid else 429, f"no replica can take '{model}' now",
                       "model_protected" if avoid else "replica_unavailable",
                       headers={"retry-after": str(wait), "retry-after-ms": str(wait * 1000),
                                "x-tiergate-redirects": str(len(avoid))},
                       type="rate_limit_error" if avoid else None)

    async def _realtime(self, scope: dict, receive, send) -> None:
        """A Realtime API session (``/v1/realtime``, a WebSocket): the key is checked here (a
        header, or a browser's subprotocol), then the session runs on the replica the router picks
        for its model, as ``tiergate serve`` runs it (``TierReplica.realtime``), with its messages
        relayed both ways. A client secret (``ek_``) is checked by the replica that made it, where
        its session runs. A refusal before the session is the handshake's HTTP answer where the
        client's server can send one, else a policy close (1008), as in ``tiergate serve``."""
        denial = "websocket.http.response" in scope.get("extensions", {})
        tier = "-"
        try:
            if (await receive())["type"] != "websocket.connect":
                return
            connection = HTTPConnection(scope)
            path = _app_path(scope)
            if path != "/v1/realtime":
                raise APIError(404, f"no WebSocket at {path}: the Realtime API is /v1/realtime", "not_found")
            presented = bearer_token(connection.headers.get("authorization")) or subprotocol_key(scope)
            origin = origin_of(presented, CLIENT_SECRET)
            model, rank = None, len(self.rank) - 1
            # a client secret's session: to the replica that made it, in the deployment of the model
            # the URL names (a tensor-parallel model's own), which checks the secret
            via = self.target(self._session_model(connection.query_params.get("model")))
            if presented is None or not presented.startswith(CLIENT_SECRET):
                caller = await self._caller(connection, subprotocol_key(scope))
                tier, rank = caller.tier, self.rank[caller.tier]
                model, via = self._session_model(connection.query_params.get("model"), caller), None
                if model is not None and not self.accounts.allows(caller, model):
                    raise APIError(404, f"the model '{model}' does not exist", "model_not_found", "model")
                if model is not None and (early := await early_refusal(self.accounts, caller)) is not None:
                    raise early
            opening = {"session": uuid.uuid4().hex, "path": path, "query": scope.get("query_string", b""),
                       "headers": _with_request_id(list(scope.get("headers", []))),
                       "subprotocols": list(scope.get("subprotocols", [])), "denial": denial}
            first, rest, _ = await self._call(opening, model, rank, True, method="realtime", origin=origin, via=via)
        except APIError as exc:
            self.answered[(tier, "ingress", exc.status)] += 1
            response = exc.response()
            await _deny(send, response.status_code, response.raw_headers, bytes(response.body), denial)
            return
        if "replica" not in first:  # the cluster-wide refusal, delivered by a replica
            self.answered[(tier, "replica", first["status"])] += 1
            await _deny(send, first["status"], first["headers"], first["body"], denial)
            return
        self.sessions[tier] = self.sessions.get(tier, 0) + 1  # "-": opened with a client secret
        try:
            await self._relay(rest, via or self.target(model), opening["session"], first["replica"], receive, send, denial)
        finally:
            self.sessions[tier] -= 1

    async def _relay(self, rest, target: "_Target", session: str, replica: str, receive, send, denial: bool) -> None:
        """The session's messages, both ways, until one side ends it: the replica's as they come,
        the client's in order, one call at a time (``realtime_input``, pinned to the replica),
        each carrying all that arrived while the one before was under way. Left any other way
        than by the session's end (this task cancelled, the client's connection broken), the
        replica's stream is cancelled, which the replica's app sees as the client gone."""
        pump: asyncio.Task | None = None
        ended = False
        try:
            async for message in rest:
                if message["type"] == "websocket.accept":
                    pump = asyncio.ensure_future(_pump(receive, target, session, replica))
                await send(message)
            ended = True
        except RayError as exc:
            ended = True  # the replica died: a clean error, as a stream gets one
            log.warning("replica failed mid-session: %s", type(exc).__name__)
            error = APIError(502, "the replica serving this session failed; open a new session", "replica_failed")
            if pump is None:
                response = error.response()
                await _deny(send, response.status_code, response.raw_headers, bytes(response.body), denial)
                return
            with contextlib.suppress(Exception):  # the client may have left too
                await send({"type": "websocket.send", "text": json.dumps(
                    {"type": "error", "event_id": f"event_{uuid.uuid4().hex[:24]}", "error": error.body()["error"]})})
                await send({"type": "websocket.close", "code": 1011, "reason": "the replica failed"})
        except OSError:  # the client's connection broke while a message was sent to it
            pass
        finally:
            if not ended:
                rest.cancel()
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump

    def _session_model(self, name: str | None, caller: Caller | None = None) -> str | None:
        """The model a realtime session is routed by: the chat model of a conversation, or the
        speech-to-text model of a transcription (when the URL names none, the first one configured
        that ``caller`` may use: 404 as ``tiergate serve``'s when there is none, never naming a model
        the key's allow-list hides); None for a name the cluster does not know (the replica refuses
        it as ``tiergate serve`` does)."""
        if name:
            return self.base.get(name)
        usable = (m.name for m in self.config.models
                  if m.kind == "stt" and (caller is None or self.accounts.allows(caller, m.name)))
        model = next(usable, None)
        if model is None and caller is not None:
            raise APIError(404, "this server has no transcription (stt) model for realtime sessions",
                           "model_not_found", "model")
        return model

    def target(self, model: str | None) -> "_Target":
        """The deployment that serves ``model`` (the pool for requests that need none)."""
        return self.by_model.get(model, self.default) if model is not None else self.default

    async def _body(self, rest, tier: str, sse: bool, anthropic: bool = False) -> AsyncIterator[bytes]:
        """The replica's body as it comes; a stream (SSE) whose replica dies ends with an error
        event the client's SDK raises: OpenAI's ``data: {"error"}``, or on the Messages API
        (``anthropic``) Anthropic's ``event: error``, as its stream reports a failure (the openai
        shape there was ignored by the anthropic SDK: a truncated message, read as whole)."""
        try:
            async for chunk in rest:
                yield chunk
        except RayError as exc:
            log.warning("replica failed mid-answer: %s", type(exc).__name__)
            if sse:
                error = APIError(502, "the replica serving this request failed; retry it", "replica_failed")
                if anthropic:
                    yield b"event: error\ndata: " + json.dumps({"type": "error", **error.body()}).encode() + b"\n\n"
                else:
                    yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        finally:
            self.inflight[tier] -= 1

    async def _scrape(self) -> bytes:
        """Every replica's metrics (each asked once, in turn: the router avoids those already
        asked) with ``replica`` and ``node`` labels, and this ingress's own. A replica that does not
        answer within ``SCRAPE_ASK_S`` (hung, or its loop held) is left out of this scrape, and the
        whole scrape stops asking after ``SCRAPE_S``, within Prometheus' default 10 s timeout."""
        texts = []
        deadline = asyncio.get_running_loop().time() + SCRAPE_S
        for target in self.deployments:
            seen: set[str] = set()
            for _ in range(target.replicas):
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(min(SCRAPE_ASK_S, left)):
                        got = await target.metrics.remote(avoid=sorted(seen))
                except (RayError, TimeoutError) as exc:  # a replica dying or hung: the next scrape asks again
                    log.warning("a replica's metrics failed: %s", type(exc).__name__)
                    self.scrape_misses += 1
                    continue
                if got["replica"] in seen:  # every replica answered already (the router fell back)
                    break
                seen.add(got["replica"])
                texts.append(({"replica": got["replica"], "node": got["node"]}, got["text"]))
        if self._watching:
            texts.append(({"ingress": self.id}, generate_latest(self._own_registry).decode()))
        return merged(texts, self._own_metrics())

    def _own_metrics(self) -> list[Metric]:
        """This ingress's counters, labelled with its id (each node's ingress counts its own)."""
        me = self.id
        answered = CounterMetricFamily("tiergate_ingress_responses", "Responses by tier, who answered "
                                       "(ingress: refused before any replica) and status",
                                       labels=["ingress", "tier", "by", "status"])
        for (tier, by, status), n in sorted(self.answered.items()):
            answered.add_metric([me, tier, by, str(status)], n)
        inflight = GaugeMetricFamily("tiergate_ingress_in_flight", "Requests in flight through this ingress",
                                     labels=["ingress", "tier"])
        for tier, n in self.inflight.items():
            inflight.add_metric([me, tier], n)
        sessions = GaugeMetricFamily("tiergate_ingress_realtime_sessions", "Realtime API sessions open through "
                                     "this ingress", labels=["ingress", "tier"])
        for tier, n in self.sessions.items():
            sessions.add_metric([me, tier], n)
        redirects = CounterMetricFamily("tiergate_ingress_redirects", "Replicas that answered redirect (stale stats)",
                                        labels=["ingress"])
        redirects.add_metric([me], self.redirects)
        misses = CounterMetricFamily("tiergate_ingress_scrape_misses", "Replicas' metrics left out of a scrape "
                                     "(the replica died, or did not answer in time)", labels=["ingress"])
        misses.add_metric([me], self.scrape_misses)
        return [answered, inflight, sessions, redirects, misses]

    def _model(self, request: Request, body: bytes, path: str = "") -> Routing:
        """How the request is routed (``Routing``); 400/404 on bad input."""
        affinity = origin = None
        once = False
        if request.method != "POST" or not body:
            if path.startswith(IMAGE_FILES):
                origin = origin_of(path[len(IMAGE_FILES):], IMAGE)
            # a read (GET, HEAD, OPTIONS) takes no effect: tried once more elsewhere, as a model request is
            return Routing(None, request.method != "POST", None, origin, request.method not in READS)
        kind = request.headers.get("content-type", "").lower()  # media types are case-insensitive (RFC 9110)
        streamed = True
        if kind.startswith("multipart/"):
            found = _FORM_MODEL.search(body)
            name = found.group(1).decode() if found else None
        elif kind.startswith("application/json") or not kind:
            try:
                parsed = json.loads(body)
            except ValueError:
                raise APIError(400, "the body is not valid JSON", "invalid_json") from None
            parsed = parsed if isinstance(parsed, dict) else {}
            if path == CLIENT_SECRETS:  # made where its sessions' chat model is best placed: they run there
                session = parsed.get("session")
                name = session.get("model") if isinstance(session, dict) else None
                model = self.base.get(name) if isinstance(name, str) else None
                return Routing(model, False, None, None, model is None)
            name = parsed.get("model")
            affinity = affinity_of(parsed)
            origin = spoken_origin(parsed.get("messages"))
            streamed = parsed.get("stream") is True or parsed.get("stream_format") == "sse" or path in STREAMED_ANSWERS
            once = lasting(path, parsed)
        else:
            return Routing(None, True, None, None, True)
        if name is None:
            return Routing(None, streamed, None, origin, True)
        if not isinstance(name, str):  # as the replicas' schemas answer it
            raise APIError(400, f"'model' must be a string, not {type(name).__name__}", "invalid_type", "model")
        base = self.base.get(name)
        if base is None:
            base = self.config.folder_adapter_base(name)  # an adapter_dirs adapter: its replica reads and checks it
        if base is None:
            raise APIError(404, f"the model '{name}' does not exist", "model_not_found", "model")
        return Routing(base, streamed, affinity, origin, once)




class Routing(NamedTuple):
    """What the ingress reads from a request to route it (``Ingress._model``)."""

    model: str | None  # the base model it needs (None for endpoints that need none)
    streamed: bool  # its answer may come as a stream: asked for one, speech, or not a JSON POST (a file, a form)
    affinity: str | None  # for the router (``affinity_of``)
    origin: str | None  # the replica that made an id it names (an image url's file, a spoken reply: ``gateway.origin``)
    # it may take effect before its answer (it needs no model: a file, a key; or ``lasting``): a replica that
    # died before answering may have made it, so it is answered 502 ``replica_failed``, never sent to another
    once: bool


def lasting(path: str, body: dict) -> bool:
    """Whether a model request writes what outlives the call before it answers, so that a second
    replica would make it again: a stored response (``store`` is true unless false; a background one's
    record, written before it answers, is run again by another replica's reclaim), a turn added to a
    conversation, a stored chat completion (listed at ``GET /v1/chat/completions``), a vector store."""
    if path == "/v1/responses":
        return body.get("store") is not False or body.get("background") is True or body.get("conversation") is not None
    if path == "/v1/chat/completions":
        return body.get("store") is True
    return path.startswith("/v1/vector_stores") and not path.endswith("/search")


RUNTIME_LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
STREAMED_ANSWERS = ("/v1/audio/speech",)  # answers sent as they are made, whatever the body asks (a streaming call)
IMAGE_FILES = "/v1/images/files/"
CLIENT_SECRETS = "/v1/realtime/client_secrets"


async def _pump(receive, target: "_Target", session: str, replica: str) -> None:
    """A realtime client's messages to its session's replica (``Ingress._relay``), until the
    client leaves or the session is no longer there."""
    arrived: asyncio.Queue = asyncio.Queue()

    async def read() -> None:
        while True:
            message = await receive()
            arrived.put_nowait(message)
            if message["type"] == "websocket.disconnect":
                return

    reader = asyncio.ensure_future(read())
    try:
        while True:
            batch = [await arrived.get()]
            while not arrived.empty():
                batch.append(arrived.get_nowait())
            if not await target.realtime_input.remote(session, batch, replica=replica):
                return  # the session ended there, or its replica died (the relay says so)
            if batch[-1]["type"] == "websocket.disconnect":
                return
    except RayError:
        return  # the replica died: the relay's stream fails too and tells the client
    finally:
        reader.cancel()


async def _deny(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes, denial: bool) -> None:
    """Refuse a WebSocket's handshake: with an HTTP answer where the server can send one (ASGI's
    ``websocket.http.response``), else with a policy close naming the reason."""
    if denial:
        kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": kept + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    try:
        reason = json.loads(body)["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        reason = ""
    await send({"type": "websocket.close", "code": 1008, "reason": reason})


class Dispatch:
    """The ingress's ASGI app for Serve (``serve.ingress``): HTTP requests and WebSockets go to the
    replica's ``Ingress``; the lifespan is the ingress's own (it starts at Serve's health check)."""

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await serve.get_replica_context().servable_object.asgi(scope, receive, send)


def affinity_of(body: dict) -> str | None:
    """What keeps a request beside others that share its prompt's start (the router's affinity):
    its ``prompt_cache_key`` (OpenAI's field for exactly this), else the response or conversation
    it continues (its prompt is that one's, and more). Two API keys' equal cache keys meet on one
    replica, whose prefix cache still keeps their blocks apart (``server.prefix_cache``)."""
    for value in (body.get("prompt_cache_key"), body.get("previous_response_id"), body.get("conversation")):
        if isinstance(value, dict):
            value = value.get("id")
        if isinstance(value, str) and value:
            return value[:256]
    return None


def spoken_origin(messages: object) -> str | None:
    """The replica that made the first spoken reply a chat's messages send back by its audio id."""
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, dict) and isinstance(audio := message.get("audio"), dict):
            if (origin := origin_of(audio.get("id"), AUDIO)) is not None:
                return origin
    return None


class _WithCors(Response):
    """``response`` sent through Starlette's CORS middleware (Serve sends a returned response by
    calling it with the request's scope), which answers a preflight without it."""

    def __init__(self, response: Response, middleware: Middleware) -> None:
        super().__init__(status_code=response.status_code)  # (what is sent is ``response``)
        self.response, self.middleware = response, middleware

    async def __call__(self, scope, receive, send) -> None:
        mw = self.middleware
        await mw.cls(self.response, *mw.args, **mw.kwargs)(scope, receive, send)


@dataclass(frozen=True)
class _Target:
    """A deployment's handles, one per method called (made once: a handle's method attribute makes a
    new handle each time), and its replica count."""

    forward: Any  # streamed
    answer: Any
    metrics: Any
    realtime: Any  # streamed: a realtime session's messages from the replica
    realtime_input: Any  # the client's, to it
    replicas: int

    @classmethod
    def of(cls, handle: Any, replicas: int) -> "_Target":
        """The handle was made where the application was built, with that process's Serve settings:
        its calls go over gRPC when this process's Serve says so (``cluster.settings``)."""
        handle = handle.options(_by_reference=not in_effect()["RAY_SERVE_USE_GRPC_BY_DEFAULT"])
        return cls(handle.options(method_name="forward", stream=True), handle.options(method_name="answer"),
                   handle.options(method_name="metrics"), handle.options(method_name="realtime", stream=True),
                   handle.options(method_name="realtime_input"), replicas)


def _app_path(scope: dict) -> str:
    """The path below the application's route prefix (ASGI's ``path`` includes ``root_path``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _with_request_id(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request's headers with Serve's request id (the client's x-request-id, or the one its
    proxy made and answers with) as x-request-id, so the replica's request log names the same id."""
    from ray.serve.context import _get_serve_request_context

    request_id = _get_serve_request_context().request_id
    kept = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
    return kept + [(b"x-request-id", request_id.encode())] if request_id else list(headers)
