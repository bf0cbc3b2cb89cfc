"""Where conversations (``/v1/conversations``) are kept: on the batch store's backend
(``batch.store`` in tiers.yaml), as stored responses are.

* ``sqlite`` (the default): ``conversations`` and ``conversation_items`` tables in the batch store's
  SQLite file; a conversation's items in the order they were added (the items table's rowid).
* ``redis://...``: ``tg:conversation:{id}`` holds a conversation, ``tg:conversation-items:{id}``
  (a list) its items in order.

A conversation is its owner (the key that made it: another key finds nothing), its creation time,
its ``metadata`` and its items, each a Responses API item as the items list shows it (with its
``id``, unique in the conversation). Conversations are kept until deleted (OpenAI does not expire
them either).
"""

from __future__ import annotations

import abc
import functools
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from gateway.service import Services
from storage import on_backend
from storage.sqlite import SQLiteFile

_SCHEMA = """CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, metadata TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS conversation_items (
    conversation_id TEXT NOT NULL, item_id TEXT NOT NULL, doc TEXT NOT NULL, UNIQUE (conversation_id, item_id));"""


@dataclass(frozen=True)
class Conversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, str]

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class DuplicateItem(Exception):
    """An item id the conversation has already (or that a response running here will add to it)."""

    def __init__(self, item_id: str) -> None:
        super().__init__(item_id)
        self.item_id = item_id


class Holds:
    """The item ids that responses running in this process will add to their conversations once
    they end. A second response (or ``items.create``) that brings one is refused before its model
    runs, as it would be once the first had added it. Another process's responses are not seen
    here: the store's append refuses their ids (``add_items``), once their model has run."""

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}

    def taken(self, conversation_id: str) -> set[str]:
        return self._held.get(conversation_id, set())

    def hold(self, conversation_id: str, ids: Iterable[str]) -> Callable[[], None]:
        """Hold ``ids`` in the conversation (DuplicateItem for one held already); what releases
        them (once, however often it is called)."""
        ids = set(ids)
        held = self._held.setdefault(conversation_id, set())
        clash = held & ids
        if clash:
            raise DuplicateItem(min(clash))
        held |= ids
        holding = [ids]

        def release() -> None:
            if holding:
                held.difference_update(holding.pop())
            if not held and self._held.get(conversation_id) is held:
                del self._held[conversation_id]

        return release


