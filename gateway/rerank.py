"""Reranking and scoring, as ``vllm serve`` answers them: ``POST /v1/rerank`` (also ``/rerank``
and ``/v2/rerank``, the Jina and Cohere shapes RAG frameworks call) orders documents by how well
each answers a query; ``POST /v1/score`` (and ``/score``) scores text pairs.

Either runs on a reranker (``kind: rerank``, a cross-encoder: each pair read together,
``workers.rerank``) or on an embedding model (``kind: embed``: the cosine similarity of the two
texts' embeddings, as vLLM scores with one). ``plan_scores`` checks a request and tokenizes its
pairs before it takes a slot; ``serve_scores`` (the serving core) runs them in passes shared with
the other requests waiting.

* ``/v1/rerank``: ``query``, ``documents`` (strings, or ``{"text": ...}`` objects as Cohere's v1
  and Jina's clients send), ``top_n`` (0 or none: all), ``return_documents`` (default true),
  ``max_tokens_per_doc`` (0: whole documents). Results come best first, each with its index in
  ``documents`` and its ``relevance_score``.
* ``/v1/score``: a first side (``text_1``, ``queries`` or ``data_1``) and a second (``text_2``,
  ``documents``, ``items`` or ``data_2``), each a string or strings: one first text is scored
  against every second one, or the two lists pairwise when they are the same length.
* ``use_activation`` (vLLM's): false gives a cross-encoder's raw logit instead of its sigmoid (a
  cosine has no activation). ``max_tokens_per_doc`` applies on either kind of model.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from accounts.rates import Ask
from gateway.auth import Caller
from gateway.errors import bad_request
from gateway.http import answered
from gateway.request_log import new_id
from gateway.schemas import _Body, parse
from gateway.service import Services
from gateway.serving import Gone, Serving, in_thread, weightless
from workers.embed import EmbedWorker, InputError
from workers.rerank import PairRow, QueryError, RerankWorker

KINDS = ("rerank", "embed")


class DocumentText(_Body):
    text: str


class RerankRequest(_Body):
    model: str = Field(min_length=1)
    query: str
    documents: str | list[str | DocumentText]
    top_n: int | None = Field(default=None, ge=0)  # 0 or None: every document
    return_documents: bool = True
    max_tokens_per_doc: int = Field(default=0, ge=0)
    use_activation: bool | None = None
    user: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) for each document, in order; 400 naming the field otherwise."""
        docs = [self.documents] if isinstance(self.documents, str) else self.documents
        if not docs:
            raise bad_request("documents must not be an empty list", "documents")
        texts = [d if isinstance(d, str) else d.text for d in docs]
        _check_texts("query", [self.query], single=True)
        _check_texts("documents", texts, single=isinstance(self.documents, str))
        return [(self.query, text) for text in texts]


def _check_texts(field: str, texts: list[str], single: bool) -> None:
    """400 naming ``field`` (or its item) for an empty text: there is nothing to score."""
    for i, text in enumerate(texts):
        if not text.strip():
            where = field if single else f"{field}[{i}]"
            raise bad_request(f"{where} is an empty string", where)


FIRST, SECOND = ("text_1", "queries", "data_1"), ("text_2", "documents", "items", "data_2")


class ScoreRequest(_Body):
    model: str = Field(min_length=1)
    text_1: str | list[str] | None = None
    queries: str | list[str] | None = None
    data_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_2: str | list[str] | None = None
    max_tokens_per_doc: int = Field(default=0, ge=0)
    use_activation: bool | None = None
    user: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """The (first, second) pairs to score, in order; 400 naming the field otherwise."""
        sides = []
        for names in (FIRST, SECOND):
            given = [n for n in names if getattr(self, n) is not None]
            if len(given) != 1:
                raise bad_request(f"give one of {', '.join(names)}" + (f", not {len(given)}" if given else ""),
                                  names[0], "missing_required_parameter" if not given else "invalid_value")
            value = getattr(self, given[0])
            texts = [value] if isinstance(value, str) else value
            _check_texts(given[0], texts, single=isinstance(value, str))
            sides.append((given[0], texts))
        (one, first), (two, second) = sides
        if not first or not second:
            empty = one if not first else two
            raise bad_request(f"{empty} must not be an empty list", empty)
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise bad_request(f"{one} has {len(first)} texts and {two} {len(second)}: one, or as many as {two}", one)
        return list(zip(first, second))


