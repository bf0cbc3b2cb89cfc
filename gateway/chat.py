"""POST /v1/chat/completions: OpenAI chat completions, whole or streamed as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.adapters import resolve_request
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.schemas import ChatCompletionRequest, parse, read_json
from gateway.service import Held, HeldStream, Services, unless_gone
from workers.base import AdapterStackSpec, ChatEvent, ChatFinished, ChatParams, ChatRequest, TextDelta
from workers.chat import ContextTooLong

DEFAULT_MAX_TOKENS = 256


async def chat_completions(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    data = await read_json(request, svc.config.limits.max_body)
    return await complete(svc, caller, data, request)


async def complete(svc: Services, caller: Caller, data: dict, request: Request | None) -> Response:
    """Serve one chat completion body for ``caller``. ``request`` is None for batch lines."""
    arrived = time.monotonic()
    body = parse(ChatCompletionRequest, data)
    spec, stack = resolve_request(svc, body.model, body.adapters, "chat")
    limit = svc.config.limits.max_chat_tokens
    max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, limit)
    if max_tokens > limit:
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise bad_request(f"{param} is {max_tokens}, above this server's limit of {limit}", param)
    params = ChatParams(max_tokens, body.temperature, body.top_p, body.stop or [], body.seed)

    held = await unless_gone(request, svc.hold(caller.tier, spec.name, units=max_tokens))
    try:
        events, first = await _start(svc, held, body, params, stack, caller, request)
    except BaseException:
        held.release(ok=False)
        raise
    svc.metrics.ttft.labels(caller.tier).observe(time.monotonic() - arrived)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(events, first, completion_id, body.model, include_usage)
        return HeldStream(sse, held, svc, caller.tier, arrived, "chat", "text/event-stream",
                          headers=svc.gate.rate_headers(caller.tier))
    try:
        text, finished = await unless_gone(request, _collect(events, first))
    finally:
        held.release(ok=True)
        svc.metrics.latency.labels(caller.tier, "chat").observe(time.monotonic() - arrived)
    return JSONResponse(_completion(completion_id, body.model, text, finished), headers=svc.gate.rate_headers(caller.tier))


async def _start(svc: Services, held: Held, body: ChatCompletionRequest, params: ChatParams,
                 stack: AdapterStackSpec, caller: Caller,
                 request: Request | None) -> tuple[AsyncIterator[ChatEvent], ChatEvent]:
    """Submit the request and wait for its first event, so that errors found on submission
    (context too long, out of memory) become HTTP errors rather than a broken stream. On out of
    memory the arbiter evicts the least valuable other model and the request is tried once more."""
    rank = svc.tier_rank[caller.tier]
    for attempt in (1, 2):
        req = ChatRequest(body.messages_as_dicts(), params, priority=rank, ctx=held.lease.context(), adapters=stack)
        events = held.lease.worker.chat(req)
        try:
            return events, await unless_gone(request, events.__anext__())
        except ContextTooLong as exc:
            raise bad_request(str(exc), "messages", "context_length_exceeded") from None
        except ValueError as exc:  # the engine cannot serve this adapter stack (e.g. rank too high)
            raise bad_request(str(exc), "adapters", "adapter_not_supported") from None
        except torch.OutOfMemoryError as exc:
            await events.aclose()
            if attempt == 2 or not svc.arbiter.relieve_oom(held.lease.model, rank):
                raise APIError(503, f"out of memory running {held.lease.model}: {exc}", "out_of_memory") from None
        except BaseException:
            await events.aclose()
            raise
    raise AssertionError("unreachable")


async def _collect(events: AsyncIterator[ChatEvent], first: ChatEvent) -> tuple[str, ChatFinished]:
    parts: list[str] = []
    ev = first
    while True:
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, ChatFinished):
            return "".join(parts), ev
        ev = await events.__anext__()


def _usage(f: ChatFinished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def _completion(cid: str, model: str, text: str, f: ChatFinished) -> dict:
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": f.finish_reason, "logprobs": None}],
        "usage": _usage(f),
    }


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
        ev = first
        while True:
            if isinstance(ev, TextDelta):
                yield chunk({"content": ev.text})
            elif isinstance(ev, ChatFinished):
                yield chunk({}, ev.finish_reason)
                if include_usage:
                    yield chunk({}, usage=_usage(ev), choices=False)
                break
            ev = await events.__anext__()
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        err = APIError(500, f"generation failed: {type(exc).__name__}", "generation_failed")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"

