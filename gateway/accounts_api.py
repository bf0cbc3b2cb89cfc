"""The accounts' HTTP side: managed keys (``/admin/keys``), usage (``/v1/usage`` for the caller's
own key, ``/admin/usage`` for any), and :class:`KeyHeaders`, which puts the key's rate-limit
headers on every response it gets. See docs/ACCOUNTS.md."""

from __future__ import annotations

import datetime
import re
import time
from typing import Annotated, Any

from pydantic import Field, create_model
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from accounts.config import Limits
from accounts.keys import KeyRecord
from accounts.usage import group, to_csv
from gateway.accounts import Accounts
from gateway.errors import APIError, bad_request, not_found
from gateway.pages import cursor_page, listing, page_query
from gateway.schemas import _Body, parse, read_json
from gateway.service import Services

MAX_BODY = 64 * 1024
PAGING = ("limit", "after", "before", "order")  # GET /admin/keys: OpenAI's cursor list, once one is given
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")

# A key's own limits as the API takes them: Limits' numbers, strictly typed (the allow-lists are
# ``models`` and ``adapters``).
KeyLimits = create_model("KeyLimits", __base__=_Body,
                         **{n: (f.annotation, f) for n, f in Limits.model_fields.items() if n not in ("models", "adapters")})
Pattern = Annotated[str, Field(min_length=1, max_length=256)]  # an adapter name, or a shell-style pattern of names


class NewKey(_Body):
    name: str = Field(default="", max_length=200)
    tier: str
    limits: KeyLimits | None = None  # type: ignore[valid-type]
    models: list[str] | None = None
    adapters: list[Pattern] | None = None


class KeyChange(_Body):
    name: str | None = Field(default=None, max_length=200)
    tier: str | None = None
    limits: KeyLimits | None = None  # type: ignore[valid-type]  # replaces the key's own limits
    models: list[str] | None = None  # null: back to its tier's allow-list
    adapters: list[Pattern] | None = None  # null: back to its tier's adapter allow-list


def _accounts(request: Request) -> tuple[Services, Accounts]:
    svc: Services = request.app.state.services
    if svc.accounts is None:
        raise APIError(404, "accounts are not enabled on this server", "not_found")
    return svc, svc.accounts


def _checked(svc: Services, tier: str | None, models: list[str] | None) -> tuple[str, ...] | None:
    if tier is not None and tier not in svc.config.tier_names:
        raise bad_request(f"no tier named {tier!r} (tiers: {', '.join(svc.config.tier_names)})", "tier")
    if models is None:
        return None
    unknown = [m for m in models if m not in svc.arbiter.specs]
    if unknown:
        raise bad_request(f"no model named {unknown[0]!r}", "models")
    return tuple(models)


def _found(record: KeyRecord | None) -> KeyRecord:
    if record is None:
        raise not_found("no such key", None, "key_not_found")
    return record


async def create_key(request: Request) -> Response:
    """POST /admin/keys: a new key; its secret is in this answer and nowhere else, ever."""
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    body = parse(NewKey, await read_json(request, MAX_BODY))
    models = _checked(svc, body.tier, body.models)
    limits = body.limits.model_dump(exclude_unset=True) if body.limits is not None else {}
    adapters = tuple(body.adapters) if body.adapters is not None else None
    record, secret = await accounts.create_key(body.name, body.tier, limits, models, adapters)
    return JSONResponse({**record.public(), "value": secret}, status_code=201)


async def list_keys(request: Request) -> Response:
    """GET /admin/keys: the managed keys, without secrets, oldest first: all of them, or a page
    (OpenAI's ``limit``, ``after``, ``before``, ``order``) once any of those is given."""
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    q = request.query_params
    for name in sorted(set(q) - set(PAGING)):
        raise bad_request(f"unrecognized query parameter: {name}", name, "unknown_parameter")
    keys = [r.public() for r in await accounts.store.list_keys()]
    if not set(q) & set(PAGING):
        return JSONResponse(listing(keys, False))
    limit, order = page_query(q, "asc")
    return JSONResponse(cursor_page(keys, order, limit, q.get("after"), q.get("before")))



async def get_key(request: Request) -> Response:
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    return JSONResponse(_found(await accounts.store.get_key(request.path_params["key_id"])).public())


