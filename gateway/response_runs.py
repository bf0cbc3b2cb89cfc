"""Background responses (``background: true``, stored) as they run: in the process that answered
their request (``run_in_background``), and in another when that one died (``reclaim``).

The request is checked and admitted as any other (its 400s and its early 429 come at once), stored ``queued`` and answered;
the work then runs in this process (``gateway.background``) at the caller's tier, ``in_progress``
from its first token, and its record ends ``completed``, ``incomplete``, ``failed`` (with
``error``) or ``cancelled``. ``POST /v1/responses/{id}/cancel`` stops it: at once when this process
runs it, else by writing ``cancelled`` to the store and announcing it (``announce_stop``): the
running process hears it at once on Redis, and on SQLite finds it at its next write (every
``HEARTBEAT_S``) and stops. A record still running whose last write is older than
``responses.reclaim_after_s`` (30 s) had its process die: every RECLAIM_S (at most) each process
looks for those (``reclaim``) and one claims it and runs it again from its kept request (shown ``queued`` meanwhile); what runs at
shutdown is handed back the same way. A streamed one runs again with its stored events going on
(``StoredEvents.resumed``): one still queued from the start; one whose followers saw part of its
text (``resumable``: a plain text reply) from that text, the chat model given the prompt and the
text so far as its raw prompt (``_continued``); a reasoning model's from its thinking so far, or
from its whole thinking and the answer so far; one whose reply had ended (its record says so, ``_ended``, before
its items' closing events) is finished, not run (``_finish``). One that cannot run again (streamed past ``queued``
with tools, a JSON format or logprobs: its followers saw output that cannot be continued; or run
RECLAIM_TRIES times) is shown ``failed`` (``server_error``). Only a ``completed`` or ``incomplete``
response can be continued with ``previous_response_id``.

A background response made with ``stream: true`` is answered with its events: ``response.created``
and ``response.queued`` (stored with it before the answer), ``response.in_progress`` at its first
token, then a live stream's. The connection is only a follower (``EventLog.follow``): closing it
stops nothing. Each event is stored before any follower sees it (the items' closing events before
the record says it ended, the last event after), so that a run again elsewhere goes on from the
last event any follower saw, and ``GET /v1/responses/{id}?stream=true
&starting_after=n`` follows it from any process: live from the log where it runs, else from the
store (``replay``, read every POLL_S). A cancelled one ends with an ``error`` event
(``response_cancelled``), a failed one with ``response.failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace
from typing import Any, AsyncGenerator, AsyncIterator

from gateway.auth import Caller
from gateway.background import Background, EventLog
from gateway.chat import ChoiceDelta, collect, serve_chat
from gateway.completions import tokenizer_of
from gateway.conversation_store import ConversationStore
from gateway.errors import APIError
from gateway.response_store import ResponseStore, StoredResponse
from gateway.responses import (CONTINUABLE, RUNNING, Draft, ResponseEvents, ResponsesRequest, Sent, closing_events,
                               delta_events, message_item, plan_response, prepared, reasoning_item, reclaimable,
                               responses_names, resumable, shown, sse_event, whole_output)
from gateway.service import ClientGone, Services
from gateway.serving import Gone
from workers.base import ChatFinished
from workers.chat_prompt import render, thinking_marker

log = logging.getLogger("tiergate.responses")

HEARTBEAT_S = 5.0  # a running background response's record is written at least this often
RECLAIM_S = 10.0  # how often a process looks for background responses whose process died (at most)
POLL_S = 0.25  # a follower in another process reads the store this often
async def run_in_background(svc: Services, caller: Caller, draft: Draft, store: ResponseStore,
                             conversations: ConversationStore, background: Background, gone: Gone,
                             events: "StoredEvents | None") -> None:
    """A background response's work: served as a live request would be (``gone`` is its stop
    signal), its record rewritten as it goes, and how it ended stored; a streamed one's events
    added to ``events`` as they are made, its last after its record is written."""
    owner, phase = caller.key_id, ["queued"]
    beat = asyncio.get_running_loop().create_task(_heartbeat(store, draft, owner, phase, gone))
    status, error, shut_down = "failed", None, False
    try:
        with responses_names():
            draft.job = await prepared(svc, caller, draft.job, gone=gone)  # searched here, not when it was asked
            if events is not None and events.sent.output:
                deltas = await _continued(svc, caller, draft, events.sent, gone)
            else:
                deltas = serve_chat(svc, caller, draft.job.chat, gone)
            first = await deltas.__anext__()
            phase[0] = "in_progress"
            if not await store.update_running(draft.record("in_progress", owner)):
                gone.set()  # cancelled or deleted by another process while it waited: stop here
            if events is None:
                replies, _ = await collect(_after(first, deltas))
                draft.reply = replies[0]
                draft.output = whole_output(draft)
            else:
                if not events.sent.began:
                    await events.add([events.s.event("response.in_progress", response=draft.public("in_progress")),
                                      *events.s.searched()])
                async with contextlib.aclosing(_after(first, deltas)) as each:
                    async for delta in each:
                        await events.add(delta_events(events.s, delta))
                        if delta.finished is not None:
                            break
            status, error = await _ended(draft, store, conversations, owner)
            if events is not None:
                await events.add(closing_events(events.s) if status in CONTINUABLE else [])
    except ClientGone:
        status = "cancelled"
        if background.stopping:  # stopped by the shutdown (a finished one is recorded as it ended)
            shut_down = True
            status, error = "failed", {"code": "server_error",
                                       "message": "the server shut down before this response finished; create it again"}
    except APIError as exc:
        error = {"code": exc.code, "message": exc.message}
    except Exception:
        log.exception("background response %s failed", draft.id)
        error = {"code": "server_error", "message": "the server failed while making this response"}
    finally:
        beat.cancel()
    can_go_on = events is None or phase[0] == "queued" or resumable(draft.request["body"])
    if shut_down and can_go_on and reclaimable(draft.record("queued", owner)):
        # handed back: stored queued and unwritten since the epoch, so that the next process to look
        # (another one now, or this server once it is back) runs it again (``reclaim``); a streamed
        # one's followers here end, and follow it again from any process
        back = replace(draft.record("queued", owner), beat=0.0)
        back = replace(back, response={**back.response, "output": []})
        if await store.update_running(back):
            log.info("background response %s: handed back at shutdown, to run again", draft.id)
            if events is not None:
                events.log.end()
            return
    if events is not None:  # what it had begun, closed; all stored before its record says it ended
        await events.add(events.s.close("incomplete") if status not in CONTINUABLE else [])
    draft.request.pop("ended", None)  # (its record says how it ended from now)
    # (not kept: deleted meanwhile, or cancelled by another process, whose write carried the event)
    kept = await end_response(svc, store, draft.record(status, owner, error))
    if events is not None:
        await events.add([last_event(draft.public(status, error), events.s.next())])
        events.log.end()
    log.info("background response %s: %s%s%s", draft.id, status, f" ({error['code']})" if error else "",
             "" if kept else " (not recorded: cancelled or deleted meanwhile)")


async def end_response(svc: Services, store: ResponseStore, record: StoredResponse) -> bool:
    """Write ``record``, which ends a background response (``update_running``), with its webhook
    event in the same step (``Webhooks.along``): no crash or stop right after the write leaves the
    response ended without its event, and only the one write that ends it sends one. Whether it
    was written."""
    hooks = svc.webhooks
    event = None if hooks is None else hooks.along(f"response.{record.response['status']}", record.id, record.owner)
    kept = await store.update_running(record, event)
    if kept and event is not None:
        hooks.written()
    return kept


async def _ended(draft: Draft, store: ResponseStore, conversations: ConversationStore | None,
                 owner: str) -> tuple[str, dict[str, str] | None]:
    """A reply that ended (a streamed one's before its items' closing events): added to its
    conversation, then its record (still running) written with its whole output, its usage and how
    it ended (``ended`` in its request), so that a process that claims it, should this one die
    before its record says it ended, finishes it (``_finish``) rather than failing it (streamed)
    or running it again (its input items already in its conversation, it would fail). Its status,
    and an error when its conversation refused it (one of its input ids was added meanwhile, by a
    response another process ran): then it failed."""
    try:
        await draft.add_to_conversation(conversations, owner)
    except APIError as exc:
        return "failed", {"code": exc.code, "message": exc.message}
    draft.request = {**draft.request, "ended": draft.status}  # (the heartbeat writes it too from now)
    try:
        await store.update_running(draft.record("in_progress", owner))
    except Exception as exc:  # noqa: BLE001 - only a safeguard: its record is written again as it ends
        log.warning("background response %s: storing that its reply ended failed: %s", draft.id, exc)
    return draft.status, None


async def _finish(svc: Services, store: ResponseStore, record: StoredResponse, claimed: StoredResponse,
                  events: "StoredEvents | None") -> None:
    """Finish a dead process's response whose reply had ended (``_ended``): its record ended as
    the reply did, with the output and usage its ending record kept; a streamed one's output is
    the items its stored events closed, its items' closing events stored first when they were not
    yet (its last event is made from the record, as ``replay`` makes one). Nothing runs again, and
    nothing is metered again (its process metered the reply)."""
    ended, output = record.request["ended"], record.response["output"]
    if events is not None:
        if not events.sent.closed:
            await events.add(events.s.close(ended))
        output = [json.loads(event.split("data: ", 1)[1])["item"] for event in await store.events(record.id, -1)
                  if event.startswith("event: response.output_item.done\n")]
    response = {**record.response, "status": ended, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if ended == "incomplete" else None}
    asked = {k: v for k, v in claimed.request.items() if k != "ended"}
    await end_response(svc, store, replace(claimed, response=response, request=asked, beat=time.time()))
    log.info("background response %s: its process had ended its reply; finished here (%s)", record.id, ended)


class StoredEvents:
    """A streamed background response's events: numbered by ``s``, written to the store for any
    process's followers, then added to ``log`` for this process's: no follower sees an event
    before it is stored. A failed write is tried again with the next; the events go to this
    process's followers meanwhile (they would otherwise stall while the store is down), so a run
    again elsewhere, should this process then die, may go on from before what they saw."""

    def __init__(self, store: ResponseStore, draft: Draft, s: "ResponseEvents", sent: Sent | None = None) -> None:
        self.store, self.draft, self.s = store, draft, s
        self.sent = sent or Sent()  # what the stored events show (a run again goes on after them)
        self.log = EventLog()
        self.stored = 0  # the number of the first event not stored yet
        self.unstored: list[str] = []  # made but not stored (a write failed): tried again with the next

    @classmethod
    async def resumed(cls, store: ResponseStore, draft: Draft) -> "StoredEvents":
        """The events of a streamed response run again (``reclaim``): those its dead process
        stored, in the log for this process's followers, and the new ones numbered after them;
        the message it had begun is open again with its text so far (``Sent``)."""
        before = await store.events(draft.id, -1)
        sent = Sent.of(before)
        events = cls(store, draft, ResponseEvents(draft), sent)
        events.log.add(before)
        events.stored = events.s.seq = len(before)
        if sent.thought_id is not None and not sent.closed:  # the reasoning item: open, or ended
            item = reasoning_item(sent.thought_id, sent.thought, "completed" if sent.thought_done else "in_progress")
            draft.output.append(item)
            if not sent.thought_done:
                item.update(content=[], _thought=[sent.thought])
                events.s.thought = item
            draft.reply.reasoning.append(sent.thought)
        if sent.item_id is not None and not sent.closed:
            item = message_item(sent.item_id, "", "in_progress", None)
            item.update(content=[], _text=[sent.text])
            draft.output.append(item)
            events.s.text = item
            draft.reply.content.append(sent.text)
        return events

    async def add(self, events: list[str]) -> None:
        self.unstored += events
        if self.unstored:
            try:
                await self.store.add_events(self.draft.id, self.draft.created_at, self.stored, self.unstored)
            except Exception as exc:  # noqa: BLE001 - the store is down: followers here still see them
                log.warning("background response %s: storing its events failed: %s", self.draft.id, exc)
            else:
                self.stored += len(self.unstored)
                self.unstored = []
        self.log.add(events)


async def reclaim(svc: Services, store: ResponseStore, conversations: ConversationStore | None,
                  background: Background) -> list[str]:
    """One pass: run here again the background responses whose process died (still running in the
    store, unwritten for ``responses.reclaim_after_s``, ``reclaimable``), each taken by one process's ``claim`` and run
    from the start under this process's runner; what was reclaimed."""
    taken = []
    for response_id, doc in await store.running():
        record = StoredResponse.of(response_id, doc)
        stale = record.beat is not None and time.time() - record.beat > svc.config.responses.reclaim_after_s
        if response_id in background.running or not stale:
            continue
        if not reclaimable(record):
            continue
        asked = {**record.request, "attempts": record.request.get("attempts", 1) + 1}
        claimed = replace(record, response={**record.response, "status": "queued", "output": []}, beat=time.time(),
                          request=asked, runner=background.runner)
        if not await store.claim(response_id, doc, claimed):
            continue  # another process took it first, or it changed meanwhile
        caller = Caller(asked["tier"], record.owner)
        body = ResponsesRequest.model_validate(asked["body"])
        try:
            job = await plan_response(svc, caller, store, body, conversations, prepare=False)
        except APIError as exc:  # what it continued is gone, say
            await end_response(svc, store, replace(claimed, response={
                **claimed.response, "status": "failed", "error": {"code": exc.code, "message": exc.message}}))
            continue
        draft = Draft(response_id, job, record.response["service_tier"], created_at=record.created_at, background=True,
                      request=asked, runner=background.runner)
        events = await StoredEvents.resumed(store, draft) if body.stream else None
        if asked.get("ended") in CONTINUABLE:  # its reply had ended: finish it
            await _finish(svc, store, record, claimed, events)
            taken.append(response_id)
            continue
        if events is not None and events.sent.closed:  # it had ended an item: nothing to go on from
            await end_response(svc, store, replace(claimed, response={**claimed.response, "status": "failed", "error": {
                "code": "server_error", "message": "the server failed while making this response"}}))
            continue
        background.start(response_id, lambda gone, d=draft, e=events: run_in_background(
            svc, caller, d, store, conversations, background, gone, e), events.log if events else None)
        log.info("background response %s: its process stopped writing it; run again here (attempt %d)",
                 response_id, asked["attempts"])
        taken.append(response_id)
    return taken


