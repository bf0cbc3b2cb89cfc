"""The Starlette application: the one route table, error handling, and building the services from
a config. This module composes the server: it is the only one in ``gateway`` that imports
``batch`` and ``tuning`` (whose routes it mounts and whose runners it starts); they import the
gateway's serving core, never this module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from typing import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arbiter.events import EventLog
from arbiter.footprint import configured_device, device_budget
from arbiter.residency import Arbiter, Refused, Unavailable
from batch import api as batch_api
from batch import message_batches
from batch.runner import runner_for
from batch.uploads import uploads_for
from tuning import api as tuning_api
from gateway import (adapters, audio, chat, classify, completions, conversations, dashboard, embeddings, images,
                     messages, moderations, realtime_conversation, rerank, response_runs, responses_api, stored_chat,
                     tokenize, vector_stores)
from accounts.store import STORE_ERRORS
from gateway.accounts import Accounts
from gateway.accounts_api import KeyHeaders
from gateway import accounts_api
from gateway.adapters import load_adapters
from gateway.admission import Gate, TierPolicy
from gateway.auth import Caller, KeyRing
from gateway.body_deadline import BodyDeadline
from gateway.config import Config
from gateway.cors import cors
from gateway.background import Background
from gateway.drain import LIVENESS, Drain, DrainGate, Preload, readyz
from gateway.store_watch import StoreWatch
from gateway.errors import APIError, speaks_anthropic, store_unavailable
from gateway.image_store import ImageStore
from gateway.loop_watch import LoopWatch
from gateway.metrics import Metrics
from gateway.output_audio import SpokenReplies
from gateway.realtime_secrets import ClientSecrets
from gateway.request_log import RequestLog, note, request_id_of
from gateway.schemas import is_count
from gateway.completion_store import completions_for
from gateway.conversation_store import conversations_for
from gateway.vector_indexer import indexer_for
from gateway.vector_store import vector_stores_for
from gateway.response_store import responses_for
from gateway.webhooks import webhooks_for
from gateway.serving import use_threads
from gateway.service import ClientGone, Services, retry_headers
from workers import grammar

log = logging.getLogger("tiergate")

_STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# Anthropic's Messages API: its errors carry its "type" too (gateway.messages), as do those of any request its SDK
# sends (an anthropic-version header: its models list)


def build_services(config: Config, keys: KeyRing, origin: str = "") -> Services:
    """Everything one server process serves with. ``origin``: a cluster replica's id, in the ids
    of what this process keeps in memory (``gateway.origin``)."""
    policies = [
        TierPolicy(t.name, i, config.max_inflight(t), t.max_queued, t.latency_target_s, is_batch=t.batch,
                   token_latency_target_s=t.token_latency_target_s)
        for i, t in enumerate(config.tiers)
    ]
    events = EventLog()  # the one stream the gate and the arbiter report into (the dashboard's)
    gate = Gate(policies, config.gate.slots, guard=config.gate.slo_guard.settings(), events=events)
    device = configured_device(config.gpu.device)  # RuntimeError for cuda where there is none
    arbiter = Arbiter(
        config.model_specs(),
        device=device,
        budget=device_budget(device, config.gpu.vram_budget, config.gpu.reserve),
        host_cache_budget=config.gpu.host_cache_budget,
        protect_window_s=config.eviction.protect_window_s,
        batch_rank=config.batch_rank,
        events=events,
        tier_names=config.tier_names,
    )
    gate.on_change = lambda: arbiter.set_demand(gate.others_busy())
    limits = config.limits
    services = Services(config, keys, gate, arbiter, Metrics(gate, arbiter),
                        adapters=load_adapters(config),  # ConfigError for a bad adapter
                        images=ImageStore(limits.image_url_ttl_s, limits.image_url_store, origin=origin),
                        accounts=Accounts.from_config(config))  # beside the batch store
    services.on_startup.append(services.accounts.start)
    services.on_startup.append(services.read_model_folders)  # /v1/models' max_model_len, sampling defaults
    if any(m.kind == "chat" for m in config.models):  # structured outputs' compiler: not on the loop at a first request
        services.on_startup.append(lambda: asyncio.to_thread(grammar.import_compiler))
    services.on_shutdown.append(services.accounts.stop)
    services.on_shutdown.append(gate.stop)  # the SLO guard's timer (set only while a tier's limit is lowered)
    services.metrics.registry.register(services.adapters)  # folder adapters read, held, dropped
    services.metrics.registry.register(services.accounts)  # usage kept while the store fails, and lost
    services.webhooks = webhooks_for(services)  # ConfigError for an endpoint whose secret is not set
    services.spoken = SpokenReplies(origin=origin)
    if config.server.loop_stall_s:  # the loop's lag and stalls, with where it was (gateway/loop_watch.py)
        watch = LoopWatch(config.server.loop_stall_s, events, services.metrics.registry)
        services.on_startup.append(watch.start)
        services.on_shutdown.append(watch.stop)
    services.client_secrets = ClientSecrets(origin=origin)
    return services


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    svc: Services = request.app.state.services
    if svc.config.server.metrics_need_admin:
        svc.require_admin(request)
    await svc.adapters.drop_gone()  # the held gauges: what is held now, deleted folders let go
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")


async def list_models(request: Request) -> Response:
    """GET /v1/models: OpenAI's list; Anthropic's (its SDK's ``models.list``, which sends an
    ``anthropic-version`` header) lists the models its Messages API serves, in its shape."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    rows = _model_rows(svc, caller, await _adapter_rows(svc))
    if "anthropic-version" in request.headers:
        return JSONResponse(_anthropic_page(svc, rows, request.query_params))
    return JSONResponse({"object": "list", "data": rows})