async def change_key(request: Request) -> Response:
    """PATCH /admin/keys/{id}: name, tier, limits (replacing the key's own), models or adapters."""
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    body = parse(KeyChange, await read_json(request, MAX_BODY))
    given = body.model_fields_set
    changes: dict[str, Any] = {}
    if "name" in given and body.name is not None:
        changes["name"] = body.name
    if "tier" in given:
        if body.tier is None:
            raise bad_request("tier must be a tier's name", "tier")
        _checked(svc, body.tier, None)
        changes["tier"] = body.tier
    if "limits" in given:
        changes["limits"] = body.limits.model_dump(exclude_unset=True) if body.limits is not None else {}
    if "models" in given:
        changes["models"] = _checked(svc, None, body.models)
    if "adapters" in given:
        changes["adapters"] = tuple(body.adapters) if body.adapters is not None else None
    key_id = request.path_params["key_id"]
    if not _found(await accounts.store.get_key(key_id)).active:  # a revoke is final: a change would look made
        raise APIError(409, f"the key '{key_id}' is revoked: it cannot be changed", "key_revoked",
                       type="invalid_request_error")
    return JSONResponse(_found(await accounts.update_key(key_id, **changes)).public())


async def revoke_key(request: Request) -> Response:
    """DELETE /admin/keys/{id}: revoked on every process within ``accounts.refresh_s``."""
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    record = _found(await accounts.update_key(request.path_params["key_id"], revoked_at=int(time.time())))
    return JSONResponse({"id": record.id, "object": "api_key.deleted", "deleted": True})


async def own_usage(request: Request) -> Response:
    """GET /v1/usage: the caller's own key."""
    svc, accounts = _accounts(request)
    caller = svc.authenticate(request)
    return await _usage(request, accounts, caller.key_id, ("day", "model"))


async def admin_usage(request: Request) -> Response:
    """GET /admin/usage: any key (``key``), any model, a day range, grouped; JSON or CSV."""
    svc, accounts = _accounts(request)
    svc.require_admin(request)
    return await _usage(request, accounts, request.query_params.get("key"), ("day", "model", "key", "tier"))


async def _usage(request: Request, accounts: Accounts, key: str | None, groups: tuple[str, ...]) -> Response:
    q = request.query_params
    unknown = sorted(set(q) - {"key", "model", "start_date", "end_date", "group_by", "format"})
    if unknown or ("key" in q and "key" not in groups):
        raise bad_request(f"unrecognized query parameter: {(unknown or ['key'])[0]}", (unknown or ["key"])[0],
                          "unknown_parameter")
    since, until = _day(q, "start_date"), _day(q, "end_date")
    by = q.get("group_by", "day")
    if by not in groups:
        raise bad_request(f"group_by must be one of {', '.join(groups)}", "group_by")
    fmt = q.get("format", "json")
    if fmt not in ("json", "csv"):
        raise bad_request("format must be json or csv", "format")
    if accounts.unwritten:  # usage kept while the store failed goes in first (a store still down: 503)
        await accounts.write_again()
    rows = await accounts.store.usage(key, q.get("model"), since, until)
    items = group(rows, by, accounts.prices)  # type: ignore[arg-type]
    if fmt == "csv":
        return Response(to_csv(items), media_type="text/csv; charset=utf-8")
    return JSONResponse({"object": "list", "group_by": by, "start_date": since, "end_date": until, "data": items})


def _day(q, name: str) -> str | None:
    value = q.get(name)
    if value is not None and not (_DAY.match(value) and _is_date(value)):  # 2026-13-01 has the shape, not a day
        raise bad_request(f"{name} must be a UTC date, YYYY-MM-DD", name)
    return value


def _is_date(value: str) -> bool:
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        return False
    return True


class KeyHeaders:
    """Pure ASGI middleware: on the response of an authenticated request, the key's own
    ``x-ratelimit-*`` headers (from its admission, or its buckets as they stand), replacing the
    tier's. They go out with the response's start, so a stream has them before its first byte."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                caller = scope.get("state", {}).get("caller")
                if caller is not None and caller.rate is not None:
                    headers = caller.rate.headers
                    if headers is None:
                        accounts = scope["app"].state.services.accounts
                        headers = await accounts.headers(caller)
                    if headers:
                        message["headers"] = _replaced(message.get("headers", []), headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _replaced(raw: list[tuple[bytes, bytes]], headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    names = {k.encode() for k in headers}
    kept = [(k, v) for k, v in raw if k.lower() not in names]
    return kept + [(k.encode(), v.encode()) for k, v in headers.items()]
