"""The Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel`` and
``POST /v1/responses/input_tokens`` (the prompt's tokens, counted without running the model).

A request becomes a chat job: ``input`` (a string, or items: messages with ``input_text`` /
``output_text`` parts, ``function_call`` and ``function_call_output`` items) is turned into chat
messages after ``instructions`` (a system message) and, with ``previous_response_id``, after the
stored conversation of that response (its input and its reply; its instructions are not carried
over, as OpenAI does), or with ``conversation`` after that conversation's items
(``gateway.conversations``), to which its input and output items are added once it ends
``completed`` or ``incomplete``. Tools, ``tool_choice``, ``text.format`` and the sampling fields are read by
the chat planner (``gateway.chat.plan_chat``: tools, structured outputs, the token limit), so a
response runs through the same serving core, gate, arbiter and engines as chat; a 400 names the
Responses field (``text.format``, ``max_output_tokens``, ``input``...).

The reply is a list of output items: a ``message`` with one ``output_text`` part, and a
``function_call`` item per tool call. ``status`` is ``completed``, or ``incomplete`` (with
``incomplete_details.reason: max_output_tokens``) when the reply hit the limit. With ``store``
(the default) the response and its conversation are kept in the durable store
(``gateway.response_store``), visible only to the key that made it.

Streaming sends OpenAI's events, each ``event: <type>`` plus ``data`` with ``type`` and a growing
``sequence_number``: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
for a call ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``,
then ``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``).

A stored response's input items (``input_items``) are what it was made from, kept with it: a
continued response's are the previous one's input items and output items (their ids unchanged),
then its own ``input``, each item as the client sent it, with the id it gave or a new one and
``status: completed`` (a string ``input`` is one user message); a given id already used in the
conversation is a 400, so that a page's cursor names one place. ``instructions`` are not an item,
as in OpenAI's API. A record stored before items were kept has them rebuilt from its chat
messages (a message's parts as one, ``developer`` as ``system``, ids fixed by the response and
place). A page is OpenAI's cursor list (``limit`` 1..100, default 20; ``order`` ``desc``, the
newest first, by default; ``after`` / ``before`` an item id).

Background responses (``background: true``, stored): the request is checked and
admitted as any other (its 400s and its early 429 come at once), stored ``queued`` and answered;
the work then runs in this process (``gateway.background``) at the caller's tier, ``in_progress``
from its first token, and its record ends ``completed``, ``incomplete``, ``failed`` (with
``error``) or ``cancelled``. ``POST /v1/responses/{id}/cancel`` stops it: at once when this process
runs it, else by writing ``cancelled`` to the store and announcing it (``announce_stop``): the
running process hears it at once on Redis, and on SQLite finds it at its next write (every
``HEARTBEAT_S``) and stops. A record still running whose last write is older than
``responses.reclaim_after_s`` (30 s) had its process die: every RECLAIM_S each process looks for those (``reclaim``) and
one claims it and runs it again from its kept request (shown ``queued`` meanwhile); what runs at
shutdown is handed back the same way. One that cannot run again (streamed, or run RECLAIM_TRIES
times) is shown ``failed`` (``server_error``). Only a ``completed`` or ``incomplete`` response
can be continued with ``previous_response_id``.

A background response made with ``stream: true`` is answered with its events: ``response.created``
and ``response.queued`` (stored with it before the answer), ``response.in_progress`` at its first
token, then a live stream's. The connection is only a follower (``EventLog.follow``): closing it
stops nothing. The events are stored as they are made (every FLUSH_S; the items' closing events
before the record says it ended, the last event after), so ``GET /v1/responses/{id}?stream=true
&starting_after=n`` follows it from any process: live from the log where it runs, else from the
store (``_replay``, read every POLL_S). A cancelled one ends with an ``error`` event
(``response_cancelled``), a failed one with ``response.failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import service_tier
from gateway.auth import Caller
from gateway.background import Background, EventLog
from gateway.chat import ChatJob, ChoiceDelta, Reply, collect, plan_chat, served_caller, serve_chat
from gateway.completions import tokenizer_of
from gateway.conversation_store import ConversationStore
from gateway.errors import APIError, bad_request, not_found
from gateway.http import Streamed, disconnect_signal
from gateway.logprobs import chat_content
from gateway.pages import cursor_page, page_query
from gateway.response_store import ResponseStore, StoredResponse
from gateway.schemas import (MAX_STACK, MAX_TOOLS, TOOL_NAME, AdapterChoice, ChatCompletionRequest, Metadata, _Body,
                             is_count, parse, read_json)
from gateway.service import ClientGone, Services
from gateway.serving import Gone
from gateway.tools import CallDelta
from workers.chat_prompt import encode
from workers.registry import describe

log = logging.getLogger("tiergate.responses")

HEARTBEAT_S = 5.0  # a running background response's record is written at least this often
RECLAIM_S = 10.0  # how often a process looks for background responses whose process died (at most)
RECLAIM_TRIES = 3  # runs of one background response at most (a request that kills its process stops)
CANCEL_WAIT_S = 5.0  # a cancel waits this long for this process's work to stop and record it
FLUSH_S = 0.25  # a streamed background response's new events are stored at least this often
POLL_S = 0.25  # a follower in another process reads the store this often
RUNNING = ("queued", "in_progress")
CONTINUABLE = ("completed", "incomplete")


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=TOOL_NAME)  # json_schema
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; the model decides


class ConversationRef(_Body):
    id: str = Field(min_length=1)


class ResponsesRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    conversation: str | ConversationRef | None = None  # its id, or {"id": ...}
    stream: bool = False
    include: list[str] | None = None  # accepted; logprobs come with top_logprobs
    metadata: Metadata = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the oldest turns dropped until it fits
    background: bool = False
    reasoning: None = None
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: what a response would be made from, ``input`` optional."""

    input: str | list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ResponseJob:
    """A checked response request: its chat job and the conversation it continues and adds."""

    chat: ChatJob
    conversation: list[dict[str, Any]]  # every message of the prompt but the instructions
    body: ResponsesRequest
    items: list[dict[str, Any]]  # the same as the Responses API's input items (``input_items``)
    conversation_id: str | None = None  # the conversation it continues and adds its items to
    added: list[dict[str, Any]] = field(default_factory=list)  # its own input's items


