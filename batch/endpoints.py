"""The endpoints a batch line can call: each checks the line's body as its HTTP endpoint does,
calls the same serving core (``gateway.chat.serve_chat``, ...) at the caller's tier with no one to
watch for, and returns the result for the output line: a JSON object (the response body), or
:class:`Binary` (speech audio), which the line stores base64-encoded with its content type."""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from gateway.audio import SpeechBody, plan_speech, serve_speech
from gateway.auth import Caller
from gateway.chat import checked_chat, collect, completion, serve_chat
from gateway.completions import completion_result
from gateway.embeddings import EmbeddingRequest, embedding_list, plan_embeddings, serve_embeddings
from gateway.errors import bad_request
from gateway.images import ImageGenerationRequest, b64_rows, encoded, plan_images, serve_images
from gateway.output_audio import say_replies
from gateway.messages import message_result
from gateway.moderations import ModerationRequest, moderation_results, plan_moderation, serve_moderation
from gateway.classify import classify_answer
from gateway.rerank import rerank_answer, score_answer
from gateway.responses import response_result
from gateway.schemas import parse
from gateway.service import Services


@dataclass(frozen=True)
class Binary:
    """A non-JSON result: its bytes and their content type."""

    data: bytes
    content_type: str


Result = dict[str, Any] | Binary
Endpoint = Callable[[Services, Caller, dict], Awaitable[Result]]


def line_body(result: Result) -> Any:
    """What an output line's ``response.body`` holds for ``result``."""
    if isinstance(result, Binary):
        return {"content_type": result.content_type, "encoding": "base64",
                "data": base64.b64encode(result.data).decode()}
    return result


async def chat(svc: Services, caller: Caller, data: dict) -> Result:
    body, job, voice = await checked_chat(svc, caller, data, in_batch=True)
    replies, tier = await collect(serve_chat(svc, caller, job, None))
    if voice is not None:
        await say_replies(svc, caller, voice, replies, None)
    return completion(f"chatcmpl-{body.request_id or uuid.uuid4().hex}", body.model, replies, tier, job, svc)


async def images(svc: Services, caller: Caller, data: dict) -> Result:
    body = parse(ImageGenerationRequest, data)
    if body.stream:
        raise bad_request("stream is not supported in a batch (a line's output is the image)", "stream")
    await svc.adapters.ready(body.model, body.adapters)
    job = plan_images(svc, body)
    if body.response_format == "url":  # a url is served to a live request's key for minutes
        raise bad_request("response_format 'url' is only for live requests; use b64_json", "response_format")
    images = await encoded(await serve_images(svc, caller, job, None), body)
    return {"created": int(time.time()), "data": b64_rows(images),
            **({"output_format": body.output_format} if body.output_format else {})}


async def speech(svc: Services, caller: Caller, data: dict) -> Result:
    body = parse(SpeechBody, data)
    if body.stream_format == "sse":
        raise bad_request("stream_format sse is not supported in a batch (a line's output is the audio file)",
                          "stream_format")
    job = await plan_speech(svc, body)
    audio = b"".join([piece async for piece in serve_speech(svc, caller, job, None)])
    return Binary(audio, job.media_type)


async def embeddings(svc: Services, caller: Caller, data: dict) -> Result:
    body = parse(EmbeddingRequest, data)
    job = await plan_embeddings(svc, body)
    vectors = await serve_embeddings(svc, caller, job, None)
    return embedding_list(body.model, vectors, body.encoding_format, job.tokens)


async def moderations(svc: Services, caller: Caller, data: dict) -> Result:
    job = await plan_moderation(svc, parse(ModerationRequest, data))
    return moderation_results(job, await serve_moderation(svc, caller, job, None))


async def rerank(svc: Services, caller: Caller, data: dict) -> Result:
    return await rerank_answer(svc, caller, data, None)


async def score(svc: Services, caller: Caller, data: dict) -> Result:
    return await score_answer(svc, caller, data, None)


async def classify(svc: Services, caller: Caller, data: dict) -> Result:
    return await classify_answer(svc, caller, data, None)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": chat,
    "/v1/completions": completion_result,  # legacy text completions
    "/v1/responses": response_result,  # not stored; no previous_response_id
    "/v1/images/generations": images,
    "/v1/audio/speech": speech,
    "/v1/embeddings": embeddings,
    "/v1/moderations": moderations,
    "/v1/rerank": rerank,  # vLLM's batch runner takes these two too
    "/v1/score": score,
    "/v1/classify": classify,
    "/v1/messages": message_result,  # Anthropic's Messages API: Message Batches' lines (batch.message_batches)
}
