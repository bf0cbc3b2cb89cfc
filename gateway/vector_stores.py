"""Vector stores: OpenAI's ``/v1/vector_stores`` API over an embedding model of tiers.yaml.

* ``POST /v1/vector_stores`` (``name``, ``description``, ``file_ids``, ``metadata``,
  ``expires_after``, ``chunking_strategy``; extension ``model``: the embedding model, the first
  ``embed`` model of tiers.yaml unless named), ``GET`` (a cursor list), ``GET``/``POST``/``DELETE
  /v1/vector_stores/{id}``;
* ``POST /v1/vector_stores/{id}/files`` (``file_id``: a file uploaded with purpose ``assistants``
  or ``user_data``, ``attributes``, ``chunking_strategy``), ``GET`` (a cursor list, ``filter`` by
  status), ``GET``/``POST`` (``attributes``)/``DELETE /v1/vector_stores/{id}/files/{file_id}``, and
  ``GET .../files/{file_id}/content`` (its chunks' texts);
* ``POST /v1/vector_stores/{id}/file_batches`` (``file_ids`` or ``files``), ``GET .../{batch_id}``,
  ``POST .../{batch_id}/cancel`` and ``GET .../{batch_id}/files``: files added together;
* ``POST /v1/vector_stores/{id}/search`` (``query``: a string or strings, ``max_num_results``
  1..50, ``filters`` on the files' attributes, ``ranking_options.score_threshold``).

A file is added ``in_progress`` and read in the background (``gateway.vector_indexer``): its text
(``gateway.documents``: PDF, Word, PowerPoint, HTML or UTF-8 text), cut into chunks of the strategy's tokens (the embedding model's
tokenizer; ``auto`` is OpenAI's 800 tokens overlapping by 400, or the model's context if that is
smaller), each chunk embedded as a request of the key that added the file, at its tier, through
the gate (its tokens count in that key's usage, as ``/v1/embeddings`` tokens). A search embeds its
queries the same way and ranks every chunk of the store (``gateway.vector_search``). Only the key
that made a store sees it (a 404 otherwise). Kept in ``gateway.vector_store``, until deleted or
expired.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batch.store import FileInfo
from gateway.auth import Caller
from gateway.errors import APIError, bad_request, not_found
from gateway.input_files import DOCUMENT_PURPOSES, owned_file
from gateway.pages import cursor_page, page_query
from gateway.schemas import INT64, Metadata, _Body, parse, read_json
from gateway.service import Services
from gateway.vector_search import check_filter, encoder_of, search_stores
from gateway.vector_store import FileBatch, StoreFile, VectorStore, VectorStoreStore

AUTO_CHUNK, AUTO_OVERLAP = 800, 400  # OpenAI's auto strategy, in tokens
MAX_BATCH = 2000  # files in one file batch, as OpenAI allows


def _checked_attributes(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if len(value) > 16:
        raise ValueError("at most 16 attributes")
    for key, item in value.items():
        if len(key) > 64:
            raise ValueError(f"attribute key {key[:80]!r} is longer than 64 characters")
        if isinstance(item, str) and len(item) > 512:
            raise ValueError(f"attribute {key!r} is longer than 512 characters")
        if type(item) is int and not INT64[0] <= item <= INT64[1]:  # (as every integer of the API)
            raise ValueError(f"attribute {key[:80]!r}: integer out of range (a signed 64-bit integer is expected)")
    return value


Attributes = Annotated[dict[str, str | bool | int | float] | None, AfterValidator(_checked_attributes)]


class StaticChunking(_Body):
    max_chunk_size_tokens: int = Field(ge=100, le=4096)
    chunk_overlap_tokens: int = Field(ge=0)


class ChunkingStrategy(_Body):
    type: Literal["auto", "static"]
    static: StaticChunking | None = None


class StoreExpiry(_Body):
    anchor: Literal["last_active_at"]
    days: int = Field(ge=1, le=365)


class StoreCreate(_Body):
    name: str | None = Field(default=None, max_length=256)
    description: str | None = Field(default=None, max_length=512)
    file_ids: list[str] = Field(default_factory=list, max_length=500)
    metadata: Metadata = None
    expires_after: StoreExpiry | None = None
    chunking_strategy: ChunkingStrategy | None = None
    model: str | None = None  # extension: the embedding model (tiers.yaml's first by default)


class StoreUpdate(_Body):
    name: str | None = Field(default=None, max_length=256)
    metadata: Metadata = None
    expires_after: StoreExpiry | None = None


class FileCreate(_Body):
    file_id: str = Field(min_length=1)
    attributes: Attributes = None
    chunking_strategy: ChunkingStrategy | None = None


class FileUpdate(_Body):
    attributes: Attributes


class BatchFile(_Body):
    file_id: str = Field(min_length=1)
    attributes: Attributes = None
    chunking_strategy: ChunkingStrategy | None = None


class BatchCreate(_Body):
    file_ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_BATCH)
    files: list[BatchFile] | None = Field(default=None, min_length=1, max_length=MAX_BATCH)
    attributes: Attributes = None
    chunking_strategy: ChunkingStrategy | None = None


class HybridSearch(_Body):
    embedding_weight: float = Field(ge=0)
    text_weight: float = Field(ge=0)


class RankingOptions(_Body):
    ranker: Literal["auto", "none", "default-2024-11-15"] = "auto"
    score_threshold: float = Field(default=0.0, ge=0.0, le=1.0)
    hybrid_search: HybridSearch | None = None

    def weights(self, param: str) -> tuple[float, float] | None:
        """(embedding, text) weights of a hybrid search, or None; both 0 is a 400 naming ``param``."""
        h = self.hybrid_search
        if h is None:
            return None
        if h.embedding_weight + h.text_weight <= 0:
            raise bad_request("hybrid_search needs a weight above 0", f"{param}.hybrid_search")
        return h.embedding_weight, h.text_weight


class SearchBody(_Body):
    query: str | list[str]
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None
    rewrite_query: bool = False


# -- the decisions: chunk sizes (pure) -------------------------------------------------------------


def chunk_sizes(strategy: ChunkingStrategy | None, room: int, param: str) -> tuple[int, int]:
    """(tokens per chunk, overlap) of ``strategy`` for a model whose inputs hold ``room`` tokens of
    text: ``auto`` is 800 overlapping by 400, scaled down to ``room``; a ``static`` size over
    ``room``, or an overlap over half the size, is a 400 naming ``param``."""
    if strategy is None or strategy.type == "auto":
        if strategy is not None and strategy.static is not None:
            raise bad_request("an 'auto' chunking strategy takes no 'static'", f"{param}.static")
        size = min(AUTO_CHUNK, room)
        return size, size * AUTO_OVERLAP // AUTO_CHUNK
    if strategy.static is None:
        raise bad_request("a 'static' chunking strategy needs 'static'", f"{param}.static", "missing_required_parameter")
    size, overlap = strategy.static.max_chunk_size_tokens, strategy.static.chunk_overlap_tokens
    if size > room:
        raise bad_request(f"max_chunk_size_tokens is {size}; this store's embedding model reads at most {room} tokens "
                          "of text per chunk", f"{param}.static.max_chunk_size_tokens", "chunk_too_large")
    if overlap > size // 2:
        raise bad_request(f"chunk_overlap_tokens is {overlap}; at most half of max_chunk_size_tokens ({size // 2})",
                          f"{param}.static.chunk_overlap_tokens")
    return size, overlap


# -- HTTP -----------------------------------------------------------------------------------------------


def _store(request: Request) -> VectorStoreStore:
    return request.app.state.vector_stores


def _owner(request: Request) -> tuple[str, Services]:
    svc: Services = request.app.state.services
    return svc.authenticate(request).key_id, svc  # records take no slot: no gate


def _missing(store_id: str) -> Exception:
    return not_found(f"no vector store with id '{store_id}'", "vector_store_id", "vector_store_not_found")


async def _owned(request: Request, owner: str) -> VectorStore:
    store_id = request.path_params["vector_store_id"]
    found = await _store(request).get(store_id, owner)
    if found is None:
        raise _missing(store_id)
    return found


async def _shown(request: Request, store: VectorStore) -> dict[str, Any]:
    return store.public(await _store(request).files(store.id), time.time())


def _embedding_model(svc: Services, caller: Caller, name: str | None) -> str:
    """The model a new store embeds with: ``name``, or the first ``embed`` model of tiers.yaml that
    the caller's key may use (a managed key's allow-list; a model it may not use is a 404, as on
    every endpoint)."""
    def allowed(model: str) -> bool:
        return svc.accounts is None or svc.accounts.allows(caller, model)

    if name is not None:
        model = svc.spec(name, "embed").name
        if not allowed(model):
            raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
        return model
    for spec in svc.arbiter.specs.values():
        if spec.kind == "embed" and allowed(spec.name):
            return spec.name
    raise bad_request("this server has no embedding model this key may use to make a vector store with "
                      "(tiers.yaml: kind: embed)", "model", "no_embedding_model")


async def _room(svc: Services, model: str) -> int:
    encoder = await encoder_of(svc, model)
    return await asyncio.to_thread(lambda: encoder.chunk_room)


async def _document(request: Request, caller: Caller, file_id: str, param: str) -> FileInfo:
    """The caller's document ``file_id``: a 404 naming ``param`` for a file it cannot see, a 400 for
    one that is not a document."""
    return await owned_file(request.app.state.services, caller, file_id, param, DOCUMENT_PURPOSES, "a vector store")


async def _add(request: Request, caller: Caller, store: VectorStore, info: FileInfo, attributes: dict | None,
               sizes: tuple[int, int], batch_id: str | None = None) -> StoreFile:
    """Add the (checked) document to ``store`` and wake the indexer."""
    file = StoreFile(store.id, info.id, secrets.token_hex(8), store.owner, caller.tier, int(time.time()),
                     info.filename, *sizes, attributes=attributes or {}, batch_id=batch_id)
    if not await _store(request).add_file(file):
        raise _missing(store.id)
    request.app.state.indexer.wake()
    return file


async def create_store(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(StoreCreate, await read_json(request, svc.config.limits.max_body))
    model = _embedding_model(svc, caller, body.model)
    sizes = chunk_sizes(body.chunking_strategy, await _room(svc, model), "chunking_strategy")
    documents = [await _document(request, caller, file_id, f"file_ids[{i}]") for i, file_id in enumerate(body.file_ids)]
    now = int(time.time())
    store = VectorStore(f"vs_{secrets.token_hex(12)}", caller.key_id, now, body.name or "", model,
                        body.metadata or {}, body.description, body.expires_after.days if body.expires_after else None, now)
    await _store(request).create(store)
    for info in dict((d.id, d) for d in documents).values():  # a file named twice is added once
        await _add(request, caller, store, info, None, sizes)
    return JSONResponse(await _shown(request, store))


async def list_stores(request: Request) -> Response:
    owner, _ = _owner(request)
    q = request.query_params
    limit, order = page_query(q, "desc")
    stores = {s.id: s for s in await _store(request).list(owner)}
    page = cursor_page([{"id": i} for i in stores], order, limit, q.get("after") or None, q.get("before") or None)
    page["data"] = [await _shown(request, stores[row["id"]]) for row in page["data"]]  # only the page's files are read
    return JSONResponse(page)


async def get_store(request: Request) -> Response:
    owner, _ = _owner(request)
    return JSONResponse(await _shown(request, await _owned(request, owner)))


async def update_store(request: Request) -> Response:
    owner, svc = _owner(request)
    store = await _owned(request, owner)
    raw = await read_json(request, svc.config.limits.max_body)
    body = parse(StoreUpdate, raw)
    changed = store
    if "name" in raw:
        changed = replace(changed, name=body.name or "")
    if "metadata" in raw:
        changed = replace(changed, metadata=body.metadata or {})
    if "expires_after" in raw:
        changed = replace(changed, expires_days=body.expires_after.days if body.expires_after else None)
    if not await _store(request).update(changed):
        raise _missing(store.id)
    return JSONResponse(await _shown(request, changed))


async def delete_store(request: Request) -> Response:
    owner, _ = _owner(request)
    store_id = request.path_params["vector_store_id"]
    if not await _store(request).delete(store_id, owner):
        raise _missing(store_id)
    return JSONResponse({"id": store_id, "object": "vector_store.deleted", "deleted": True})


async def add_file(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    store = await _owned(request, caller.key_id)
    body = parse(FileCreate, await read_json(request, svc.config.limits.max_body))
    if store.expired(time.time()):
        raise expired_error(store)
    sizes = chunk_sizes(body.chunking_strategy, await _room(svc, store.model), "chunking_strategy")
    info = await _document(request, caller, body.file_id, "file_id")
    return JSONResponse((await _add(request, caller, store, info, body.attributes, sizes)).public())


async def list_files(request: Request) -> Response:
    owner, _ = _owner(request)
    store = await _owned(request, owner)
    return _file_page(request, await _store(request).files(store.id))


def _file_page(request: Request, files: list[StoreFile]) -> Response:
    q = request.query_params
    limit, order = page_query(q, "desc")
    status = q.get("filter")
    if status is not None and status not in ("in_progress", "completed", "failed", "cancelled"):
        raise bad_request("filter must be one of in_progress, completed, failed, cancelled", "filter")
    shown = [f.public() for f in files if status is None or f.status == status]
    return JSONResponse(cursor_page(shown, order, limit, q.get("after") or None, q.get("before") or None))


async def _owned_file(request: Request) -> tuple[VectorStore, StoreFile]:
    owner, _ = _owner(request)
    store = await _owned(request, owner)
    file_id = request.path_params["file_id"]
    file = await _store(request).file(store.id, file_id)
    if file is None:
        raise not_found(f"no file '{file_id[:80]}' in this vector store", "file_id", "file_not_found")
    return store, file


async def get_file(request: Request) -> Response:
    _, file = await _owned_file(request)
    return JSONResponse(file.public())


async def update_file(request: Request) -> Response:
    store, file = await _owned_file(request)
    svc: Services = request.app.state.services
    body = parse(FileUpdate, await read_json(request, svc.config.limits.max_body))
    changed = await _store(request).set_attributes(store.id, file.id, body.attributes or {})
    if changed is None:
        raise not_found(f"no file '{file.id}' in this vector store", "file_id", "file_not_found")
    return JSONResponse(changed.public())


async def delete_file(request: Request) -> Response:
    store, file = await _owned_file(request)
    if not await _store(request).delete_file(store.id, file.id):
        raise not_found(f"no file '{file.id}' in this vector store", "file_id", "file_not_found")
    return JSONResponse({"id": file.id, "object": "vector_store.file.deleted", "deleted": True})


async def file_content(request: Request) -> Response:
    store, file = await _owned_file(request)
    texts = await _store(request).file_texts(store.id, file.id) or []
    return JSONResponse({"object": "vector_store.file_content.page", "data": [{"type": "text", "text": t} for t in texts],
                         "has_more": False, "next_page": None})


def expired_error(store: VectorStore, param: str = "vector_store_id") -> APIError:
    return bad_request(f"the vector store '{store.id}' expired at {store.expires_at}", param, "vector_store_expired")


async def search(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)  # the queries are embedded: a model request
    store = await _owned(request, caller.key_id)
    body = parse(SearchBody, await read_json(request, svc.config.limits.max_body))
    queries = [body.query] if isinstance(body.query, str) else body.query
    if not queries or len(queries) > 10:
        raise bad_request("query is a string or a list of 1 to 10 strings", "query")
    for i, text in enumerate(queries):
        if not text.strip():
            raise bad_request("a query must not be empty", "query" if isinstance(body.query, str) else f"query[{i}]")
    if body.filters is not None:
        check_filter(body.filters)
    if body.rewrite_query:
        raise bad_request("rewrite_query is not supported here: the query is searched as written", "rewrite_query",
                          "unsupported_parameter")
    if store.expired(time.time()):
        raise expired_error(store)
    options = body.ranking_options or RankingOptions()
    hits = await search_stores(svc, _store(request), caller, [store], queries, body.filters, body.max_num_results,
                               options.score_threshold, hybrid=options.weights("ranking_options"))
    return JSONResponse({"object": "vector_store.search_results.page", "search_query": queries,
                         "data": [{"file_id": f.id, "filename": f.filename, "score": score, "attributes": f.attributes,
                                   "content": [{"type": "text", "text": text}]} for score, f, text in hits],
                         "has_more": False, "next_page": None},
                        headers=svc.gate.rate_headers(caller.tier))


# -- file batches: files added together, followed and cancelled together ----------------------------


_STATUSES = ("in_progress", "completed", "failed", "cancelled")


def batch_counts(batch: FileBatch, files: list[StoreFile]) -> dict[str, int]:
    """What a file batch's files are now (``files``: the store's): each by its row in the store,
    whatever addition it is now of; one taken out of the store before the batch ended counts
    as ``cancelled`` (its reading was stopped). The counts it ended with, once it has."""
    if batch.counts is not None:
        return batch.counts
    now = {f.id: f.status for f in files}
    return {s: sum(now.get(file_id, "cancelled") == s for file_id in batch.file_ids) for s in _STATUSES}


def batch_public(batch: FileBatch, counts: dict[str, int]) -> dict[str, Any]:
    """A file batch as OpenAI shows it: ``in_progress`` while any of its files is, ``cancelled`` if
    any was cancelled, ``failed`` if every file failed, ``completed`` otherwise."""
    status = ("in_progress" if counts["in_progress"] else "cancelled" if counts["cancelled"]
              else "failed" if counts["failed"] == len(batch.file_ids) else "completed")
    return {"id": batch.id, "object": "vector_store.files_batch", "created_at": batch.created_at,
            "vector_store_id": batch.vector_store_id, "status": status,
            "file_counts": {**counts, "total": len(batch.file_ids)}}


async def create_batch(request: Request) -> Response:
    """POST /v1/vector_stores/{id}/file_batches: ``file_ids`` (with one ``attributes`` and
    ``chunking_strategy`` for all) or ``files`` (each with its own); every file is checked before
    any is added."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    store = await _owned(request, caller.key_id)
    body = parse(BatchCreate, await read_json(request, svc.config.limits.max_body))
    if (body.file_ids is None) == (body.files is None):
        raise bad_request("give either file_ids or files", "file_ids")
    if store.expired(time.time()):
        raise expired_error(store)
    room = await _room(svc, store.model)
    if body.file_ids is not None:
        sizes = chunk_sizes(body.chunking_strategy, room, "chunking_strategy")
        wanted = [(fid, body.attributes, sizes, f"file_ids[{i}]") for i, fid in enumerate(body.file_ids)]
    else:
        if body.attributes is not None or body.chunking_strategy is not None:
            raise bad_request("with files, give attributes and chunking_strategy for each file", "files")
        wanted = [(f.file_id, f.attributes, chunk_sizes(f.chunking_strategy, room, f"files[{i}].chunking_strategy"),
                   f"files[{i}].file_id") for i, f in enumerate(body.files)]
    seen: set[str] = set()
    checked = []
    for file_id, attributes, sizes, param in wanted:
        if file_id in seen:
            raise bad_request(f"the file '{file_id[:80]}' is in the batch twice", param, "duplicate_file")
        seen.add(file_id)
        checked.append((await _document(request, caller, file_id, param), attributes, sizes))
    batch = FileBatch(f"vsfb_{secrets.token_hex(12)}", store.id, int(time.time()), [info.id for info, _, _ in checked])
    if not await _store(request).put_batch(batch):  # kept with its files: adding them again or removing one later
        raise _missing(store.id)  # changes the store's rows, not the batch
    added = [await _add(request, caller, store, info, attributes, sizes, batch.id)
             for info, attributes, sizes in checked]
    return JSONResponse(batch_public(batch, batch_counts(batch, added)))


