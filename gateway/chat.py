"""Chat completions: ``plan_chat`` checks a request, ``serve_chat`` (the serving core, shared with
batch lines) yields its choices' deltas, and ``chat_completions`` (POST /v1/chat/completions)
renders them as one JSON completion or as server-sent events.

A request with ``n`` choices runs them as ``n`` requests of the engine (rows sharing the prompt),
each with its own gate slot and model lease; a seeded request gives choice ``i`` the seed
``seed + i``. Tool calls are read from each choice's text by the parser its tool plan names
(``gateway.tools``), logprobs are shaped by ``gateway.logprobs``, ``response_format`` becomes a
grammar in ``gateway.structured`` and ``service_tier`` picks the tier served
(``gateway.service_tier``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Literal

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import service_tier, stored_chat
from gateway.adapters import names_own, resolve_request, served_names
from accounts.rates import Ask
from gateway.accounts import estimate_tokens
from gateway.auth import Caller
from gateway.errors import APIError, bad_request
from gateway.http import Streamed, disconnect_signal
from gateway.input_audio import chat_audio, hear
from gateway.input_files import chat_files
from gateway.logprobs import chat_content, chat_logprobs, check_prompt_logprobs, prompt_logprob_dicts
from gateway.output_audio import SpokenReplies, SpokenStream, Voice, heard_replies, plan_voice, say, say_replies
from gateway.reasoning import ReasoningParser, ThinkSplitter
from gateway.request_log import new_id
from gateway.schemas import ChatCompletionRequest, check_vllm_defaults, parse, read_json, reply_options, sampling
from gateway.service import Services
from gateway.serving import Gone, Joint, Serving
from gateway.store_watch import NOT_STORED, StoreWatch
from gateway.structured import request_grammar
from gateway.tools import CallDelta, CallParser, ToolCalls, ToolPlan, plan_tools
from gateway.vision import PendingImage, request_images, resolve_images
from workers.base import (
    AdapterStackSpec,
    ChatEvent,
    ChatFinished,
    ChatParams,
    ChatRequest,
    InvalidParam,
    PromptEnd,
    StepContext,
    TokenLogprob,
)
from workers.chat import ContextTooLong

log = logging.getLogger("tiergate")

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ChatJob:
    """A checked chat request: the base model, what the worker gets, its adapter stack, how its
    tools shape the reply, how many choices, and the service tier it asked for."""

    model: str
    messages: list[dict]
    params: ChatParams
    stack: AdapterStackSpec
    tools: ToolPlan = ToolPlan()
    n: int = 1
    service_tier: str | None = None
    prompt_ids: list[int] | None = None  # a raw prompt (legacy completions): no chat template
    # of prompt_ids, the last tokens that are the reply so far (a background response run again from
    # its text, ``response_runs._continued``): metered as output, as its usage counts them
    said: int = 0
    stream: bool = True  # False: the reply is read whole (the engine may hand it over in fewer pieces)
    template_kwargs: dict | None = None  # the chat template's own variables (enable_thinking, ...)
    prompt_end: PromptEnd = "generation"  # vLLM's add_generation_prompt / continue_final_message
    reasoning: ReasoningParser = "none"  # the model's reasoning_parser: where its thinking is in the reply
    include_reasoning: bool = True  # False: the thinking is left out of the answer
    # the messages' image parts, in order, as encoded files (``gateway.vision``); one still to read
    # (an image URL, a long data: URL) is read by ``with_images`` before the job is served
    images: tuple[bytes | PendingImage, ...] = ()
    own_adapter: bool = False  # ``model`` named the stack's first adapter (whose refusal names ``model``)
    prediction: str | None = None  # Predicted Outputs' text (``ChatRequest.prediction``)
    token_ids: bool = False  # vLLM's return_token_ids (``ChatRequest.token_ids``)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>"
    echo: str = ""  # vLLM's echo: the text each choice's content starts with (``ChatCompletionRequest.echoed``)
    truncate: int | None = None  # vLLM's truncate_prompt_tokens and truncation_side (``ChatRequest.truncate``)
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None  # vLLM's: the prompt's cached blocks shared only under this salt (``prefix_salt``)
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens added to the template's prompt


@dataclass
class ChoiceDelta:
    """What one choice adds: content, pieces of tool calls, the logprobs of its tokens; the last
    delta of a choice has ``finish_reason``, its token counts and the tier that served it."""

    index: int
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    finished: ChatFinished | None = None
    tier: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # ``ChatParams.prompt_logprobs``, in the first delta
    reasoning: str = ""  # a reasoning model's thinking (``gateway.reasoning``)
    reasoning_tokens: int = 0  # the last delta: the completion tokens the choice spent thinking
    token_ids: list[int] | None = None  # ``ChatJob.token_ids``: the tokens generated since the last delta's
    prompt_ids: list[int] | None = None  # ... and in the choice's first delta, the prompt's
    prompt_tokens: int | None = None  # the choice's first delta: the prompt's length (the engine has rendered it)

    @property
    def empty(self) -> bool:
        return not (self.content or self.calls or self.reasoning or self.logprobs or self.finish_reason
                    or self.prompt_logprobs or self.token_ids or self.prompt_ids)


def plan_chat(svc: Services, body: ChatCompletionRequest) -> ChatJob:
    """The job of ``body``; 404 for an unknown model or adapter, 400 naming the field for a bad
    one (a message without what its role needs, the token limit, ``n`` over the cap,
    ``top_logprobs`` without ``logprobs``, a tool or response schema that does not compile, a
    ``tool_choice`` naming a missing tool, an unknown ``service_tier``)."""
    problem = body.message_problem()
    if problem:
        raise bad_request(problem[0], problem[1], "missing_required_parameter" if "missing" in problem[0] else "invalid_value")
    spec, stack = resolve_request(svc, body.model, body.adapters, "chat")
    limits = svc.config.limits
    images = request_images(body, spec, svc.config)
    defaults = svc.sampling_defaults.get(spec.name, {})  # (its generation_config's max_new_tokens, as vLLM's)
    if body.max_completion_tokens is not None and body.max_tokens is not None:  # OpenAI's refusal
        raise bad_request("max_tokens and max_completion_tokens cannot both be set: max_completion_tokens replaces "
                          "max_tokens", "max_tokens", "invalid_parameter_combination")
    if body.stream_options is not None and not body.stream:  # OpenAI's and vLLM's
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    max_tokens = body.max_completion_tokens or body.max_tokens or \
        min(defaults.get("max_tokens", DEFAULT_MAX_TOKENS), limits.max_chat_tokens)
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_tokens > limits.max_chat_tokens:
        raise bad_request(f"{param} is {max_tokens}, above this server's limit of {limits.max_chat_tokens}", param)
    if body.max_completion_tokens or body.max_tokens:  # one no prompt fits beside: at once, a background one too
        check_room(svc, spec.name, max_tokens, param)
    if body.n > limits.max_n:
        raise bad_request(f"n is {body.n}, above this server's limit of {limits.max_n} choices", "n")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM's
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    check_prompt_logprobs(spec, body.prompt_logprobs is not None, "prompt_logprobs")
    engine = engine_config(svc, spec.name)
    tools = _plan_tools(body, getattr(engine, "tool_parser", "hermes"))
    asked = request_grammar(body.response_format, body.structured_outputs, limits.grammar_max_chars)
    asked_param = "response_format" if body.structured_outputs is None else "structured_outputs"
    grammar = tools.reply_grammar(asked, asked_param)
    service_tier.check(svc.config, body.service_tier)
    check_vllm_defaults(body)
    if body.request_id is not None and body.store:
        raise bad_request("a stored completion's id is the server's: leave request_id out with store", "request_id")
    if body.add_special_tokens and images:
        raise bad_request("add_special_tokens is for a text prompt: the processor of a model that reads images "
                          "adds its own", "add_special_tokens")
    reasoning = getattr(engine, "reasoning_parser", "none")
    ends = reply_options(body, max_tokens, reasoning)
    stop = body.stop or []
    if tools.mode == "forced":  # the reply is the grammar's calls alone: a stop string or token could
        stop, ends["stop_token_ids"] = [], ()  # only cut one short, its arguments no longer JSON
    params = ChatParams(
        max_tokens, max_tokens_default=not (body.max_completion_tokens or body.max_tokens),
        stop=stop, seed=body.seed,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()}, prompt_logprobs=body.prompt_logprobs,
        grammar=grammar, grammar_param=tools.grammar_param(asked_param), **sampling(body, defaults), **ends,
    )
    return ChatJob(spec.name, body.messages_as_dicts(), params, stack, tools, body.n, body.service_tier,
                   stream=bool(body.stream), template_kwargs=body.template_kwargs(), prompt_end=body.prompt_end(),
                   reasoning=reasoning, include_reasoning=body.include_reasoning, images=images,
                   own_adapter=names_own(body.model, stack),
                   prediction=body.prediction.text() if body.prediction is not None else None,
                   token_ids=bool(body.return_token_ids), tokens_as_ids=bool(body.return_tokens_as_token_ids),
                   echo=body.echoed(), truncate=_truncate(body.truncate_prompt_tokens, bool(images)),
                   truncation_side=body.truncation_side, cache_salt=body.cache_salt,
                   add_special_tokens=body.add_special_tokens)


def check_room(svc: Services, model: str, max_tokens: int, param: str) -> None:
    """400 ``context_length_exceeded`` for a reply limit that leaves no token of the model's
    context for a prompt: known before any prompt is read (vLLM refuses it so too)."""
    context = svc.context_lengths.get(model)
    if context is not None and max_tokens >= context:
        raise bad_request(f"{param} is {max_tokens}: the model's context of {context} tokens leaves no room for "
                          "a prompt beside it", param, "context_length_exceeded")


def prefix_salt(svc: Services, caller: Caller, job: ChatJob) -> str | None:
    """The salt of the job's prompt in vLLM's prefix cache: the caller's key under
    ``server.prefix_cache: per_key``, and the request's own ``cache_salt`` after it (its blocks
    shared only with requests of the same key and salt; the pair as JSON, which no key's id alone
    or other pair spells); None: shared with every request."""
    own = caller.key_id if svc.config.server.prefix_cache == "per_key" else None
    if job.cache_salt is None:
        return own
    return job.cache_salt if own is None else json.dumps([own, job.cache_salt])


def _truncate(keep: int | None, images: bool) -> int | None:
    """vLLM's ``truncate_prompt_tokens``, checked: 1 or more, or -1; not on a prompt with images,
    whose image tokens a cut would split."""
    if keep == 0:
        raise bad_request("truncate_prompt_tokens is 0: 1 or more tokens to keep, or -1 for the context less one",
                          "truncate_prompt_tokens")
    if keep is not None and images:
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
    return keep


async def with_images(svc: Services, job: ChatJob) -> ChatJob:
    """``job`` with its pending images read (fetched, or decoded on a thread; a 400 naming the part
    when one fails), before it asks for a slot: no slot or model waits on the network."""
    if not job.images:  # nearly every request: nothing to read
        return job
    images = await resolve_images(job.images, svc.config.limits)
    return job if images is job.images else dataclasses.replace(job, images=images)


def _plan_tools(body: ChatCompletionRequest, parser: str) -> ToolPlan:
    """The request's tool plan; the deprecated ``functions`` / ``function_call`` are planned as the
    tools they stand for (one call at most), their errors named in their own terms."""
    tools, choice, parallel = body.tool_fields()
    if body.functions is None:
        return plan_tools(tools, choice, parallel, parser)
    try:
        plan = plan_tools(tools, choice, parallel, parser)
    except APIError as exc:
        param = exc.param or ""
        if param.startswith("tools["):
            exc.param = "functions" + param.removeprefix("tools").replace(".function.", ".", 1)
        elif param.startswith("tool_choice"):
            exc.param = "function_call"
        exc.message = exc.message.replace("tool_choice", "function_call").replace("tool ", "function ")
        raise
    return dataclasses.replace(plan, legacy=True)


def engine_config(svc: Services, model: str):
    """A chat model's ``engine:`` block (its ``tool_parser``, ``reasoning_parser``, ``search_queries``),
    looked up once per request; None for a model without one."""
    entry = next((m for m in svc.config.models if m.name == model), None)
    return getattr(entry, "engine", None)


def served_caller(svc: Services, caller: Caller, job: ChatJob) -> Caller:
    """``caller`` at the tier its request's ``service_tier`` is served at."""
    tier = service_tier.served_tier(svc.config, caller.tier, job.service_tier)
    return caller if tier == caller.tier else dataclasses.replace(caller, tier=tier)


