"""Classification: vLLM's ``POST /classify`` (also ``/v1/classify``) on a sequence classifier
(``kind: moderation`` in tiers.yaml: any ``AutoModelForSequenceClassification`` folder, its
labels the config's ``id2label``).

``plan_classify`` checks a request and tokenizes each input whole (a text, or token ids),
``serve_classify`` (the serving core, shared with batch lines) runs the rows through the model in
the encoders' shared passes, and ``classify_list`` renders vLLM's answer: per input the label
with the highest score, every label's score (``probs``: a sigmoid per label where the model is
multi-label or has one label, softmax over them otherwise, as /v1/moderations reads them; raw
logits with ``use_activation: false``) and ``num_classes``.

Unlike moderation, an input is one distribution, so it is never read in pieces: longer than the
model's context it is refused, or cut by ``truncate_prompt_tokens`` (``truncation_side``), as
vLLM answers it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

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
from workers.embed import InputError
from gateway.moderations import checked_size
from workers.moderation import ModerationWorker


class ClassifyRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]  # a text, texts, a token array, token arrays
    model: str | None = Field(default=None, min_length=1)  # optional, as vLLM's: the first classifier
    user: str | None = None
    # keep at most this many tokens of each input (-1: the model's context), from its start
    # (truncation_side right, the default) or its end (left), rather than refusing a longer one
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    use_activation: bool | None = None  # false: each label's raw logit


@dataclass(frozen=True)
class ClassifyJob:
    """A checked request: the model, its labels, each input's token ids, the activation asked."""

    model: str
    labels: list[str]
    rows: list[list[int]]
    activation: bool

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.rows)


async def plan_classify(svc: Services, body: ClassifyRequest) -> ClassifyJob:
    """The job of ``body``; 404 for an unknown model (or none configured), 400 naming ``input``
    for an empty input, one over the context (without ``truncate_prompt_tokens``), more inputs
    than ``limits.moderation_max_inputs`` or more tokens than ``limits.moderation_max_tokens``.
    Needs no weights."""
    spec = svc.spec(body.model, "moderation") if body.model is not None else \
        svc.first_spec("moderation", "classification model (kind: moderation)")
    inputs = _inputs(body.input)
    limits = svc.config.limits
    too_long = checked_size(limits, inputs, "classification")
    reader = await weightless(svc.encoders, spec, ModerationWorker.reader)
    truncate = body.truncate_prompt_tokens
    if truncate is not None:
        context = reader.context_length
        if truncate > context or truncate == 0:
            raise bad_request(f"truncate_prompt_tokens is {truncate}: 1 to this model's context length of {context}, "
                              "or -1 for all of it", "truncate_prompt_tokens")
        truncate = context if truncate == -1 else truncate
    try:
        rows = await asyncio.to_thread(reader.rows, inputs, truncate, body.truncation_side or "right")
    except InputError as exc:
        raise bad_request(str(exc), "input", "context_length_exceeded" if exc.too_long else "invalid_value") from None
    job = ClassifyJob(spec.name, reader.categories, rows, body.use_activation is not False)
    if job.tokens > limits.moderation_max_tokens:
        raise bad_request(f"input is {job.tokens} tokens, {too_long}", "input", "too_many_tokens")
    return job


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """The inputs: a string or a token array is one."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be an empty list", "input")
    return [value] if isinstance(value[0], int) else value  # type: ignore[list-item]


async def serve_classify(svc: Services, caller: Caller, job: ClassifyJob, gone: Gone | None) -> np.ndarray:
    """The serving core: each input's scores per label. The gate counts the job's tokens."""
    async with Serving(svc, caller, job.model, job.tokens, "classify", gone, Ask(tokens=job.tokens)) as serving:
        serving.usage.embedding_tokens = job.tokens
        worker: ModerationWorker = serving.worker
        return await serving.step(lambda ctx: in_thread(lambda: worker.probs(job.rows, ctx, job.activation), ctx),
                                  "classifying with")


def classify_list(job: ClassifyJob, probs: np.ndarray) -> dict:
    """vLLM's classification response: per input its likeliest label, every label's score, and
    how many labels there are."""
    data = [{"index": i, "label": job.labels[int(np.argmax(row))], "probs": row.tolist(), "num_classes": len(row)}
            for i, row in enumerate(probs)]
    return {"id": f"classify-{new_id()}", "object": "list", "created": int(time.time()), "model": job.model,
            "data": data, "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens, "completion_tokens": 0}}


async def classify_answer(svc: Services, caller: Caller, data: dict, gone: Gone | None) -> dict:
    """The answer to a classification request's JSON ``data`` (a live request's, or a batch line's)."""
    job = await plan_classify(svc, parse(ClassifyRequest, data))
    return classify_list(job, await serve_classify(svc, caller, job, gone))


# -- HTTP -------------------------------------------------------------------------------------------


async def classify(request: Request) -> Response:
    """POST /classify, /v1/classify."""
    return await answered(request, classify_answer)
