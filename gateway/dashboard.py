"""The live dashboard: its JSON (``GET /admin/state``), its server-sent event stream
(``GET /admin/events``) and its page (``GET /dashboard``). docs/DASHBOARD.md documents the JSON.

The state is read from its owners at the moment it is asked for: places and footprints from the
arbiter, queues, limits and each tier's recent figures from the gate, batch jobs from the batch
store, recent events from the one event stream the arbiter and the gate produce into
(``arbiter.events``). The stream sends a snapshot first, then every event as it happens, a fresh
snapshot every ``STATE_EVERY_S`` (counters move without events) and a heartbeat comment every
``HEARTBEAT_S``; a reader that falls behind gets a fresh snapshot instead of the events it missed.
The stream ends when its client disconnects, when the server starts draining (so that it does
not hold the shutdown), or once its key is no longer an admin key (taken out of its key file).

Both JSON routes need an admin key. The page itself holds no data: it asks for the key once,
keeps it in ``sessionStorage`` and sends it as a bearer header, never in a URL.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from arbiter.events import Lagged
from gateway.errors import APIError
from gateway.http import Streamed
from gateway.service import Services

EVENTS = "/admin/events"  # the stream's path: the drain does not wait for it (it ends itself as the drain begins)
STATE_EVERY_S = 2.0
HEARTBEAT_S = 15.0
RECENT_EVENTS = 100
RECENT_BATCHES = 20
STORE_TIMEOUT_S = 2.0
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}


async def snapshot(svc: Services, batch_store: Any, tuner: Any = None) -> dict[str, Any]:
    """Everything the dashboard shows, as documented in docs/DASHBOARD.md."""
    arbiter = svc.arbiter
    view = arbiter.view()
    now = view.now
    tiers = svc.config.tier_names
    models = []
    for row in arbiter.table():
        state = arbiter.states[row["id"]]
        last = row["last_tier"]
        protected = {tiers[r]: round(until - now, 1) for r in range(len(tiers))
                     if (until := state.protected_until(r, arbiter.protect_window_s)) > now}
        models.append({**row, "last_tier": tiers[last] if last is not None else None,
                       "host_bytes": state.warm_bytes, "protected_until_s": round(row["protected_until_s"], 1),
                       "protected_from": protected})
    return {
        "time": time.time(),
        "started_at": arbiter.events.started_at,
        "last_event_id": arbiter.events.last_id,
        "vram": {"device": str(arbiter.device), "budget_bytes": view.budget, "used_bytes": view.used},
        "host_cache": {"budget_bytes": view.host_cache_budget, "used_bytes": view.host_used},
        "models": models,
        "tiers": [_tier_row(svc, name) for name in tiers],
        **await _batches(batch_store),
        **await _fine_tuning(tuner),
        "events": [e.public() for e in arbiter.events.since(0, RECENT_EVENTS)],
    }


def _tier_row(svc: Services, name: str) -> dict[str, Any]:
    gate = svc.gate
    policy = gate.tiers[name]
    figures = gate.stats.figures(name)
    return {
        "name": name, "rank": policy.rank, "batch": policy.is_batch,
        "in_flight": gate.inflight[name], "queued": gate.queued(name), "limit": gate.limits[name],
        "max_inflight": policy.max_inflight, "max_queued": policy.max_queued,
        "latency_target_s": policy.latency_target_s,
        "admitted_per_min": figures.admitted_per_min, "refused_per_min": figures.refused_per_min,
        "refused_by_reason_per_min": figures.refused_by_reason_per_min,
        "latency_samples": figures.latency_samples, "p50_s": figures.p50_s, "p99_s": figures.p99_s,
        "realtime_sessions": svc.metrics.realtime_sessions.get(name, 0),
    }


async def _batches(store: Any) -> dict[str, Any]:
    """The most recent batch jobs with their progress, newest first; when the store does not
    answer, none and why (the rest of the state is still worth showing)."""
    if store is None:
        return {"batches": []}
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):  # not wait_for: it can swallow a cancel on 3.11
            jobs = await store.list_batches(None, None, RECENT_BATCHES)
    except Exception as exc:  # noqa: BLE001 - Redis down, store closed while stopping, timeout
        return {"batches": [], "batches_error": f"the batch store did not answer: {type(exc).__name__}: {exc}"}
    return {"batches": [{"id": b.id, "status": b.status, "endpoint": b.endpoint, "created_at": b.created_at,
                         "total": b.total, "completed": b.completed, "failed": b.failed,
                         "progress": round(b.done / b.total, 4) if b.total else 0.0} for b in jobs]}


async def _fine_tuning(tuner: Any) -> dict[str, Any]:
    """The most recent fine-tuning jobs, newest first, the one this process trains with its steps
    (``Tuner.progress``); when the store does not answer, none and why, as for batches."""
    if tuner is None:
        return {"fine_tuning": []}
    try:
        async with asyncio.timeout(STORE_TIMEOUT_S):
            jobs = await tuner.store.list(None, None, RECENT_BATCHES)
    except Exception as exc:  # noqa: BLE001 - Redis down, store closed while stopping, timeout
        return {"fine_tuning": [], "fine_tuning_error": f"the fine-tuning store did not answer: {type(exc).__name__}: {exc}"}
    here = tuner.progress()
    return {"fine_tuning": [{"id": j.id, "model": j.model, "method": j.method, "status": j.status,
                             "created_at": j.created_at, "estimated_finish": j.estimated_finish,
                             "fine_tuned_model": j.fine_tuned_model,
                             "step": here[1] if here and here[0] == j.id else None,
                             "total_steps": here[2] if here and here[0] == j.id else None} for j in jobs]}


def _services(request: Request) -> Services:
    svc: Services = request.app.state.services
    svc.require_admin(request)
    return svc


def _store(request: Request) -> Any:
    runner = getattr(request.app.state, "batches", None)
    return runner.store if runner is not None else None


def _tuner(request: Request) -> Any:
    return getattr(request.app.state, "tuner", None)


async def admin_state(request: Request) -> Response:
    return JSONResponse(await snapshot(_services(request), _store(request), _tuner(request)))


async def admin_events(request: Request) -> Response:
    svc: Services = request.app.state.services
    key = svc.require_admin(request).key_id
    drain = getattr(request.app.state, "drain", None)
    draining = (lambda: drain.draining) if drain is not None else (lambda: False)
    return Streamed(_stream(svc, _store(request), _tuner(request), draining, key), "text/event-stream",
                    {"x-accel-buffering": "no"})


def _still_admin(svc: Services, key: str | None) -> bool:
    """Whether the key with id ``key`` is an admin key still (admin keys are configured keys,
    in a variable or a key file read again when it changes: ``gateway.key_files``)."""
    if key is None:
        return True
    caller = svc.keys.by_id(key)
    return caller is not None and caller.admin


async def _stream(svc: Services, store: Any, tuner: Any, draining: Callable[[], bool],
                  key: str | None = None) -> AsyncIterator[str]:
    events = svc.arbiter.events
    sub = events.subscribe()  # before the snapshot: nothing falls between the two
    try:
        next_state = time.monotonic()
        next_beat = next_state + HEARTBEAT_S
        while not draining() and _still_admin(svc, key):  # a key taken out of its file: its stream ends
            now = time.monotonic()
            if now >= next_state:
                yield _sse("state", await snapshot(svc, store, tuner))
                next_state = now + STATE_EVERY_S
            if now >= next_beat:
                yield ": heartbeat\n\n"
                next_beat = now + HEARTBEAT_S
            try:
                event = await sub.next(max(0.0, min(next_state, next_beat) - time.monotonic()))
            except Lagged:  # fell behind: a fresh snapshot stands for what was missed
                sub.close()
                sub = events.subscribe()
                next_state = 0.0
                continue
            if event is not None:
                yield _sse("event", event.public(), event.id)
    finally:
        sub.close()


def _sse(name: str, data: dict[str, Any], event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _asset(name: str) -> str:
    return resources.files("gateway").joinpath("static", name).read_text(encoding="utf-8")


async def page(request: Request) -> Response:
    return Response(_asset("dashboard.html"), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _ASSETS:
        raise APIError(404, f"no route for GET {request.url.path}", "not_found")
    return Response(_asset(name), media_type=f"{_ASSETS[name]}; charset=utf-8", headers=_PAGE_HEADERS)