def serve_chat(svc: Services, caller: Caller, job: ChatJob, gone: Gone | None,
               joint: Joint | None = None, part: int = 0) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of every choice of a completion, interleaved as they come; each choice ends with
    a delta that has its ``finish_reason``. What goes wrong before the first delta (429/503, a
    bad field the engine finds, context too long, out of memory after relief, client gone) is
    raised by the first ``__anext__``. Closing the iterator early cancels the generation. The
    choices are one request to the key's account (``joint``: the request they are part of, which
    admits them, and ``part``, which of its prompts this job is; else, with ``n`` above 1, one of
    their own)."""
    served = served_caller(svc, caller, job)
    if joint is None and job.n > 1:
        joint = joint_request(svc, served, [job])
        return joint.serve(_choices(svc, served, job, gone, joint))
    return _choices(svc, served, job, gone, joint, part)


def _choices(svc: Services, caller: Caller, job: ChatJob, gone: Gone | None, joint: Joint | None,
             part: int = 0) -> AsyncGenerator[ChoiceDelta, None]:
    choices = [_serve_choice(svc, caller, job, i, gone, joint, part) for i in range(job.n)]
    return choices[0] if job.n == 1 else interleave(choices)


def joint_request(svc: Services, caller: Caller, jobs: list[ChatJob]) -> Joint:
    """The request that runs ``jobs`` (a completion's prompts; else one chat job), each ``n``
    times, to its key's account: admitted once for all their prompts and choices."""
    first = jobs[0]
    ask = Ask(tokens=sum(_ask(svc, caller, j, j.params, j.n).tokens for j in jobs))
    return Joint(svc, caller, first.model, ask, sum(j.n for j in jobs), first.params.max_tokens,
                 served_names(first.stack), first.own_adapter)


def _ask(svc: Services, caller: Caller, job: ChatJob, params: ChatParams, choices: int = 1) -> Ask:
    """What the request spends of its key's minute limits, corrected when it ends: its prompt
    once, and ``max_tokens`` for each of its ``choices``; nothing to work out for a key without
    limits (most: the prompt would be serialised only to be ignored)."""
    if svc.accounts is None or not svc.accounts.limits(caller.key_id, caller.tier).limited:
        return Ask()
    prompt = len(job.prompt_ids) if job.prompt_ids is not None else estimate_tokens(job.messages)
    return Ask(tokens=prompt + choices * params.max_tokens)


async def _serve_choice(svc: Services, caller: Caller, job: ChatJob, index: int,
                        gone: Gone | None, joint: Joint | None, part: int) -> AsyncGenerator[ChoiceDelta, None]:
    params = job.params
    if index and params.seed is not None:
        params = dataclasses.replace(params, seed=params.seed + index)
    parser = job.tools.parser_for_reply()
    ask = _ask(svc, caller, job, params) if joint is None else Ask()  # (a joint request asked for it)
    adapters = served_names(job.stack)
    async with Serving(svc, caller, job.model, params.max_tokens, "chat", gone, ask, adapters, job.own_adapter,
                       joint=joint, part=part, said=job.said) as serving:
        events, event, ctx = await serving.step(lambda ctx: _first_event(serving, job, params, ctx), "running")
        # (after the first event: the engine has rendered the prompt, and noted its thinking marker)
        thinking = ThinkSplitter(job.reasoning, ctx.prompt_thinking) if job.reasoning != "none" else None
        svc.metrics.observe(svc.metrics.ttft, serving.first_token(), caller.tier)
        prompt_tokens: int | None = ctx.prompt_tokens  # told in the choice's first delta, then not again
        # Thinking left out (include_reasoning: false) makes no delta until the answer: the first goes
        # out empty all the same, so that a stream starts (and its keep-alives with it) as the model
        # begins, not when its thinking ends
        announce = thinking is not None and not job.include_reasoning
        try:
            while not isinstance(event, ChatFinished):
                delta = _read(index, event, parser, thinking, job.include_reasoning)
                if not delta.empty or announce:
                    announce = False
                    delta.prompt_tokens, prompt_tokens = prompt_tokens, None
                    yield delta
                try:
                    event = await serving.until_gone(events.__anext__())
                except InvalidParam as exc:  # found as it generates: constraints that leave no token to sample
                    raise bad_request(str(exc), exc.param) from None
            serving.count_tokens(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        finally:
            await events.aclose()
    # the slot is free and the service time learned before the last delta goes out
    last = _read(index, None, parser, thinking, job.include_reasoning)
    calls = parser is not None and parser.calls > 0
    if calls and event.finish_reason == "stop":
        last.finish_reason = "function_call" if job.tools.legacy else "tool_calls"
    else:
        last.finish_reason = event.finish_reason
    last.finished, last.tier, last.prompt_tokens = event, caller.tier, prompt_tokens
    if thinking is not None:
        last.reasoning_tokens = thinking.reasoning_tokens(event)
    yield last


def _read(index: int, event: ChatEvent | None, parser: CallParser | None, thinking: ThinkSplitter | None = None,
          include_reasoning: bool = True) -> ChoiceDelta:
    """A text event (None: the end of the text) as a choice delta: a reasoning model's thinking
    split off first, then the answer through the tool-call parser."""
    if thinking is None and parser is None:  # the common case: the text as it is
        return ChoiceDelta(index) if event is None else \
            ChoiceDelta(index, event.text, [], event.logprobs, prompt_logprobs=event.prompt_logprobs,
                        token_ids=event.token_ids, prompt_ids=event.prompt_ids)
    if thinking is None:
        reasoning, text = "", event.text if event is not None else ""
    else:
        reasoning, text = thinking.feed(event.text) if event is not None else thinking.finish()
    if not include_reasoning:
        reasoning = ""
    if parser is None:
        delta = ChoiceDelta(index, text, [], None, reasoning=reasoning)
    else:
        pieces = parser.feed(text) if text else []
        if event is None:
            pieces += parser.finish()
        delta = ChoiceDelta(index, "".join(p for p in pieces if isinstance(p, str)),
                            [p for p in pieces if isinstance(p, CallDelta)], None, reasoning=reasoning)
    if event is not None:
        delta.logprobs, delta.prompt_logprobs = event.logprobs, event.prompt_logprobs
        # the thinking left out of the answer: its tokens too, as vLLM leaves them out
        delta.token_ids, delta.prompt_ids = event.token_ids if include_reasoning else None, event.prompt_ids
    return delta


async def interleave(streams: list[AsyncGenerator[ChoiceDelta, None]]) -> AsyncGenerator[ChoiceDelta, None]:
    """The deltas of several streams (a completion's choices, or its prompts' choices) as they
    come, each stream pumped by its own task, until every one has ended; the first error any
    raises is raised here, and closing this closes them all."""
    queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[ChoiceDelta, None]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(streams)
        while running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        # Each ends its choice's block, which meters it into the request's usage (``Joint``): waited
        # for to the end, not cut short by a cancel of this task (a stream the client left: its
        # scope cancels it again at every await), which would cancel them again mid-write (a gather
        # passes its cancel on; ``wait`` does not), and let the request's usage be written before
        # its choices' (none).
        if tasks:  # (asyncio.wait refuses an empty set)
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)


async def _first_event(serving: Serving, job: ChatJob, params: ChatParams,
                       ctx: StepContext) -> tuple[AsyncIterator[ChatEvent], ChatEvent, StepContext]:
    """Submit the request and wait for its first event, so that errors found on submission
    become API errors rather than a broken stream."""
    if job.images and any(isinstance(image, PendingImage) for image in job.images):
        raise RuntimeError("a chat job's pending images must be read (with_images) before it is served")
    req = ChatRequest(job.messages, params, priority=serving.rank, ctx=ctx, adapters=job.stack,
                      tools=job.tools.template_tools(), template_kwargs=job.template_kwargs,
                      prompt_end=job.prompt_end, prompt_ids=job.prompt_ids, stream=job.stream, reasoning=job.reasoning != "none", images=job.images,
                      cache_salt=prefix_salt(serving.svc, serving.caller, job),
                      add_special_tokens=job.add_special_tokens,
                      prediction=job.prediction, token_ids=job.token_ids, truncate=job.truncate,
                      truncation_side=job.truncation_side)
    events = serving.worker.chat(req)
    try:
        return events, await events.__anext__(), ctx
    # turned down on submission, before any work (the prompt is longer than the model's context, a
    # field the engine cannot serve): refused, as a 400 before the slot is, so not metered
    except ContextTooLong as exc:
        await events.aclose()
        raise serving.refused(str(exc), "messages", "context_length_exceeded") from None
    except InvalidParam as exc:
        await events.aclose()
        raise serving.refused(str(exc), exc.param) from None
    except ValueError as exc:  # the engine cannot serve this adapter stack (e.g. rank too high)
        await events.aclose()
        raise serving.refused(str(exc), "adapters", "adapter_not_supported") from None
    except BaseException:
        await events.aclose()
        raise


# -- whole responses --------------------------------------------------------------------------------


@dataclass
class Reply:
    """One choice, whole."""

    index: int
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: ToolCalls = field(default_factory=ToolCalls)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    finished: ChatFinished | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning_tokens: int = 0
    audio: dict | None = None  # a spoken reply's (gateway.output_audio): then ``content`` is null
    token_ids: list[int] | None = None  # ``ChatJob.token_ids``: every generated token, and the prompt's
    prompt_ids: list[int] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.content.append(delta.content)
        if delta.token_ids is not None:
            self.token_ids = (self.token_ids or []) + delta.token_ids
        if delta.prompt_ids is not None:
            self.prompt_ids = delta.prompt_ids
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for call in delta.calls:
            self.calls.add(call)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.finished = delta.finish_reason, delta.finished
            self.reasoning_tokens = delta.reasoning_tokens

    def message(self, legacy: bool = False) -> dict:
        """The choice's message; ``legacy`` (asked as ``functions``): its first call as ``function_call``."""
        text = "".join(self.content)
        thought = self.reasoning or self.reasoning_tokens  # its thinking shown, or left out (include_reasoning)
        message: dict = {"role": "assistant",
                         "content": text if text or not (self.calls.calls or thought) else None}
        if self.calls.calls and legacy:
            message["function_call"] = self.calls.calls[0]["function"]
        elif self.calls.calls:
            message["tool_calls"] = self.calls.calls
        if self.reasoning:  # DeepSeek's field, which most clients read, and vLLM's
            message["reasoning_content"] = message["reasoning"] = "".join(self.reasoning)
        if self.audio is not None:  # the text is the audio's transcript, as OpenAI's audio models answer
            message["content"] = None
            message["audio"] = self.audio
        return message


async def collect(deltas: AsyncGenerator[ChoiceDelta, None]) -> tuple[list[Reply], str]:
    """Every choice of a completion, whole, and the tier that served it (``deltas`` is closed
    after)."""
    replies: dict[int, Reply] = {}
    tier = ""
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            replies.setdefault(delta.index, Reply(delta.index)).add(delta)
            tier = delta.tier or tier
    out = [replies[i] for i in sorted(replies)]
    if not out or any(r.finished is None for r in out):
        raise RuntimeError("the chat deltas ended without finishing every choice")
    return out, tier


def completion(cid: str, model: str, replies: list[Reply], tier: str, job: ChatJob,
               svc: Services | None = None) -> dict:
    """The ``chat.completion`` object of ``replies`` to ``job`` served at ``tier``: a call is a
    ``function_call`` where the deprecated ``functions`` asked; where logprobs were asked for,
    every choice has its ``logprobs`` object (with ``ChatJob.tokens_as_ids`` each token named by
    its id); with ``ChatJob.token_ids`` (vLLM's return_token_ids) the prompt's ids are in
    ``prompt_token_ids`` and each choice's in its ``token_ids``."""
    legacy, logprobs = job.tools.legacy, job.params.logprobs is not None
    body = {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": r.index, "message": r.message(legacy), "finish_reason": r.finish_reason,
                     "stop_reason": r.finished.stop_reason,  # vLLM's: the stop string or token that ended it
                     "logprobs": chat_logprobs(r.logprobs, logprobs, job.tokens_as_ids)} for r in replies],
        "usage": _usage(replies),
    }
    if job.echo:  # vLLM's: the last message's text first, before a reply's text or calls
        for choice in body["choices"]:
            choice["message"]["content"] = job.echo + (choice["message"]["content"] or "")
    if job.params.prompt_logprobs is not None:  # vLLM's: per prompt token after the first, by token id
        body["prompt_logprobs"] = prompt_logprob_dicts(replies[0].prompt_logprobs if replies else None)
    if job.token_ids:
        for choice, r in zip(body["choices"], replies):
            choice["token_ids"] = r.token_ids
        body["prompt_token_ids"] = replies[0].prompt_ids if replies else None
    return _with_tier(body, tier, svc)


