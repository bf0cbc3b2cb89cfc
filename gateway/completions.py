"""Legacy text completions, ``POST /v1/completions``: a raw prompt, no chat template.

``prompt`` is a string, a list of strings, a list of token ids or a list of such lists; each
prompt is its own completion with ``n`` choices (choice ``p * n + i`` is choice ``i`` of prompt
``p``), and every choice runs through the chat serving core (``gateway.chat.serve_chat``) with its
own gate slot and model lease, on either chat engine. Text prompts are encoded by the model's
tokenizer with its special tokens (as ``vllm serve`` does), and the ids go to the engine as they
are (``ChatRequest.prompt_ids``).

``logprobs: k`` (0..5) gives the legacy shape per choice: ``tokens``, ``token_logprobs``,
``top_logprobs`` (the sampled token and the ``k`` most likely, as a dict per token) and
``text_offset``. ``echo`` prepends the prompt's text; with ``logprobs`` too, the prompt's own
tokens come first in ``logprobs``, as in ``vllm serve`` (the engines' ``prompt_logprobs``: the
model's raw log probabilities, each prompt token's given those before it; the first token's
``token_logprobs`` and ``top_logprobs`` entries are ``null``, nothing preceding it), which is what
evaluation harnesses score a continuation by (``echo``, ``logprobs``, ``max_tokens: 1``, or
``max_tokens: 0`` with both, the older idiom: the prompt scored and nothing generated, as ``vllm
serve`` allows). The prompt tokens' ``text_offset`` counts their own text from 0, as vLLM's does: a
special token the tokenizer adds (a BOS) has text that the echoed prompt does not.

``response_format`` and vLLM's ``structured_outputs`` constrain each choice as they do a chat
reply (``gateway.structured``).

``suffix`` asks for the text between the prompt and it (fill in the middle, what editors' code
completion sends): a code model trained for it is given ``<prefix>`` prompt ``<suffix>`` suffix
``<middle>`` (its own three tokens, the prefix-suffix-middle order all of them were trained on) and
writes the middle, which is the completion's text. The tokens are found in the tokenizer by the
names code models give them (``FIM_LAYOUTS``: Qwen2.5-Coder, CodeGemma, StarCoder, DeepSeek-Coder,
...) or named in tiers.yaml (a chat model's ``fim:``); a model with neither is a 400 naming
``suffix``. The prompt and the suffix are each encoded as a prompt is (special tokens spelled in
the text read as those tokens), without the tokenizer's BOS, which (if it adds one) comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator, ClassVar, Literal

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway import service_tier
from gateway.adapters import names_own, resolve_request
from gateway.auth import Caller
from gateway.chat import (ChatJob, ChoiceDelta, Reply, check_room, collect, engine_config, interleave, joint_request,
                          served_caller, serve_chat)
from gateway.errors import APIError, bad_request
from gateway.http import Streamed, disconnect_signal
from gateway.logprobs import check_prompt_logprobs, json_logprob, prompt_logprob_dicts, token_name
from gateway.schemas import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_REPETITION_PENALTY, MAX_STACK,
                             MAX_STOP_TOKEN_IDS, MIN_REPETITION_PENALTY, AdapterChoice, BadWord, CacheSalt,
                             RequestId, ResponseFormat, StreamOptions, StructuredOutputs, _Body, check_vllm_defaults,
                             checked_logit_bias, checked_stops, parse, read_json, reply_options, sampling)
from gateway.serving import Gone
from gateway.service import Services
from gateway.structured import request_grammar
from workers.base import ChatParams, ModelSpec, TokenLogprob
from workers.chat_prompt import truncated
from workers.registry import describe

DEFAULT_MAX_TOKENS = 16  # as OpenAI's
MAX_LOGPROBS = 5  # the legacy endpoint's cap on ``logprobs``
MAX_CHOICES = 64  # prompts times n in one request (each choice takes a gate slot)

TokenIds = list[int]


class CompletionRequest(_Body):
    null_is_default: ClassVar[frozenset[str]] = frozenset(  # OpenAI's nullable fields (_Body)
        {"temperature", "top_p", "n", "stream", "echo", "presence_penalty", "frequency_penalty"})
    model: str = Field(min_length=1)
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt (echo and logprobs), generate nothing
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)  # per prompt; capped by limits.max_n
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in -100..100
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's sampling extensions, as chat's
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's, as chat's
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's detokenizing options and token constraints, as chat's
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[BadWord] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    thinking_token_budget: int | None = Field(default=None, ge=-1)  # vLLM's, as chat's: by the prompt's markers
    request_id: RequestId | None = None  # vLLM's, as chat's: the answer's id is cmpl-<request_id>
    cache_salt: CacheSalt | None = None  # vLLM's, as chat's
    add_special_tokens: bool = True  # vLLM's: a text prompt encoded with the tokenizer's special tokens (BOS)
    # vLLM's: each prompt token's log probability, rank and the k likeliest there, per choice (0..20; not streamed);
    # it is also what echo's prompt logprobs show, as on vLLM
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    priority: int = 0  # vLLM's, as chat's (``check_vllm_defaults``)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM's: each prompt cut, as chat's
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None  # vLLM's: each choice's prompt and generated token ids
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name each token "token_id:<id>"
    response_format: ResponseFormat | None = None  # as chat's, and vLLM's structured_outputs (gateway.structured)
    structured_outputs: StructuredOutputs | None = None
    best_of: int | None = Field(default=None, ge=1)  # candidates per prompt, the best n answered (not streamed)
    suffix: str | None = None  # fill in the middle, on a model with FIM tokens
    user: str | None = None
    service_tier: str | None = None
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        return checked_stops(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return checked_logit_bias(v)

    def prompts(self) -> list[str | TokenIds]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it, and its text for ``echo``."""

    ids: list[int]
    text: str
    first: str  # the first token's text: its place in the prompt's logprobs has no logprob


