"""Stored chat completions: a chat completion made with ``store: true`` is kept
(``gateway.completion_store``) once it finished, streamed or not, and read back with OpenAI's
stored-completions API:

* ``GET /v1/chat/completions``: the key's stored completions, oldest first (``order`` ``asc``, the
  default, or ``desc``), ``limit`` 1..100 (20), ``after`` a completion id, filtered by ``model`` and
  by ``metadata[key]=value`` pairs (every pair must match);
* ``GET /v1/chat/completions/{id}``: the completion as it was answered, with its ``metadata``;
* ``POST /v1/chat/completions/{id}``: ``{"metadata": {...}}`` replaces its metadata (null: none);
* ``DELETE /v1/chat/completions/{id}``;
* ``GET /v1/chat/completions/{id}/messages``: the request's messages, each with an id
  (``{completion id}-{index}``), its text as ``content`` and its parts as ``content_parts`` when it
  was sent as parts; ``order`` ``asc`` by default, ``limit``, ``after`` a message id.

A completion is stored when its last choice finished: one whose client left mid-way, or that
failed, is not. While the store is known to be down, a ``store: true`` request is refused 503
before its work; one whose store write fails after it is answered all the same
(``gateway.store_watch``). Batch lines are not stored (their output file is their record). Another key's
completion is a 404, as if it did not exist.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.completion_store import CompletionStore, StoredCompletion
from gateway.errors import bad_request, not_found
from gateway.pages import cursor_page, listing, page_query
from gateway.schemas import ChatCompletionRequest, Message, Metadata, _Body, parse, read_json
from gateway.service import Services


class MetadataUpdate(_Body):
    metadata: Metadata


def messages_of(completion_id: str, messages: list[Message]) -> list[dict[str, Any]]:
    """The request's messages as the messages list shows them."""
    out = []
    for i, m in enumerate(messages):
        shown: dict[str, Any] = {"id": f"{completion_id}-{i}", "role": m.role, "content": m.text(),
                                 "content_parts": [p.model_dump() for p in m.content] if isinstance(m.content, list) else None}
        if m.name is not None:
            shown["name"] = m.name
        if m.tool_calls:
            shown["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            shown["tool_call_id"] = m.tool_call_id
        out.append(shown)
    return out


async def keep(store: CompletionStore, owner: str, completion: dict[str, Any], body: ChatCompletionRequest) -> None:
    """Store a finished ``completion`` of the request ``body`` (which asked ``store: true``)."""
    await store.put(StoredCompletion(completion["id"], owner, {**completion, "metadata": body.metadata or {}},
                                     messages_of(completion["id"], body.messages)))


def _store(request: Request) -> CompletionStore:
    return request.app.state.completions


async def _record(request: Request) -> tuple[StoredCompletion, Services]:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)  # reading takes no slot: no gate
    completion_id = request.path_params["completion_id"]
    record = await _store(request).get(completion_id, caller.key_id)
    if record is None:
        raise not_found(f"no stored chat completion with id '{completion_id}'", "completion_id")
    return record, svc


async def list_completions(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    q = request.query_params
    limit, order = page_query(q, "asc")
    metadata = {k[len("metadata["):-1]: v for k, v in q.multi_items() if k.startswith("metadata[") and k.endswith("]")}
    after = q.get("after") or None
    try:
        records, more = await _store(request).page(caller.key_id, after, limit, order == "asc", q.get("model") or None,
                                                   metadata)
    except KeyError:
        raise bad_request(f"after names no stored chat completion of this key: '{after[:80]}'", "after") from None
    return JSONResponse(listing([r.completion for r in records], more))


async def get_completion(request: Request) -> Response:
    record, _ = await _record(request)
    return JSONResponse(record.completion)


async def update_completion(request: Request) -> Response:
    record, svc = await _record(request)
    body = parse(MetadataUpdate, await read_json(request, svc.config.limits.max_body))
    updated = await _store(request).set_metadata(record.id, record.owner, body.metadata or {})
    if updated is None:  # deleted meanwhile
        raise not_found(f"no stored chat completion with id '{record.id}'", "completion_id")
    return JSONResponse(updated.completion)


async def delete_completion(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    completion_id = request.path_params["completion_id"]
    if not await _store(request).delete(completion_id, caller.key_id):
        raise not_found(f"no stored chat completion with id '{completion_id}'", "completion_id")
    return JSONResponse({"id": completion_id, "object": "chat.completion.deleted", "deleted": True})


async def list_messages(request: Request) -> Response:
    record, _ = await _record(request)
    q = request.query_params
    limit, order = page_query(q, "asc")
    return JSONResponse(cursor_page(record.messages, order, limit, q.get("after") or None, None))
