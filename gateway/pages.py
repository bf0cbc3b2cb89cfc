"""OpenAI's cursor lists, as the stored objects' list endpoints answer them: ``limit`` and
``order`` read from the query (a 400 naming the bad one), and the list object
(``data``, ``first_id``, ``last_id``, ``has_more``)."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import QueryParams

from gateway.errors import bad_request
from gateway.schemas import is_count


def page_query(q: QueryParams, default_order: str) -> tuple[int, str]:
    """``limit`` (1 to 100, 20 unless given) and ``order`` (``asc`` or ``desc``)."""
    limit = q.get("limit", "20")
    if not is_count(limit) or not 1 <= int(limit) <= 100:
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    order = q.get("order", default_order)
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    return int(limit), order


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def cursor_page(items: list[dict[str, Any]], order: str, limit: int, after: str | None,
                before: str | None) -> dict[str, Any]:
    """One page of ``items`` (oldest first) in ``order``: of those after the item ``after`` and
    before the item ``before`` (ids; 400 naming the one that is not an item), the first ``limit``,
    or with ``before`` the last ``limit``: the page just before that item, as OpenAI's ``before``
    ("the previous page") reads. ``has_more``: there are more between the cursors (with
    ``before``, earlier ones)."""
    ranked = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ranked]
    start, end = 0, len(ranked)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{name} names no item of this list: '{cursor[:80]}'", name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    between = ranked[start:end]
    return listing(between[-limit:] if before is not None else between[:limit], len(between) > limit)