@dataclass(frozen=True)
class ScoreJob:
    """A checked request: the model and its kind, and its inputs tokenized. A reranker's
    ``pieces`` are one list per pair; an embedding model's ``ids`` are each distinct text's, and
    ``pairs`` index them."""

    model: str
    kind: str
    tokens: int
    activation: bool | None = None
    pieces: list[list[PairRow]] | None = None
    ids: list[list[int]] | None = None
    pairs: list[tuple[int, int]] | None = None


async def plan_scores(svc: Services, model: str, pairs: list[tuple[str, str]], max_tokens_per_doc: int,
                      activation: bool | None, params: tuple[str, str]) -> ScoreJob:
    """The job of scoring ``pairs`` on ``model``; 404 for an unknown model, 400 for a model of
    another kind, more pairs than ``limits.rerank_max_documents``, more tokens than
    ``limits.rerank_max_tokens``, or a text too long (naming ``params``: the fields of the
    pairs' first and second texts). Needs no weights."""
    first, param = params
    spec = svc.spec(model, KINDS)
    limits = svc.config.limits
    if len(pairs) > limits.rerank_max_documents:
        raise bad_request(f"{len(pairs)} documents, above this server's limit of {limits.rerank_max_documents} "
                          "per request", param, "too_many_inputs")
    too_long = f"above this server's limit of {limits.rerank_max_tokens} tokens per request"
    chars = sum(len(a) + len(b) for a, b in pairs)
    if chars > 32 * limits.rerank_max_tokens:
        raise bad_request(f"the texts are {chars} characters, {too_long}", param, "too_many_tokens")
    try:
        if spec.kind == "rerank":
            job = await _plan_pairs(svc, spec, pairs, max_tokens_per_doc, activation)
        else:
            job = await _plan_embedded(svc, spec, pairs, max_tokens_per_doc)
    except InputError as exc:
        raise bad_request(str(exc), first if isinstance(exc, QueryError) else param,
                          "context_length_exceeded" if exc.too_long else "invalid_value") from None
    if job.tokens > limits.rerank_max_tokens:
        raise bad_request(f"the pairs are {job.tokens} tokens, {too_long}", param, "too_many_tokens")
    return job


async def _plan_pairs(svc: Services, spec, pairs: list[tuple[str, str]], max_tokens: int,
                      activation: bool | None) -> ScoreJob:
    reader = await weightless(svc.encoders, spec, RerankWorker.reader)
    groups: dict[str, list[int]] = {}  # the pairs of each first text: tokenized together
    for i, (query, _) in enumerate(pairs):
        groups.setdefault(query, []).append(i)

    def tokenize() -> list[list[PairRow]]:
        pieces: list[list[PairRow]] = [[] for _ in pairs]
        for query, at in groups.items():
            for i, doc in zip(at, reader.tokenize(query, [pairs[i][1] for i in at], max_tokens)):
                pieces[i] = doc
        return pieces

    pieces = await asyncio.to_thread(tokenize)
    return ScoreJob(spec.name, "rerank", sum(len(p) for doc in pieces for p in doc), activation, pieces=pieces)


