"""Vector search: how a vector store's chunks are ranked for a query, and the stores this process
keeps loaded for it.

* Filters on a file's ``attributes`` (OpenAI's comparison and compound filters): ``check_filter``
  refuses a malformed one with a 400 naming its part, ``matches`` applies one.
* ``Matrix``: a store's completed files' chunks as one matrix of unit vectors, with their texts
  and, made on first use, their words (``Words``, BM25).
* ``rank``: every chunk scored against the queries, ``(1 + cosine) / 2`` with the closest, or with
  ``hybrid_search`` that ranking fused with BM25's by reciprocal rank; filtered, cut, best first.
  A pure function of its arguments.
* ``Shelf`` (one per process, ``SHELF``): the matrices loaded, each loaded again only when its
  store's completed files changed.
* ``search_stores``: the queries embedded (a request of the caller, through the gate), then ranked.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.auth import Caller
from gateway.embeddings import EmbedJob, serve_embeddings
from gateway.errors import APIError, bad_request
from gateway.schemas import INT64
from gateway.service import Services
from gateway.serving import weightless
from gateway.vector_store import Chunks, StoreFile, VectorStore, VectorStoreStore
from workers.embed import EmbedWorker

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
    value = f["value"]
    ok = (isinstance(value, list) and all(map(_scalar, value))) if kind in ("in", "nin") else _scalar(value)
    if not ok:
        raise bad_request(f"the value of a '{kind}' filter is {'a list of ' if kind in ('in', 'nin') else 'a '}"
                          "string, number (an integer fits in 64 bits) or boolean", f"{param}.value", "invalid_filter")


def _scalar(value: Any) -> bool:
    """A value an attribute can have: a string, a boolean, a float or a 64-bit integer."""
    return isinstance(value, (str, float, bool)) or type(value) is int and INT64[0] <= value <= INT64[1]


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
ACTIVE_EVERY_S = 60  # how stale a store's last_active_at may be before a search writes it
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


@dataclass
class _Kept:
    version: int  # the store's version when ``files`` was read
    matrix: Matrix
    files: dict[str, StoreFile]  # its completed files, as read then


class Shelf:
    """The vector stores this process has loaded for search (``Matrix``), the least recently
    searched dropped past ``budget`` bytes of vectors. Any process may change a store (Redis), so
    each search reads the store's version (one read): while it holds, the copy is current; when it
    moved, the files' records are read, and the chunks only if the completed files changed (a file
    added, read again or removed; new attributes need only the records). One per process
    (``SHELF``)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: OrderedDict[tuple[int, str], _Kept] = OrderedDict()

    async def load(self, stores: VectorStoreStore, store_id: str) -> tuple[Matrix, dict[str, StoreFile]]:
        place = (id(stores), store_id)
        version = await stores.version(store_id)
        kept = self._kept.get(place)
        if kept is None or version is None or kept.version != version:
            files = [f for f in await stores.files(store_id) if f.status == "completed"]
            key = tuple((f.id, f.token) for f in files)
            m = kept.matrix if kept is not None and kept.matrix.key == key else Matrix.of(await stores.chunks(store_id))
            kept = _Kept(version if version is not None else -1, m, {f.id: f for f in files})
            self._kept[place] = kept
        self._kept.move_to_end(place)
        while sum(k.matrix.vectors.nbytes for k in self._kept.values()) > self.budget and len(self._kept) > 1:
            self._kept.popitem(last=False)
        return kept.matrix, kept.files


SHELF = Shelf(1 << 30)


def _unit(m: np.ndarray) -> np.ndarray:
    m = m.astype(np.float32, copy=False)
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return m / np.where(norms == 0, 1.0, norms)


async def search_stores(svc: Services, stores: VectorStoreStore, caller: Caller, found: list[VectorStore],
                        queries: list[str], filters: dict[str, Any] | None, limit: int, threshold: float,
                        param: str = "query", hybrid: tuple[float, float] | None = None,
                        cut: bool = False) -> list[tuple[float, StoreFile, str]]:
    """The best ``limit`` chunks of the vector stores ``found`` for ``queries`` (``rank``, off the
    event loop), best first. The queries are embedded with each store's model as one request of
    ``caller``, through the gate; one over the model's context is a 400 naming ``param``, or with
    ``cut`` (queries a model wrote) embedded as far as the context goes. Each store searched is
    active now: its expiry counts from here (``last_active_at`` is written when it is
    ``ACTIVE_EVERY_S`` old or more)."""
    hits: list[tuple[float, StoreFile, str]] = []
    for model in dict.fromkeys(store.model for store in found):
        encoder = await encoder_of(svc, model)
        try:
            ids = await asyncio.to_thread(_query_ids, encoder, queries, cut)
        except ValueError as exc:
            raise bad_request(str(exc).replace("input", "query"), param, "context_length_exceeded") from None
        vectors = await serve_embeddings(svc, caller, EmbedJob(model, ids, None), None)
        for store in found:
            if store.model == model:
                m, files = await SHELF.load(stores, store.id)
                hits += await asyncio.to_thread(rank, m, files, vectors, filters, limit, threshold, hybrid, queries)
    now = int(time.time())
    for store in found:  # expiry is in days: a store searched all day is written once a minute, not per search
        if now - store.last_active_at >= ACTIVE_EVERY_S:
            await stores.touch(store.id, store.owner, now)  # (not the store as read: an update meanwhile stays)
    hits.sort(key=lambda hit: -hit[0])
    return hits[:limit]


def _query_ids(encoder: EmbedWorker, queries: list[str], cut: bool) -> list[list[int]]:
    """(thread) The queries' token ids (``EmbedWorker.tokenize``); with ``cut``, each cut to the
    model's context (its special tokens kept) rather than refused."""
    if cut and all(queries):
        tokenizer = encoder.tokenizer  # (read under the reader's lock, which the call below takes too)
        with encoder._tokenizing:
            queries = tokenizer(list(queries), add_special_tokens=True, truncation=True,
                                max_length=encoder.config.context_length)["input_ids"]
    return encoder.tokenize(queries)


async def encoder_of(svc: Services, model: str) -> EmbedWorker:
    """The embedding model ``model``'s reader (tokenizer, config; no weights); 503 when tiers.yaml
    no longer has that model (a vector store keeps the model it was made with)."""
    spec = svc.arbiter.specs.get(model)
    if spec is None or spec.kind != "embed":
        raise APIError(503, f"the vector store's embedding model '{model}' is not served here", "model_unavailable")
    return await weightless(svc.encoders, spec, EmbedWorker.reader)
