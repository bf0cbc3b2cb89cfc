"""Anthropic's Messages API, as ``vllm serve`` answers it: ``POST /v1/messages`` (the
``anthropic`` SDK's ``client.messages.create`` and ``client.messages.stream``) and
``POST /v1/messages/count_tokens``, on the chat models, through the same keys, tiers, gate and
engines as chat completions.

* ``chat_request`` turns a request into the chat completion it asks for: ``system`` first; a
  user message's ``tool_result`` blocks as tool messages (a result's images as a user message
  after it), its text and image blocks as one user message; an assistant message's text,
  ``tool_use`` blocks (its calls) and ``thinking`` (the history's reasoning), its
  ``redacted_thinking`` skipped (a block of a type not taken is a 400 naming it); ``tools``
  (``input_schema`` the parameters), ``tool_choice`` (``any`` is ``required``;
  ``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens``, sampling,
  ``metadata.user_id`` as the end user; ``thinking`` sets the chat template's ``enable_thinking``,
  and its ``budget_tokens`` (less than ``max_tokens``) is vLLM's ``thinking_token_budget`` on a
  model that thinks (a ``reasoning_parser``; elsewhere there is no thinking to cut);
  ``output_config.format`` (a JSON schema) constrains the reply as chat's ``response_format``
  does, and ``output_config.effort`` is chat's ``reasoning_effort`` (``max`` its ``xhigh``).
* The answer is rendered from the chat deltas: whole, a ``message`` whose content is a
  ``thinking`` block (a reasoning model's), a ``text`` block and a ``tool_use`` block per call;
  streamed, Anthropic's events (``message_start``, ``content_block_start`` / ``_delta`` /
  ``_stop`` per block, ``message_delta`` with the stop reason and usage, ``message_stop``; a
  ``ping`` while it waits, ``gateway.http.Streamed``).
  ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or
  ``tool_use`` (with ``stop_sequence`` where one cut the text after the calls). A tool call whose
  arguments are not a JSON object is not a valid ``tool_use``: whole, its arguments as written are
  answered as text (streamed, they went out as they came).

Keys may come as Anthropic's SDK sends them (``x-api-key``). Errors keep OpenAI's shape, with
Anthropic's ``"type": "error"`` beside it, so either SDK reads them."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Callable, Literal

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth import Caller
from gateway.chat import ChatJob, ChoiceDelta, Reply, collect, plan_chat, serve_chat, with_images
from gateway.errors import APIError, bad_request
from gateway.http import Streamed, disconnect_signal
from gateway.request_log import new_id
from gateway.schemas import ChatCompletionRequest, _Body, parse, read_json, tagged, text_or_parts
from gateway.service import Services

log = logging.getLogger("tiergate")

class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted: the engines cache prompt prefixes by their tokens
    citations: list[dict[str, Any]] | None = None


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Body):
    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None  # (the SDK's own blocks carry these two, sent back as history)
    toolset_name: str | None = None


class UnsupportedBlock(_Body):
    """A block of a type this server does not take (``document``, ``search_result``, ...): refused
    naming its type, not as the text block it is not."""

    type: str

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        raise ValueError(f"{value['type']} blocks are not supported by this server's Messages API")


def block_type(kinds: dict[str, str]) -> Callable[[Any], str]:
    """A block's tag from its ``type``: one of ``kinds``, a text block where it has no type (whose
    error says so), or :class:`UnsupportedBlock`."""
    def tag(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else None
        return kinds.get(kind, "UnsupportedBlock") if isinstance(kind, str) else "TextBlock"
    return tag


ResultPart = tagged(("TextBlock", TextBlock), ("ImageBlock", ImageBlock), ("UnsupportedBlock", UnsupportedBlock),
                    by=block_type({"text": "TextBlock", "image": "ImageBlock"}))
ResultContent = tagged(("Text", str), ("Parts", list[ResultPart]), by=text_or_parts)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: ResultContent | None = None  # text, and images (a screenshot) as vLLM takes them
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    """Anthropic's encrypted thinking, sent back as history: accepted and not rendered (no text to
    give the chat template), as vLLM's endpoint skips it."""

    type: Literal["redacted_thinking"]
    data: str


Block = tagged(("TextBlock", TextBlock), ("ImageBlock", ImageBlock), ("ToolUseBlock", ToolUseBlock),
               ("ToolResultBlock", ToolResultBlock), ("ThinkingBlock", ThinkingBlock),
               ("RedactedThinkingBlock", RedactedThinkingBlock), ("UnsupportedBlock", UnsupportedBlock),
               by=block_type({"text": "TextBlock", "image": "ImageBlock", "tool_use": "ToolUseBlock",
                              "tool_result": "ToolResultBlock", "thinking": "ThinkingBlock",
                              "redacted_thinking": "RedactedThinkingBlock"}))


class Message(_Body):
    role: Literal["user", "assistant"]
    content: tagged(("Text", str), ("Parts", list[Block]), by=text_or_parts)


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: a forced call is constrained to its schema whatever it says, as chat's


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Body):
    user_id: str | None = None


