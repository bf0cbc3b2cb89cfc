"""The Conversations API: a conversation is a list of Responses API items that a response
continues with ``conversation`` (instead of ``previous_response_id``) and adds to.

* ``POST /v1/conversations`` (``items``: up to 20 to begin with, ``metadata``), ``GET``, ``POST``
  (its ``metadata``) and ``DELETE /v1/conversations/{id}``;
* ``POST /v1/conversations/{id}/items`` (``items``: 1 to 20) answers the list of those added;
  ``GET /v1/conversations/{id}/items`` is OpenAI's cursor list (``order`` ``desc`` by default,
  ``limit`` 1..100, ``after`` an item id); ``GET`` and ``DELETE /v1/conversations/{id}/items/{item_id}``
  (the delete answers the conversation).

Items are checked as a response's ``input`` is (``gateway.responses.input_messages``: messages with
text parts, ``function_call``, ``function_call_output``; a 400 names ``items[i]...``) and listed as
its input items are: each as sent, with its own ``id`` or a new one, ``status: completed``; an id
already in the conversation, or held by a response running here (``conversation_store.Holds``),
is a 400. A response made with ``conversation`` reads every item as the
start of its prompt, and once it ends ``completed`` or ``incomplete`` its input items and output
items are added (``gateway.response_runs``, ``gateway.responses_api``). Only the key that made a conversation sees it (a 404
otherwise). Kept in ``gateway.conversation_store``, until deleted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth import Caller
from gateway.conversation_store import Conversation, ConversationStore, DuplicateItem
from gateway.errors import bad_request, not_found
from gateway.pages import cursor_page, listing, page_query
from gateway.input_files import read_files
from gateway.responses import given_items, input_messages
from gateway.schemas import Metadata, _Body, parse, read_json
from gateway.service import Services

MAX_ITEMS = 20  # items added in one call, as OpenAI allows


class ConversationCreate(_Body):
    items: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_ITEMS)
    metadata: Metadata = None


class ConversationUpdate(_Body):
    metadata: Metadata


class ItemsCreate(_Body):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS)


async def checked_items(svc: Services, caller: Caller, items: list[dict[str, Any]],
                        taken: set[str]) -> list[dict[str, Any]]:
    """``items`` as the conversation lists them; 400 naming ``items[i]...`` for one that cannot be
    an input item (an image URL on no host of ``server.image_url_hosts``, a file that is not the
    caller's image...), or whose id is in ``taken`` (or twice in ``items``)."""
    input_messages(await read_files(svc, caller, items, "items"), "items", svc.config.server.image_url_hosts)
    listed = given_items(items)
    seen = set(taken)
    for i, item in enumerate(listed):
        if item["id"] in seen:
            raise _duplicate(item["id"], i)
        seen.add(item["id"])
    return listed


def _duplicate(item_id: str, i: int) -> Exception:
    return bad_request(f"duplicate item id '{item_id[:80]}' (in these items or the conversation)",
                       f"items[{i}].id", "duplicate_item_id")


def _store(request: Request) -> ConversationStore:
    return request.app.state.conversations


def _owner(request: Request) -> tuple[str, Services]:
    svc: Services = request.app.state.services
    return svc.authenticate(request).key_id, svc  # reading and writing records takes no slot: no gate


def _missing(conversation_id: str) -> Exception:
    return not_found(f"no conversation with id '{conversation_id}'", "conversation_id")


async def create_conversation(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(ConversationCreate, await read_json(request, svc.config.limits.max_body))
    items = await checked_items(svc, caller, body.items, set()) if body.items else []
    conversation = Conversation(f"conv_{uuid.uuid4().hex}", caller.key_id, int(time.time()), body.metadata or {})
    await _store(request).create(conversation, items)
    return JSONResponse(conversation.public())


async def get_conversation(request: Request) -> Response:
    owner, _ = _owner(request)
    conversation_id = request.path_params["conversation_id"]
    found = await _store(request).get(conversation_id, owner)
    if found is None:
        raise _missing(conversation_id)
    return JSONResponse(found.public())


async def update_conversation(request: Request) -> Response:
    owner, svc = _owner(request)
    conversation_id = request.path_params["conversation_id"]
    if await _store(request).get(conversation_id, owner) is None:  # a 404 before the body's 400s
        raise _missing(conversation_id)
    body = parse(ConversationUpdate, await read_json(request, svc.config.limits.max_body))
    changed = await _store(request).set_metadata(conversation_id, owner, body.metadata or {})
    if changed is None:
        raise _missing(conversation_id)
    return JSONResponse(changed.public())


async def delete_conversation(request: Request) -> Response:
    owner, _ = _owner(request)
    conversation_id = request.path_params["conversation_id"]
    if not await _store(request).delete(conversation_id, owner):
        raise _missing(conversation_id)
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def _items(request: Request) -> tuple[str, str, list[dict[str, Any]]]:
    owner, _ = _owner(request)
    conversation_id = request.path_params["conversation_id"]
    items = await _store(request).items(conversation_id, owner)
    if items is None:
        raise _missing(conversation_id)
    return owner, conversation_id, items


async def add_items(request: Request) -> Response:
    owner, conversation_id, items = await _items(request)
    svc: Services = request.app.state.services
    body = parse(ItemsCreate, await read_json(request, svc.config.limits.max_body))
    store = _store(request)  # (an id a response running here will add is taken already)
    taken = {item["id"] for item in items} | store.holds.taken(conversation_id)
    added = await checked_items(svc, svc.authenticate(request), body.items, taken)
    try:
        if not await store.add_items(conversation_id, owner, added):
            raise _missing(conversation_id)  # deleted meanwhile
    except DuplicateItem as exc:  # added meanwhile (by a response that ended, another call)
        raise _duplicate(exc.item_id, [item["id"] for item in added].index(exc.item_id)) from None
    return JSONResponse(listing(added, False))


async def list_items(request: Request) -> Response:
    _, _, items = await _items(request)
    q = request.query_params
    limit, order = page_query(q, "desc")
    return JSONResponse(cursor_page(items, order, limit, q.get("after") or None, None))


async def get_item(request: Request) -> Response:
    _, _, items = await _items(request)
    item_id = request.path_params["item_id"]
    for item in items:
        if item["id"] == item_id:
            return JSONResponse(item)
    raise not_found(f"no item with id '{item_id}' in this conversation", "item_id")


async def delete_item(request: Request) -> Response:
    owner, conversation_id, _ = await _items(request)
    item_id = request.path_params["item_id"]
    if not await _store(request).delete_item(conversation_id, owner, item_id):
        raise not_found(f"no item with id '{item_id}' in this conversation", "item_id")
    found = await _store(request).get(conversation_id, owner)
    if found is None:
        raise _missing(conversation_id)
    return JSONResponse(found.public())
