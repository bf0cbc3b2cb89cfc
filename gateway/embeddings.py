"""Embeddings: ``plan_embeddings`` checks a request and turns its input into token ids,
``serve_embeddings`` (the serving core, shared with batch lines) runs them through the model in one
forward pass, and ``embeddings`` (POST /v1/embeddings) renders OpenAI's list of vectors, as floats
or as base64 (little-endian float32 bytes, as OpenAI sends them).

``cohere_embed`` (POST /v2/embed, as ``vllm serve`` has it, and v1's /v1/embed) is Cohere's embed API on the same core:
``texts`` with an ``input_type``, which puts the model's instruction of that name before each text
(``EmbedConfig.prompts``: vLLM's rule; ``search_query`` and ``search_document`` also find a
``query``, ``document`` or ``passage`` one, and Cohere's five names find none on a model without
them: the texts go as written), ``output_dimension``, ``truncate`` (``END`` keeps each text's start,
``START`` its end, to ``max_tokens`` or the context; ``NONE`` refuses a longer one) and
``embedding_types`` (``float``, ``base64``, and ``binary`` / ``ubinary``: one bit per value, set
where it is >= 0, eight to a byte, as vLLM packs them)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from accounts.rates import Ask
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.http import disconnect_signal
from gateway.schemas import _Body, parse, read_json
from gateway.service import Services
from gateway.serving import Gone, Serving, in_thread, weightless
from workers.embed import EmbedWorker, InputError

EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]  # a text, texts, a token array, token arrays
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's: keep at most this many tokens of each input (-1: the model's context), from its start
    # (truncation_side right, the default) or its end (left), rather than refusing a longer one
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None


@dataclass(frozen=True)
class EmbedJob:
    """A checked request: the model, each input's token ids, and the vector length asked for."""

    model: str
    ids: list[list[int]]
    dimensions: int | None  # None: the model's full length

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.ids)


async def plan_embeddings(svc: Services, body: EmbeddingRequest) -> EmbedJob:
    """The job of ``body``; 404 for an unknown model, 400 naming ``input`` for an empty input, one
    over the model's context or more inputs than ``limits.embed_max_inputs``, 400 naming
    ``dimensions`` where the model does not allow that length. Needs no weights."""
    spec = svc.spec(body.model, "embed")
    inputs = _inputs(body.input)
    cap = svc.config.limits.embed_max_inputs
    if len(inputs) > cap:
        # how to batch too: LangChain's OpenAIEmbeddings sends 1000 a request by default (OpenAI takes 2048)
        raise bad_request(f"input has {len(inputs)} items, above this server's limit of {cap} per request: send them "
                          f"in batches of at most {cap} (LangChain's OpenAIEmbeddings: chunk_size={cap})",
                          "input", "too_many_inputs")
    encoder = await weightless(svc.encoders, spec, EmbedWorker.reader)
    dimensions = body.dimensions
    if dimensions == encoder.config.dimensions:
        dimensions = None  # the full length is always allowed
    elif dimensions is not None:
        try:
            encoder.config.check_dimensions(dimensions)
        except ValueError as exc:
            raise bad_request(str(exc), "dimensions", "dimensions_not_supported") from None
    truncate = body.truncate_prompt_tokens
    if truncate is not None:
        context = encoder.config.context_length
        if truncate > context or truncate == 0:
            raise bad_request(f"truncate_prompt_tokens is {truncate}: 1 to this model's context length of {context}, "
                              "or -1 for all of it", "truncate_prompt_tokens")
        truncate = context if truncate == -1 else truncate
    side = body.truncation_side or "right"
    try:  # to_thread: half anyio.to_thread's cost per request
        ids = await asyncio.to_thread(encoder.tokenize, inputs, truncate, side)
    except InputError as exc:
        raise bad_request(str(exc), "input", "context_length_exceeded" if exc.too_long else "invalid_value") from None
    return EmbedJob(spec.name, ids, dimensions)


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """The request's inputs as a list of texts or a list of token arrays."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be an empty list", "input")
    if isinstance(value[0], int):
        return [value]  # one token array
    return value


async def serve_embeddings(svc: Services, caller: Caller, job: EmbedJob, gone: Gone | None) -> np.ndarray:
    """The serving core: one float32 vector per input, in order. The gate counts the job's tokens."""
    async with Serving(svc, caller, job.model, job.tokens, "embeddings", gone, Ask(tokens=job.tokens)) as serving:
        serving.usage.embedding_tokens = job.tokens
        worker: EmbedWorker = serving.worker
        return await serving.step(lambda ctx: in_thread(lambda: worker.embed(job.ids, job.dimensions, ctx), ctx),
                                  "embedding with")


def embedding_list(model: str, vectors: np.ndarray, encoding: EncodingFormat, tokens: int) -> dict:
    """OpenAI's ``list`` of ``embedding`` objects with its usage."""
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, encoding: EncodingFormat) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()  # each float32 exactly, as a double


# -- Cohere's embed API ---------------------------------------------------------------------------