@dataclass(frozen=True)
class CompletionJob:
    """A checked completion request: one chat job per prompt, sharing everything but the ids."""

    jobs: list[ChatJob]
    prompts: list[Prompt]
    n: int  # choices made per prompt (best_of's candidates when it is above the n asked)
    echo: bool
    logprobs: int | None
    keep: int | None = None  # best_of: choices answered per prompt, the best of the n made; None: all n
    token_ids: bool = False  # vLLM's return_token_ids: each choice's prompt_token_ids and token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids (``legacy_logprobs``)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: each choice's, as chat's (``prompt_logprob_dicts``)


# -- the prompt's tokens ------------------------------------------------------------------------------

_TOKENIZERS: dict[Path, Any] = {}


async def tokenizer_of(path: Path) -> Any:
    """The tokenizer of a chat model's folder (no weights), loaded once per process."""
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from transformers import AutoTokenizer

        tok = _TOKENIZERS[path] = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
    return tok


async def processor_of(path: Path) -> Any:
    """The processor of a vision-language chat model's folder (images and text into prompt ids; no
    weights), loaded once per process."""
    proc = _TOKENIZERS.get(path / "processor")
    if proc is None:
        from transformers import AutoProcessor

        proc = _TOKENIZERS[path / "processor"] = await asyncio.to_thread(AutoProcessor.from_pretrained, str(path))
    return proc


# Fill-in-the-middle tokens (prefix, suffix, middle) as code models' tokenizers name them, each
# trained on <prefix>{prefix}<suffix>{suffix}<middle>: Qwen2.5-Coder, Qwen3-Coder and CodeGemma;
# StarCoder, StarCoder2, SantaCoder and Granite Code; DeepSeek-Coder; older BigCode models.
FIM_LAYOUTS: list[tuple[str, str, str]] = [
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
]


def fim_ids(tok: Any, configured: tuple[str, str, str] | None = None) -> tuple[int, int, int] | None:
    """The ids of the model's (prefix, suffix, middle) tokens: ``configured`` (tiers.yaml), else the
    first of FIM_LAYOUTS the tokenizer has; None when it has none. 400 naming ``suffix`` for
    configured tokens the tokenizer lacks."""
    if configured is not None:
        ids = [_token_id(tok, t) for t in configured]
        missing = [t for t, i in zip(configured, ids) if i is None]
        if missing:
            raise bad_request(f"this model's fim tokens (tiers.yaml) are not in its tokenizer: {', '.join(missing)}",
                              "suffix")
        return tuple(ids)  # type: ignore[return-value]
    for layout in FIM_LAYOUTS:
        ids = [_token_id(tok, t) for t in layout]
        if None not in ids:
            return tuple(ids)  # type: ignore[return-value]
    return None


