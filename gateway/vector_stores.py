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

A file is added ``in_progress`` and read in the background by the :class:`Indexer`: a PDF's text
(pypdf) or UTF-8 text, cut into chunks of the strategy's tokens (the embedding model's tokenizer; ``auto`` is
OpenAI's 800 tokens overlapping by 400, or the model's context if that is smaller), and each chunk
embedded as a request of the key that added the file, at its tier, through the gate (its tokens
count in that key's usage, as ``/v1/embeddings`` tokens). A search embeds its queries the same way,
then ranks every chunk of the store by cosine similarity (the best over the queries), reported as
``score = (1 + cosine) / 2``, in 0..1. Only the key that made a store sees it (a 404 otherwise).
Kept in ``gateway.vector_store``, until deleted or expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import re
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import numpy as np
import pypdf
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import AfterValidator, Field
from pypdf.errors import PdfReadError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from batch.store import FileInfo
from batch.store import Store as BatchStore
from gateway.auth import Caller
from gateway.embeddings import EmbedJob, serve_embeddings
from gateway.errors import APIError, bad_request, not_found
from gateway.pages import cursor_page, page_query
from gateway.schemas import Metadata, _Body, parse, read_json
from gateway.service import Services
from gateway.serving import weightless
from gateway.vector_store import Chunks, StoreFile, VectorStore, VectorStoreStore
from workers.embed import EmbedWorker

log = logging.getLogger("tiergate.vector_stores")
DOCUMENT_PURPOSES = ("assistants", "user_data")
AUTO_CHUNK, AUTO_OVERLAP = 800, 400  # OpenAI's auto strategy, in tokens
LEASE_S = 60.0  # a file being read is another process's to take once its lease is this old
POLL_S = 2.0  # how often an idle indexer looks for files other processes added or left
GROUP = 64  # chunks embedded in one request
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


# -- the decisions: chunk sizes, filters, ranking (pure) ---------------------------------------------


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


_COMPARISONS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin")


def check_filter(f: Any, param: str = "filters") -> None:
    """A 400 naming the part of ``f`` that is not a comparison (``{"type": "eq", "key", "value"}``,
    ``ne``, ``gt``, ``gte``, ``lt``, ``lte``; ``in``/``nin`` with a list) or a compound filter
    (``{"type": "and"|"or", "filters": [...]}``)."""
    if not isinstance(f, dict) or not isinstance(f.get("type"), str):
        raise bad_request("a filter is an object with a 'type'", param, "invalid_filter")
    kind = f["type"]
    if kind in ("and", "or"):
        if set(f) != {"type", "filters"} or not isinstance(f["filters"], list) or not f["filters"]:
            raise bad_request(f"an '{kind}' filter has 'type' and a non-empty list 'filters'", param, "invalid_filter")
        for i, inner in enumerate(f["filters"]):
            check_filter(inner, f"{param}.filters[{i}]")
        return
    if kind not in _COMPARISONS:
        raise bad_request(f"unknown filter type {kind[:40]!r}: one of and, or, {', '.join(_COMPARISONS)}",
                          f"{param}.type", "invalid_filter")
    if set(f) != {"type", "key", "value"} or not isinstance(f["key"], str):
        raise bad_request(f"a '{kind}' filter has 'type', 'key' (a string) and 'value'", param, "invalid_filter")
    scalars = (str, int, float, bool)
    value = f["value"]
    ok = (isinstance(value, list) and all(isinstance(v, scalars) for v in value)) if kind in ("in", "nin") \
        else isinstance(value, scalars)
    if not ok:
        raise bad_request(f"the value of a '{kind}' filter is {'a list of ' if kind in ('in', 'nin') else 'a '}"
                          "string, number or boolean", f"{param}.value", "invalid_filter")


def _same_kind(a: Any, b: Any) -> bool:
    """Whether two attribute values compare: both strings, both booleans or both numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    return isinstance(a, str) == isinstance(b, str)


def matches(f: dict[str, Any], attributes: dict[str, Any]) -> bool:
    """Whether a file's ``attributes`` pass the (checked) filter ``f``. A comparison on a key the
    file lacks, or on a value of another kind (a string against a number), is false (``ne`` and
    ``nin`` too)."""
    kind = f["type"]
    if kind == "and":
        return all(matches(inner, attributes) for inner in f["filters"])
    if kind == "or":
        return any(matches(inner, attributes) for inner in f["filters"])
    if f["key"] not in attributes:
        return False
    have, want = attributes[f["key"]], f["value"]
    if kind in ("in", "nin"):
        found = any(_same_kind(have, v) and have == v for v in want)
        return found if kind == "in" else not found and all(_same_kind(have, v) for v in want)
    if not _same_kind(have, want):
        return False
    return {"eq": have == want, "ne": have != want, "gt": have > want, "gte": have >= want,
            "lt": have < want, "lte": have <= want}[kind]


_WORD = re.compile(r"\w+")
RRF_K = 60  # reciprocal rank fusion's constant, as in its paper (Cormack et al., 2009)


@dataclass(frozen=True)
class Words:
    """The words of a matrix's chunks, for BM25 (Robertson's, k1 1.2, b 0.75): each word's rows
    and counts in them, and each chunk's length in words. Words are ``\\w+`` runs, lowercased."""

    postings: dict[str, tuple[np.ndarray, np.ndarray]]
    lengths: np.ndarray

    @classmethod
    def of(cls, texts: list[str]) -> "Words":
        found: dict[str, tuple[list[int], list[int]]] = {}
        lengths = []
        for row, text in enumerate(texts):
            counts = Counter(_WORD.findall(text.lower()))
            lengths.append(sum(counts.values()))
            for word, n in counts.items():
                rows, tfs = found.setdefault(word, ([], []))
                rows.append(row)
                tfs.append(n)
        return cls({w: (np.array(r, np.int64), np.array(t, np.float32)) for w, (r, t) in found.items()},
                   np.array(lengths, np.float32))

    def scores(self, query: str, k1: float = 1.2, b: float = 0.75) -> np.ndarray:
        """Each chunk's BM25 score for ``query`` (0 where it has none of its words)."""
        n = len(self.lengths)
        out = np.zeros(n, np.float32)
        if n == 0:
            return out
        mean = max(float(self.lengths.mean()), 1.0)
        for word in set(_WORD.findall(query.lower())):
            if word not in self.postings:
                continue
            rows, tf = self.postings[word]
            idf = np.log(1.0 + (n - len(rows) + 0.5) / (len(rows) + 0.5))
            out[rows] += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * self.lengths[rows] / mean))
        return out