# -- input items as chat messages ---------------------------------------------------------------------

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}


def input_messages(items: str | list[dict[str, Any]], name: str = "input") -> list[dict[str, Any]]:
    """Chat messages of ``input`` (or items called ``name``); 400 naming the item (``input[i]...``)
    that cannot be one. Function calls join the assistant message before them (or start one)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request(f"{name} must not be an empty list", name)
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        kind = item.get("type", "message")
        if kind not in _ITEM_KEYS:
            raise bad_request(f"input items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                              "function_call_output)", f"{where}.type")
        extra = sorted(set(item) - _ITEM_KEYS[kind])
        if extra:
            raise bad_request(f"unrecognized field of a {kind} item: {extra[0]}", f"{where}.{extra[0]}",
                              "unknown_parameter")
        if kind == "message":
            out.append({"role": _role(item, where), "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
    return out


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"a message item's role must be one of {', '.join(_ROLES)}", f"{where}.role")
    return _ROLES[role]


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise bad_request(f"missing required parameter: {where}.{key}", f"{where}.{key}", "missing_required_parameter")
    if not isinstance(value, str):
        raise bad_request(f"invalid type for {where}.{key}: a string is expected", f"{where}.{key}", "invalid_type")
    return value


def _text(content: Any, where: str) -> str:
    """The text of a content field: a string, or text parts (other parts are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS and kind != "refusal":
            raise bad_request(f"content parts of type {str(kind)[:40]!r} are not supported (input_text, output_text)",
                              f"{where}[{j}].type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"a {kind} part needs its text as a string", f"{where}[{j}]", "invalid_type")
        texts.append(text)
    return "".join(texts)


# -- planning -----------------------------------------------------------------------------------------

# chat's names of the fields -> the Responses API's (the first matching prefix is replaced)
_PARAMS = [(r"^response_format(\.json_schema)?", "text.format"), (r"^max_completion_tokens", "max_output_tokens"),
           (r"^messages(\[\d+\])?", "input"), (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
           (r"^top_logprobs", "top_logprobs")]


def responses_param(param: str | None) -> str | None:
    """A chat field's name as the Responses API names it."""
    for pattern, repl in _PARAMS:
        if param and re.match(pattern, param):
            return re.sub(pattern, repl, param, count=1)
    return param


@contextlib.contextmanager
def responses_names():
    """Errors raised inside name the Responses API's fields."""
    try:
        yield
    except APIError as exc:
        named = responses_param(exc.param)
        if named != exc.param and exc.param:
            exc.message = exc.message.replace(exc.param, named)
            exc.param = named
        raise


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request that ``body`` asks for, on ``messages``."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                            "top_p": body.top_p}
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.top_logprobs is not None:
        chat.update(logprobs=True, top_logprobs=body.top_logprobs)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None:
            raise bad_request("missing required parameter: text.format.name", "text.format.name",
                              "missing_required_parameter")
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        spec = {k: v for k, v in spec.items() if v is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    for key in ("service_tier", "user"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.adapters:
        chat["adapters"] = [a.model_dump() for a in body.adapters]
    return chat


async def plan_response(svc: Services, caller: Caller, store: ResponseStore | None,
                        body: ResponsesRequest, conversations: ConversationStore | None = None) -> ResponseJob:
    """The job of ``body``: its conversation (404 for a ``previous_response_id`` or a
    ``conversation`` this key cannot see) and its chat job (what ``plan_chat`` checks, errors named
    as Responses fields)."""
    history: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    conversation_id = None
    if body.conversation is not None:
        conversation_id = body.conversation if isinstance(body.conversation, str) else body.conversation.id
        if body.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot be used together", "conversation")
        found = await conversations.items(conversation_id, caller.key_id) if conversations is not None else None
        if found is None:
            raise not_found(f"no conversation with id '{conversation_id}'", "conversation")
        history, items = (input_messages(found, "conversation") if found else []), found
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id, caller.key_id) if store is not None else None
        if previous is None:
            raise not_found(f"no response with id '{body.previous_response_id}'", "previous_response_id")
        status = shown(previous, svc.config.responses.reclaim_after_s)["status"]
        if status not in CONTINUABLE:
            raise bad_request(f"the response '{body.previous_response_id}' is {status}: only a completed or incomplete "
                              "response can be continued", "previous_response_id")
        history = previous.conversation
        items = input_items(previous) + previous.response.get("output", [])
    conversation = history + (input_messages(body.input) if body.input is not None else [])
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    with responses_names():
        chat = parse(ChatCompletionRequest, chat_body(body, system + conversation))
        job = plan_chat(svc, chat)
        if body.truncation == "auto":
            kept = await fitting(svc, job, system, conversation)
            if len(kept) < len(conversation):
                job = plan_chat(svc, parse(ChatCompletionRequest, chat_body(body, system + kept)))
    given = given_items(body.input)
    seen = {item["id"] for item in items}
    for i, item in enumerate(given):  # an id names one item: a page's cursor must find one place
        if item["id"] in seen:
            raise bad_request(f"duplicate item id '{item['id'][:80]}' (in this input or the conversation it continues)",
                              f"input[{i}].id", "duplicate_item_id")
        seen.add(item["id"])
    return ResponseJob(job, conversation, body, items + given, conversation_id, given)


async def fitting(svc: Services, job: ChatJob, system: list[dict[str, Any]],
                  conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``truncation: auto``: the end of ``conversation`` that fits the model's context with room
    for the reply, dropping whole turns from the start (a turn begins at a user message, so roles
    still alternate); the last turn is always kept (when it alone does not fit, the engine
    refuses it as it would without truncation). Counted with the model's tokenizer, off the loop."""
    spec = svc.spec(job.model, "chat")
    room = describe(spec).context_length - job.params.max_tokens
    starts = [i for i, m in enumerate(conversation) if m["role"] == "user" and i > 0]
    if not starts:
        return conversation
    tokenizer, tools = await tokenizer_of(spec.path), job.tools.template_tools()

    def fits(start: int) -> bool:
        return len(encode(tokenizer, system + conversation[start:], tools)) <= room

    def first_fitting() -> int:
        if fits(0):
            return 0
        lo, hi = 0, len(starts) - 1  # starts[hi] is kept whatever its size; the answer lies in starts[lo..hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return starts[lo]

    return conversation[await asyncio.to_thread(first_fitting):]


def given_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``input`` (checked by ``input_messages``) as items to list: each as sent, with an id (its
    own or a new one), its type and ``status: completed``; a string is one user message."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"id": _item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": given}]}]
    out = []
    for item in given:
        kind = item.get("type", "message")
        given_id = item.get("id")
        listed = {**item, "id": given_id if isinstance(given_id, str) and given_id else _item_id(_ID_PREFIX[kind]),
                  "type": kind, "status": "completed"}
        if kind == "message" and isinstance(item["content"], str):
            assistant = item["role"] == "assistant"
            listed["content"] = [{"type": "output_text" if assistant else "input_text", "text": item["content"],
                                  **({"annotations": []} if assistant else {})}]
        out.append(listed)
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


# -- the response object ------------------------------------------------------------------------------


@dataclass
class Draft:
    """A response being built: its id, times, output items and how it ended."""

    id: str
    job: ResponseJob
    tier_label: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)
    reply: Reply = field(default_factory=lambda: Reply(0))
    background: bool = False
    request: dict[str, Any] | None = None  # a background one's: its body and key tier, to run it again
    runner: str | None = None  # a background one's: the process running it

    def public(self, status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """The ``response`` object, with ``status`` (and ``error`` when it failed) and what has been
        built so far."""
        body = self.job.body
        f = self.reply.finished
        usage = None
        if f is not None:
            usage = {"input_tokens": f.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": f.prompt_tokens + f.completion_tokens}
        fmt = {"type": "text"}
        if body.text and body.text.format:
            fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
        choice = body.tool_choice or "auto"
        if isinstance(choice, FunctionChoice):
            choice = choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": self.background, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": [_visible(item) for item in self.output], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": self.tier_label, "store": body.store, "temperature": body.temperature,
            "conversation": {"id": self.job.conversation_id} if self.job.conversation_id else None,
            "text": {"format": fmt}, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_logprobs": body.top_logprobs, "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.reply.finish_reason == "length" else "completed"

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation a later response continues: this one's input, then its reply."""
        return self.job.conversation + [self.reply.message()]

    async def keep(self, store: ResponseStore | None, owner: str, conversations: ConversationStore | None) -> None:
        """Store the finished response when the request asked to, and add it to its conversation."""
        if self.job.body.store and store is not None:
            await store.put(self.record(self.status, owner))
        await self.add_to_conversation(conversations, owner)

    async def add_to_conversation(self, conversations: ConversationStore | None, owner: str) -> None:
        """Its input items and output items, added to the conversation it continued (if any)."""
        if self.job.conversation_id is None or conversations is None:
            return
        if not await conversations.add_items(self.job.conversation_id, owner, self.job.added + self.output):
            log.info("response %s: its conversation %s was deleted before it ended", self.id, self.job.conversation_id)

    def record(self, status: str, owner: str, error: dict[str, str] | None = None) -> StoredResponse:
        """The stored record of this response at ``status`` (a background one's carries the time)."""
        return StoredResponse(self.id, owner, self.created_at, self.public(status, error), self.conversation(),
                              self.job.items, time.time() if self.background else None, self.request, self.runner)


def message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _visible(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as shown: a message still being streamed with its text so far."""
    if "_text" not in item:
        return item
    return message_item(item["id"], "".join(item["_text"]), item["status"], item.get("_logprobs"))


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def whole_output(draft: Draft) -> list[dict[str, Any]]:
    """The output items of a finished reply: its message (when it has text or no calls), then
    its calls; all ``incomplete`` when the reply stopped at ``max_output_tokens``."""
    r, status = draft.reply, draft.status
    text = "".join(r.content)
    logprobs = chat_content(r.logprobs) if r.logprobs is not None else None
    items = [message_item(_item_id("msg"), text, status, logprobs)] if text or not r.calls.calls else []
    return items + [call_item(_item_id("fc"), c, status) for c in r.calls.calls]


async def response_result(svc: Services, caller: Caller, data: dict) -> dict[str, Any]:
    """A batch line's response: not stored, and it cannot continue a stored one."""
    body = parse(ResponsesRequest, data)
    if body.stream:
        raise bad_request("stream is not supported in a batch", "stream")
    if body.background:
        raise bad_request("background is not supported in a batch (a batch line already runs on its own)", "background")
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported in a batch", "previous_response_id")
    if body.conversation is not None:
        raise bad_request("conversation is not supported in a batch", "conversation")
    job = await plan_response(svc, caller, None, body.model_copy(update={"store": False}))
    with responses_names():
        replies, tier = await collect(serve_chat(svc, caller, job.chat, None))
    draft = Draft(_item_id("resp"), job, service_tier.label(svc.config, tier), reply=replies[0])
    draft.output = whole_output(draft)
    return draft.public(draft.status)


# -- HTTP ---------------------------------------------------------------------------------------------


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


async def create_response(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ResponsesRequest, await read_json(request, svc.config.limits.max_body))
    store, conversations = _store(request), request.app.state.conversations
    job = await plan_response(svc, caller, store, body, conversations)
    served = served_caller(svc, caller, job.chat)
    draft = Draft(_item_id("resp"), job, service_tier.label(svc.config, served.tier), background=body.background)
    if body.background:
        draft.runner = request.app.state.background.runner
        draft.request = {"body": body.model_dump(mode="json", by_alias=True, exclude_unset=True), "tier": caller.tier,
                         "attempts": 1}
    headers = {**svc.gate.rate_headers(served.tier), "x-tiergate-tier": served.tier}
    if body.background:
        if not body.store:
            raise bad_request("a background response must be stored: background needs store true", "background")
        await store.put(draft.record("queued", caller.key_id))
        events = None
        if body.stream:  # its first events are stored with it, before it is answered
            events = _Events(store, draft, _Stream(draft))
            queued = draft.public("queued")
            await events.add([events.s.event("response.created", response=queued),
                              events.s.event("response.queued", response=queued)], flush=True)
        background: Background = request.app.state.background
        background.start(draft.id, lambda gone: _run_in_background(svc, caller, draft, store, conversations, background,
                                                                   gone, events),
                         events.log if events else None)
        if events is not None:
            return Streamed(events.log.follow(-1), "text/event-stream", headers=headers)
        return JSONResponse(draft.public("queued"), headers=headers)
    with responses_names():  # the engine refuses a prompt past the context: that is ``input``
        async with disconnect_signal(request) as gone:
            deltas = serve_chat(svc, caller, job.chat, gone)
            if not body.stream:
                replies, _ = await collect(deltas)
                draft.reply = replies[0]
                draft.output = whole_output(draft)
                await draft.keep(store, caller.key_id, conversations)
                return JSONResponse(draft.public(draft.status), headers=headers)
            first = await deltas.__anext__()
    events = _events(deltas, first, draft, store, caller.key_id, conversations)
    return Streamed(events, "text/event-stream", headers=headers)


async def _run_in_background(svc: Services, caller: Caller, draft: Draft, store: ResponseStore,
                             conversations: ConversationStore, background: Background, gone: Gone,
                             events: "_Events | None") -> None:
    """A background response's work: served as a live request would be (``gone`` is its stop
    signal), its record rewritten as it goes, and how it ended stored; a streamed one's events
    added to ``events`` as they are made, its last after its record is written."""
    owner, phase = caller.key_id, ["queued"]
    beat = asyncio.get_running_loop().create_task(_heartbeat(store, draft, owner, phase, gone))
    status, error, shut_down = "failed", None, False
    try:
        with responses_names():
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
                await events.add([events.s.event("response.in_progress", response=draft.public("in_progress"))])
                async with contextlib.aclosing(_after(first, deltas)) as each:
                    async for delta in each:
                        await events.add(_lines(events.s, delta))
                        if delta.finished is not None:
                            break
                await events.add(_tail(events.s))
        status = draft.status
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
    if shut_down and events is None and _reclaimable(draft.record("queued", owner)):
        # handed back: stored queued and unwritten since the epoch, so that the next process to look
        # (another one now, or this server once it is back) runs it again (``reclaim``)
        back = replace(draft.record("queued", owner), beat=0.0)
        back = replace(back, response={**back.response, "output": []})
        if await store.update_running(back):
            log.info("background response %s: handed back at shutdown, to run again", draft.id)
            return
    if events is not None:  # what it had begun, closed; all stored before its record says it ended
        await events.add(events.s.close("incomplete") if status not in CONTINUABLE else [], flush=True)
    kept = await store.update_running(draft.record(status, owner, error))
    if kept and status in CONTINUABLE:
        await draft.add_to_conversation(conversations, owner)
    if (kept or status == "cancelled") and svc.webhooks is not None:  # (not for one deleted meanwhile)
        svc.webhooks.emit(f"response.{status}", draft.id, owner)
    if events is not None:
        await events.add([_last_event(draft.public(status, error), events.s.next())], flush=True)
        events.log.end()
    log.info("background response %s: %s%s%s", draft.id, status, f" ({error['code']})" if error else "",
             "" if kept else " (not recorded: cancelled or deleted meanwhile)")


class _Events:
    """A streamed background response's events: numbered by ``s``, added to ``log`` for this
    process's followers, and written to the store for any process's (every FLUSH_S, and when
    asked); a failed write is tried again with the next."""

    def __init__(self, store: ResponseStore, draft: Draft, s: "_Stream") -> None:
        self.store, self.draft, self.s = store, draft, s
        self.log = EventLog()
        self.stored = 0
        self.flushed_at = time.monotonic()

    async def add(self, events: list[str], flush: bool = False) -> None:
        self.log.add(events)
        if flush or time.monotonic() - self.flushed_at >= FLUSH_S:
            await self.flush()

    async def flush(self) -> None:
        self.flushed_at = time.monotonic()
        new = self.log.events[self.stored:]
        if not new:
            return
        try:
            await self.store.add_events(self.draft.id, self.draft.created_at, self.stored, new)
        except Exception as exc:  # noqa: BLE001 - the store is down: followers here still see them
            log.warning("background response %s: storing its events failed: %s", self.draft.id, exc)
            return
        self.stored += len(new)


def _reclaimable(record: StoredResponse) -> bool:
    """Whether a background response left by a dead process is run again elsewhere: one kept with
    its request, not streamed (its followers saw part of it), run fewer than RECLAIM_TRIES times."""
    asked = record.request
    return asked is not None and not asked["body"].get("stream") and asked.get("attempts", 1) < RECLAIM_TRIES


async def reclaim(svc: Services, store: ResponseStore, conversations: ConversationStore | None,
                  background: Background) -> list[str]:
    """One pass: run here again the background responses whose process died (still running in the
    store, unwritten for ``responses.reclaim_after_s``, ``_reclaimable``), each taken by one process's ``claim`` and run
    from the start under this process's runner; what was reclaimed."""
    taken = []
    for response_id, doc in await store.running():
        record = StoredResponse.of(response_id, doc)
        stale = record.beat is not None and time.time() - record.beat > svc.config.responses.reclaim_after_s
        if response_id in background.running or not stale:
            continue
        if not _reclaimable(record):
            continue
        asked = {**record.request, "attempts": record.request.get("attempts", 1) + 1}
        claimed = replace(record, response={**record.response, "status": "queued", "output": []}, beat=time.time(),
                          request=asked, runner=background.runner)
        if not await store.claim(response_id, doc, claimed):
            continue  # another process took it first, or it changed meanwhile
        caller = Caller(asked["tier"], record.owner)
        body = ResponsesRequest.model_validate(asked["body"])
        try:
            job = await plan_response(svc, caller, store, body, conversations)
        except APIError as exc:  # what it continued is gone, say
            await store.update_running(replace(claimed, response={**claimed.response, "status": "failed",
                                                                   "error": {"code": exc.code, "message": exc.message}}))
            continue
        draft = Draft(response_id, job, record.response["service_tier"], created_at=record.created_at, background=True,
                      request=asked, runner=background.runner)
        background.start(response_id, lambda gone, d=draft: _run_in_background(svc, caller, d, store, conversations,
                                                                                background, gone, None))
        log.info("background response %s: its process stopped writing it; run again here (attempt %d)",
                 response_id, asked["attempts"])
        taken.append(response_id)
    return taken


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


def shown(record: StoredResponse, stale_s: float) -> dict[str, Any]:
    """The response object of ``record`` as the API shows it: a running one whose process stopped
    writing it (its last write older than ``stale_s``, ``responses.reclaim_after_s``) as ``failed``,
    unless another process will run it again (``reclaim``: then it is ``queued``)."""
    response = record.response
    if response["status"] in RUNNING and (record.beat is None or time.time() - record.beat > stale_s):
        if _reclaimable(record):
            return {**response, "status": "queued"}
        return {**response, "status": "failed",
                "error": {"code": "server_error", "message": "the server process running this background response "
                                                             "stopped before it finished; create it again"}}
    return response


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the prompt tokens the response would have (``usage.input_tokens``),
    counted by the model's own tokenizer and chat template; no model work, so no gate."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(InputTokensRequest, await read_json(request, svc.config.limits.max_body))
    job = await plan_response(svc, caller, _store(request), body, request.app.state.conversations)
    if svc.accounts is not None and not svc.accounts.allows(caller, job.chat.model):
        raise not_found(f"the model '{body.model}' does not exist", "model", "model_not_found")
    tokenizer = await tokenizer_of(svc.spec(job.chat.model, "chat").path)
    ids = await asyncio.to_thread(encode, tokenizer, job.chat.messages, job.chat.tools.template_tools())
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})


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
    events = running.follow(after_n) if running is not None else _replay(store, record, after_n,
                                                                         svc.config.responses.reclaim_after_s)
    return Streamed(events, "text/event-stream", headers={})


async def _replay(store: ResponseStore, record: StoredResponse, after: int, stale_s: float) -> AsyncIterator[str]:
    """A streamed background response's stored events above ``after``; while another process
    still runs it, each new one as that process stores it (read every POLL_S). Its last event is
    one of ENDING; when the record ended without one stored (that process died, or had not stored
    it yet), the last is made from the record as ``_last_event`` makes it there."""
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
            if not (new and _ends(new[-1])):
                yield _last_event(response, n + len(new))
            return
        await asyncio.sleep(POLL_S)


ENDING = ("response.completed", "response.incomplete", "response.failed", "error")


def _ends(event: str) -> bool:
    return event.split("\n", 1)[0].removeprefix("event: ") in ENDING


def _last_event(response: dict[str, Any], seq: int) -> str:
    """The event that ends a background response's stream, number ``seq``: ``response.<status>``
    with the response, or for a cancelled one an ``error`` (the Responses API has no event for a
    cancel)."""
    if response["status"] == "cancelled":
        return _sse("error", seq, code="response_cancelled", message="the response was cancelled", param=None)
    return _sse(f"response.{response['status']}", seq, response=response)


def _sse(kind: str, seq: int, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data, 'sequence_number': seq})}\n\n"


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
            if await store.update_running(replace(record, response={**record.response, "status": "cancelled"},
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


def input_items(record: StoredResponse) -> list[dict[str, Any]]:
    """The items ``record`` was made from, oldest first: those kept with it, or for a record from
    before they were kept, its conversation but its reply in the Responses API's shapes, with ids
    fixed by the response and each item's place."""
    if record.input_items is not None:
        return record.input_items
    tag = record.id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    for k, m in enumerate(record.conversation[:-1]):
        if m["role"] == "tool":
            items.append({"id": f"fco_{tag}{k:04x}", "type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"], "status": "completed"})
            continue
        if m.get("content") is not None or not m.get("tool_calls"):
            part = {"type": "output_text", "text": m["content"] or "", "annotations": []} if m["role"] == "assistant" \
                else {"type": "input_text", "text": m["content"]}
            items.append({"id": f"msg_{tag}{k:04x}", "type": "message", "role": m["role"], "status": "completed",
                          "content": [part]})
        items += [call_item(f"fc_{tag}{k:04x}{j:02x}", call, "completed") for j, call in enumerate(m.get("tool_calls") or [])]
    return items


async def delete_response(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    response_id = request.path_params["response_id"]
    if not await _store(request).delete(response_id, caller.key_id):
        raise not_found(f"no response with id '{response_id}'", "response_id")
    if not await request.app.state.background.cancel(response_id, 0):  # a background one running here stops now
        await _store(request).announce_stop(response_id)  # one running elsewhere, then (Redis)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


# -- streaming ----------------------------------------------------------------------------------------


class _Stream:
    """The events of one streamed response, numbered, and the output items they build."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.seq = 0
        self.text: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function call item

    def event(self, kind: str, **data: Any) -> str:
        return _sse(kind, self.next(), **data)

    def next(self) -> int:
        """Take the next event's number."""
        self.seq += 1
        return self.seq - 1

    @property
    def index(self) -> int:
        return len(self.draft.output) - 1

    def open_text(self) -> list[str]:
        item = message_item(_item_id("msg"), "", "in_progress", None)
        item["content"] = []
        self.text = item
        self.draft.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=self.index, item=dict(item, content=[])),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                           content_index=0, part=part)]

    def add_text(self, text: str, logprobs: list | None) -> list[str]:
        out = [] if self.text is not None else self.close() + self.open_text()
        item = self.text
        item.setdefault("_text", []).append(text)
        if logprobs is not None:
            item.setdefault("_logprobs", []).extend(logprobs)
        return out + [self.event("response.output_text.delta", item_id=item["id"], output_index=self.index,
                                 content_index=0, delta=text, logprobs=logprobs or [])]

    def add_call(self, delta: CallDelta) -> list[str]:
        out = []
        if delta.id is not None:
            out = self.close()
            item = call_item(_item_id("fc"), {"id": delta.id, "function": {"name": delta.name, "arguments": ""}},
                             "in_progress")
            self.call = item
            self.draft.output.append(item)
            out.append(self.event("response.output_item.added", output_index=self.index, item=dict(item)))
        if delta.arguments:
            self.call["arguments"] += delta.arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                                  output_index=self.index, delta=delta.arguments))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """End the open item (if any) with its done events and ``status``."""
        out: list[str] = []
        if self.text is not None:
            item, self.text = self.text, None
            text = "".join(item.pop("_text", []))
            logprobs = item.pop("_logprobs", None)
            final = message_item(item["id"], text, status, logprobs)
            item.clear()
            item.update(final)
            part = final["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=self.index,
                               content_index=0, text=text, logprobs=logprobs or []),
                    self.event("response.content_part.done", item_id=item["id"], output_index=self.index,
                               content_index=0, part=part),
                    self.event("response.output_item.done", output_index=self.index, item=final)]
        if self.call is not None:
            item, self.call = self.call, None
            item["status"] = status
            out += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=self.index, item=item)]
        return out


