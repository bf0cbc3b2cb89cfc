"""The Responses API's routes: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``
(``GET`` with ``stream=true`` follows a streamed background response again),
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel`` and
``POST /v1/responses/input_tokens`` (the prompt's tokens, counted without running the model),
``POST /v1/responses/compact`` (a conversation's window compacted to its user messages and a
summary). The
model is ``gateway.responses``; background work runs in ``gateway.response_runs``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import replace
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable

from pydantic import Field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import service_tier
from gateway.background import Background, EventLog
from gateway.auth import Caller
from gateway.chat import ChatJob, ChoiceDelta, collect, plan_chat, served_caller, serve_chat
from gateway.completions import processor_of, tokenizer_of
from gateway.conversation_store import ConversationStore
from gateway.errors import APIError, bad_request, not_found
from gateway.http import Streamed, disconnect_signal
from gateway.pages import cursor_page, page_query
from gateway.response_runs import StoredEvents, end_response, replay, run_in_background
from gateway.response_store import ResponseStore
from gateway.responses import (RUNNING, Draft, InputTokensRequest, ResponseEvents, ResponseJob, ResponsesRequest,
                               closing_events, compaction_item, delta_events, held, input_items, new_item_id,
                               plan_response, responses_names, shown, whole_output)
from gateway.schemas import ChatCompletionRequest, EndUser, is_count, parse, read_json
from gateway.service import Services
from gateway.store_watch import NOT_STORED, StoreWatch
from workers.base import ChatParams, ChatRequest, InvalidParam
from workers.chat_prompt import encode, vision_inputs
from workers.registry import describe

log = logging.getLogger("tiergate.responses")

CANCEL_WAIT_S = 5.0  # a cancel waits this long for this process's work to stop and record it


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


async def create_response(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ResponsesRequest, await read_json(request, svc.config.limits.max_body))
    store, conversations = _store(request), request.app.state.conversations
    # a background response is answered queued at once: its file search (and the turn in which a
    # model writes the queries) runs in its run
    job = await plan_response(svc, caller, store, body, conversations, prepare=not body.background)
    release = held(conversations, job)  # until it ends (the background run, or the stream, takes it over)
    try:
        return await _started(request, svc, caller, body, job, release)
    except BaseException:
        release()
        raise


async def _started(request: Request, svc: Services, caller: Caller, body: ResponsesRequest, job: ResponseJob,
                   release: Callable[[], None]) -> Response:
    """The response to ``job``: answered whole, streamed, or queued to run in the background;
    ``release`` called once it ended."""
    store, conversations = _store(request), request.app.state.conversations
    served = served_caller(svc, caller, job.chat)
    if (end_user := body.end_user(caller.key_id)) is not None:
        log.info("response request: key %s, user %s, tier %s", caller.key_id, end_user, served.tier)
    draft = Draft(new_item_id("resp"), job, service_tier.label(svc.config, served.tier), background=body.background)
    headers = {**svc.gate.rate_headers(served.tier), "x-tiergate-tier": served.tier}
    if body.background:
        if not body.store:
            raise bad_request("a background response must be stored: background needs store true", "background")
        draft.runner = request.app.state.background.runner  # its record keeps what another process needs to run it
        draft.request = {"body": body.model_dump(mode="json", by_alias=True, exclude_unset=True), "tier": caller.tier,
                         "attempts": 1}
        await store.put(draft.record("queued", caller.key_id))
        events = None
        if body.stream:  # its first events are stored with it, before it is answered
            events = StoredEvents(store, draft, ResponseEvents(draft))
            queued = draft.public("queued")
            await events.add([events.s.event("response.created", response=queued),
                              events.s.event("response.queued", response=queued)])
        background: Background = request.app.state.background
        background.start(draft.id, lambda gone: _released(run_in_background(
            svc, caller, draft, store, conversations, background, gone, events), release),
            events.log if events else None)
        if events is not None:
            return Streamed(events.log.follow(-1), "text/event-stream", headers=headers)
        return JSONResponse(draft.public("queued"), headers=headers)
    watch: StoreWatch = request.app.state.store_watch
    if body.store:  # refused before the work while the store is down, not after it
        await watch.check(lambda: store.get(draft.id, caller.key_id))
    with responses_names():  # the engine refuses a prompt past the context: that is ``input``
        async with disconnect_signal(request) as gone:
            deltas = serve_chat(svc, caller, job.chat, gone)
            if not body.stream:
                replies, _ = await collect(deltas)
                draft.reply = replies[0]
                draft.output = whole_output(draft)
                if not await watch.kept(draft.keep(store, caller.key_id, conversations), draft.id):
                    headers = {**headers, **NOT_STORED}  # answered all the same: the work is done and metered
                release()
                return JSONResponse(draft.public(draft.status), headers=headers)
            first = await deltas.__anext__()
    events = live_events(deltas, first, draft, store, caller.key_id, conversations, watch)
    return Streamed(_Releasing(events, release), "text/event-stream", headers=headers)


async def _released(work: Awaitable[None], release: Callable[[], None]) -> None:
    try:
        await work
    finally:
        release()


class _Releasing:
    """A live stream's events, which call ``release`` once closed: ``Streamed`` closes it however
    the stream ended, even before its first event (where a generator's ``finally`` would not run)."""

    def __init__(self, events: AsyncGenerator[str, None], release: Callable[[], None]) -> None:
        self.events, self.release = events, release

    def __aiter__(self) -> "_Releasing":
        return self

    async def __anext__(self) -> str:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            self.release()


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the prompt tokens the response would have (``usage.input_tokens``),
    counted by the model's own tokenizer and chat template; no model work, so no gate."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(InputTokensRequest, await read_json(request, svc.config.limits.max_body))
    job = await plan_response(svc, caller, _store(request), body, request.app.state.conversations, write_queries=False)
    count = await prompt_token_count(svc, caller, job.chat, body.model, "input")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


async def prompt_token_count(svc: Services, caller: Caller, chat: ChatJob, model: str, param: str) -> int:
    """The prompt tokens of a chat job, counted by the model's own tokenizer and chat template (its
    images as the tokens the model's processor expands each to); 404 for a model the key may not use,
    400 naming ``param`` where the template refuses the messages or an image does not decode."""
    if svc.accounts is not None and not svc.accounts.allows(caller, chat.model):
        raise not_found(f"the model '{model}' does not exist", "model", "model_not_found")
    spec = svc.spec(chat.model, "chat")
    try:
        if chat.images:
            req = ChatRequest(chat.messages, ChatParams(max_tokens=0), tools=chat.tools.template_tools(),
                              template_kwargs=chat.template_kwargs, images=chat.images)
            ids, _ = await asyncio.to_thread(vision_inputs, await processor_of(spec.path), req, sys.maxsize)
        else:
            ids = await asyncio.to_thread(encode, await tokenizer_of(spec.path), chat.messages,
                                          chat.tools.template_tools(), chat.template_kwargs)
    except InvalidParam as exc:  # the chat template refused the input, or an image did not decode
        raise bad_request(str(exc), param) from None
    return len(ids)


COMPACT_ASK = ("Write a summary of the conversation above for your own later use, in place of its turns: what was "
               "asked, what you answered or did (your tool calls and what they returned), and what is still open. "
               "Write only the summary.")


class CompactRequest(EndUser):
    """``POST /v1/responses/compact``: the conversation to compact, given as a response's would be."""

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    instructions: str | None = None  # the compaction turn's own (not carried into the compacted window)
    service_tier: str | None = None
    prompt_cache_options: dict[str, Any] | None = None  # accepted, as prompt_cache_key is


async def compact_response(request: Request) -> Response:
    """POST /v1/responses/compact: a conversation's window compacted, as OpenAI's compaction makes
    it: every user message as it was, then one ``compaction`` item that stands for the rest (the
    assistant's turns, tool calls and their results), which a later response's input reads as a
    summary the model wrote of them. The summary is one greedy turn of the model over the whole
    window (gated, metered and limited as a response is), of at most the tokens the model's context
    leaves after the window and ``limits.max_chat_tokens`` (``summary_room``)."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(CompactRequest, await read_json(request, svc.config.limits.max_body))
    if body.input is None and body.previous_response_id is None:
        raise bad_request("missing required parameter: input (or previous_response_id: the conversation to compact)",
                          "input", "missing_required_parameter")
    window = InputTokensRequest(model=body.model, input=body.input, previous_response_id=body.previous_response_id,
                                service_tier=body.service_tier, store=False)
    job = await plan_response(svc, caller, _store(request), window, request.app.state.conversations, write_queries=False)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    ask = {"model": body.model, "temperature": 0, "service_tier": body.service_tier,  # (its length: summary_room)
           "messages": system + job.conversation + [{"role": "user", "content": COMPACT_ASK}]}
    with responses_names():
        summary_job = replace(plan_chat(svc, parse(ChatCompletionRequest, ask)), images=job.chat.images)
        summary_job = await summary_room(svc, caller, summary_job, body.model)
        async with disconnect_signal(request) as gone:
            (reply,), _ = await collect(serve_chat(svc, caller, summary_job, gone))
    summary = "".join(reply.content).strip()
    kept = [item for item in job.items if item.get("type", "message") == "message" and item.get("role") == "user"]
    usage = reply.finished
    return JSONResponse({
        "id": new_item_id("resp"), "object": "response.compaction", "created_at": int(time.time()),
        "output": kept + [compaction_item(summary)],
        "usage": {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                  "output_tokens": usage.completion_tokens,
                  "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens}},
        headers={"x-tiergate-tier": served_caller(svc, caller, summary_job).tier})


async def summary_room(svc: Services, caller: Caller, job: ChatJob, model: str) -> ChatJob:
    """The summary turn ``job`` with the room the model's context leaves after its prompt (the
    window and the ask) for the summary, at most ``limits.max_chat_tokens``: a window that fits
    compacts even on a model whose context is under that limit. 400 naming ``input`` when the
    window leaves no room."""
    prompt = await prompt_token_count(svc, caller, job, model, "input")
    context = describe(svc.spec(job.model, "chat")).context_length
    room = min(svc.config.limits.max_chat_tokens, context - prompt)
    if room < 1:
        raise bad_request(f"the window and the ask to summarize it are {prompt} tokens, which leaves no room for a "
                          f"summary in the model's context of {context} tokens", "input", "context_length_exceeded")
    return replace(job, params=replace(job.params, max_tokens=room))


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{id}: the response object; with ``stream=true`` a streamed background
    response's events again, from the first or from above ``starting_after``, then as they come."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)  # reading a record takes no slot: no gate
    q = request.query_params
    stream = q.get("stream", "false")
    if stream not in ("true", "false"):
        raise bad_request("stream must be true or false", "stream")
    after = q.get("starting_after")
    if after is not None and (stream == "false" or not is_count(after)):
        raise bad_request("starting_after must be a non-negative integer (an event's sequence_number), "
                          "and only with stream=true", "starting_after")
    response_id, store = request.path_params["response_id"], _store(request)
    record = await store.get(response_id, caller.key_id)
    if record is None:
        raise not_found(f"no response with id '{response_id}'", "response_id")
    if stream == "false":
        return JSONResponse(shown(record, svc.config.responses.reclaim_after_s))
    if not record.response.get("background") or not await store.events(response_id, -1):
        raise bad_request("only a background response created with stream true can be streamed again; "
                          "read this one without stream", "stream", "not_streamable")
    after_n = -1 if after is None else int(after)
    running: EventLog | None = request.app.state.background.logs.get(response_id)
    events = running.follow(after_n) if running is not None else replay(store, record, after_n,
                                                                         svc.config.responses.reclaim_after_s)
    return Streamed(events, "text/event-stream", headers={})


async def cancel_response(request: Request) -> Response:
    """POST /v1/responses/{id}/cancel: a background response still running stops (here at once, in
    another process at its next write); one that ended is returned as it is."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    response_id, store = request.path_params["response_id"], _store(request)
    record = await store.get(response_id, caller.key_id)
    if record is None:
        raise not_found(f"no response with id '{response_id}'", "response_id")
    if not record.response.get("background"):
        raise bad_request("only a background response (background: true) can be cancelled", "response_id",
                          "not_background")
    if shown(record, svc.config.responses.reclaim_after_s)["status"] in RUNNING:  # (one whose process died shows failed: returned as it is)
        background: Background = request.app.state.background
        if not await background.cancel(response_id, CANCEL_WAIT_S):  # another process runs it, or none does
            # (written as the record's runner: the only writer the store lets through)
            if await end_response(svc, store, replace(record, response={**record.response, "status": "cancelled"},
                                                          beat=time.time())):
                await store.announce_stop(response_id)  # the process running it stops now (Redis), not at its next write
        record = await store.get(response_id, caller.key_id) or record
    return JSONResponse(shown(record, svc.config.responses.reclaim_after_s))