def _token_id(tok: Any, token: str) -> int | None:
    """The id of ``token`` in the vocabulary, None when it has none (a lookup, not ``get_vocab``'s
    copy of a 150k-entry vocabulary on the event loop per request)."""
    i = tok.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and tok.convert_ids_to_tokens(i) == token else None


def encode_prompts(tok: Any, prompts: list[str | TokenIds], suffix: str | None = None,
                   fim: tuple[int, int, int] | None = None, special: bool = True) -> list[Prompt]:
    """Token ids and text of each prompt, a text one with the tokenizer's special tokens unless not
    ``special`` (vLLM's ``add_special_tokens``); 400 naming ``prompt`` for an empty one or an id
    outside the vocabulary. With ``suffix`` (and the model's ``fim`` ids), each prompt's ids are
    its fill-in-the-middle layout: the tokenizer's BOS for a text prompt (when ``special``), then
    prefix token, prompt, suffix token, suffix, middle token, the texts encoded without special
    tokens."""
    vocab = len(tok)
    insert = suffix is not None and fim is not None
    out = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids = list(tok(p, add_special_tokens=special and not insert)["input_ids"])
            text = p
        else:
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})", param)
            ids, text = list(p), tok.decode(p)
        if not ids and not insert:
            raise bad_request("the prompt is empty (no tokens)", param)
        if insert:
            lead = [t for t in tok("")["input_ids"] if t == tok.bos_token_id] if isinstance(p, str) and special else []
            ids = [*lead, fim[0], *ids, fim[1], *tok(suffix, add_special_tokens=False)["input_ids"], fim[2]]
        out.append(Prompt(ids, text, tok.decode(ids[:1])))
    return out


# -- planning and serving -----------------------------------------------------------------------------


async def plan_completion(svc: Services, body: CompletionRequest) -> CompletionJob:
    """The job of ``body``; 404 for an unknown model or adapter, 400 naming the field."""
    await svc.adapters.ready(body.model, body.adapters)
    spec, stack = resolve_request(svc, body.model, body.adapters, "chat")
    limits = svc.config.limits
    defaults = svc.sampling_defaults.get(spec.name, {})  # (its generation_config's max_new_tokens, as vLLM's)
    max_tokens = body.max_tokens if body.max_tokens is not None else \
        min(defaults.get("max_tokens", DEFAULT_MAX_TOKENS), limits.max_chat_tokens)
    if max_tokens == 0 and not (body.echo and body.logprobs is not None) and body.prompt_logprobs is None:
        raise bad_request("max_tokens 0 scores the prompt and generates nothing: it needs echo and logprobs, or "
                          "prompt_logprobs", "max_tokens")
    if body.prompt_logprobs is not None and body.stream:  # as vLLM's
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if body.stream_options is not None and not body.stream:  # OpenAI's and vLLM's
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if max_tokens > limits.max_chat_tokens:
        raise bad_request(f"max_tokens is {max_tokens}, above this server's limit of {limits.max_chat_tokens}",
                          "max_tokens")
    if body.max_tokens is not None:
        check_room(svc, spec.name, max_tokens, "max_tokens")
    if body.n > limits.max_n:
        raise bad_request(f"n is {body.n}, above this server's limit of {limits.max_n} choices", "n")
    made = body.n if body.best_of is None else body.best_of
    if made < body.n:
        raise bad_request(f"best_of ({made}) must be at least n ({body.n})", "best_of")
    if made > limits.max_n:
        raise bad_request(f"best_of is {made}, above this server's limit of {limits.max_n} candidates", "best_of")
    if made > body.n and body.stream:
        raise bad_request("best_of above n cannot be streamed: the best are known only when every candidate ends",
                          "best_of")
    if body.suffix is not None and body.echo:
        raise bad_request("echo with suffix is not supported: the completion is the text between the prompt and "
                          "the suffix", "echo")
    raw = body.prompts()
    if not raw:
        raise bad_request("prompt must not be an empty list", "prompt")
    if len(raw) * made > MAX_CHOICES:
        raise bad_request(f"{len(raw)} prompts times {'best_of' if made > body.n else 'n'}={made} is above "
                          f"{MAX_CHOICES} choices", "prompt")
    service_tier.check(svc.config, body.service_tier)
    check_vllm_defaults(body)
    check_prompt_logprobs(spec, body.prompt_logprobs is not None, "prompt_logprobs")
    check_prompt_logprobs(spec, bool(body.echo) and body.logprobs is not None, "echo")  # its prompt's logprobs
    tok, fim = await tokenizer_of(spec.path), None
    if body.suffix is not None:
        fim = fim_ids(tok, svc.config.fim_tokens(spec.name))
        if fim is None:
            raise bad_request(f"the model '{spec.name}' has no fill-in-the-middle tokens (none of the layouts tiergate "
                              "knows, and no fim: in tiers.yaml), so it cannot complete between a prompt and a suffix",
                              "suffix")
    prompts = await asyncio.to_thread(encode_prompts, tok, raw, body.suffix, fim,  # off the loop
                                      body.add_special_tokens)
    if body.truncate_prompt_tokens is not None:
        prompts = await _truncated(svc, spec, tok, prompts, body.truncate_prompt_tokens, body.truncation_side)
    ranked = made > body.n  # best_of: each candidate's tokens' logprobs rank it
    params = ChatParams(
        max_tokens, max_tokens_default=body.max_tokens is None, stop=body.stop or [], seed=body.seed,
        logprobs=0 if ranked and body.logprobs is None else body.logprobs,
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        prompt_logprobs=body.prompt_logprobs if body.prompt_logprobs is not None else
        body.logprobs if body.echo else None,
        grammar=request_grammar(body.response_format, body.structured_outputs, limits.grammar_max_chars),
        grammar_param="response_format" if body.structured_outputs is None else "structured_outputs",
        **sampling(body, defaults),
        **reply_options(body, max_tokens, getattr(engine_config(svc, spec.name), "reasoning_parser", "none")),
    )
    token_ids = bool(body.return_token_ids)
    jobs = [ChatJob(spec.name, [], params, stack, n=made, service_tier=body.service_tier, prompt_ids=p.ids,
                    own_adapter=names_own(body.model, stack), token_ids=token_ids, cache_salt=body.cache_salt)
            for p in prompts]
    return CompletionJob(jobs, prompts, made, body.echo, body.logprobs, keep=body.n if ranked else None,
                         token_ids=token_ids, tokens_as_ids=bool(body.return_tokens_as_token_ids),
                         prompt_logprobs=body.prompt_logprobs is not None)