class ConversationStore(abc.ABC):
    @functools.cached_property
    def holds(self) -> Holds:
        """The item ids this process's running responses hold (``Holds``)."""
        return Holds()

    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        """Store a new conversation with its first items."""

    @abc.abstractmethod
    async def get(self, conversation_id: str, owner: str) -> Conversation | None:
        """The conversation, or None when there is none or another key made it."""

    @abc.abstractmethod
    async def set_metadata(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> Conversation | None:
        """Replace its metadata; the conversation after, or None when ``get`` finds none."""

    @abc.abstractmethod
    async def delete(self, conversation_id: str, owner: str) -> bool:
        """Delete it and its items; False when ``get`` finds none."""

    @abc.abstractmethod
    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        """Its items, oldest first; None when ``get`` finds no conversation."""

    @abc.abstractmethod
    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        """Append ``items``, all or none: DuplicateItem for an id the conversation has already
        (checked with the append, so that two racing appends cannot both add one); False when
        ``get`` finds none."""

    @abc.abstractmethod
    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        """Delete one item; False when the conversation or the item is not found."""


class SQLiteConversations(SQLiteFile, ConversationStore):
    """Two tables in one SQLite file (WAL; ``storage.sqlite``), every call on the thread that
    owns the connection."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _SCHEMA, "tiergate-conversations")

    def _get(self, conversation_id: str, owner: str) -> Conversation | None:
        row = self._db.execute("SELECT created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
                               (conversation_id, owner)).fetchone()
        return Conversation(conversation_id, owner, row[0], json.loads(row[1])) if row else None

    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        def write(db: sqlite3.Connection) -> None:
            c = conversation
            db.execute("INSERT INTO conversations (id, owner, created_at, metadata) VALUES (?, ?, ?, ?)",
                       (c.id, c.owner, c.created_at, json.dumps(c.metadata)))
            self._append(db, c.id, items)

        await self._call(self._tx, write)

    @staticmethod
    def _append(db: sqlite3.Connection, conversation_id: str, items: list[dict[str, Any]]) -> None:
        ids = [item["id"] for item in items]
        marks = ",".join("?" * len(ids))
        taken = {row[0] for row in db.execute(
            f"SELECT item_id FROM conversation_items WHERE conversation_id = ? AND item_id IN ({marks})",
            (conversation_id, *ids))}
        if taken:  # (checked in the append's transaction: the table's UNIQUE would be a store error)
            raise DuplicateItem(next(i for i in ids if i in taken))
        db.executemany("INSERT INTO conversation_items (conversation_id, item_id, doc) VALUES (?, ?, ?)",
                       [(conversation_id, item["id"], json.dumps(item)) for item in items])

    async def get(self, conversation_id: str, owner: str) -> Conversation | None:
        return await self._call(self._get, conversation_id, owner)

    async def set_metadata(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> Conversation | None:
        def write(db: sqlite3.Connection) -> Conversation | None:
            if db.execute("UPDATE conversations SET metadata = ? WHERE id = ? AND owner = ?",
                          (json.dumps(metadata), conversation_id, owner)).rowcount != 1:
                return None
            return self._get(conversation_id, owner)

        return await self._call(self._tx, write)

    async def delete(self, conversation_id: str, owner: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if db.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (conversation_id, owner)).rowcount != 1:
                return False
            db.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            return True

        return await self._call(self._tx, write)

    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        def read() -> list[dict[str, Any]] | None:
            if self._get(conversation_id, owner) is None:
                return None
            rows = self._db.execute("SELECT doc FROM conversation_items WHERE conversation_id = ? ORDER BY rowid",
                                    (conversation_id,)).fetchall()
            return [json.loads(row[0]) for row in rows]

        return await self._call(read)

    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            if self._get(conversation_id, owner) is None:
                return False
            self._append(db, conversation_id, items)
            return True

        return await self._call(self._tx, write)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        def write(db: sqlite3.Connection) -> bool:
            return self._get(conversation_id, owner) is not None and db.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                (conversation_id, item_id)).rowcount == 1

        return await self._call(self._tx, write)


# KEYS conversation, its items; ARGV owner, items...: append while the owner's conversation exists
# and has none of their ids (else the first id it has, and nothing is added)
_ADD = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
local new = {}
for i = 2, #ARGV do new[cjson.decode(ARGV[i])['id']] = true end
for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  local id = cjson.decode(item)['id']
  if new[id] then return id end
end
for i = 2, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
return 1
"""

# KEYS conversation, its items; ARGV owner, the new doc ('' to delete it and its items)
_CHANGE = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1], KEYS[2]) else redis.call('SET', KEYS[1], ARGV[2]) end
return 1
"""

# KEYS conversation, its items; ARGV owner, item id: remove the item with that id
_DELETE_ITEM = """
local doc = redis.call('GET', KEYS[1])
if not doc or cjson.decode(doc)['owner'] ~= ARGV[1] then return 0 end
for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if cjson.decode(item)['id'] == ARGV[2] then return redis.call('LREM', KEYS[2], 1, item) end
end
return 0
"""


class RedisConversations(ConversationStore):
    """Per conversation a key with its owner, time and metadata (JSON) and a list of its items."""

    def __init__(self, url: str, prefix: str = "tg:") -> None:
        self.url, self.prefix = url, prefix
        self._r = None

    def _keys(self, conversation_id: str) -> list[str]:
        return [f"{self.prefix}conversation:{conversation_id}", f"{self.prefix}conversation-items:{conversation_id}"]

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.Redis.from_url(self.url)
        self._add = self._r.register_script(_ADD)
        self._change = self._r.register_script(_CHANGE)
        self._delete_item = self._r.register_script(_DELETE_ITEM)

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
            self._r = None

    @staticmethod
    def _doc(c: Conversation) -> str:
        return json.dumps({"owner": c.owner, "created_at": c.created_at, "metadata": c.metadata})

    async def create(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        record, listed = self._keys(conversation.id)
        async with self._r.pipeline(transaction=True) as tx:
            tx.set(record, self._doc(conversation), nx=True)
            if items:
                tx.rpush(listed, *[json.dumps(item) for item in items])
            await tx.execute()

    async def get(self, conversation_id: str, owner: str) -> Conversation | None:
        raw = await self._r.get(self._keys(conversation_id)[0])
        d = json.loads(raw) if raw else None
        if d is None or d["owner"] != owner:
            return None
        return Conversation(conversation_id, owner, d["created_at"], d["metadata"])

    async def set_metadata(self, conversation_id: str, owner: str, metadata: dict[str, str]) -> Conversation | None:
        found = await self.get(conversation_id, owner)
        if found is None:
            return None
        changed = Conversation(conversation_id, owner, found.created_at, metadata)
        return changed if await self._change(keys=self._keys(conversation_id), args=[owner, self._doc(changed)]) else None

    async def delete(self, conversation_id: str, owner: str) -> bool:
        return bool(await self._change(keys=self._keys(conversation_id), args=[owner, ""]))

    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        if await self.get(conversation_id, owner) is None:
            return None
        return [json.loads(item) for item in await self._r.lrange(self._keys(conversation_id)[1], 0, -1)]

    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        added = await self._add(keys=self._keys(conversation_id), args=[owner, *[json.dumps(i) for i in items]])
        if isinstance(added, bytes):  # an id it has already
            raise DuplicateItem(added.decode())
        return bool(added)

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        return bool(await self._delete_item(keys=self._keys(conversation_id), args=[owner, item_id]))


def open_conversations(spec: str, data_dir: Path) -> ConversationStore:
    """The conversations on ``spec``'s backend (``storage.on_backend``): the batch store's SQLite file in
    ``data_dir``, or Redis at that URL."""
    return on_backend(spec, lambda: SQLiteConversations(data_dir / "batches.sqlite3"), RedisConversations)


def conversations_for(svc: Services) -> ConversationStore:
    """The process's conversation store on the configured backend, opened and closed with the app."""
    return svc.keep_open(open_conversations(svc.config.batch.store, svc.config.data_dir()))