async def _continued(svc: Services, caller: Caller, draft: Draft, sent: Sent,
                     gone: Gone) -> AsyncIterator[ChoiceDelta]:
    """The deltas of a reply that goes on after what a resumed stream's followers saw (``sent``):
    the chat model is given its prompt (rendered with the request's template variables, as the
    first run's was) and the reply so far as a raw prompt, and what is left of ``max_tokens``; the
    last delta's token counts are the whole reply's (the reply so far is output, not input), and
    the key is metered so (``ChatJob.said``). None left: the reply ends there, at its length.

    The reply so far is its text, or a reasoning model's thinking (after ``<think>``, unless the
    prompt opened it) and, once the thinking ended, ``</think>`` and the answer's text. Cut while
    thinking, it goes on thinking (the raw prompt's last marker is open), then answers; cut in the
    answer (or with no thinking at all), the rest is answer."""
    job = draft.job.chat
    tok = await tokenizer_of(svc.spec(job.model, "chat").path)
    rendered = await asyncio.to_thread(render, tok, job.messages, None, job.template_kwargs)
    prompt = list(tok(rendered, add_special_tokens=False)["input_ids"])
    so_far, thought = sent.text, ""
    if sent.thought_id is not None:
        thought = ("" if thinking_marker(rendered) == "open" else "<think>") + sent.thought
        so_far = thought + ("</think>" + sent.text if sent.thought_done else "")
    said = list(tok(so_far, add_special_tokens=False)["input_ids"])
    # the reasoning tokens said: all of them while thinking, else those through </think>
    thinking = 0 if not thought else len(said) if not sent.thought_done else len(
        tok(thought + "</think>", add_special_tokens=False)["input_ids"])
    left = job.params.max_tokens - len(said)
    if left <= 0:
        ended = ChatFinished("length", len(prompt) + len(said), 0)  # as the engine counts: the text in the prompt
        return _counted(_one(ChoiceDelta(0, finish_reason="length", finished=ended)), len(said), thinking)
    still_thinking = sent.thought_id is not None and not sent.thought_done
    job = replace(job, prompt_ids=prompt + said, said=len(said), params=replace(job.params, max_tokens=left),
                  reasoning=job.reasoning if still_thinking else "none")
    return _counted(serve_chat(svc, caller, job, gone), len(said), thinking)