async def list_input_items(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    response_id = request.path_params["response_id"]
    record = await _store(request).get(response_id, caller.key_id)
    if record is None:
        raise not_found(f"no response with id '{response_id}'", "response_id")
    q = request.query_params
    limit, order = page_query(q, "desc")
    return JSONResponse(cursor_page(input_items(record), order, limit, q.get("after"), q.get("before")))


async def delete_response(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    response_id = request.path_params["response_id"]
    if not await _store(request).delete(response_id, caller.key_id):
        raise not_found(f"no response with id '{response_id}'", "response_id")
    if not await request.app.state.background.cancel(response_id, 0):  # a background one running here stops now
        await _store(request).announce_stop(response_id)  # one running elsewhere, then (Redis)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def live_events(deltas: AsyncGenerator[ChoiceDelta, None], first: ChoiceDelta, draft: Draft,
                      store: ResponseStore, owner: str, conversations: ConversationStore | None,
                      watch: StoreWatch) -> AsyncIterator[str]:
    s = ResponseEvents(draft)
    try:
        yield s.event("response.created", response=draft.public("in_progress"))
        yield s.event("response.in_progress", response=draft.public("in_progress"))
        for line in s.searched():
            yield line
        delta = first
        while True:
            for line in delta_events(s, delta):
                yield line
            if delta.finished is not None:
                break
            delta = await deltas.__anext__()
        for line in closing_events(s):
            yield line
        status = draft.status
        await watch.kept(draft.keep(store, owner, conversations), draft.id)  # failed: logged, and it ends as it would
        yield s.event(f"response.{status}", response=draft.public(status))
    except APIError as exc:  # (its conversation refused its items: a duplicate_item_id)
        yield s.event("error", code=exc.code, message=exc.message, param=exc.param)
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        yield s.event("error", code="generation_failed", message=f"generation failed: {type(exc).__name__}",
                      param=None)
    finally:
        await deltas.aclose()