class MessagesRequest(_Body):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Anthropic's: priority capacity where it has some, or standard only; here the key's tier serves either way
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(_Body):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def chat_request(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat completion request ``body`` asks for (module doc), as JSON."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for m in body.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages += _user(m.content)
        else:
            messages.append(_assistant(m.content))
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice of type tool needs the name of the tool to call", "tool_choice.name",
                              "missing_required_parameter")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name or ""}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        budget = _budget(body)
        if budget is not None and budget >= body.max_tokens:  # as Anthropic's API and vLLM's
            raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({body.max_tokens})",
                              "thinking.budget_tokens")
        output = body.output_config
        if output is not None and output.format is not None:  # the reply is JSON the schema allows
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "strict": True,
                                                                             "schema": output.format.schema_}}
        if output is not None and output.effort is not None:  # ("max" is the chat API's highest, "xhigh")
            chat["reasoning_effort"] = "xhigh" if output.effort == "max" else output.effort
        for name in ("temperature", "top_p", "top_k"):
            if getattr(body, name) is not None:
                chat[name] = getattr(body, name)
        if body.stop_sequences:
            chat["stop"] = body.stop_sequences
        if body.metadata is not None and body.metadata.user_id:
            chat["user"] = body.metadata.user_id
        chat["stream"] = body.stream
    return chat


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content if isinstance(b, TextBlock))


def _image(b: ImageBlock) -> dict[str, Any]:
    src = b.source
    url = src.url if src.type == "url" else f"data:{src.media_type};base64,{src.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _user(blocks: list) -> list[dict[str, Any]]:
    """A user message's blocks: each tool result a tool message (they answer the calls before
    them), its images (a screenshot a tool took) a user message after it, as vLLM turns them;
    then the message's text and images as one user message."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            text = _text(b.content or "")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {text}" if b.is_error else text})
            images = [_image(p) for p in b.content or () if isinstance(p, ImageBlock)]
            if images:
                out.append({"role": "user", "content": images})
        elif isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append(_image(b))
        else:
            raise bad_request(f"a user message takes text, image and tool_result blocks, not {b.type}", "messages")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(blocks: list) -> dict[str, Any]:
    """An assistant message's blocks as one chat message: its text, its calls, its thinking (not
    its redacted thinking, which has no text)."""
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thinking:
        message["reasoning_content"] = thinking
    if any(isinstance(b, (ImageBlock, ToolResultBlock)) for b in blocks):
        raise bad_request("an assistant message takes text, tool_use, thinking and redacted_thinking blocks",
                          "messages")
    return message


_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config",
          "reasoning_effort": "output_config"}


def _budget(body: MessagesRequest) -> int | None:
    """The thinking's ``budget_tokens``, where the request enables thinking."""
    return body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None


def _thinking_budget(body: MessagesRequest, job: ChatJob) -> ChatJob:
    """``job`` with ``thinking.budget_tokens`` as its thinking budget, where its model thinks."""
    budget = _budget(body)
    if budget is None or job.reasoning == "none":
        return job
    return dataclasses.replace(job, params=dataclasses.replace(job.params, thinking_budget=budget))


def _named(exc: APIError) -> APIError:
    """A chat field's error named as the Messages API names the field, in ``param`` and where its
    message names it (a message's by ``messages`` alone: the chat's list has the system prompt and
    each tool result as messages of their own)."""
    param = exc.param or ""
    head = param.split("[")[0].split(".")[0]
    if head == "messages":
        exc.param = "messages"
    elif head in _NAMES:
        exc.param = _NAMES[head] + param[len(head):]
    elif head == "tools":
        exc.param = param.replace(".function.parameters", ".input_schema").replace(".function", "")
    if param and exc.param != param:  # ("invalid value for stop: ...", as gateway.schemas.parse words it)
        exc.message = exc.message.replace(f" for {param}:", f" for {exc.param}:")
    return exc


def stop_reason(reply: Reply | ChoiceDelta) -> tuple[str, str | None]:
    """Anthropic's stop reason of a finished reply, and the stop sequence that ended it: named
    beside ``tool_use`` too (its calls came before the text the sequence cut), as Anthropic's
    ``stop_sequence`` is whichever of the request's sequences was generated."""
    finished = reply.finished
    sequence = finished.stop_reason if finished is not None and isinstance(finished.stop_reason, str) else None
    if reply.finish_reason in ("tool_calls", "function_call"):
        return "tool_use", sequence
    if reply.finish_reason == "length":
        return "max_tokens", None
    return ("end_turn", None) if sequence is None else ("stop_sequence", sequence)