def serve_completion(svc: Services, caller: Caller, job: CompletionJob,
                     gone: Gone | None) -> AsyncGenerator[ChoiceDelta, None]:
    """Every choice's deltas, indexed across prompts (prompt ``p``'s choice ``i`` is ``p * n + i``);
    errors before the first delta come from the first ``__anext__``, as with chat."""
    if len(job.jobs) == 1:  # (its n choices, if more than one, are one request: serve_chat's joint)
        return _reindexed(serve_chat(svc, caller, job.jobs[0], gone), 0)
    served = served_caller(svc, caller, job.jobs[0])
    joint = joint_request(svc, served, job.jobs)  # its prompts are one request to the key's account
    return joint.serve(interleave([_reindexed(serve_chat(svc, caller, j, gone, joint, p), p * job.n)
                                   for p, j in enumerate(job.jobs)]))


async def _reindexed(deltas: AsyncGenerator[ChoiceDelta, None], offset: int) -> AsyncGenerator[ChoiceDelta, None]:
    async with contextlib.aclosing(deltas):
        try:
            async for delta in deltas:
                delta.index += offset
                yield delta
        except APIError as exc:  # the chat core names the prompt ``messages``
            if exc.param == "messages":
                exc.param = "prompt"
            raise


# -- the legacy shapes --------------------------------------------------------------------------------