@dataclass(frozen=True)
class Matrix:
    """A vector store's completed files' chunks, loaded for search: every chunk's vector as one
    row (unit length), the rows of file ``k`` from ``starts[k]``, its chunks' texts, and ``key``,
    which additions of which files it holds."""

    key: tuple[tuple[str, str], ...]
    vectors: np.ndarray
    starts: np.ndarray
    ids: list[str]
    texts: list[list[str]]

    @classmethod
    def of(cls, chunks: list[Chunks]) -> "Matrix":
        parts = [c.vectors for c in chunks if c.texts]
        vectors = _unit(np.concatenate(parts)) if parts else np.zeros((0, 1), np.float32)
        sizes = [len(c.texts) for c in chunks]
        return cls(tuple((c.file.id, c.file.token) for c in chunks), vectors,
                   np.cumsum([0, *sizes[:-1]], dtype=np.int64), [c.file.id for c in chunks], [c.texts for c in chunks])

    @functools.cached_property
    def words(self) -> Words:
        """Its chunks' words, made the first time a hybrid search needs them."""
        return Words.of([text for texts in self.texts for text in texts])


def rank(m: Matrix, files: dict[str, StoreFile], queries: np.ndarray, filters: dict[str, Any] | None, limit: int,
         threshold: float, hybrid: tuple[float, float] | None = None,
         texts: list[str] = ()) -> list[tuple[float, StoreFile, str]]:
    """The best ``limit`` chunks of ``m`` for ``queries`` (one vector per query), best first:
    (score, file, text), the file as ``files`` has it now (its attributes). A chunk's score is
    ``(1 + cosine) / 2`` with the query closest to it; chunks of files no longer in ``files`` or
    whose attributes fail ``filters`` are left out, and so are scores under ``threshold``. Ties
    keep the files' and chunks' order.

    ``hybrid`` (embedding, text weights): the chunks ranked twice, by that score and by BM25 for
    the query ``texts`` (the best over them; a chunk without a query word is not in the second
    ranking), then fused by reciprocal rank, ``sum(weight / (60 + rank))``, scaled so that first
    in both is 1."""
    if not m.ids or not len(m.vectors):
        return []
    scores = ((1.0 + (m.vectors @ _unit(queries).T).max(axis=1)) / 2.0).clip(0.0, 1.0)
    ends = [*m.starts[1:], len(scores)]
    allowed = np.ones(len(scores), bool)
    for k, file_id in enumerate(m.ids):
        f = files.get(file_id)
        if f is None or (filters is not None and not matches(filters, f.attributes)):
            allowed[m.starts[k]:ends[k]] = False
    if hybrid is not None:
        words = np.max([m.words.scores(t) for t in texts], axis=0) if texts else np.zeros_like(scores)
        scores = _fused(scores, words, allowed, *hybrid)
    scores[~allowed] = -1.0
    order = np.argsort(-scores, kind="stable")[:limit]
    hits = []
    for row in order:
        if scores[row] < max(threshold, 0.0):
            break
        k = int(np.searchsorted(m.starts, row, side="right")) - 1
        hits.append((float(scores[row]), files[m.ids[k]], m.texts[k][row - m.starts[k]]))
    return hits


