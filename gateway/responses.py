"""The Responses API's model: its request, how a request becomes a chat job (input items as chat
messages, ``previous_response_id``, ``conversation``, ``truncation``), the response object and its
output items, how a stored response reads, and the stream of events a response is rendered as.

A request becomes a chat job: ``input`` (a string, or items: messages with ``input_text`` /
``output_text`` parts, ``function_call`` and ``function_call_output`` items) is turned into chat
messages after ``instructions`` (a system message) and, with ``previous_response_id``, after the
items of that response (its input items and its output, read again as a conversation's are: a
file deleted since is a 404; its instructions are not carried over, as OpenAI does), or with
``conversation`` after that conversation's items
(``gateway.conversations``), to which its input and output items are added once it ends
``completed`` or ``incomplete``. Tools, ``tool_choice``, ``text.format`` and the sampling fields are read by
the chat planner (``gateway.chat.plan_chat``: tools, structured outputs, the token limit), so a
response runs through the same serving core, gate, arbiter and engines as chat; a 400 names the
Responses field (``text.format``, ``max_output_tokens``, ``input``...).

The reply is a list of output items: a reasoning model's thinking as a ``reasoning`` item (its
text as ``reasoning_text`` content), a ``message`` with one ``output_text`` part, and a
``function_call`` item per tool call. ``status`` is ``completed``, or ``incomplete`` (with
``incomplete_details.reason: max_output_tokens``) when the reply hit the limit. With ``store``
(the default) the response and its conversation are kept in the durable store
(``gateway.response_store``), visible only to the key that made it.

Streaming sends OpenAI's events, each ``event: <type>`` plus ``data`` with ``type`` and a growing
``sequence_number``: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
for a call ``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``,
for thinking ``response.reasoning_text.delta``..., ``response.reasoning_text.done``,
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

The HTTP handlers are in ``gateway.responses_api``; background responses run in
``gateway.response_runs``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from gateway import service_tier
from gateway.auth import Caller
from gateway.chat import ChatJob, ChoiceDelta, Reply, collect, engine_config, plan_chat, serve_chat, with_images
from gateway.completions import processor_of, tokenizer_of
from gateway.adapters import resolve_request
from gateway.conversation_store import ConversationStore, DuplicateItem
from gateway.errors import APIError, bad_request, not_found
from gateway.input_files import read_files
from gateway.logprobs import chat_content
from gateway.response_store import ResponseStore, StoredResponse
from gateway.schemas import (MAX_REPETITION_PENALTY, MAX_STACK, MAX_TOOLS, MIN_REPETITION_PENALTY, TOOL_NAME,
                             AdapterChoice, ChatCompletionRequest, EndUser, Metadata, StructuredOutputs, _Body, loads,
                             parse, served_tool_types)
from gateway.service import Services
from gateway.serving import Gone
from gateway.tools import CallDelta
from gateway.vector_search import check_filter, search_stores
from gateway.vector_stores import RankingOptions, expired_error
from gateway.vision import check_reads_images, read_image_url
from workers.base import ChatParams, ChatRequest, InvalidParam
from workers.chat_prompt import encode, vision_inputs
from workers.registry import describe

log = logging.getLogger("tiergate.responses")

RECLAIM_TRIES = 3  # runs of one background response at most (a request that kills its process stops)
RUNNING = ("queued", "in_progress")
CONTINUABLE = ("completed", "incomplete")


class FunctionTool(_Body):
    type: Annotated[Literal["function"], served_tool_types("function", "file_search")]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FileSearchTool(_Body):
    """The built-in file search over the caller's vector stores (``gateway.vector_stores``)."""

    type: Literal["file_search"]
    vector_store_ids: list[str] = Field(min_length=1, max_length=16)
    max_num_results: int = Field(default=10, ge=1, le=50)
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None


Tool = Annotated[Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[FileSearchTool, Tag("FileSearchTool")],
                 Discriminator(lambda t: "FileSearchTool" if isinstance(t, dict) and t.get("type") == "file_search"
                               or isinstance(t, FileSearchTool) else "FunctionTool")]


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class FileSearchChoice(_Body):
    type: Literal["file_search"]