def legacy_logprobs(entries: list[TokenLogprob], offset: int, prompt: tuple[Prompt, list] | None = None,
                    as_ids: bool = False) -> dict:
    """``logprobs`` of a choice (or chunk) in the legacy shape, its text starting at ``offset``;
    with ``prompt`` (echo: the prompt and its engine's prompt logprobs), the prompt's tokens first.
    ``as_ids`` (vLLM's return_tokens_as_token_ids): each token named ``token_id:<id>``; its
    ``text_offset`` stays its place in the text (vLLM's counts the names' lengths)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def top(e: TokenLogprob) -> dict[str, float]:
        return {token_name(e, as_ids): json_logprob(e.logprob),
                **{token_name(t, as_ids): json_logprob(t.logprob) for t in e.top}}

    if prompt is not None:
        at = 0
        for e in _prompt_entries(*prompt):
            text = e.token if e is not None else prompt[0].first
            out["tokens"].append(token_name(e, as_ids) if e is not None else
                                 f"token_id:{prompt[0].ids[0]}" if as_ids else text)
            out["token_logprobs"].append(None if e is None else json_logprob(e.logprob))
            out["top_logprobs"].append(None if e is None else top(e))
            out["text_offset"].append(at)
            at += len(text)
    for e in entries:
        out["tokens"].append(token_name(e, as_ids))
        out["token_logprobs"].append(json_logprob(e.logprob))
        out["top_logprobs"].append(top(e))
        out["text_offset"].append(offset)
        offset += len(e.token)
    return out


def _prompt_entries(prompt: Prompt, entries: list | None) -> list[TokenLogprob | None]:
    if entries is None or len(entries) != len(prompt.ids):  # an engine bug, not the client's
        raise RuntimeError(f"the engine gave {None if entries is None else len(entries)} prompt logprobs "
                           f"for {len(prompt.ids)} prompt tokens")
    return entries


async def _truncated(svc: Services, spec: ModelSpec, tok: Any, prompts: list[Prompt], keep: int,
                     side: str | None) -> list[Prompt]:
    """vLLM's ``truncate_prompt_tokens`` on each prompt (``workers.chat_prompt.truncated``); a cut one
    echoes as the text of the tokens it kept."""
    if keep == 0:
        raise bad_request("truncate_prompt_tokens is 0: 1 or more tokens to keep, or -1 for the context less one",
                          "truncate_prompt_tokens")
    context = svc.context_lengths.get(spec.name) or (await asyncio.to_thread(describe, spec)).context_length
    out = []
    for p in prompts:
        ids = truncated(tok, p.ids, keep, side, context)
        out.append(p if ids is p.ids else Prompt(ids, tok.decode(ids), tok.decode(ids[:1])))
    return out


def completion_usage(job: CompletionJob, replies: list[Reply] | list[ChoiceDelta]) -> dict:
    """Usage of a whole completion: each prompt counted once (and of it what the engine's prefix
    cache held, as the prompt's first choice found it), every choice's tokens."""
    finished = [r.finished for r in replies if r.finished is not None]
    prompt = sum(len(p.ids) for p in job.prompts)
    generated = sum(f.completion_tokens for f in finished)
    cached = sum(r.finished.cached_tokens for r in replies if r.finished is not None and r.index % job.n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def text_completion(cid: str, model: str, job: CompletionJob, replies: list[Reply], tier_label: str) -> dict:
    """The ``text_completion`` object: every choice, or with ``best_of`` each prompt's best
    (``best``); usage counts every candidate made, as OpenAI bills them."""
    choices = []
    for index, r in best(job, replies):
        prompt = job.prompts[r.index // job.n]
        head = prompt.text if job.echo else ""
        echoed = (prompt, r.prompt_logprobs) if job.echo else None
        lp = None if job.logprobs is None else legacy_logprobs(r.logprobs or [], len(head), echoed, job.tokens_as_ids)
        choices.append({"index": index, "text": head + "".join(r.content), "logprobs": lp,
                        "finish_reason": r.finish_reason, "stop_reason": r.finished.stop_reason})
        if job.token_ids:  # vLLM's: the prompt's ids in each choice (a request may have several prompts)
            choices[-1].update(prompt_token_ids=prompt.ids, token_ids=r.token_ids)
        if job.prompt_logprobs:
            choices[-1]["prompt_logprobs"] = prompt_logprob_dicts(r.prompt_logprobs)
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": completion_usage(job, replies), "service_tier": tier_label,
            "system_fingerprint": None}


def best(job: CompletionJob, replies: list[Reply]) -> list[tuple[int, Reply]]:
    """The answered choices with their indexes: every reply as it is, or with ``best_of`` each
    prompt's ``keep`` best candidates, highest mean log probability per token first (OpenAI's
    rule; a candidate with no token, an end of text at once, ranks last: the engines give no
    logprob for the end of text), indexed ``p * keep + i``."""
    if job.keep is None:
        return [(r.index, r) for r in replies]
    out = []
    for p in range(len(job.prompts)):
        candidates = [r for r in replies if r.index // job.n == p]
        ranked = sorted(candidates, key=lambda r: -_mean_logprob(r.logprobs or []))[:job.keep]
        out += [(p * job.keep + i, r) for i, r in enumerate(ranked)]
    return out


def _mean_logprob(entries: list[TokenLogprob]) -> float:
    return sum(json_logprob(e.logprob) for e in entries) / len(entries) if entries else float("-inf")


async def completion_result(svc: Services, caller: Caller, data: dict) -> dict:
    """A batch line's completion (no streaming)."""
    body = parse(CompletionRequest, data)
    if body.stream:
        raise bad_request("stream is not supported in a batch", "stream")
    job = await plan_completion(svc, body)
    replies, tier = await collect(serve_completion(svc, caller, job, None))
    return text_completion(f"cmpl-{body.request_id or uuid.uuid4().hex}", body.model, job, replies,
                           service_tier.label(svc.config, tier))


