"""The cluster's HTTP entry point, behind Ray Serve's proxy (one per node): what the gateway does
before a model is needed, then the call to the replica the router picks, streamed back.

* authentication with the tiers' keys and the managed keys (``gateway.accounts``: the store is
  ``cluster.redis_url``'s Redis when set, shared with every replica; 401 without a valid key);
* validation: the body's ``model`` must be a configured model or adapter that the key may use
  (404 otherwise, as if it did not exist), a JSON body must parse (400);
* an early 429 when a tier already has as many requests in flight through this ingress as all
  replicas' gates could hold (``max_inflight + max_queued`` each), before any replica is asked;
* the call: ``forward`` on the replica deployment with ``stream=True``; the router (a
  ``cluster.ray_router.TierRouter``) reads the model and tier from its arguments. A replica that
  answers "redirect" (its stats were stale) is avoided and the router is asked again, until a replica
  takes the request or the router refuses (at most once per replica); a replica that died before
  answering is tried once more (Serve drops it from the router's candidates).
* a replica that dies mid-answer: a stream (SSE) ends with an OpenAI-shaped error event, which the
  OpenAI SDK raises as an ``APIError``; any other body is cut short.

Per-key quotas (requests and tokens per minute, daily spend) and usage are applied by the chosen
replica's serving core, as in ``tiergate serve``: on a shared Redis the limiter is atomic across
processes, so a key's limits hold for the whole cluster (docs/CLUSTER.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

from ray.exceptions import RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.replica import shared_store
from gateway.accounts import Accounts
from gateway.auth import Caller, KeyRing, bearer_token
from gateway.config import load_config
from gateway.errors import APIError

log = logging.getLogger("tiergate.cluster")
_FORM_MODEL = re.compile(rb'name="model"\r\n\r\n([^\r\n]*)\r\n')


class Ingress:
    """A Ray Serve deployment class; ``replicas`` is the replica deployment's handle."""

    def __init__(self, config_path: str, keys: dict[str, list[str]], admin_keys: list[str], replicas,
                 num_replicas: int) -> None:
        self.config = shared_store(load_config(Path(config_path)))
        self.keys = KeyRing(keys, admin_keys)
        self.accounts = Accounts.from_config(self.config)
        self._accounts_started: asyncio.Future | None = None
        self.replicas = replicas
        self.num_replicas = num_replicas
        self.rank = {t.name: i for i, t in enumerate(self.config.tiers)}
        self.base = {m.name: m.name for m in self.config.models} | {a.name: a.model for a in self.config.adapters}
        self.capacity = {t.name: num_replicas * (self.config.max_inflight(t) + t.max_queued)
                         for t in self.config.tiers}
        self.inflight = {t.name: 0 for t in self.config.tiers}

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._serve(request)
        except APIError as exc:
            return exc.response()

    async def _serve(self, request: Request) -> Response:
        if _app_path(request.scope) == "/healthz":
            return JSONResponse({"status": "ok"})
        caller = await self._caller(request)
        body = await request.body()
        model = self._model(request, body)
        if model is not None and not self.accounts.allows(caller, model):
            raise APIError(404, f"the model '{model}' does not exist", "model_not_found", "model")
        tier = caller.tier
        if self.inflight[tier] >= self.capacity[tier]:
            raise APIError(429, f"the {tier} tier's queues are full on every replica", "queue_full",
                           headers={"retry-after": "1", "retry-after-ms": "1000"}, type="rate_limit_error")
        forwarded = {"method": request.method, "path": _app_path(request.scope), "query": request.url.query.encode(),
                     "headers": _with_request_id(request.headers.raw), "body": body}
        self.inflight[tier] += 1
        try:
            head, rest, redirects = await self._call(forwarded, model, self.rank[tier])
        except BaseException:
            self.inflight[tier] -= 1
            raise
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head["headers"]
                   if k.lower() != b"x-request-id"]  # Serve's proxy writes the same id
        headers.append(("x-tiergate-redirects", str(redirects)))
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)
        response = StreamingResponse(self._body(rest, tier, sse), status_code=head["status"])
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        return response

    async def _caller(self, request: Request) -> Caller:
        if self._accounts_started is None:
            self._accounts_started = asyncio.ensure_future(self.accounts.start())
        await asyncio.shield(self._accounts_started)
        token = bearer_token(request.headers.get("authorization"))
        caller = (self.keys.lookup(token) or self.accounts.lookup(token)) if token else None
        if caller is None:
            raise APIError(401, "missing or incorrect API key", "invalid_api_key")
        return caller

    async def _call(self, forwarded: dict, model: str | None, tier: int):
        avoid: list[str] = []
        for _ in range(max(2, self.num_replicas)):  # until a replica takes it or the router refuses
            stream = self.replicas.options(stream=True).forward.remote(forwarded, model=model, tier=tier, avoid=avoid)
            try:
                first = await stream.__anext__()
            except RayError as exc:  # died before answering: Serve stops routing to it; try once more
                log.warning("replica failed before answering: %s", type(exc).__name__)
                continue
            if "redirect" not in first:
                return first, stream, len(avoid)
            avoid.append(first["redirect"])
        raise APIError(503 if not avoid else 429, f"no replica can take '{model}' now",
                       "model_protected" if avoid else "replica_unavailable",
                       headers={"retry-after": "1", "retry-after-ms": "1000"},
                       type="rate_limit_error" if avoid else None)

    async def _body(self, rest, tier: str, sse: bool) -> AsyncIterator[bytes]:
        try:
            async for chunk in rest:
                yield chunk
        except RayError as exc:
            log.warning("replica failed mid-answer: %s", type(exc).__name__)
            if sse:
                error = APIError(502, "the replica serving this request failed; retry it", "replica_failed")
                yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
        finally:
            self.inflight[tier] -= 1

    def _model(self, request: Request, body: bytes) -> str | None:
        """The base model the request needs (None for endpoints that need none); 400/404 on bad input."""
        if request.method != "POST" or not body:
            return None
        kind = request.headers.get("content-type", "")
        if kind.startswith("multipart/"):
            found = _FORM_MODEL.search(body)
            name = found.group(1).decode() if found else None
        elif kind.startswith("application/json") or not kind:
            try:
                parsed = json.loads(body)
            except ValueError:
                raise APIError(400, "the body is not valid JSON", "invalid_json") from None
            name = parsed.get("model") if isinstance(parsed, dict) else None
        else:
            return None
        if name is None:
            return None
        if not isinstance(name, str) or name not in self.base:
            raise APIError(404, f"the model '{name}' does not exist", "model_not_found", "model")
        return self.base[name]


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