COHERE_INPUT_TYPES = ("search_document", "search_query", "classification", "clustering", "image")
# where a model names its instructions otherwise (E5's "query" / "passage", ...)
PROMPT_NAMES = {"search_query": ("search_query", "query"),
                "search_document": ("search_document", "document", "passage")}


class CohereEmbedRequest(_Body):
    model: str | None = Field(default=None, min_length=1)  # required on v2; v1's default: the first embedding model
    input_type: str | None = None
    texts: list[str] | None = None
    images: list[Any] | None = None
    inputs: list[Any] | None = None
    output_dimension: int | None = Field(default=None, ge=1)
    embedding_types: list[Literal["float", "base64", "binary", "ubinary"]] | None = Field(default=None, min_length=1)
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(default=None, ge=1)
    priority: int | None = None  # accepted; the key's tier orders requests here


def instruction(prompts: dict[str, str], input_type: str | None) -> str:
    """What goes before each text of ``input_type`` (module doc); 400 naming it for a name the
    model has no instruction for and Cohere does not define."""
    if input_type is None:
        return ""
    for name in PROMPT_NAMES.get(input_type, (input_type,)):
        if name in prompts:
            return prompts[name]
    if input_type in COHERE_INPUT_TYPES:
        return ""
    known = ", ".join(sorted(prompts)) or "none"
    raise bad_request(f"input_type {input_type!r} is not one of Cohere's ({', '.join(COHERE_INPUT_TYPES)}) nor an "
                      f"instruction of this model (it has: {known})", "input_type")


def typed_embeddings(vectors: np.ndarray, types: list[str]) -> dict[str, Any]:
    """Cohere's ``embeddings`` object: the vectors as each type asks."""
    out: dict[str, Any] = {}
    for kind in types:
        if kind == "float":
            out[kind] = vectors.tolist()
        elif kind == "base64":
            out[kind] = [_encoded(v, "base64") for v in vectors]
        else:
            bits = np.packbits(vectors >= 0, axis=-1)
            out[kind] = (bits.astype(np.int16) - 128 if kind == "binary" else bits).tolist()
    return out


_COHERE_PARAMS = {"input": "texts", "dimensions": "output_dimension", "truncate_prompt_tokens": "max_tokens"}


async def cohere_embed(request: Request) -> Response:
    """POST /v2/embed; and /v1/embed, Cohere's v1 ``Client.embed`` (``model`` optional: the first
    embedding model; without ``embedding_types`` the answer is v1's ``embeddings_floats``)."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    v1 = request.url.path == "/v1/embed"
    body = parse(CohereEmbedRequest, await read_json(request, svc.config.limits.max_body))
    if body.model is None:
        if not v1:
            raise bad_request("missing required parameter: model", "model", "missing_required_parameter")
        body.model = svc.first_spec("embed", "embedding model").name
    if body.images is not None or body.inputs is not None:
        raise bad_request("this server's embedding models read text: give texts", "images" if body.images else "inputs")
    if not body.texts:
        raise bad_request("texts must be a non-empty list", "texts", "missing_required_parameter")
    types = body.embedding_types or ["float"]
    encoder = await weightless(svc.encoders, svc.spec(body.model, "embed"), EmbedWorker.reader)
    if {"binary", "ubinary"} & set(types) and (body.output_dimension or encoder.config.dimensions) % 8:
        raise bad_request("binary embeddings pack 8 values to a byte: the length must be a multiple of 8",
                          "embedding_types")
    prefix = instruction(encoder.config.prompts, body.input_type)
    cut = None if body.truncate == "NONE" else body.max_tokens or -1
    try:
        job = await plan_embeddings(svc, EmbeddingRequest(
            model=body.model, input=[prefix + t for t in body.texts], dimensions=body.output_dimension,
            truncate_prompt_tokens=cut, truncation_side="left" if body.truncate == "START" else "right"))
    except APIError as exc:
        exc.param = _COHERE_PARAMS.get(exc.param or "", exc.param)
        raise
    if body.max_tokens is not None and body.truncate == "NONE":
        longest = max(len(row) for row in job.ids)
        if longest > body.max_tokens:
            raise bad_request(f"a text has {longest} tokens, above max_tokens ({body.max_tokens}); truncate "
                              "END or START cuts it", "texts", "context_length_exceeded")
    async with disconnect_signal(request) as gone:
        vectors = await serve_embeddings(svc, caller, job, gone)
    floats = v1 and body.embedding_types is None
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}",
                         "embeddings": vectors.tolist() if floats else typed_embeddings(vectors, types),
                         "texts": body.texts, "meta": {"api_version": {"version": "1" if v1 else "2"},
                                                       "billed_units": {"input_tokens": job.tokens}},
                         "response_type": "embeddings_floats" if floats else "embeddings_by_type"},
                        headers=svc.gate.rate_headers(caller.tier))


# -- HTTP -------------------------------------------------------------------------------------------


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(EmbeddingRequest, await read_json(request, svc.config.limits.max_body))
    job = await plan_embeddings(svc, body)
    async with disconnect_signal(request) as gone:
        vectors = await serve_embeddings(svc, caller, job, gone)
    return JSONResponse(embedding_list(body.model, vectors, body.encoding_format, job.tokens),
                        headers=svc.gate.rate_headers(caller.tier))