async def _counted(deltas: AsyncGenerator[ChoiceDelta, None], said: int, thinking: int) -> AsyncIterator[ChoiceDelta]:
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            if delta.finished is not None:
                f = delta.finished
                delta = replace(delta, finished=replace(f, prompt_tokens=f.prompt_tokens - said,
                                                        completion_tokens=f.completion_tokens + said),
                                reasoning_tokens=delta.reasoning_tokens + thinking)
            yield delta


async def _one(delta: ChoiceDelta) -> AsyncIterator[ChoiceDelta]:
    yield delta


async def _after(first: ChoiceDelta, rest: AsyncGenerator[ChoiceDelta, None]) -> AsyncIterator[ChoiceDelta]:
    yield first
    async with contextlib.aclosing(rest):
        async for delta in rest:
            yield delta


async def _heartbeat(store: ResponseStore, draft: Draft, owner: str, phase: list[str], gone: Gone) -> None:
    """Rewrite the running record every HEARTBEAT_S; stop the work once the store says it was
    cancelled or deleted meanwhile (by another process)."""
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        if not await store.update_running(draft.record(phase[0], owner)):
            gone.set()
            return


async def replay(store: ResponseStore, record: StoredResponse, after: int, stale_s: float) -> AsyncIterator[str]:
    """A streamed background response's stored events above ``after``; while another process
    still runs it, each new one as that process stores it (read every POLL_S). Its last event is
    one of ENDING; when the record ended without one stored (that process died, or had not stored
    it yet), the last is made from the record as ``last_event`` makes it there. Past the last (a
    client that saw it coming back with its number), none."""
    n = after + 1
    while True:
        new = await store.events(record.id, n - 1)
        n += len(new)
        for event in new:
            yield event
        if new and _ends(new[-1]):
            return
        now = await store.get(record.id, record.owner)
        if now is None:  # deleted meanwhile
            return
        response = shown(now, stale_s)
        if response["status"] not in RUNNING:
            new = await store.events(record.id, n - 1)  # stored just before its record ended
            for event in new:
                yield event
            n += len(new)
            if await _ends_unstored(store, record.id, n):
                yield last_event(response, n)
            return
        await asyncio.sleep(POLL_S)


async def _ends_unstored(store: ResponseStore, response_id: str, n: int) -> bool:
    """Whether the stream of an ended response, none of it stored from number ``n`` on, ends with an
    event made up as number ``n``: its stored events end at ``n - 1``, with none of ENDING. When its
    end is stored, or ``n - 1`` is past its last, the client asked from after the end: nothing is left."""
    if n == 0:
        return True  # none stored at all
    last = await store.events(response_id, n - 2)
    return bool(last) and not _ends(last[0])


ENDING = ("response.completed", "response.incomplete", "response.failed", "error")


def _ends(event: str) -> bool:
    return event.split("\n", 1)[0].removeprefix("event: ") in ENDING


def last_event(response: dict[str, Any], seq: int) -> str:
    """The event that ends a background response's stream, number ``seq``: ``response.<status>``
    with the response, or for a cancelled one an ``error`` (the Responses API has no event for a
    cancel)."""
    if response["status"] == "cancelled":
        return sse_event("error", seq, code="response_cancelled", message="the response was cancelled", param=None)
    return sse_event(f"response.{response['status']}", seq, response=response)