def usage(reply: Reply | ChoiceDelta) -> dict[str, int]:
    f = reply.finished
    return {"input_tokens": f.prompt_tokens if f else 0, "output_tokens": f.completion_tokens if f else 0,
            "cache_read_input_tokens": f.cached_tokens if f else 0, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, reply: Reply) -> dict[str, Any]:
    """The whole ``message`` of ``reply``."""
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": "".join(reply.reasoning), "signature": ""})
    text = "".join(reply.content)
    calls = []
    for call in reply.calls.calls:
        arguments = call["function"]["arguments"]
        try:  # ("": a forced call that max_tokens cut before its arguments, not a call of no arguments)
            given = json.loads(arguments)
        except (ValueError, RecursionError):  # (nested past json.loads' depth: not a call's input either)
            given = None
        if isinstance(given, dict):
            calls.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": given})
        else:  # not a call Anthropic's clients can run: its arguments, as written, are text
            text += arguments
    if text or not (content or calls):
        content.append({"type": "text", "text": text})
    reason, sequence = stop_reason(reply)
    if reason == "tool_use" and not calls:  # (no call Anthropic's clients can run: what ended the text)
        reason = "end_turn" if sequence is None else "stop_sequence"
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content + calls,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(reply)}


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(deltas: AsyncIterator[ChoiceDelta], first: ChoiceDelta, mid: str, model: str) -> AsyncIterator[str]:
    """The streamed message: a content block per kind of piece as they come (thinking, text, each
    tool call), each started, filled and stopped in order."""
    start = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": first.prompt_tokens or 0, "output_tokens": 0}}
    yield _event("message_start", message=start)
    index, open_kind = -1, None  # the block being written, and its kind ("thinking", "text", or a call's index)

    def switch(kind: Any, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = [] if open_kind is None else [_event("content_block_stop", index=index)]
        index, open_kind = index + 1, kind
        return out + [_event("content_block_start", index=index, content_block=block)]

    try:
        delta = first
        while True:
            pieces: list[str] = []
            if delta.reasoning:
                if open_kind != "thinking":
                    pieces += switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                pieces.append(_event("content_block_delta", index=index,
                                     delta={"type": "thinking_delta", "thinking": delta.reasoning}))
            if delta.content:
                if open_kind != "text":
                    pieces += switch("text", {"type": "text", "text": ""})
                pieces.append(_event("content_block_delta", index=index,
                                     delta={"type": "text_delta", "text": delta.content}))
            for call in delta.calls:
                if call.id is not None:
                    pieces += switch(("call", call.index), {"type": "tool_use", "id": call.id, "name": call.name,
                                                            "input": {}})
                if call.arguments:
                    pieces.append(_event("content_block_delta", index=index,
                                         delta={"type": "input_json_delta", "partial_json": call.arguments}))
            for piece in pieces:
                yield piece
            if delta.finished is not None:
                break
            delta = await deltas.__anext__()
        if open_kind is not None:
            yield _event("content_block_stop", index=index)
        reason, sequence = stop_reason(delta)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage(delta))
        yield _event("message_stop")
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, as Anthropic's API does
        err = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {type(exc).__name__}",
                                                             "generation_failed")
        yield _event("error", **err.body())  # the same error object as a refusal's, in Anthropic's event
    finally:
        await deltas.aclose()


# -- HTTP -------------------------------------------------------------------------------------------


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(MessagesRequest, await read_json(request, svc.config.limits.max_body))
    chat, job = await _planned(svc, body)
    if (end_user := chat.end_user(caller.key_id)) is not None:
        log.info("messages request: key %s, user %s, tier %s", caller.key_id, end_user, caller.tier)
    mid = f"msg_{new_id()}"
    headers = {**svc.gate.rate_headers(caller.tier), "x-tiergate-tier": caller.tier}
    async with disconnect_signal(request) as gone:
        deltas = serve_chat(svc, caller, job, gone)
        if not body.stream:
            replies, _ = await collect(deltas)
            return JSONResponse(message(mid, body.model, replies[0]), headers=headers)
        first = await deltas.__anext__()
    return Streamed(_events(deltas, first, mid, body.model), "text/event-stream", headers=headers)


async def _planned(svc: Services, body: MessagesRequest) -> tuple[ChatCompletionRequest, ChatJob]:
    """The chat request ``body`` stands for and its job, errors named in the Messages API's terms."""
    try:
        chat = parse(ChatCompletionRequest, chat_request(body))
        await svc.adapters.ready(chat.model, chat.adapters)
        job = await with_images(svc, plan_chat(svc, chat))
    except APIError as exc:
        raise _named(exc) from None
    return chat, _thinking_budget(body, job)


async def message_result(svc: Services, caller: Caller, data: dict[str, Any]) -> dict[str, Any]:
    """A batch line's message (``batch.endpoints``, Message Batches' lines): the whole message."""
    body = parse(MessagesRequest, data)
    if body.stream:
        raise bad_request("stream is not supported in a batch", "stream")
    _, job = await _planned(svc, body)
    replies, _ = await collect(serve_chat(svc, caller, job, None))
    return message(f"msg_{new_id()}", body.model, replies[0])


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt tokens the message would have (``input_tokens``)."""
    from gateway.responses_api import prompt_token_count

    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(CountTokensRequest, await read_json(request, svc.config.limits.max_body))
    try:
        chat = parse(ChatCompletionRequest, chat_request(body))
        await svc.adapters.ready(chat.model, chat.adapters)  # a folder adapter read in a worker thread, not below
        job = await with_images(svc, plan_chat(svc, chat))
    except APIError as exc:
        raise _named(exc) from None
    return JSONResponse({"input_tokens": await prompt_token_count(svc, caller, job, body.model, "messages")})
