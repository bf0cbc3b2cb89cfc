"""Moderations: ``plan_moderation`` checks a request and tokenizes its texts, ``serve_moderation``
(the serving core, shared with batch lines) scores them on a moderation model, and
``moderations`` (POST /v1/moderations) renders OpenAI's answer: one result per input string, or one
for an array of content parts (moderated together, as OpenAI does).

The model is optional, as OpenAI's is: without one the first moderation model of tiers.yaml
serves. Image parts are refused: these models read text only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from accounts.rates import Ask
from gateway.auth import Caller
from gateway.config import LimitsConfig
from gateway.errors import bad_request
from gateway.http import disconnect_signal
from gateway.request_log import new_id
from gateway.schemas import TextPart, _Body, parse, part_type, read_json, tagged
from gateway.service import Services
from gateway.serving import Gone, Serving, in_thread, weightless
from workers.base import ModelSpec
from workers.embed import InputError
from workers.moderation import ModerationWorker


class _ImageUrl(_Body):
    url: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: _ImageUrl


Part = tagged(("TextPart", TextPart), ("ImagePart", ImagePart), by=part_type({"image_url": "ImagePart"}, "TextPart"))
Input = tagged(("Text", str), ("Texts", list[str]), ("Parts", list[Part]),
               by=lambda v: ("Parts" if v and isinstance(v[0], dict) else "Texts") if isinstance(v, list) else "Text")


class ModerationRequest(_Body):
    input: Input  # a text, texts (a result each), or content parts (one result)
    model: str | None = Field(default=None, min_length=1)

    @field_validator("input", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        """A part of another type is named as such, not as "not a valid string"."""
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else "text"
            if kind not in ("text", "image_url"):
                raise ValueError(f"content parts of type {str(kind)[:40]!r} are not supported: moderation takes "
                                 "parts of type 'text' (and 'image_url', which these models refuse)")
        return value


@dataclass(frozen=True)
class ModerationJob:
    """A checked request: the model, its categories and threshold, each text's pieces' token ids."""

    model: str
    categories: list[str]
    threshold: float
    pieces: list[list[list[int]]]

    @property
    def tokens(self) -> int:
        return sum(len(piece) for text in self.pieces for piece in text)


async def plan_moderation(svc: Services, body: ModerationRequest) -> ModerationJob:
    """The job of ``body``; 404 for an unknown model (or none configured), 400 naming ``input``
    for an empty text, an image part, more inputs than ``limits.moderation_max_inputs`` or more
    tokens than ``limits.moderation_max_tokens`` (refused unread above 32 characters a token).
    Needs no weights."""
    spec = _model(svc, body.model)
    texts = _texts(body.input)
    limits = svc.config.limits
    too_long = checked_size(limits, texts, "moderation")
    reader = await weightless(svc.encoders, spec, ModerationWorker.reader)
    try:
        pieces = await asyncio.to_thread(reader.tokenize, texts)
    except InputError as exc:
        raise bad_request(str(exc), "input") from None
    job = ModerationJob(spec.name, reader.categories, reader.threshold, pieces)
    if job.tokens > limits.moderation_max_tokens:
        raise bad_request(f"input is {job.tokens} tokens, {too_long}", "input", "too_many_tokens")
    return job


def checked_size(limits: LimitsConfig, inputs: list[str] | list[list[int]], what: str) -> str:
    """Refuse (400 naming ``input``) more inputs than ``limits.moderation_max_inputs``, or texts
    longer than 32 characters a token allows under ``limits.moderation_max_tokens``, before any is
    read; the words that refuse more tokens, once they are counted."""
    if len(inputs) > limits.moderation_max_inputs:
        raise bad_request(f"input has {len(inputs)} items, above this server's limit of "
                          f"{limits.moderation_max_inputs} per request", "input", "too_many_inputs")
    too_long = f"above this server's limit of {limits.moderation_max_tokens} tokens per {what} request"
    chars = sum(len(t) for t in inputs if isinstance(t, str))
    if chars > 32 * limits.moderation_max_tokens:
        raise bad_request(f"input is {chars} characters, {too_long}", "input", "too_many_tokens")
    return too_long


def _model(svc: Services, name: str | None) -> ModelSpec:
    if name is not None:
        return svc.spec(name, "moderation")
    return svc.first_spec("moderation", "moderation model")


def _texts(value: str | list[str] | list[TextPart | ImagePart]) -> list[str]:
    """The texts to score: each string its own; an array of parts one text, its texts joined."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be an empty list", "input")
    if isinstance(value[0], str):
        return value
    for i, part in enumerate(value):
        if isinstance(part, ImagePart):
            raise bad_request("this server's moderation models read text only: send the image's text, "
                              "or leave the image out", f"input[{i}]", "image_not_supported")
    return ["\n".join(part.text for part in value)]


async def serve_moderation(svc: Services, caller: Caller, job: ModerationJob, gone: Gone | None) -> np.ndarray:
    """The serving core: each text's score per category. The gate counts the job's tokens."""
    async with Serving(svc, caller, job.model, job.tokens, "moderations", gone, Ask(tokens=job.tokens)) as serving:
        worker: ModerationWorker = serving.worker
        return await serving.step(lambda ctx: in_thread(lambda: worker.classify(job.pieces, ctx), ctx),
                                  "moderating with")


def moderation_results(job: ModerationJob, scores: np.ndarray) -> dict:
    """OpenAI's moderation object: per text, each category flagged at ``threshold`` or more, its
    score, and the input types it was read from (text, always)."""
    results = []
    for row in scores:
        flags = {c: bool(s >= job.threshold) for c, s in zip(job.categories, row.tolist())}
        results.append({"flagged": any(flags.values()), "categories": flags,
                        "category_scores": dict(zip(job.categories, row.tolist())),
                        "category_applied_input_types": {c: ["text"] for c in job.categories}})
    return {"id": f"modr-{new_id()}", "model": job.model, "results": results}


# -- HTTP -------------------------------------------------------------------------------------------


async def moderations(request: Request) -> Response:
    """POST /v1/moderations."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ModerationRequest, await read_json(request, svc.config.limits.max_body))
    job = await plan_moderation(svc, body)
    async with disconnect_signal(request) as gone:
        scores = await serve_moderation(svc, caller, job, gone)
    return JSONResponse(moderation_results(job, scores), headers=svc.gate.rate_headers(caller.tier))