def _fused(semantic: np.ndarray, words: np.ndarray, allowed: np.ndarray, w_embed: float, w_text: float) -> np.ndarray:
    """Reciprocal rank fusion of the allowed rows' two rankings, in 0..1 (1: first in both)."""
    fused = np.zeros(len(semantic), np.float64)
    rows = np.flatnonzero(allowed)
    by_meaning = rows[np.argsort(-semantic[rows], kind="stable")]
    fused[by_meaning] += w_embed / (RRF_K + 1 + np.arange(len(by_meaning)))
    worded = rows[words[rows] > 0]
    by_words = worded[np.argsort(-words[worded], kind="stable")]
    fused[by_words] += w_text / (RRF_K + 1 + np.arange(len(by_words)))
    return (fused / ((w_embed + w_text) / (RRF_K + 1))).astype(np.float32)


class Shelf:
    """The vector stores this process has loaded for search (``Matrix``), the least recently
    searched dropped past ``budget`` bytes of vectors. A store is loaded again when its completed
    files changed (a file added, read again or removed): each search reads only its files' records
    to tell. One per process (``SHELF``); any process may change a store (Redis), so none trusts
    its copy without that check."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: OrderedDict[tuple[int, str], Matrix] = OrderedDict()

    async def load(self, stores: VectorStoreStore, store_id: str) -> tuple[Matrix, dict[str, StoreFile]]:
        files = await stores.files(store_id)
        key = tuple((f.id, f.token) for f in files if f.status == "completed")
        place = (id(stores), store_id)
        m = self._kept.get(place)
        if m is None or m.key != key:
            m = Matrix.of(await stores.chunks(store_id))
            self._kept[place] = m
        self._kept.move_to_end(place)
        while sum(kept.vectors.nbytes for kept in self._kept.values()) > self.budget and len(self._kept) > 1:
            self._kept.popitem(last=False)
        return m, {f.id: f for f in files if f.status == "completed"}


SHELF = Shelf(1 << 30)


def _unit(m: np.ndarray) -> np.ndarray:
    m = m.astype(np.float32, copy=False)
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(norms == 0, 1.0, norms)


# -- the indexer: files read, cut and embedded in the background -------------------------------------


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Dropped(Exception):
    """The file was removed, added again or its store deleted while it was read: leave it."""


def document_text(content: bytes) -> str:
    """The text of a document: a PDF's pages' text (pypdf), one after another, or UTF-8 text as
    it is (without a byte-order mark). ``_Refused`` for anything else: an encrypted or broken PDF,
    bytes that are not UTF-8 (Office files among them)."""
    if content.startswith(b"%PDF-"):
        try:
            reader = pypdf.PdfReader(io.BytesIO(content))
            if reader.is_encrypted:
                raise _Refused("unsupported_file", "the PDF is encrypted")
            return "\n\n".join(page.extract_text() for page in reader.pages)
        except PdfReadError as exc:
            raise _Refused("invalid_file", f"the PDF cannot be read: {exc}") from None
    try:
        return content.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise _Refused("unsupported_file", "the file is neither a PDF nor UTF-8 text (Markdown, code, JSON, HTML); "
                                           "Office files and images are not read") from None


class Indexer(Collector):
    """Reads the files added to vector stores, one at a time, in the order added. One task owns
    the work: it claims a waiting file (its own, another process's, or one whose process died: its
    lease ended), reads it, and finishes or fails it; it sleeps until a file is added here
    (``wake``) or ``POLL_S`` passes. A file's chunks are embedded ``GROUP`` at a time, each group
    one request of the key that added the file, at its tier, waiting its turn at the gate as any
    request does (a 429 there is waited out, not a failure); the lease is renewed after each group.
    Stopped at shutdown: a file half read is taken again, whole, by the next process to claim it.
    ``/metrics`` shows the files this process read by how they ended, the chunks it embedded and
    whether it is reading one now (``collect``)."""

    def __init__(self, svc: Services, store: VectorStoreStore, files: BatchStore) -> None:
        self.svc, self.store, self.files = svc, store, files
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.ended: Counter[str] = Counter()  # completed, failed, dropped (removed or added again meanwhile)
        self.chunks = 0
        self.reading = False

    def collect(self):
        files = CounterMetricFamily("tiergate_vector_store_files_read", "Files this process read into vector stores, "
                                    "by outcome (completed, failed, dropped: removed or added again meanwhile)",
                                    labels=["outcome"])
        for outcome in ("completed", "failed", "dropped"):
            files.add_metric([outcome], self.ended[outcome])
        yield files
        yield CounterMetricFamily("tiergate_vector_store_chunks", "Chunks this process embedded into vector stores",
                                  value=self.chunks)
        yield GaugeMetricFamily("tiergate_vector_store_reading", "1 while this process reads a file into a vector store",
                                value=int(self.reading))

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            taken: list[StoreFile] = []
            try:  # one at a time: a second file claimed now would wait under a lease nobody renews
                taken = await self.store.claim(time.time(), LEASE_S, 1)
                for file in taken:
                    await self._index(file)
            except Exception:  # noqa: BLE001 - the store is down: the file's lease ends, and it is taken again
                log.exception("vector stores: claiming or recording a file failed")
            if not taken:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await self._wake.wait()

    async def _index(self, file: StoreFile) -> None:
        self.reading = True
        try:
            texts, vectors = await self._read(file)
            ended = "completed" if await self.store.finish(file, texts, vectors) else "dropped"
            self.chunks += len(texts) if ended == "completed" else 0
        except _Refused as refused:
            ended = "failed" if await self.store.fail(file, refused.code, refused.message) else "dropped"
        except _Dropped:
            ended = "dropped"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded on the file; the indexer goes on
            log.exception("vector stores: reading %s into %s failed", file.id, file.vector_store_id)
            message = exc.message if isinstance(exc, APIError) else "the server failed while reading the file"
            ended = "failed" if await self.store.fail(file, "server_error", message) else "dropped"
        finally:
            self.reading = False
        self.ended[ended] += 1

    async def _read(self, file: StoreFile) -> tuple[list[str], np.ndarray]:
        """The file's chunks and their vectors; ``_Refused`` for a file that is not text."""
        store = await self.store.get(file.vector_store_id, file.owner)
        if store is None:
            raise _Dropped
        content = await self.files.file_content(file.id)
        if content is None:
            raise _Refused("invalid_file", "the file was deleted before it was read")
        text = await asyncio.to_thread(document_text, content)
        encoder = await encoder_of(self.svc, store.model)
        texts, rows = await asyncio.to_thread(encoder.cut, text, file.chunk_tokens, file.overlap_tokens)
        if not rows:
            raise _Refused("invalid_file", "the file has no text")
        caller = Caller(file.tier, file.owner)
        parts = []
        for start in range(0, len(rows), GROUP):
            parts.append(await self._embed(file, caller, store.model, rows[start:start + GROUP]))
            if not await self.store.hold(file, time.time() + LEASE_S):
                raise _Dropped
        return texts, np.concatenate(parts)

    async def _embed(self, file: StoreFile, caller: Caller, model: str, rows: list[list[int]]) -> np.ndarray:
        while True:
            try:
                return await serve_embeddings(self.svc, caller, EmbedJob(model, rows, None), None)
            except APIError as exc:
                if exc.status != 429:
                    raise
                wait = exc.headers.get("retry-after", "1")
                await asyncio.sleep(min(30.0, max(0.5, float(wait) if wait.isdigit() else 1.0)))
                if not await self.store.hold(file, time.time() + LEASE_S):
                    raise _Dropped from None