def _with_tier(body: dict, tier: str, svc: Services | None) -> dict:
    if svc is not None and tier:
        body["service_tier"] = service_tier.label(svc.config, tier)
    return body


def _usage(choices: list[Reply] | list[ChoiceDelta]) -> dict:
    """The usage of a completion's finished ``choices`` (whole, or their last deltas): the prompt
    once (and of it what the engine's prefix cache held, as the first choice found it), every
    choice's completion tokens, and of them those spent thinking."""
    finished = [c.finished for c in choices if c.finished is not None]
    prompt = finished[0].prompt_tokens if finished else 0
    completion_tokens = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished[0].cached_tokens if finished else 0},
            "completion_tokens_details": {
                "reasoning_tokens": sum(c.reasoning_tokens for c in choices),
                "accepted_prediction_tokens": sum(f.accepted_prediction_tokens for f in finished),
                "rejected_prediction_tokens": sum(f.rejected_prediction_tokens for f in finished)}}


# -- HTTP -------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body, job, voice = await checked_chat(svc, caller, await read_json(request, svc.config.limits.max_body))
    served = served_caller(svc, caller, job)
    if (end_user := body.end_user(caller.key_id)) is not None:
        log.info("chat request: key %s, user %s, tier %s", caller.key_id, end_user, served.tier)
    completion_id = f"chatcmpl-{body.request_id or new_id()}"
    headers = {**svc.gate.rate_headers(served.tier), "x-tiergate-tier": served.tier}
    watch: StoreWatch = request.app.state.store_watch
    if body.store:  # refused before the work while the store is down, not after it
        await watch.check(lambda: request.app.state.completions.get(completion_id, caller.key_id))
    async with disconnect_signal(request) as gone:
        deltas = serve_chat(svc, caller, job, gone)
        if not body.stream:
            replies, tier = await collect(deltas)
            if voice is not None:
                await say_replies(svc, caller, voice, replies, gone)
            answer = completion(completion_id, body.model, replies, tier, job, svc)
            if body.store and not await watch.kept(stored_chat.keep(request.app.state.completions, caller.key_id,
                                                                    _unsaid(answer), body), completion_id):
                headers = {**headers, **NOT_STORED}  # answered all the same: the work is done and metered
            return JSONResponse(answer, headers=headers)
        first = await deltas.__anext__()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    label = service_tier.label(svc.config, served.tier)
    kept = None
    if body.store:
        async def kept(answer: dict) -> None:  # a store that failed: logged, and the stream ends as it would
            await watch.kept(stored_chat.keep(request.app.state.completions, caller.key_id, _unsaid(answer), body),
                             completion_id)
    speaker = None
    if voice is not None:
        def speaker(text: str) -> AsyncIterator[bytes]:  # the client leaving closes the stream, and the speech with it
            return say(svc, caller, voice, text, None, within=True)
    sse = _sse(deltas, first, completion_id, body.model, job, label, include_usage, kept, speaker, svc.spoken,
               caller.key_id)
    return Streamed(sse, "text/event-stream", headers=headers)