async def _plan_embedded(svc: Services, spec, pairs: list[tuple[str, str]], max_tokens: int) -> ScoreJob:
    """Each distinct text embedded once (a second text cut to ``max_tokens`` when > 0); the two
    sides tokenized apart, so that an error names its side (``QueryError``: the first)."""
    encoder = await weightless(svc.encoders, spec, EmbedWorker.reader)
    firsts = list(dict.fromkeys(a for a, _ in pairs))
    seconds = list(dict.fromkeys(b for _, b in pairs))

    def tokenize(texts: list[str], error: type[InputError], truncate: int | None) -> list[list[int]]:
        try:
            return encoder.tokenize(texts, truncate)
        except InputError as exc:  # "input[k] is ...": named by its text, k counts distinct texts
            raise error(re.sub(r"^input\[(\d+)\]", lambda m: repr(texts[int(m.group(1))][:40]), str(exc)),
                        exc.too_long) from None

    def both() -> tuple[list[list[int]], list[list[int]]]:
        return tokenize(firsts, QueryError, None), tokenize(seconds, InputError, max_tokens or None)

    head, tail = await asyncio.to_thread(both)
    at_first, at_second = {t: i for i, t in enumerate(firsts)}, {t: len(firsts) + i for i, t in enumerate(seconds)}
    ids = head + tail
    return ScoreJob(spec.name, "embed", sum(len(row) for row in ids), ids=ids,
                    pairs=[(at_first[a], at_second[b]) for a, b in pairs])


async def serve_scores(svc: Services, caller: Caller, job: ScoreJob, endpoint: str, gone: Gone | None) -> np.ndarray:
    """The serving core: one score per pair, in order. The gate counts the job's tokens."""
    async with Serving(svc, caller, job.model, job.tokens, endpoint, gone, Ask(tokens=job.tokens)) as serving:
        serving.usage.embedding_tokens = job.tokens
        worker = serving.worker
        if job.kind == "rerank":
            return await serving.step(lambda ctx: in_thread(lambda: worker.score(job.pieces, ctx, job.activation), ctx),
                                      "scoring with")
        vectors = await serving.step(lambda ctx: in_thread(lambda: worker.embed(job.ids, None, ctx), ctx),
                                     "scoring with")
    return cosines(vectors, job.pairs)


def cosines(vectors: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """The cosine similarity of each pair of ``vectors`` (by index)."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    a, b = (np.array(side) for side in zip(*pairs))
    return np.einsum("ij,ij->i", unit[a], unit[b])


def rerank_results(body: RerankRequest, scores: np.ndarray, tokens: int) -> dict:
    """vLLM's (and Jina's) rerank response: the documents best first, ``top_n`` of them."""
    texts = [doc for _, doc in body.pairs()]
    order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))[: body.top_n or None]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{new_id()}", "model": body.model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def score_list(model: str, scores: np.ndarray, tokens: int, created: int) -> dict:
    """vLLM's score response: one ``score`` object per pair, in order."""
    return {"id": f"score-{new_id()}", "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


async def rerank_answer(svc: Services, caller: Caller, data: dict, gone: Gone | None) -> dict:
    """The answer to a rerank request's JSON ``data`` (a live request's, or a batch line's)."""
    body = parse(RerankRequest, data)
    job = await plan_scores(svc, body.model, body.pairs(), body.max_tokens_per_doc, body.use_activation,
                            ("query", "documents"))
    return rerank_results(body, await serve_scores(svc, caller, job, "rerank", gone), job.tokens)


async def score_answer(svc: Services, caller: Caller, data: dict, gone: Gone | None) -> dict:
    """The answer to a score request's JSON ``data`` (a live request's, or a batch line's)."""
    body = parse(ScoreRequest, data)
    pairs = body.pairs()
    sides = tuple(next(n for n in side if getattr(body, n) is not None) for side in (FIRST, SECOND))
    job = await plan_scores(svc, body.model, pairs, body.max_tokens_per_doc, body.use_activation, sides)
    return score_list(body.model, await serve_scores(svc, caller, job, "score", gone), job.tokens, int(time.time()))


# -- HTTP -------------------------------------------------------------------------------------------


async def rerank(request: Request) -> Response:
    """POST /v1/rerank, /rerank, /v2/rerank."""
    return await answered(request, rerank_answer)


async def score(request: Request) -> Response:
    """POST /v1/score, /score."""
    return await answered(request, score_answer)
