"""Embeddings: ``plan_embeddings`` checks a request and turns its input into token ids,
``serve_embeddings`` (the serving core, shared with batch lines) runs them through the model in one
forward pass, and ``embeddings`` (POST /v1/embeddings) renders OpenAI's list of vectors, as floats
or as base64 (little-endian float32 bytes, as OpenAI sends them)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from accounts.rates import Ask
from gateway.auth import Caller
from gateway.errors import bad_request
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
        raise bad_request(f"input has {len(inputs)} items, above this server's limit of {cap} per request",
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
