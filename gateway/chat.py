"""Chat completions: ``plan_chat`` checks a request, ``serve_chat`` (the serving core, shared with
batch lines) yields its events, and ``chat_completions`` (POST /v1/chat/completions) renders them
as one JSON completion or as server-sent events."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.adapters import resolve_request
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.http import Streamed, disconnect_signal
from gateway.schemas import ChatCompletionRequest, parse, read_json
from gateway.service import Services
from gateway.serving import Gone, Serving
from workers.base import AdapterStackSpec, ChatEvent, ChatFinished, ChatParams, ChatRequest, StepContext, TextDelta
from workers.chat import ContextTooLong

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ChatJob:
    """A checked chat request: the base model, what the worker gets, and its adapter stack."""

    model: str
    messages: list[dict]
    params: ChatParams
    stack: AdapterStackSpec


def plan_chat(svc: Services, body: ChatCompletionRequest) -> ChatJob:
    """The job of ``body``; 404 for an unknown model or adapter, 400 past the token limit."""
    spec, stack = resolve_request(svc, body.model, body.adapters, "chat")
    limit = svc.config.limits.max_chat_tokens
    max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, limit)
    if max_tokens > limit:
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise bad_request(f"{param} is {max_tokens}, above this server's limit of {limit}", param)
    params = ChatParams(max_tokens, body.temperature, body.top_p, body.stop or [], body.seed)
    return ChatJob(spec.name, body.messages_as_dicts(), params, stack)


async def serve_chat(svc: Services, caller: Caller, job: ChatJob,
                     gone: Gone | None) -> AsyncGenerator[ChatEvent, None]:
    """The events of one completion: text deltas, then one ``ChatFinished``. What goes wrong
    before the first event (429/503, context too long, out of memory after relief, client gone)
    is raised by the first ``__anext__``. Closing the iterator early cancels the generation."""
    async with Serving(svc, caller, job.model, job.params.max_tokens, "chat", gone) as serving:
        events, event = await serving.step(lambda ctx: _first_event(serving, job, ctx), "running")
        svc.metrics.ttft.labels(caller.tier).observe(serving.first_token())
        try:
            while not isinstance(event, ChatFinished):
                yield event
                event = await serving.until_gone(events.__anext__())
        finally:
            await events.aclose()
    yield event  # the slot is free and the service time learned before the last event goes out


async def _first_event(serving: Serving, job: ChatJob, ctx: StepContext) -> tuple[AsyncIterator[ChatEvent], ChatEvent]:
    """Submit the request and wait for its first event, so that errors found on submission
    become API errors rather than a broken stream."""
    req = ChatRequest(job.messages, job.params, priority=serving.rank, ctx=ctx, adapters=job.stack)
    events = serving.worker.chat(req)
    try:
        return events, await events.__anext__()
    except ContextTooLong as exc:
        await events.aclose()
        raise bad_request(str(exc), "messages", "context_length_exceeded") from None
    except ValueError as exc:  # the engine cannot serve this adapter stack (e.g. rank too high)
        await events.aclose()
        raise bad_request(str(exc), "adapters", "adapter_not_supported") from None
    except BaseException:
        await events.aclose()
        raise


async def collect(events: AsyncGenerator[ChatEvent, None]) -> tuple[str, ChatFinished]:
    """The whole text of a completion and how it finished (``events`` is closed after)."""
    parts: list[str] = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, ChatFinished):
                return "".join(parts), event
    raise RuntimeError("the chat events ended without ChatFinished")


def completion(cid: str, model: str, text: str, f: ChatFinished) -> dict:
    """The ``chat.completion`` object."""
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": f.finish_reason, "logprobs": None}],
        "usage": _usage(f),
    }


# -- HTTP -------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ChatCompletionRequest, await read_json(request, svc.config.limits.max_body))
    job = plan_chat(svc, body)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    async with disconnect_signal(request) as gone:
        events = serve_chat(svc, caller, job, gone)
        if not body.stream:
            text, finished = await collect(events)
            return JSONResponse(completion(completion_id, body.model, text, finished),
                                headers=svc.gate.rate_headers(caller.tier))
        first = await events.__anext__()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    sse = _sse(events, first, completion_id, body.model, include_usage)
    return Streamed(sse, "text/event-stream", headers=svc.gate.rate_headers(caller.tier))


def _usage(f: ChatFinished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens}


async def _sse(events: AsyncIterator[ChatEvent], first: ChatEvent, cid: str, model: str,
               include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if choices else []}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        event = first
        while True:
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ChatFinished):
                yield chunk({}, event.finish_reason)
                if include_usage:
                    yield chunk({}, usage=_usage(event), choices=False)
                break
            event = await events.__anext__()
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        err = APIError(500, f"generation failed: {type(exc).__name__}", "generation_failed")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"