async def _batch(request: Request) -> tuple[FileBatch, list[StoreFile]]:
    """The file batch of the path and its files as they are in the store now; once it has ended,
    the counts it ended with are kept with it (read here, so they change no more)."""
    owner, _ = _owner(request)
    store = await _owned(request, owner)
    batch_id = request.path_params["batch_id"]
    files, batch = await _store(request).files(store.id), await _store(request).batch(store.id, batch_id)
    if batch is None:  # made before batches were kept: what its files say
        mine = [f for f in files if f.batch_id == batch_id]
        if not mine:
            raise not_found(f"no file batch '{batch_id[:80]}' in this vector store", "batch_id", "batch_not_found")
        return FileBatch(batch_id, store.id, min(f.created_at for f in mine), [f.id for f in mine]), mine
    counts = batch_counts(batch, files)
    if batch.counts is None and not counts["in_progress"]:
        batch = replace(batch, counts=counts)
        await _store(request).put_batch(batch)
    wanted = set(batch.file_ids)
    return batch, [f for f in files if f.id in wanted]


async def get_batch(request: Request) -> Response:
    batch, files = await _batch(request)
    return JSONResponse(batch_public(batch, batch_counts(batch, files)))


async def cancel_batch(request: Request) -> Response:
    """POST .../file_batches/{batch_id}/cancel: its files not read yet are ``cancelled`` (and not
    read); those read keep their chunks. (A file added again since, by another addition, is that
    one's now: not cancelled.)"""
    batch, files = await _batch(request)
    for f in files:
        if f.status == "in_progress" and f.batch_id == batch.id:
            await _store(request).cancel(f)
    batch, files = await _batch(request)
    return JSONResponse(batch_public(batch, batch_counts(batch, files)))


async def list_batch_files(request: Request) -> Response:
    _, files = await _batch(request)
    return _file_page(request, files)