def indexer_for(svc: Services, store: VectorStoreStore, files: BatchStore) -> Indexer:
    """The process's indexer, started once the stores are open and stopped before they close."""
    indexer = Indexer(svc, store, files)
    svc.on_startup.append(indexer.start)
    svc.on_shutdown.append(indexer.stop)
    svc.metrics.registry.register(indexer)
    return indexer


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


def _embedding_model(svc: Services, name: str | None) -> str:
    if name is not None:
        return svc.spec(name, "embed").name
    for spec in svc.arbiter.specs.values():
        if spec.kind == "embed":
            return spec.name
    raise bad_request("this server has no embedding model to make a vector store with (tiers.yaml: kind: embed)",
                      "model", "no_embedding_model")


async def encoder_of(svc: Services, model: str) -> EmbedWorker:
    """The embedding model ``model``'s reader (tokenizer, config; no weights); 503 when tiers.yaml
    no longer has that model (a vector store keeps the model it was made with)."""
    spec = svc.arbiter.specs.get(model)
    if spec is None or spec.kind != "embed":
        raise APIError(503, f"the vector store's embedding model '{model}' is not served here", "model_unavailable")
    return await weightless(svc.encoders, spec, EmbedWorker.reader)


async def _room(svc: Services, model: str) -> int:
    encoder = await encoder_of(svc, model)
    return await asyncio.to_thread(lambda: encoder.chunk_room)