def _lines(s: _Stream, delta: ChoiceDelta) -> list[str]:
    """The events of one delta of the reply (which it is added to)."""
    s.draft.reply.add(delta)
    out: list[str] = []
    if delta.content or (delta.logprobs and s.text is not None):
        out += s.add_text(delta.content, chat_content(delta.logprobs) if delta.logprobs is not None else None)
    for call in delta.calls:
        out += s.add_call(call)
    return out


def _tail(s: _Stream) -> list[str]:
    """The events that end a finished reply's items (an empty reply is still one, empty, message)."""
    return (s.open_text() if not s.draft.output else []) + s.close(s.draft.status)


async def _events(deltas: AsyncGenerator[ChoiceDelta, None], first: ChoiceDelta, draft: Draft,
                  store: ResponseStore, owner: str, conversations: ConversationStore | None) -> AsyncIterator[str]:
    s = _Stream(draft)
    try:
        yield s.event("response.created", response=draft.public("in_progress"))
        yield s.event("response.in_progress", response=draft.public("in_progress"))
        delta = first
        while True:
            for line in _lines(s, delta):
                yield line
            if delta.finished is not None:
                break
            delta = await deltas.__anext__()
        for line in _tail(s):
            yield line
        status = draft.status
        await draft.keep(store, owner, conversations)
        yield s.event(f"response.{status}", response=draft.public(status))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        yield s.event("error", code="generation_failed", message=f"generation failed: {type(exc).__name__}",
                      param=None)
    finally:
        await deltas.aclose()