async def checked_chat(svc: Services, caller: Caller, data: Any,
                       in_batch: bool = False) -> tuple[ChatCompletionRequest, ChatJob, Voice | None]:
    """A chat request's body, its job (images read) and how its replies are said (None: they are
    not), all checked before its ``input_audio`` parts are heard: a request refused for any field
    spends no speech-to-text work and is not metered. ``in_batch``: a batch line, which does not stream."""
    data, unheard = await chat_audio(svc, heard_replies(svc, caller, await chat_files(svc, caller, data)))
    body = parse(ChatCompletionRequest, data)
    if in_batch and body.stream:
        raise bad_request("stream is not supported in a batch", "stream")
    await svc.adapters.ready(body.model, body.adapters)
    job = await with_images(svc, plan_chat(svc, body))
    spoken = body.spoken or body.audio is not None
    voice = await plan_voice(svc, body) if spoken else None  # (no coroutine per plain request)
    if unheard is not None:  # checked whole: now the audio is heard, and the job planned with its transcripts
        body = parse(ChatCompletionRequest, await hear(svc, caller, data, unheard))
        job = dataclasses.replace(plan_chat(svc, body), images=job.images)  # (the images, already read)
    return body, job, voice


def _unsaid(answer: dict) -> dict:
    """A completion as it is stored: a spoken reply's transcript and id, not its audio file."""
    if not any(c["message"].get("audio") for c in answer["choices"]):
        return answer
    choices = [{**c, "message": {**c["message"], "audio": {k: v for k, v in c["message"]["audio"].items()
                                                            if k != "data"}}}
               if c["message"].get("audio") else c for c in answer["choices"]]
    return {**answer, "choices": choices}