async def _document(request: Request, caller: Caller, file_id: str, param: str) -> FileInfo:
    """The caller's document ``file_id``: a 404 naming ``param`` for a file it cannot see, a 400 for
    one that is not a document."""
    info = await request.app.state.batches.store.get_file(file_id)
    if info is None or info.expired(time.time()) or not (caller.admin or info.owner == caller.key_id):
        raise not_found(f"no such file: '{file_id[:80]}'", param, "file_not_found")
    if info.purpose not in DOCUMENT_PURPOSES:
        raise bad_request(f"the file's purpose is {info.purpose!r}; a vector store reads files uploaded with purpose "
                          "'assistants' or 'user_data'", param, "invalid_file_purpose")
    return info


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
    model = _embedding_model(svc, body.model)
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
    stores = await _store(request).list(owner)
    shown = [await _shown(request, s) for s in stores]
    return JSONResponse(cursor_page(shown, order, limit, q.get("after") or None, q.get("before") or None))


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


async def search_stores(svc: Services, stores: VectorStoreStore, caller: Caller, found: list[VectorStore],
                        queries: list[str], filters: dict[str, Any] | None, limit: int, threshold: float,
                        param: str = "query", hybrid: tuple[float, float] | None = None) -> list[tuple[float, StoreFile, str]]:
    """The best ``limit`` chunks of the vector stores ``found`` for ``queries`` (``rank``, off the
    event loop), best first. The queries are embedded with each store's model as one request of
    ``caller``, through the gate; one over the model's context is a 400 naming ``param``. Each
    store searched is active now (its expiry counts from here)."""
    hits: list[tuple[float, StoreFile, str]] = []
    for model in dict.fromkeys(store.model for store in found):
        encoder = await encoder_of(svc, model)
        try:
            ids = await asyncio.to_thread(encoder.tokenize, queries)
        except ValueError as exc:
            raise bad_request(str(exc).replace("input", "query"), param, "context_length_exceeded") from None
        vectors = await serve_embeddings(svc, caller, EmbedJob(model, ids, None), None)
        for store in found:
            if store.model == model:
                m, files = await SHELF.load(stores, store.id)
                hits += await asyncio.to_thread(rank, m, files, vectors, filters, limit, threshold, hybrid, queries)
    now = int(time.time())
    for store in found:
        await stores.update(replace(store, last_active_at=now))
    hits.sort(key=lambda hit: -hit[0])
    return hits[:limit]


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