class ReasoningOptions(_Body):
    """``reasoning``: its ``effort`` goes to the chat template as chat's ``reasoning_effort`` does.
    ``summary`` is taken and shown (the Agents SDK and Codex send ``auto``), but no summary is
    written: no summarizer runs here, and the reasoning item holds the whole thinking instead, as
    vLLM serves open-weight models. (``generate_summary`` is its deprecated name.)"""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class AllowedToolsChoice(_Body):
    """Responses' flat form: ``{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}``."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


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


class ResponseStreamOptions(_Body):
    include_obfuscation: bool | None = None  # accepted; no padding field is added to the events


class ResponsesRequest(EndUser):
    # OpenAI's nullable fields (_Body): null is the default (store: true)
    null_is_default: ClassVar[frozenset[str]] = frozenset({"temperature", "top_p", "store", "stream", "background"})
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's sampling extensions, as chat's
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    structured_outputs: StructuredOutputs | None = None  # vLLM's, as chat's; not with a text.format
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | FileSearchChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1)
    conversation: str | ConversationRef | None = None  # its id, or {"id": ...}
    stream: bool = False
    include: list[str] | None = None  # message.output_text.logprobs: logprobs (as top_logprobs does); others accepted
    metadata: Metadata = None
    service_tier: str | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # of built-in tools: none is served, so none is made
    stream_options: ResponseStreamOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the oldest turns dropped until it fits
    background: bool = False
    reasoning: ReasoningOptions | None = None
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
    searched: dict[str, Any] | None = None  # its file_search_call output item, when it searched
    sources: tuple[tuple[str, str], ...] = ()  # the files the search found (id, name), the best first
    query_usage: tuple[int, int] = (0, 0)  # prompt and completion tokens of the turn that wrote its queries
    system: list[dict[str, Any]] = field(default_factory=list)  # the instructions, as a system message
    ready: bool = False  # ``prepared``: searched, and its prompt cut to the context (truncation auto)


# -- input items as chat messages ---------------------------------------------------------------------

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    # caller and namespace (name on an output): OpenAI's for namespaced tools and calls a program made, which
    # the SDK's own items carry as null (``model_dump()``); taken at a plain call's values (``_plain_call``)
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "caller", "namespace"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "caller", "name", "namespace"},
    # a reasoning model's thinking from an earlier turn (sent back as the Agents SDK does): its text
    # goes to the template as the next assistant message's reasoning_content
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
    # an earlier response's file search, sent back as the Agents SDK sends every output item: listed,
    # not rendered (a response searches again with its own input)
    "file_search_call": {"type", "id", "queries", "status", "results"},
    # what POST /v1/responses/compact made of a conversation's earlier turns: read as their summary
    "compaction": {"type", "id", "encrypted_content", "created_by", "status"},
}
COMPACTED = "A summary of the conversation before this point, which you wrote:\n"  # how a compaction item reads


def compaction_item(summary: str) -> dict[str, Any]:
    """The item that stands for a conversation's compacted turns. Its ``encrypted_content`` is
    opaque to a client but not encrypted: the summary, as base64 of a small JSON document, so that
    any server process reads it back (nothing is kept for it)."""
    content = base64.urlsafe_b64encode(json.dumps({"v": 1, "summary": summary}).encode()).decode()
    return {"id": new_item_id("cmp"), "type": "compaction", "encrypted_content": content}


def _compacted(item: dict[str, Any], where: str) -> str:
    """The summary a compaction item holds; 400 naming its ``encrypted_content`` when it holds none."""
    try:
        doc = loads(base64.urlsafe_b64decode(item["encrypted_content"].encode()))  # strict: no RecursionError
        if isinstance(doc, dict) and doc.get("v") == 1 and isinstance(doc.get("summary"), str):
            return doc["summary"]
    except (KeyError, AttributeError, TypeError, ValueError):
        pass
    raise bad_request("a compaction item's encrypted_content is what POST /v1/responses/compact made, as it made it",
                      f"{where}.encrypted_content", "invalid_value")


def input_messages(items: str | list[dict[str, Any]], name: str = "input", hosts: list[str] = (),
                   places: list[str] | None = None) -> list[dict[str, Any]]:
    """Chat messages of ``input`` (or items called ``name``); 400 naming the item (``input[i]...``)
    that cannot be one. Function calls join the assistant message before them (or start one).
    ``hosts``: where image URLs may point (``server.image_url_hosts``). ``places``: each message's
    item (``input[i]``) is added to it, to name a chat error's part as the request does (``Places``)."""
    if isinstance(items, str):
        if places is not None:
            places.append(name)
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request(f"{name} must not be an empty list", name)
    out: list[dict[str, Any]] = []
    origin: list[str] = []  # each message's item
    thought: str | None = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        where = f"{name}[{i}]"
        kind = item.get("type", "message")
        if thought is not None and not _answers(item):  # a reply that was thinking only (cut short): a turn still
            out.append(_thinking_only(thought))
            origin.append(f"{name}[{i - 1}]")
            thought = None
        if kind not in _ITEM_KEYS:
            raise bad_request(f"input items of type {str(kind)[:40]!r} are not supported (message, function_call, "
                              "function_call_output, reasoning, file_search_call, compaction)", f"{where}.type")
        extra = sorted(set(item) - _ITEM_KEYS[kind])
        if extra:
            raise bad_request(f"unrecognized field of a {kind} item: {extra[0]}", f"{where}.{extra[0]}",
                              "unknown_parameter")
        if kind in ("function_call", "function_call_output"):
            _plain_call(item, where)
        if kind == "file_search_call":
            continue
        if kind == "compaction":
            out.append({"role": "system", "content": COMPACTED + _compacted(item, where)})
            origin.append(where)
            continue
        if kind == "reasoning":
            if not isinstance(item.get("summary", []), list):
                raise bad_request("a reasoning item's summary is a list", f"{where}.summary", "invalid_type")
            content = item.get("content")  # null: none (the SDK's item without content, dumped whole)
            if content is not None and not isinstance(content, list):
                raise bad_request("a reasoning item's content is a list", f"{where}.content", "invalid_type")
            thought = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
            continue
        if kind == "message":
            role = _role(item, where)
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content", role == "assistant",
                                                       images=hosts if role == "user" else None)})
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
        if thought and out[-1]["role"] == "assistant":  # the thinking that led to this reply or call
            out[-1]["reasoning_content"] = thought
        thought = None
        origin += [where] * (len(out) - len(origin))
    if thought is not None and name != "input":  # the history's last reply was thinking only; the input follows it
        out.append(_thinking_only(thought))
        origin.append(f"{name}[{len(items) - 1}]")
    if not out and name == "input":  # (a conversation's items may be anything so far)
        raise bad_request(f"{name} holds reasoning items only: no message to answer", name)
    if places is not None:
        places += origin
    return out


def _plain_call(item: dict[str, Any], where: str) -> None:
    """A call item's (or its output's) ``caller`` and ``namespace`` at a plain function call's values,
    null or ``{"type": "direct"}`` and null, and an output's ``name`` a string or null; 400 naming
    the field otherwise: namespaced tools and calls made by a program are not served here."""
    if item.get("caller") not in (None, {"type": "direct"}):
        raise bad_request("a call made by a program is not served here: a call's caller is null or {\"type\": "
                          "\"direct\"} (the model called it)", f"{where}.caller", "invalid_value")
    if item.get("namespace") is not None:
        raise bad_request("namespaced tools are not served here: a call's namespace is null", f"{where}.namespace",
                          "invalid_value")
    if item.get("type") == "function_call_output" and not isinstance(item.get("name"), (str, type(None))):
        raise bad_request(f"invalid type for {where}.name: a string is expected", f"{where}.name", "invalid_type")


def _thinking_only(thought: str) -> dict[str, Any]:
    """The assistant message of a reply that was only thinking (as chat's ``Reply.message`` stores one)."""
    return {"role": "assistant", "content": None, "reasoning_content": thought} if thought \
        else {"role": "assistant", "content": ""}