async def _sse(deltas: AsyncIterator[ChoiceDelta], first: ChoiceDelta, cid: str, model: str, job: ChatJob,
               tier_label: str, include_usage: bool, kept: Callable[[dict], Awaitable[None]] | None = None,
               speaker: Callable[[str], AsyncIterator[bytes]] | None = None, spoken: SpokenReplies | None = None,
               owner: str = "") -> AsyncIterator[str]:
    """The chunks of a streamed completion of ``job``; with ``kept``, the whole completion is
    handed to it once every choice finished (``store: true``), before the last chunk. Where the
    deprecated ``functions`` asked, the first call goes out as ``delta.function_call`` (name first,
    then argument fragments). ``speaker``:
    the replies are spoken (gateway.output_audio): each choice's text goes out as
    ``delta.audio.transcript``, its speech as ``delta.audio.data`` a phrase at a time as the
    phrases are written (``SpokenStream``), then its audio id and ``expires_at`` with the finish
    reason; ``spoken`` keeps its transcript
    for ``owner``. ``ChatJob.token_ids`` (vLLM's return_token_ids): the prompt's ids in the first
    chunk's ``prompt_token_ids``, and each chunk's generated ids in its choice's ``token_ids``."""
    n, legacy, token_ids = job.n, job.tools.legacy, job.token_ids
    logprobs, as_ids = job.params.logprobs is not None, job.tokens_as_ids
    created = int(time.time())
    replies: dict[int, Reply] = {}
    voicing = SpokenStream(speaker, n) if speaker is not None else None
    audio_ids = {i: spoken.new_id() for i in range(n)} if speaker is not None and spoken is not None else {}

    def chunk(choices: list[dict], usage: dict | None = None, **extra: object) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "service_tier": tier_label, "choices": choices, **extra}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(d: ChoiceDelta) -> dict:
        delta: dict = {}
        if d.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = d.reasoning
        if d.content and voicing is not None:
            voicing.write(d.index, d.content)
            delta["audio"] = {"transcript": d.content}
        elif d.content:
            delta["content"] = d.content
        if d.calls and legacy:
            first = [c for c in d.calls if c.index == 0]  # the functions API makes one call
            if first:
                delta["function_call"] = {"arguments": "".join(c.arguments for c in first)}
                if first[0].name is not None:
                    delta["function_call"] = {"name": first[0].name, **delta["function_call"]}
        elif d.calls:
            delta["tool_calls"] = [c.as_openai() for c in d.calls]
        lp = {"content": chat_content(d.logprobs or [], as_ids), "refusal": None} if logprobs else None
        out = {"index": d.index, "delta": delta, "finish_reason": d.finish_reason, "logprobs": lp}
        if token_ids:
            out["token_ids"] = d.token_ids or []
        if d.finished is not None:  # vLLM's field, in the chunk that ends the choice
            out["stop_reason"] = d.finished.stop_reason
        return out

    def sound(index: int, piece: bytes) -> str:
        return chunk([{"index": index, "delta": {"audio": {"data": base64.b64encode(piece).decode()}},
                       "finish_reason": None, "logprobs": None}])

    async def audio(d: ChoiceDelta, last: dict) -> AsyncIterator[str]:
        """A spoken choice's end: the rest of its speech (when it wrote text), then its id with
        ``last``, the chunk that carries the finish reason."""
        async for index, piece in voicing.rest(d.index):
            yield sound(index, piece)
        text = "".join(voicing.text[d.index])
        if text:
            expires_at = spoken.put(owner, audio_ids[d.index], text)
            last = {**last, "delta": {**last["delta"], "audio": {"id": audio_ids[d.index], "expires_at": expires_at}}}
            if kept is not None:
                replies[d.index].audio = {"id": audio_ids[d.index], "expires_at": expires_at, "transcript": text}
        yield chunk([last])

    finished: list[ChoiceDelta] = []  # each choice's last delta
    try:
        for i in range(n):
            opening = {"role": "assistant", "content": ""}
            if speaker is not None:
                opening = {"role": "assistant", "content": None, "audio": {"id": audio_ids[i], "transcript": ""}}
            # vLLM's return_token_ids: the prompt's in the first chunk
            prompt = {"prompt_token_ids": first.prompt_ids} if token_ids and i == 0 else {}
            yield chunk([{"index": i, "delta": opening, "finish_reason": None, "logprobs": None}], **prompt)
        for i in range(n) if job.echo else ():  # vLLM's echo: the last message's text, a chunk per choice
            yield chunk([{"index": i, "delta": {"content": job.echo}, "finish_reason": None, "logprobs": None}])
        delta = first
        while True:
            if kept is not None:
                replies.setdefault(delta.index, Reply(delta.index)).add(delta)
            if speaker is not None and delta.finished is not None:  # the finish reason goes with the audio's id
                body = choice(delta)
                stop_reason = body.pop("stop_reason")
                yield chunk([{**body, "finish_reason": None}])
                async for piece in audio(delta, {"index": delta.index, "delta": {}, "finish_reason": body["finish_reason"],
                                                 "stop_reason": stop_reason, "logprobs": None}):
                    yield piece
            elif not delta.empty:  # (an empty one: a choice's first while its thinking is left out)
                yield chunk([choice(delta)])
            for index, piece in voicing.ready() if voicing is not None else ():  # the phrases said meanwhile
                yield sound(index, piece)
            if delta.finished is not None:
                finished.append(delta)
                if len(finished) == n:
                    break
            delta = await deltas.__anext__()
        if kept is not None:
            whole = completion(cid, model, [replies[i] for i in sorted(replies)], "", job)
            await kept({**whole, "created": created, "service_tier": tier_label})
        if include_usage:
            yield chunk([], _usage(finished))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        # a refusal met after the start (a spoken reply's speech model: 429, 503) says itself
        err = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {type(exc).__name__}",
                                                             "generation_failed")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        if voicing is not None:
            await voicing.aclose()
        await deltas.aclose()
    yield "data: [DONE]\n\n"