def batch_public(store_id: str, batch_id: str, files: list[StoreFile]) -> dict[str, Any]:
    """A file batch as OpenAI shows it, made from its files: ``in_progress`` while any is,
    ``cancelled`` if any was cancelled, ``failed`` if every file failed, ``completed`` otherwise."""
    counts = {s: sum(f.status == s for f in files) for s in ("in_progress", "completed", "failed", "cancelled")}
    status = ("in_progress" if counts["in_progress"] else "cancelled" if counts["cancelled"]
              else "failed" if counts["failed"] == len(files) else "completed")
    return {"id": batch_id, "object": "vector_store.files_batch", "created_at": min(f.created_at for f in files),
            "vector_store_id": store_id, "status": status, "file_counts": {**counts, "total": len(files)}}


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
    batch_id = f"vsfb_{secrets.token_hex(12)}"
    added = [await _add(request, caller, store, info, attributes, sizes, batch_id) for info, attributes, sizes in checked]
    return JSONResponse(batch_public(store.id, batch_id, added))


async def _batch(request: Request) -> tuple[VectorStore, str, list[StoreFile]]:
    owner, _ = _owner(request)
    store = await _owned(request, owner)
    batch_id = request.path_params["batch_id"]
    files = [f for f in await _store(request).files(store.id) if f.batch_id == batch_id]
    if not files:
        raise not_found(f"no file batch '{batch_id[:80]}' in this vector store", "batch_id", "batch_not_found")
    return store, batch_id, files


async def get_batch(request: Request) -> Response:
    store, batch_id, files = await _batch(request)
    return JSONResponse(batch_public(store.id, batch_id, files))


async def cancel_batch(request: Request) -> Response:
    """POST .../file_batches/{batch_id}/cancel: its files not read yet are ``cancelled`` (and not
    read); those read keep their chunks."""
    store, batch_id, files = await _batch(request)
    for f in files:
        if f.status == "in_progress":
            await _store(request).cancel(f)
    now = [f for f in await _store(request).files(store.id) if f.batch_id == batch_id]
    return JSONResponse(batch_public(store.id, batch_id, now or files))


async def list_batch_files(request: Request) -> Response:
    _, _, files = await _batch(request)
    return _file_page(request, files)