def _answers(item: Any) -> bool:
    """Whether ``item`` carries the reply a reasoning item before it thought: an assistant message or a call."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    return kind in ("function_call", "reasoning") or (kind == "message" and item.get("role") == "assistant")


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


def _text(content: Any, where: str, assistant: bool = False,
          images: list[str] | None = None) -> str | list[dict[str, Any]]:
    """The text of a content field: a string, or text parts (other parts are refused). An
    assistant's ``refusal`` parts are history, accepted and not rendered, as chat takes them.
    With ``images`` (a user message: the hosts its image URLs may name) ``input_image`` parts are
    taken too: such content becomes chat's parts, text and ``image_url`` in order
    (``gateway.vision`` reads them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where, "invalid_type")
    if images is not None and any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return _chat_parts(content, where, images)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            raise bad_request("content parts of type 'input_image' are only for user messages", f"{where}[{j}].type")
        if kind not in _TEXT_PARTS and kind != "refusal":
            raise bad_request(f"content parts of type {str(kind)[:40]!r} are not supported (input_text, output_text, "
                              "input_image)", f"{where}[{j}].type")
        if kind == "refusal" and not assistant:
            raise bad_request("content parts of type 'refusal' are only for assistant messages", f"{where}[{j}].type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"a {kind} part needs its text as a string", f"{where}[{j}]", "invalid_type")
        if kind != "refusal":
            texts.append(text)
    return "".join(texts)


def _first_image(items: str | list[dict[str, Any]] | None) -> str | None:
    """The place of the first ``input_image`` part of ``input`` (``input[i].content[j].type``)."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_image":
                return f"input[{i}].content[{j}].type"
    return None


def _chat_parts(content: list[Any], where: str, hosts: list[str]) -> list[dict[str, Any]]:
    """A user message's text and ``input_image`` parts as chat's ``text`` and ``image_url`` parts."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if part.get("file_id") is not None and part.get("image_url") is None:  # (``read_files`` reads them)
                raise bad_request("input_image by file_id is not read here: send image_url as a data: URL",
                                  f"{where}[{j}].file_id", "unsupported_value")
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request("an input_image part needs image_url as a string", f"{where}[{j}].image_url",
                                  "missing_required_parameter" if url is None else "invalid_type")
            read_image_url(url, f"{where}[{j}].image_url", hosts)  # its 400 named here: chat's would name a message
            detail = part.get("detail")
            parts.append({"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}})
        elif kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad_request(f"a {kind} part needs its text as a string", f"{where}[{j}]", "invalid_type")
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise bad_request(f"content parts of type {str(kind)[:40]!r} are not supported in a user message (input_text, "
                              "input_image, input_file)", f"{where}[{j}].type")
    return parts


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


_CONTINUED = {"previous_response_id": "previous response", "conversation": "conversation"}


@dataclass(frozen=True)
class Places:
    """Where each chat message of a response's prompt came from (``instructions``, ``input[i]``,
    ``previous_response_id[i]``, ``conversation[i]``): a chat error about a message's part is named
    as the request names it, ``input[i].content[j].image_url`` (or ``.detail``), not ``messages[k]...``."""

    paths: tuple[str, ...]

    def name(self, param: str) -> str | None:
        found = re.match(r"messages\[(\d+)\](.*)", param)
        if found is None or int(found[1]) >= len(self.paths):
            return None
        path, rest = self.paths[int(found[1])], found[2]
        if path == "instructions":
            return path
        part = re.fullmatch(r"\.content\[(\d+)\]\.image_url\.(url|detail)", rest)
        if part is not None:  # an input_image's fields: image_url (a string), detail
            rest = f".content[{part[1]}].{'detail' if part[2] == 'detail' else 'image_url'}"
        return path + rest

    def continued(self) -> str | None:
        """What the prompt continues (``previous_response_id``, ``conversation``), if anything."""
        return next((p.split("[")[0] for p in self.paths if p.startswith(("previous_response_id", "conversation"))),
                    None)


@contextlib.contextmanager
def responses_names(places: Places | None = None):
    """Errors raised inside name the Responses API's fields (a message's part by ``places``)."""
    try:
        yield
    except APIError as exc:
        named = (places.name(exc.param) if places is not None and exc.param else None) or responses_param(exc.param)
        if named != exc.param and exc.param:
            exc.message = exc.message.replace(exc.param, named)
            exc.param = named
        if exc.code == "too_many_images" and places is not None and places.continued():  # not this input's alone
            exc.message += f" (counting those of the {_CONTINUED[places.continued()]} it continues)"
        raise


LOGPROBS = "message.output_text.logprobs"  # the include that asks for the output text's logprobs


def chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request that ``body`` asks for, on ``messages``."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.stream:  # its text as the engine writes it, not held to the reply's end (``ChatRequest.stream``):
        chat["stream"] = True  # a client that leaves mid-stream is seen there, and its work stopped
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    # the sampling fields the request sets; the rest are the model's defaults, as chat's (``schemas.sampling``)
    chat.update({k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                 if k in body.model_fields_set and getattr(body, k) is not None})
    if body.top_logprobs is not None or LOGPROBS in (body.include or ()):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    functions = [t for t in body.tools or [] if isinstance(t, FunctionTool)]
    if functions:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in functions]
    searches = any(isinstance(t, FileSearchTool) for t in body.tools or [])
    if isinstance(body.tool_choice, FileSearchChoice) and not searches:
        raise bad_request("tool_choice is file_search, and tools has no file_search tool", "tool_choice")
    if isinstance(body.tool_choice, FileSearchChoice) or (body.tool_choice == "required" and searches and not functions):
        pass  # the file search is what is asked for: it runs before the model (``file_search``)
    elif isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif isinstance(body.tool_choice, AllowedToolsChoice):
        chat["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
            "mode": body.tool_choice.mode,
            "tools": [{"type": "function", "function": {"name": t.name}} for t in body.tool_choice.tools]}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
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
    if body.structured_outputs is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_request("set text.format or structured_outputs, not both", "structured_outputs")
        chat["structured_outputs"] = body.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
    for key in ("service_tier", "user"):
        if getattr(body, key) is not None:
            chat[key] = getattr(body, key)
    if body.adapters:
        chat["adapters"] = [a.model_dump() for a in body.adapters]
    return chat


async def plan_response(svc: Services, caller: Caller, store: ResponseStore | None,
                        body: ResponsesRequest, conversations: ConversationStore | None = None,
                        write_queries: bool = True, prepare: bool = True) -> ResponseJob:
    """The job of ``body``: its conversation (404 for a ``previous_response_id`` or a
    ``conversation`` this key cannot see) and its chat job (what ``plan_chat`` checks, errors named
    as Responses fields), then ``prepared`` (its file search run, its prompt fitted to the
    context). ``prepare`` False: checked only (a file search's stores too), to be prepared where it
    runs (a background response, in its run: answered ``queued`` before any model writes its
    search queries). ``write_queries`` False: a file search searches for the latest user message's
    text even where the model would write the queries (counting tokens runs no model)."""
    history: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    conversation_id = None
    paths: list[str] = []  # each chat message's place in the request (``Places``)
    if body.conversation is not None:
        conversation_id = body.conversation if isinstance(body.conversation, str) else body.conversation.id
        if body.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot be used together", "conversation")
        found = await conversations.items(conversation_id, caller.key_id) if conversations is not None else None
        if found is None:
            raise not_found(f"no conversation with id '{conversation_id}'", "conversation")
        history = input_messages(await read_files(svc, caller, found, "conversation"), "conversation",
                                 svc.config.server.image_url_hosts, paths) if found else []
        items = found
    if body.previous_response_id is not None:
        previous = await store.get(body.previous_response_id, caller.key_id) if store is not None else None
        if previous is None:
            raise not_found(f"no response with id '{body.previous_response_id}'", "previous_response_id")
        status = shown(previous, svc.config.responses.reclaim_after_s)["status"]
        if status not in CONTINUABLE:
            raise bad_request(f"the response '{body.previous_response_id}' is {status}: only a completed or incomplete "
                              "response can be continued", "previous_response_id")
        items = input_items(previous) + previous.response.get("output", [])
        # read again from its items, as a conversation's are: a file deleted since is a 404, not kept in the record
        if previous.input_items is None:  # (a record from before they were kept)
            history, paths = previous.conversation, ["previous_response_id"] * len(previous.conversation)
        else:
            history = input_messages(await read_files(svc, caller, items, "previous_response_id"),
                                     "previous_response_id", svc.config.server.image_url_hosts, paths)
    await svc.adapters.ready(body.model, body.adapters)
    image = _first_image(body.input)
    if image is not None:  # named here as an input item: chat's check would name a message
        check_reads_images(resolve_request(svc, body.model, body.adapters, "chat")[0], image)
    conversation = history + (input_messages(await read_files(svc, caller, body.input),
                                             hosts=svc.config.server.image_url_hosts, places=paths)
                              if body.input is not None else [])
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    with responses_names(Places(tuple(["instructions"] * len(system) + paths))):
        chat = parse(ChatCompletionRequest, chat_body(body, system + conversation))
        job = await with_images(svc, plan_chat(svc, chat))
        if not prepare:  # checked now, searched when it runs (``prepared`` looks its stores up again then)
            await search_plan(svc, caller, body, conversation)
    given = given_items(body.input)
    seen = {item["id"] for item in items}
    for i, item in enumerate(given):  # an id names one item: a page's cursor must find one place
        if item["id"] in seen:
            raise duplicate_item(item["id"], given, i)
        seen.add(item["id"])
    planned = ResponseJob(job, conversation, body, items + given, conversation_id, given, system=system)
    return await prepared(svc, caller, planned, write_queries) if prepare else planned


def duplicate_item(item_id: str, given: list[dict[str, Any]], at: int | None = None) -> APIError:
    """The 400 of the input item (of ``given``, its items; at ``at``, else the first with that id)
    whose id the conversation (or the input before it) has already."""
    at = at if at is not None else next((i for i, item in enumerate(given) if item["id"] == item_id), None)
    return bad_request(f"duplicate item id '{item_id[:80]}' (in this input or the conversation it continues)",
                       "input" if at is None else f"input[{at}].id", "duplicate_item_id")


def held(conversations: ConversationStore | None, job: ResponseJob) -> Callable[[], None]:
    """``job``'s input item ids, held in its conversation until it ends (``Holds``), so that a
    response racing it with one of them is refused before its model runs: 400 when a response
    running here holds one already. What releases them."""
    if job.conversation_id is None or conversations is None:
        return lambda: None
    try:
        return conversations.holds.hold(job.conversation_id, [item["id"] for item in job.added])
    except DuplicateItem as exc:
        raise duplicate_item(exc.item_id, job.added) from None


async def prepared(svc: Services, caller: Caller, planned: ResponseJob, write_queries: bool = True,
                   gone: Gone | None = None) -> ResponseJob:
    """``planned`` ready to serve: its file search run (``file_search``; the model may write the
    queries first, stopped by ``gone``), what it found read after the question, and with
    ``truncation: auto`` its prompt cut to the model's context. A job already prepared is
    returned as it is."""
    if planned.ready:
        return planned
    body, system, conversation, job = planned.body, planned.system, planned.conversation, planned.chat
    with responses_names():
        search = await search_plan(svc, caller, body, conversation)
        searched, found, sources, query_usage = (await file_search(svc, caller, body, system, conversation, search,
                                                                   write_queries, gone)
                                                 if search is not None else (None, "", (), (0, 0)))
        prompt = conversation  # what the model reads: with what the search found, after the question
        if searched is not None:
            prompt = _with_excerpts(conversation, found)
            read = plan_chat(svc, parse(ChatCompletionRequest, chat_body(body, system + prompt)))
            job = replace(read, images=job.images)
        if body.truncation == "auto":
            kept = await fitting(svc, job, system, prompt)
            if len(kept) < len(prompt):
                shorter = plan_chat(svc, parse(ChatCompletionRequest, chat_body(body, system + kept)))
                # the images of the turns kept, as read already (a suffix: images go in message order)
                job = replace(shorter, images=job.images[len(job.images) - len(shorter.images):])
    return replace(planned, chat=job, searched=searched, sources=sources, query_usage=query_usage, ready=True)


FILE_SEARCH_RESULTS = "file_search_call.results"  # include: the results in the file_search_call item


@dataclass(frozen=True)
class SearchPlan:
    """A request's ``file_search`` tool, checked: its place in ``tools``, the vector stores it
    searches (the caller's, unexpired) and the latest user message's text."""

    index: int
    tool: FileSearchTool
    stores: tuple[Any, ...]
    query: str


async def search_plan(svc: Services, caller: Caller, body: ResponsesRequest,
                      conversation: list[dict[str, Any]]) -> SearchPlan | None:
    """The request's ``file_search`` tool checked (None when it has none, ``tool_choice`` is
    ``none``, or there is nothing to search for): its vector stores each the caller's (a 404
    naming ``tools[i].vector_store_ids[j]`` otherwise) and unexpired, its filters and ranking
    options valid. Checked when the request is made, searched when it runs."""
    tools = [(i, t) for i, t in enumerate(body.tools or []) if isinstance(t, FileSearchTool)]
    if not tools:
        return None
    if len(tools) > 1:
        raise bad_request("at most one file_search tool", f"tools[{tools[1][0]}]")
    i, tool = tools[0]
    if svc.vector_stores is None:
        raise bad_request("this server keeps no vector stores", f"tools[{i}]")
    now = time.time()
    found = []
    for j, store_id in enumerate(tool.vector_store_ids):
        param = f"tools[{i}].vector_store_ids[{j}]"
        if store_id in tool.vector_store_ids[:j]:
            continue  # named twice, searched once: its hits would be read (and shown) twice
        store = await svc.vector_stores.get(store_id, caller.key_id)
        if store is None:
            raise not_found(f"no vector store with id '{store_id[:80]}'", param, "vector_store_not_found")
        if store.expired(now):
            raise expired_error(store, param)
        found.append(store)
    if tool.filters is not None:
        check_filter(tool.filters, f"tools[{i}].filters")
    (tool.ranking_options or RankingOptions()).weights(f"tools[{i}].ranking_options")
    query = _last_user_text(conversation)
    if body.tool_choice == "none" or not query.strip():
        return None
    return SearchPlan(i, tool, tuple(found), query)


async def file_search(svc: Services, caller: Caller, body: ResponsesRequest, system: list[dict[str, Any]],
                      conversation: list[dict[str, Any]], plan: SearchPlan, write_queries: bool = True,
                      gone: Gone | None = None) -> tuple[dict[str, Any] | None, str, tuple[tuple[str, str], ...], tuple[int, int]]:
    """The search of ``plan`` (``search_plan``), run before the model answers: its
    ``file_search_call`` output item, the text the model reads of what it found, the files found
    (id, name; what the answer may cite), and the tokens of the turn that wrote the queries;
    (None, "", (), usage) when the model wrote no query.

    What is searched for is the model's ``engine.search_queries``: ``message`` (the default), the
    latest user message's text, whatever the model, tool-calling or not, at no extra turn;
    ``model``, the queries the model writes in a turn of its own first (``written_queries``), so a
    follow-up ("and the second one?") is searched for what it means, and none when it needs no
    search. They are searched in the tool's vector stores as ``POST
    /v1/vector_stores/{id}/search`` searches. What it found is read best first, up to half the chat
    model's context, after the latest user message's text (``_with_excerpts``)."""
    tool, query = plan.tool, plan.query
    options = tool.ranking_options or RankingOptions()
    hybrid = options.weights(f"tools[{plan.index}].ranking_options")
    queries, used = [query], (0, 0)
    engine = engine_config(svc, resolve_request(svc, body.model, None, "chat")[0].name)
    if write_queries and engine is not None and engine.search_queries == "model":
        required = isinstance(body.tool_choice, FileSearchChoice) or body.tool_choice == "required"
        written, used = await written_queries(svc, caller, body, system + conversation, required, gone)
        queries = queries if written is None else written
        if not queries:
            return None, "", (), used
    hits = await search_stores(svc, svc.vector_stores, caller, list(plan.stores), queries, tool.filters, tool.max_num_results,
                               options.score_threshold, "input", hybrid, cut=queries != [query])
    hits = await _readable(svc, body.model, hits)
    results = [{"file_id": f.id, "filename": f.filename, "score": score, "text": text, "attributes": f.attributes}
               for score, f, text in hits]
    item = {"id": new_item_id("fs"), "type": "file_search_call", "status": "completed", "queries": queries,
            "results": results if FILE_SEARCH_RESULTS in (body.include or ()) else None}
    return item, _results_text(results), tuple(dict.fromkeys((r["file_id"], r["filename"]) for r in results)), used


MAX_QUERIES = 4  # the most search queries a model writes for one response
QUERY_CHARS = 200  # each at most this long
QUERY_TOKENS = 160  # the turn that writes them, at most (4 queries of ~25 words; a reasoning model's thinking included)
SEARCH_FUNCTION = "file_search"
SEARCH_DESCRIPTION = ("Search the user's files for passages that help answer the conversation's latest message. "
                      "Write short search queries that stand on their own (say what 'it' or 'that' refers to), one "
                      "per thing to look up; write none when the answer needs nothing from the files.")


async def written_queries(svc: Services, caller: Caller, body: ResponsesRequest, messages: list[dict[str, Any]],
                          required: bool, gone: Gone | None = None) -> tuple[list[str] | None, tuple[int, int]]:
    """The search queries the model writes for ``messages``, and the tokens that took: a turn of
    its own, at temperature 0, in which it must call a ``file_search`` function whose arguments are
    ``{"queries": [...]}`` (at most ``MAX_QUERIES``, each at most ``QUERY_CHARS`` characters; at
    least one when ``required``, else possibly none). It is a chat request of the caller's tier
    (gated, metered and logged as one), on the response's model and adapters. None when the call
    was cut short at ``QUERY_TOKENS`` or the conversation leaves no room for them in the model's
    context: then the latest message's text is searched for."""
    parameters = {"type": "object", "additionalProperties": False, "required": ["queries"], "properties": {
        "queries": {"type": "array", "minItems": 1 if required else 0, "maxItems": MAX_QUERIES,
                    "items": {"type": "string", "minLength": 1, "maxLength": QUERY_CHARS}}}}
    data: dict[str, Any] = {
        "model": body.model, "messages": messages, "temperature": 0, "max_completion_tokens": QUERY_TOKENS,
        "tools": [{"type": "function", "function": {"name": SEARCH_FUNCTION, "description": SEARCH_DESCRIPTION,
                                                    "parameters": parameters}}],
        "tool_choice": {"type": "function", "function": {"name": SEARCH_FUNCTION}}}
    for key in ("service_tier", "user", "safety_identifier"):
        if getattr(body, key) is not None:
            data[key] = getattr(body, key)
    if body.adapters:
        data["adapters"] = [a.model_dump() for a in body.adapters]
    job = await with_images(svc, plan_chat(svc, parse(ChatCompletionRequest, data)))
    try:
        replies, _ = await collect(serve_chat(svc, caller, job, gone))
    except APIError as exc:
        if exc.code != "context_length_exceeded":
            raise
        return None, (0, 0)  # no room for the turn beside the conversation: the answer's own check tells
    reply = replies[0]
    used = (reply.finished.prompt_tokens, reply.finished.completion_tokens) if reply.finished else (0, 0)
    if reply.finish_reason != "tool_calls" or not reply.calls.calls:
        return None, used
    queries = json.loads(reply.calls.calls[0]["function"]["arguments"])["queries"]  # as the grammar made it
    return list(dict.fromkeys(q.strip() for q in queries if q.strip())), used


def _with_excerpts(conversation: list[dict[str, Any]], found: str) -> list[dict[str, Any]]:
    """``conversation`` with ``found`` after the text of its latest user message: the excerpts are
    read as the user's material, with the question they answer, not with the instructions'
    authority (a document cannot instruct the model as the system does), and the roles still
    alternate as chat templates require. The conversation kept for a later turn is unchanged."""
    at = max(i for i, m in enumerate(conversation) if m["role"] == "user")
    message = dict(conversation[at])
    content = message["content"]
    if isinstance(content, str):
        message["content"] = f"{content}\n\n{found}"
    else:
        message["content"] = [*content, {"type": "text", "text": f"\n\n{found}"}]
    return [*conversation[:at], message, *conversation[at + 1:]]


def _last_user_text(conversation: list[dict[str, Any]]) -> str:
    for message in reversed(conversation):
        if message["role"] == "user":
            content = message["content"]
            if isinstance(content, str):
                return content
            return "\n".join(p["text"] for p in content or [] if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


async def _readable(svc: Services, model: str, hits: list) -> list:
    """The best of ``hits`` whose texts fit in half of the chat model's context, in its tokens."""
    spec = resolve_request(svc, model, None, "chat")[0]
    budget = describe(spec).context_length // 2
    tokenizer = await tokenizer_of(spec.path)
    sizes = await asyncio.to_thread(lambda: [len(tokenizer(text, add_special_tokens=False)["input_ids"])
                                             for _, _, text in hits])
    kept, used = [], 0
    for hit, size in zip(hits, sizes):
        if used + size > budget:
            break
        kept.append(hit)
        used += size
    return kept


def _results_text(results: list[dict[str, Any]]) -> str:
    if not results:
        return "(A search of my files for this found nothing.)"
    found = "\n\n".join(f"[{k}] {r['filename']}:\n{r['text']}" for k, r in enumerate(results, 1))
    return (f"Excerpts from my files that a search for this found, the most relevant first. Answer from "
            f"them where they help, naming the file you use.\n\n{found}")


async def fitting(svc: Services, job: ChatJob, system: list[dict[str, Any]],
                  conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``truncation: auto``: the end of ``conversation`` that fits the model's context with room
    for the reply, dropping whole turns from the start (a turn begins at a user message, so roles
    still alternate); the last turn is always kept (when it alone does not fit, the engine
    refuses it as it would without truncation). Counted with the model's tokenizer, off the loop;
    an image as the tokens its processor expands it to (``job.images``, read already)."""
    spec = svc.spec(job.model, "chat")
    room = describe(spec).context_length - job.params.max_tokens
    starts = [i for i, m in enumerate(conversation) if m["role"] == "user" and i > 0]
    if not starts:
        return conversation
    tokenizer, tools = await tokenizer_of(spec.path), job.tools.template_tools()
    extra = await asyncio.to_thread(_image_tokens, await processor_of(spec.path), job.images) if job.images else []
    messages = [_template_form(m) for m in system + conversation]
    images_from = [0] * (len(messages) + 1)  # images in messages[i:]
    for i in range(len(messages) - 1, -1, -1):
        images_from[i] = images_from[i + 1] + _image_count(messages[i])

    def fits(start: int) -> bool:  # (a template that refuses the messages: the engine says so, a 400, after)
        kept = len(system) + start
        added = sum(extra[len(extra) - images_from[kept]:]) if images_from[kept] else 0
        try:
            return len(encode(tokenizer, system + messages[kept:], tools, job.template_kwargs)) + added <= room
        except InvalidParam:
            return True

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


def _template_form(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the template takes it (``ChatCompletionRequest.messages_as_dicts``): an
    ``image_url`` part as ``{"type": "image"}``."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in content]}


def _image_count(message: dict[str, Any]) -> int:
    content = message.get("content")
    return sum(p.get("type") == "image" for p in content) if isinstance(content, list) else 0


def _image_tokens(processor: Any, images: tuple[bytes, ...]) -> list[int]:
    """Per image, the tokens its processor adds to the prompt beyond its placeholder's."""
    one = [{"role": "user", "content": [{"type": "image"}]}]
    placeholder = len(encode(processor.tokenizer, one))
    return [len(vision_inputs(processor, ChatRequest(one, ChatParams(max_tokens=0), images=(image,)), sys.maxsize)[0])
            - placeholder for image in images]


def given_items(given: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``input`` (checked by ``input_messages``) as items to list: each as sent, with an id (its
    own or a new one), its type and ``status: completed``; a string is one user message."""
    if given is None:
        return []
    if isinstance(given, str):
        return [{"id": new_item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": given}]}]
    out = []
    for item in given:
        kind = item.get("type", "message")
        given_id = item.get("id")
        listed = {**item, "id": given_id if isinstance(given_id, str) and given_id else new_item_id(_ID_PREFIX[kind]),
                  "type": kind, "status": "completed"}
        if kind == "message" and isinstance(item["content"], str):
            assistant = item["role"] == "assistant"
            listed["content"] = [{"type": "output_text" if assistant else "input_text", "text": item["content"],
                                  **({"annotations": []} if assistant else {})}]
        out.append(listed)
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "file_search_call": "fs", "compaction": "cmp"}


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
        if f is not None:  # with the turn that wrote the search queries, as OpenAI counts a tool's turns
            prompt, completion = f.prompt_tokens + self.job.query_usage[0], f.completion_tokens + self.job.query_usage[1]
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": f.cached_tokens},
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": self.reply.reasoning_tokens},
                     "total_tokens": prompt + completion}
        fmt = {"type": "text"}
        if body.text and body.text.format:
            fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
        choice = body.tool_choice or "auto"
        if isinstance(choice, (FunctionChoice, FileSearchChoice, AllowedToolsChoice)):
            choice = choice.model_dump()
        params = self.job.chat.params if self.job.chat is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": self.background, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": [_visible(item) for item in self.output], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort, "summary": body.reasoning.summary or body.reasoning.generate_summary}
            if body.reasoning else {"effort": None, "summary": None},
            "service_tier": self.tier_label, "store": body.store,
            "temperature": params.temperature if params else body.temperature,  # as sampled: the model's default too
            "conversation": {"id": self.job.conversation_id} if self.job.conversation_id else None,
            "text": {"format": fmt}, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_logprobs": body.top_logprobs, "top_p": params.top_p if params else body.top_p, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "max_tool_calls": body.max_tool_calls,
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.reply.finish_reason == "length" else "completed"

    async def keep(self, store: ResponseStore | None, owner: str, conversations: ConversationStore | None) -> None:
        """Add the finished response to its conversation, then store it when the request asked to
        (one that its conversation refuses is not stored)."""
        await self.add_to_conversation(conversations, owner)
        if self.job.body.store and store is not None:
            await store.put(self.record(self.status, owner))

    async def add_to_conversation(self, conversations: ConversationStore | None, owner: str) -> None:
        """Its input items and output items, added to the conversation it continued (if any); the
        400 ``duplicate_item_id`` when the conversation has one of its input ids already (added
        since it was planned, by a response another process ran, say)."""
        if self.job.conversation_id is None or conversations is None:
            return
        try:
            added = await conversations.add_items(self.job.conversation_id, owner, self.job.added + self.output)
        except DuplicateItem as exc:
            raise duplicate_item(exc.item_id, self.job.added) from None
        if not added:
            log.info("response %s: its conversation %s was deleted before it ended", self.id, self.job.conversation_id)

    def record(self, status: str, owner: str, error: dict[str, str] | None = None) -> StoredResponse:
        """The stored record of this response at ``status`` (a background one's carries the time)."""
        return StoredResponse(self.id, owner, self.created_at, self.public(status, error), None, self.job.items,
                              time.time() if self.background else None, self.request, self.runner)


def message_item(item_id: str, text: str, status: str, logprobs: list | None,
                 annotations: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """An assistant message of output text; its ``logprobs`` are ``[]`` when none were asked for, as
    OpenAI's (and as the streamed events already were)."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": list(annotations),
                            "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def citations(text: str, sources: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """The ``file_citation`` annotations of an answer: one per file the search found whose name the
    answer writes (ignoring case), at the end of its first mention, in the text's order. Only what
    the text says: an answer that uses a file without naming it cites nothing."""
    found = []
    for file_id, filename in sources:
        mention = re.search(re.escape(filename), text, re.IGNORECASE) if filename else None
        if mention is not None:
            found.append({"type": "file_citation", "index": mention.end(), "file_id": file_id, "filename": filename})
    return sorted(found, key=lambda a: a["index"])


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking (``gateway.reasoning``), as OpenAI's open-weight models give
    it: the text itself as ``reasoning_text`` content, no summary."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _visible(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as shown: a message (or reasoning) still being streamed with its text so far."""
    if "_thought" in item:
        return reasoning_item(item["id"], "".join(item["_thought"]), item["status"])
    if "_text" not in item:
        return item
    return message_item(item["id"], "".join(item["_text"]), item["status"], item.get("_logprobs"))


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def whole_output(draft: Draft) -> list[dict[str, Any]]:
    """The output items of a finished reply: its file search (if it searched), a reasoning model's
    thinking, its message (when it has text, or neither calls nor thinking), then its calls; all
    but the search ``incomplete`` when the reply stopped at ``max_output_tokens``."""
    r, status = draft.reply, draft.status
    text = "".join(r.content)
    logprobs = chat_content(r.logprobs) if r.logprobs is not None else None
    items = [draft.job.searched] if draft.job.searched else []
    items += [reasoning_item(new_item_id("rs"), "".join(r.reasoning), status)] if r.reasoning else []
    if text or not (r.calls.calls or r.reasoning):
        items.append(message_item(new_item_id("msg"), text, status, logprobs, citations(text, draft.job.sources)))
    return items + [call_item(new_item_id("fc"), c, status) for c in r.calls.calls]


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
    draft = Draft(new_item_id("resp"), job, service_tier.label(svc.config, tier), reply=replies[0])
    draft.output = whole_output(draft)
    return draft.public(draft.status)


def reclaimable(record: StoredResponse) -> bool:
    """Whether a background response left by a dead process is run again elsewhere: one kept with
    its request, run fewer than RECLAIM_TRIES times, and when streamed, still ``queued`` or
    ``resumable``. A streamed one's record says ``in_progress`` before its first output event is
    made, so a queued one's followers have seen no output: its events go on from the last stored
    (a run again after ``response.queued``); a resumable one's followers may have seen some of
    its text, which the run again goes on from. Others whose followers saw output are not run
    again."""
    asked = record.request
    if asked is None or asked.get("attempts", 1) >= RECLAIM_TRIES:
        return False
    body = asked["body"]
    return not body.get("stream") or record.response["status"] == "queued" or resumable(body)


def resumable(body: dict[str, Any]) -> bool:
    """Whether a streamed response (its request ``body``) can go on from the text its followers
    saw: a plain text reply, with no tools (a call's arguments cannot be continued), no JSON format
    (the grammar's state is not kept) and no logprobs (the text already sent has them only in its
    events)."""
    fmt = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    return (not body.get("tools") and fmt == "text" and body.get("top_logprobs") is None
            and LOGPROBS not in (body.get("include") or ()))


@dataclass
class Sent:
    """What a streamed response's stored events show of its output: how many there are, whether
    ``response.in_progress`` is among them, a reasoning model's reasoning item (its id, its
    thinking so far, ``thought_done`` once it ended), and the message item begun after it (its id
    and text so far); or ``closed`` when anything else was begun or ended (then it cannot go on
    from there)."""

    count: int = 0
    began: bool = False
    item_id: str | None = None
    text: str = ""
    closed: bool = False
    thought_id: str | None = None
    thought: str = ""
    thought_done: bool = False

    @classmethod
    def of(cls, events: list[str]) -> "Sent":
        sent = cls(len(events))
        for event in events:
            data = json.loads(event.split("data: ", 1)[1])
            kind = data["type"]
            if kind == "response.in_progress":
                sent.began = True
            elif kind == "response.output_item.added":
                item = data["item"]
                if item["type"] == "reasoning" and sent.thought_id is None and sent.item_id is None:
                    sent.thought_id = item["id"]
                    continue
                if item["type"] != "message" or sent.item_id is not None or (sent.thought_id and not sent.thought_done):
                    sent.closed = True
                sent.item_id = item["id"]
            elif kind == "response.output_text.delta":
                sent.text += data["delta"]
            elif kind == "response.reasoning_text.delta":
                sent.thought += data["delta"]
            elif kind.endswith(".done") and sent.item_id is None and sent.thought_id is not None \
                    and (data.get("item_id") or (data.get("item") or {}).get("id")) == sent.thought_id:
                sent.thought_done = True  # the reasoning item's done events: the answer comes next
            elif kind.endswith(".done") or kind in ("response.completed", "response.incomplete", "response.failed"):
                sent.closed = True
        return sent

    @property
    def output(self) -> bool:
        """Some of the reply's output was seen (it goes on from there, ``response_runs._continued``)."""
        return bool(self.text or self.thought)


def shown(record: StoredResponse, stale_s: float) -> dict[str, Any]:
    """The response object of ``record`` as the API shows it: a running one whose process stopped
    writing it (its last write older than ``stale_s``, ``responses.reclaim_after_s``) as ``failed``,
    unless another process will run it again (``reclaim``: then it is ``queued``)."""
    response = record.response
    if response["status"] in RUNNING and (record.beat is None or time.time() - record.beat > stale_s):
        if reclaimable(record):
            return {**response, "status": "queued"}
        return {**response, "status": "failed",
                "error": {"code": "server_error", "message": "the server process running this background response "
                                                             "stopped before it finished; create it again"}}
    return response


def sse_event(kind: str, seq: int, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data, 'sequence_number': seq})}\n\n"


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


# -- streaming ----------------------------------------------------------------------------------------


class ResponseEvents:
    """The events of one streamed response, numbered, and the output items they build."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.seq = 0
        self.text: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function call item
        self.thought: dict[str, Any] | None = None  # the open reasoning item

    def event(self, kind: str, **data: Any) -> str:
        return sse_event(kind, self.next(), **data)

    def next(self) -> int:
        """Take the next event's number."""
        self.seq += 1
        return self.seq - 1

    @property
    def index(self) -> int:
        return len(self.draft.output) - 1

    def searched(self) -> list[str]:
        """The file search's events (it ran before the reply: all at once, first)."""
        item = self.draft.job.searched
        if item is None:
            return []
        self.draft.output.append(item)
        at = {"output_index": self.index, "item_id": item["id"]}
        return [self.event("response.output_item.added", output_index=self.index, item={**item, "status": "in_progress"}),
                self.event("response.file_search_call.in_progress", **at),
                self.event("response.file_search_call.searching", **at),
                self.event("response.file_search_call.completed", **at),
                self.event("response.output_item.done", output_index=self.index, item=item)]

    def open_text(self) -> list[str]:
        item = message_item(new_item_id("msg"), "", "in_progress", None)
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

    def add_reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        if self.thought is None:
            out = self.close()
            item = reasoning_item(new_item_id("rs"), "", "in_progress")
            self.thought = item
            self.draft.output.append(item)
            item["_thought"] = []
            out += [self.event("response.output_item.added", output_index=self.index, item=dict(item, content=[])),
                    self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                               content_index=0, part={"type": "reasoning_text", "text": ""})]
        self.thought["_thought"].append(text)
        return out + [self.event("response.reasoning_text.delta", item_id=self.thought["id"], output_index=self.index,
                                 content_index=0, delta=text)]

    def add_call(self, delta: CallDelta) -> list[str]:
        out = []
        if delta.id is not None:
            out = self.close()
            item = call_item(new_item_id("fc"), {"id": delta.id, "function": {"name": delta.name, "arguments": ""}},
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
        if self.thought is not None:
            item, self.thought = self.thought, None
            final = reasoning_item(item["id"], "".join(item.pop("_thought")), status)
            item.clear()
            item.update(final)
            part = final["content"][0]
            out += [self.event("response.reasoning_text.done", item_id=item["id"], output_index=self.index,
                               content_index=0, text=part["text"]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=self.index,
                               content_index=0, part=part),
                    self.event("response.output_item.done", output_index=self.index, item=final)]
        if self.text is not None:
            item, self.text = self.text, None
            text = "".join(item.pop("_text", []))
            logprobs = item.pop("_logprobs", None)
            cited = citations(text, self.draft.job.sources)
            final = message_item(item["id"], text, status, logprobs, cited)
            item.clear()
            item.update(final)
            part = final["content"][0]
            out += [self.event("response.output_text.annotation.added", item_id=item["id"], output_index=self.index,
                               content_index=0, annotation_index=k, annotation=a) for k, a in enumerate(cited)]
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


def delta_events(s: ResponseEvents, delta: ChoiceDelta) -> list[str]:
    """The events of one delta of the reply (which it is added to)."""
    s.draft.reply.add(delta)
    out: list[str] = []
    if delta.reasoning:
        out += s.add_reasoning(delta.reasoning)
    if delta.content or (delta.logprobs and s.text is not None):
        out += s.add_text(delta.content, chat_content(delta.logprobs) if delta.logprobs is not None else None)
    for call in delta.calls:
        out += s.add_call(call)
    return out


def closing_events(s: ResponseEvents) -> list[str]:
    """The events that end a finished reply's items (an empty reply is still one, empty, message)."""
    replied = any(item["type"] != "file_search_call" for item in s.draft.output)
    return (s.open_text() if not replied else []) + s.close(s.draft.status)