# -- HTTP ---------------------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(CompletionRequest, await read_json(request, svc.config.limits.max_body))
    job = await plan_completion(svc, body)
    served = served_caller(svc, caller, job.jobs[0])
    label = service_tier.label(svc.config, served.tier)
    cid = f"cmpl-{body.request_id or uuid.uuid4().hex}"
    headers = {**svc.gate.rate_headers(served.tier), "x-tiergate-tier": served.tier}
    async with disconnect_signal(request) as gone:
        deltas = serve_completion(svc, caller, job, gone)
        if not body.stream:
            replies, _ = await collect(deltas)
            return JSONResponse(text_completion(cid, body.model, job, replies, label), headers=headers)
        first = await deltas.__anext__()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Streamed(_sse(deltas, first, cid, body.model, job, label, include_usage), "text/event-stream",
                    headers=headers)


async def _sse(deltas: AsyncIterator[ChoiceDelta], first: ChoiceDelta, cid: str, model: str, job: CompletionJob,
               tier_label: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    total = len(job.prompts) * job.n
    offsets = [0] * total  # each choice's text sent so far, for text_offset
    opened: set[int] = set()  # choices whose first chunk went out (``job.token_ids``)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "service_tier": tier_label, "choices": choices, "system_fingerprint": None}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(index: int, text: str, entries: list[TokenLogprob] | None, finish: str | None,
               ids: list[int] | None = None) -> dict:
        lp = None if job.logprobs is None else legacy_logprobs(entries or [], offsets[index], None, job.tokens_as_ids)
        offsets[index] += len(text)
        out = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        if job.token_ids:  # vLLM's: each chunk's generated ids, and the prompt's in the choice's first
            out["token_ids"] = ids or []
            if index not in opened:
                opened.add(index)
                out["prompt_token_ids"] = job.prompts[index // job.n].ids
        return out

    def echoed(index: int, entries: list[TokenLogprob | None]) -> dict:
        """The prompt of choice ``index`` with its logprobs: sent when its engine gave them."""
        prompt = job.prompts[index // job.n]
        offsets[index] = len(prompt.text)
        lp = legacy_logprobs([], 0, (prompt, entries), job.tokens_as_ids)
        return {"index": index, "text": prompt.text, "logprobs": lp,
                "finish_reason": None}

    done: list[ChoiceDelta] = []
    try:
        if job.echo and job.logprobs is None:
            for i in range(total):
                yield chunk([choice(i, job.prompts[i // job.n].text, None, None)])
        delta = first
        while True:
            if delta.prompt_logprobs is not None and job.echo:
                yield chunk([echoed(delta.index, delta.prompt_logprobs)])
            if delta.content or delta.logprobs or delta.finish_reason or delta.prompt_logprobs is None:
                piece = choice(delta.index, delta.content, delta.logprobs, delta.finish_reason, delta.token_ids)
                if delta.finished is not None:  # vLLM's field, in the chunk that ends the choice
                    piece["stop_reason"] = delta.finished.stop_reason
                yield chunk([piece])
            if delta.finished is not None:
                done.append(delta)
                if len(done) == total:
                    break
            delta = await deltas.__anext__()
        if include_usage:
            yield chunk([], completion_usage(job, done))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band (a request's error as it is)
        err = exc if isinstance(exc, APIError) else APIError(500, f"generation failed: {type(exc).__name__}",
                                                             "generation_failed")
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"