async def get_model(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    name = request.path_params["model"]
    anthropic = "anthropic-version" in request.headers
    for row in _model_rows(svc, caller, await _adapter_rows(svc)):
        if row["id"] == name and (not anthropic or _speaks(svc, row)):
            return JSONResponse(_anthropic_model(svc, row) if anthropic else row)
    raise APIError(404, f"the model '{name}' does not exist", "model_not_found", "model")


def _speaks(svc: Services, row: dict) -> bool:
    """Whether the Messages API serves the model of a /v1/models row: a chat model, its alias or adapter."""
    if "alias_of" in row:
        return svc.arbiter.specs[row["alias_of"]].kind == "chat"
    return row.get("kind") == "chat" or row.get("base_kind") == "chat"


def _anthropic_model(svc: Services, row: dict) -> dict:
    """Anthropic's ``model`` object of a chat model's row (its release date unknown: the epoch, as
    Anthropic's API says then); ``max_input_tokens`` its context, ``max_tokens`` this server's cap."""
    base = row.get("alias_of") or row.get("parent") or row["id"]
    return {"type": "model", "id": row["id"], "display_name": row["id"], "created_at": "1970-01-01T00:00:00Z",
            "max_input_tokens": svc.context_lengths.get(base), "max_tokens": svc.config.limits.max_chat_tokens}


def _anthropic_page(svc: Services, rows: list[dict], query) -> dict:
    """A page of Anthropic's model list: ``limit`` (1 to 1000, 20 unless given) after ``after_id``
    or before ``before_id``, in /v1/models' order."""
    raw = query.get("limit", "20")
    if not is_count(raw) or not 1 <= int(raw) <= 1000:  # (not isdigit alone: "²" is one, which int refuses)
        raise APIError(400, f"limit must be an integer from 1 to 1000, not {raw!r}", "invalid_value", "limit")
    data = [_anthropic_model(svc, r) for r in rows if _speaks(svc, r)]
    ids = [m["id"] for m in data]
    start, end, limit = 0, len(data), int(raw)
    for cursor, param in ((query.get("after_id"), "after_id"), (query.get("before_id"), "before_id")):
        if cursor and cursor not in ids:
            raise APIError(400, f"no such model to page from: {cursor!r}", "invalid_value", param)
    if query.get("before_id"):
        end = ids.index(query["before_id"])
        start = max(end - limit, 0)
    elif query.get("after_id"):
        start = ids.index(query["after_id"]) + 1
        end = min(start + limit, len(data))
    else:
        end = min(limit, len(data))
    page = data[start:end]
    more = start > 0 if query.get("before_id") else end < len(data)
    return {"data": page, "has_more": more, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


async def _adapter_rows(svc: Services) -> list[dict]:
    """The adapters' rows: with ``adapter_dirs``, their folders are listed in a worker thread (and
    held adapters whose folders are gone let go)."""
    if not svc.adapters.dirs:
        return svc.adapters.rows()
    await svc.adapters.drop_gone()
    return await asyncio.to_thread(svc.adapters.rows)


def _model_rows(svc: Services, caller: Caller | None = None, adapter_rows: list[dict] | None = None) -> list[dict]:
    """Every model, alias and adapter; for ``caller``, only those its key's allow-list lets it
    see. An alias is a row of its own (clients check a name against this list, as they would
    OpenAI's), naming its model in ``alias_of`` and nothing more (its model's row has the facts)."""
    tiers = svc.config.tier_names
    rows, aliases = [], []
    for r in svc.arbiter.table():
        if r["kind"] == "train" and caller is not None:  # a fine-tuning trainer: no request calls it
            continue
        last = r.pop("last_tier")
        name = r.pop("id")
        own = [alias for alias, model in svc.aliases.items() if model == name]
        context = {"max_model_len": svc.context_lengths[name]} if name in svc.context_lengths else {}
        rows.append({"id": name, "object": "model", "created": 0, "owned_by": "tiergate",
                     **r, "last_tier": tiers[last] if last is not None else None, "aliases": own, **context})
        aliases += [{"id": alias, "object": "model", "created": 0, "owned_by": "tiergate", "alias_of": name}
                    for alias in own]
    rows += aliases
    for row in svc.adapters.rows() if adapter_rows is None else adapter_rows:  # an adapter reads its base's context
        base = row.get("parent")
        rows.append({**row, "max_model_len": svc.context_lengths[base]} if base in svc.context_lengths else row)
    if caller is not None and svc.accounts is not None:
        rows = [r for r in rows if svc.accounts.allows(caller, r.get("parent") or r.get("alias_of") or r["id"])
                and (r.get("kind") != "adapter" or svc.accounts.allows_adapter(caller, r["id"]))]
    return rows


async def admin_model(request: Request) -> Response:
    """POST /admin/models/{model}/{action}: load, unload, pin or unpin a model."""
    svc: Services = request.app.state.services
    svc.require_admin(request)
    name, action = svc.model_name(request.path_params["model"]), request.path_params["action"]
    if name not in svc.arbiter.states:
        raise APIError(404, f"the model '{name}' does not exist", "model_not_found", "model")
    if action == "load":
        try:
            await svc.arbiter.load(name)
        except Refused as exc:
            raise APIError(429, str(exc), "model_protected", headers={"retry-after": str(exc.retry_after)}) from None
        except Unavailable as exc:  # (a cooldown's seconds, as the model API's 503 gives them)
            headers = retry_headers(exc.retry_after) if exc.retry_after else {}
            raise APIError(503, str(exc), "model_unavailable", headers=headers) from None
    elif action == "unload":
        if not await svc.arbiter.unload(name):
            raise APIError(409, f"'{name}' is not resident or is busy", "model_busy", type="invalid_request_error")
    elif action in ("pin", "unpin"):
        svc.arbiter.pin(name, action == "pin")
    else:
        raise APIError(404, f"unknown action '{action}': use load, unload, pin or unpin", "not_found")
    row = next(r for r in _model_rows(svc) if r["id"] == name)
    return JSONResponse(row)


def _anthropic(request: Request) -> bool:
    """Whether the request's errors carry Anthropic's ``"type": "error"`` (README, "Anthropic's
    Messages API"): on its paths, and on any request with its SDK's ``anthropic-version`` header."""
    return speaks_anthropic(request.url.path, request.headers)


async def _api_error(request: Request, exc: APIError) -> Response:
    request.app.state.services.left_door()  # refused on its way to the gate: no longer demand
    note(reason=exc.code)
    return exc.response(anthropic=_anthropic(request))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = _STATUS_CODES.get(exc.status_code, "http_error")
    message = {404: f"no route for {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    note(reason=code)
    return APIError(exc.status_code, message, code, headers=dict(exc.headers or {})).response(_anthropic(request))


async def _client_gone(request: Request, exc: ClientGone | ClientDisconnect) -> Response:
    """The client left before its answer was ready (``ClientGone``), or while its body was still
    arriving (``ClientDisconnect``): a 499 nobody reads (the server drops it), for its log line."""
    request.app.state.services.left_door()
    return Response(status_code=499)


async def _store_down(request: Request, exc: Exception) -> Response:
    """Redis or SQLite did not answer (``accounts.store.STORE_ERRORS``): not the request's fault,
    and worth trying again shortly. A constraint SQLite refused is no outage (trying again fails
    again): a 500, as any other error nothing expected."""
    if isinstance(exc, sqlite3.IntegrityError):
        return await _unexpected(request, exc)
    request.app.state.services.left_door()
    request.app.state.store_watch.failed(exc)  # stored responses and chat completions: refused before their work
    log.warning("a store did not answer on %s %s: %r", request.method, request.url.path, exc)
    return store_unavailable("a store this request needs").response(_anthropic(request))


async def _unexpected(request: Request, exc: Exception) -> Response:
    request.app.state.services.left_door()
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    request_id = request_id_of(request.scope)  # the request log's middleware is inside this handler's
    return APIError(500, "internal error; the request was not completed", "internal_error",
                    headers={"x-request-id": request_id} if request_id else None).response(_anthropic(request))


class Unexpected:
    """Middleware (outside all but CORS): an error nothing handled, before the response started, is answered
    with ``_unexpected``'s 500 (its traceback logged once) and the connection stays open for the
    client's next request. (Starlette's own last resort, ServerErrorMiddleware, raises the error
    again after its 500, and uvicorn then drops the kept-alive connection unannounced: the
    client's next request on it failed with a reset.) An error after the response started is
    raised on: that response is cut, and so is its connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            response = await _unexpected(Request(scope, receive), exc)
            await response(scope, receive, send)


def routes() -> list[BaseRoute]:
    """Every route the server has. The router tries them in order on every request, so the
    model endpoints come first (no two routes match the same path and method)."""
    return [
        Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
        *(Route(path, embeddings.cohere_embed, methods=["POST"]) for path in ("/v2/embed", "/v1/embed")),  # Cohere's
        Route("/v1/moderations", moderations.moderations, methods=["POST"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/responses", responses_api.create_response, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses_api.count_input_tokens, methods=["POST"]),
        Route("/v1/responses/compact", responses_api.compact_response, methods=["POST"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),  # vLLM's tokenizer endpoints, at its paths
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        *(Route(path, rerank.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),  # vLLM's
        *(Route(path, rerank.score, methods=["POST"]) for path in ("/v1/score", "/score")),
        *(Route(path, classify.classify, methods=["POST"]) for path in ("/v1/classify", "/classify")),  # vLLM's
        Route("/v1/messages", messages.messages, methods=["POST"]),  # Anthropic's Messages API, as vLLM's
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        *(Route(path, healthz, methods=["GET"]) for path in LIVENESS),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/models/{model:path}", tuning_api.delete_model, methods=["DELETE"]),  # fine-tuned models
        Route("/v1/responses/{response_id}", responses_api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/input_items", responses_api.list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses_api.cancel_response, methods=["POST"]),
        Route("/v1/conversations", conversations.create_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conversations.get_conversation, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", conversations.update_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conversations.delete_conversation, methods=["DELETE"]),
        Route("/v1/conversations/{conversation_id}/items", conversations.add_items, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/items", conversations.list_items, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conversations.get_item, methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conversations.delete_item, methods=["DELETE"]),
        Route("/v1/vector_stores/{vector_store_id}/search", vector_stores.search, methods=["POST"]),
        Route("/v1/vector_stores", vector_stores.create_store, methods=["POST"]),
        Route("/v1/vector_stores", vector_stores.list_stores, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}", vector_stores.get_store, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}", vector_stores.update_store, methods=["POST"]),
        Route("/v1/vector_stores/{vector_store_id}", vector_stores.delete_store, methods=["DELETE"]),
        Route("/v1/vector_stores/{vector_store_id}/files", vector_stores.add_file, methods=["POST"]),
        Route("/v1/vector_stores/{vector_store_id}/files", vector_stores.list_files, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}/files/{file_id}", vector_stores.get_file, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}/files/{file_id}", vector_stores.update_file, methods=["POST"]),
        Route("/v1/vector_stores/{vector_store_id}/files/{file_id}", vector_stores.delete_file, methods=["DELETE"]),
        Route("/v1/vector_stores/{vector_store_id}/files/{file_id}/content", vector_stores.file_content, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}/file_batches", vector_stores.create_batch, methods=["POST"]),
        Route("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}", vector_stores.get_batch, methods=["GET"]),
        Route("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}/cancel", vector_stores.cancel_batch,
              methods=["POST"]),
        Route("/v1/vector_stores/{vector_store_id}/file_batches/{batch_id}/files", vector_stores.list_batch_files,
              methods=["GET"]),
        Route("/v1/chat/completions", stored_chat.list_completions, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored_chat.get_completion, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored_chat.update_completion, methods=["POST"]),
        Route("/v1/chat/completions/{completion_id}", stored_chat.delete_completion, methods=["DELETE"]),
        Route("/v1/chat/completions/{completion_id}/messages", stored_chat.list_messages, methods=["GET"]),
        Route("/v1/images/generations", images.generations, methods=["POST"]),
        Route("/v1/images/edits", images.edits, methods=["POST"]),
        Route("/v1/images/variations", images.variations, methods=["POST"]),
        Route("/v1/images/files/{image_id}.{fmt}", images.image_file, methods=["GET"], name="image_file"),
        Route("/v1/audio/speech", audio.speech, methods=["POST"]),
        Route("/v1/audio/transcriptions", audio.transcriptions, methods=["POST"]),
        Route("/v1/audio/translations", audio.translations, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime_conversation.realtime),  # a transcription or a conversation
        Route("/v1/realtime/client_secrets", realtime_conversation.client_secrets, methods=["POST"]),
        Route("/v1/files", batch_api.upload_file, methods=["POST"]),
        Route("/v1/files", batch_api.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", batch_api.get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", batch_api.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", batch_api.file_content, methods=["GET"]),
        Route("/v1/uploads", batch_api.create_upload, methods=["POST"]),
        Route("/v1/uploads/{upload_id}/parts", batch_api.add_upload_part, methods=["POST"]),
        Route("/v1/uploads/{upload_id}/complete", batch_api.complete_upload, methods=["POST"]),
        Route("/v1/uploads/{upload_id}/cancel", batch_api.cancel_upload, methods=["POST"]),
        Route("/v1/fine_tuning/jobs", tuning_api.create_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs", tuning_api.list_jobs, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}", tuning_api.get_job, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/cancel", tuning_api.cancel_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/pause", tuning_api.pause_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/resume", tuning_api.resume_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/events", tuning_api.list_events, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/checkpoints", tuning_api.list_checkpoints, methods=["GET"]),
        Route("/v1/batches", batch_api.create_batch, methods=["POST"]),
        Route("/v1/batches", batch_api.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batch_api.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batch_api.cancel_batch, methods=["POST"]),
        Route("/v1/messages/batches", message_batches.create, methods=["POST"]),  # Anthropic's Message Batches
        Route("/v1/messages/batches", message_batches.list_batches, methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", message_batches.retrieve, methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", message_batches.delete, methods=["DELETE"]),
        Route("/v1/messages/batches/{message_batch_id}/cancel", message_batches.cancel, methods=["POST"]),
        Route("/v1/messages/batches/{message_batch_id}/results", message_batches.results, methods=["GET"],
              name="message_batch_results"),
        Route("/v1/load_lora_adapter", adapters.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", adapters.unload_lora_adapter, methods=["POST"]),
        Route("/admin/models/{model}/{action}", admin_model, methods=["POST"]),
        Route("/admin/keys", accounts_api.create_key, methods=["POST"]),
        Route("/admin/keys", accounts_api.list_keys, methods=["GET"]),
        Route("/admin/keys/{key_id}", accounts_api.get_key, methods=["GET"]),
        Route("/admin/keys/{key_id}", accounts_api.change_key, methods=["PATCH"]),
        Route("/admin/keys/{key_id}", accounts_api.revoke_key, methods=["DELETE"]),
        Route("/admin/usage", accounts_api.admin_usage, methods=["GET"]),
        Route("/v1/usage", accounts_api.own_usage, methods=["GET"]),
        Route("/admin/state", dashboard.admin_state, methods=["GET"]),
        Route(dashboard.EVENTS, dashboard.admin_events, methods=["GET"]),
        Route("/dashboard", dashboard.page, methods=["GET"]),
        Route("/dashboard/{name}", dashboard.asset, methods=["GET"]),
    ]


def create_app(services: Services, extra: Sequence[BaseRoute] = ()) -> Starlette:
    """The ASGI app: every route, the batch runner (``app.state.batches``), the stored responses
    (``app.state.responses``), chat completions (``app.state.completions``), conversations
    (``app.state.conversations``), vector stores (``app.state.vector_stores``, read by
    ``app.state.indexer``), the drain
    (``app.state.drain``: readiness, refusing while draining, handing batch lines back), and
    ``extra`` routes (benchmarks add probes), and the models loaded at start (``app.state.preload``). Middleware, outermost first: CORS when
    ``server.cors_origins`` names any (``cors``), the 500 for an unexpected error (``Unexpected``),
    the request log, the drain's gate, the body deadline, the keys' rate-limit headers."""
    drain = Drain(services.config.server.drain_timeout_s)
    app = Starlette(
        routes=routes() + list(extra),
        exception_handlers={APIError: _api_error, HTTPException: _http_error, ClientGone: _client_gone,
                            ClientDisconnect: _client_gone,
                            **dict.fromkeys(STORE_ERRORS, _store_down)},  # any other: ``Unexpected``
        lifespan=_lifespan,
        middleware=[*cors(services.config.server.cors_origins), Middleware(Unexpected), Middleware(RequestLog),
                    Middleware(DrainGate, drain=drain, unwaited=frozenset({dashboard.EVENTS})),
                    Middleware(BodyDeadline, seconds=services.config.limits.body_timeout_s),
                    Middleware(KeyHeaders)],
    )
    app.state.services = services
    app.state.batches = runner_for(services)
    services.files = app.state.batches.store
    app.state.uploads = uploads_for(services)  # input files sent in parts (batch/api.py)
    app.state.responses = responses_for(services)
    app.state.completions = completions_for(services)  # stored chat completions
    app.state.store_watch = StoreWatch()  # whether the store was last seen failing
    app.state.conversations = conversations_for(services)
    app.state.vector_stores = vector_stores_for(services)
    app.state.indexer = indexer_for(services, app.state.vector_stores, app.state.batches.store)
    app.state.tuner = tuning_api.tuner_for(services, app.state.batches.store)  # fine-tuning jobs (tuning/)
    app.state.background = Background(drain)  # background responses: stopped at shutdown before the store closes
    services.on_startup.append(lambda: _follow_stops(services, app.state))
    services.on_shutdown.append(app.state.background.stop)
    services.metrics.registry.register(app.state.background)
    app.state.drain = drain
    drain.hooks.append(app.state.batches.hand_back)
    app.state.preload = Preload([m.name for m in services.config.models if m.preload])
    services.on_startup.append(lambda: app.state.preload.start(services.arbiter.load))
    services.on_shutdown.append(app.state.preload.stop)
    app.state.started = time.time()
    return app


ADAPTER_SWEEP_S = 60.0  # how often held folder adapters are checked for deleted folders


async def _follow_stops(services: Services, state) -> None:
    """(After the stores opened: they start first.) Other processes' cancels, and the background
    responses of processes that died, taken over (``gateway.response_runs.reclaim``); held folder
    adapters whose folders were deleted let go (``AdapterRegistry.drop_gone``)."""
    background: Background = state.background
    background.follow_stops(state.responses.stops())
    period = min(response_runs.RECLAIM_S, services.config.responses.reclaim_after_s / 3)
    background.every(period, lambda: response_runs.reclaim(services, state.responses, state.conversations, background),
                     "reclaiming responses whose process died")
    if services.adapters.dirs:  # deleted adapter folders let go even where nothing scrapes /metrics
        background.every(ADAPTER_SWEEP_S, services.adapters.drop_gone, "letting go of deleted adapter folders")


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    services: Services = app.state.services
    use_threads(asyncio.get_running_loop())
    for start in services.on_startup:
        await start()
    yield
    for stop in reversed(services.on_shutdown):
        await stop()
    await services.arbiter.stop()
