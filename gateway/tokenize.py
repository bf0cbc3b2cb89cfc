"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints, at the paths and in the
shapes ``vllm serve`` answers them (vllm/entrypoints/serve/tokenize/protocol.py), so that clients
written for it count and read tokens here the same way.

* ``/tokenize`` takes a text (``prompt``, special tokens added unless ``add_special_tokens`` is
  false) or a chat (``messages``, with chat's message shapes and ``tools``, through the model's
  chat template as a chat request's prompt is made: ``add_generation_prompt`` (true),
  ``continue_final_message`` (false), ``chat_template_kwargs``; ``add_special_tokens`` false) and
  answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``return_token_strs``: each
  token as the vocabulary spells it). At most ``limits.tokenize_max_tokens`` tokens, or the
  model's context where that is longer (a 400 ``too_many_tokens`` naming ``prompt`` or
  ``messages``): the answer, built off the event loop, grows with them.
* ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``, the text they decode to (special
  tokens kept, as vLLM's).

Any model with a tokenizer: a chat model (either form), an embedding, moderation or rerank model (a text),
an adapter (its base model's tokenizer); the model is required (a server here serves many). Any
tier's key; a key's model allow-list applies. No model work, so no gate and no load: the
tokenizer is read from the model's folder once (``gateway.completions.tokenizer_of``), as
``/v1/responses/input_tokens`` reads it. A chat's ``file`` parts are read as chat reads them (a
document's text, ``gateway.input_files``), and a spoken reply's ``audio`` id as its transcript. Its
image parts are not tokenized here (400): count them with ``/v1/responses/input_tokens``; nor its
``input_audio`` parts (400): chat hears those through a speech-to-text model, model work this
endpoint does not do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth import Caller
from gateway.chat import plan_chat
from gateway.completions import tokenizer_of
from gateway.errors import bad_request, not_found
from gateway.input_files import chat_files
from gateway.output_audio import heard_replies
from gateway.schemas import ChatCompletionRequest, _Body, parse, read_json
from gateway.service import TEXT_KINDS, Services
from workers.base import InvalidParam, ModelSpec
from workers.chat_prompt import render
from workers.registry import describe


class TokenizeText(_Body):
    model: str = Field(min_length=1)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChat(_Body):
    """The chat form's own fields; ``messages``, ``tools`` and ``chat_template_kwargs`` are read
    as a chat request's are."""

    model: str = Field(min_length=1)
    messages: list[Any]
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class Detokenize(_Body):
    model: str = Field(min_length=1)
    tokens: list[int] = Field(max_length=1_000_000)


async def tokenize(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    raw = await read_json(request, svc.config.limits.max_body)
    if "messages" in raw and "prompt" in raw:
        raise bad_request("send prompt (a text) or messages (a chat), not both", "prompt")
    if "messages" in raw:
        body = parse(TokenizeChat, raw)
        spec = _allowed(svc, caller, body.model)
        if spec.kind != "chat":
            raise bad_request(f"the model '{body.model}' is not a chat model: send it a prompt", "messages",
                              "model_not_supported")
        if body.add_generation_prompt and body.continue_final_message:
            raise bad_request("continue_final_message leaves the last message open: set add_generation_prompt to "
                              "false with it", "continue_final_message")
        chat = {k: v for k, v in raw.items() if k in ("model", "messages", "tools", "chat_template_kwargs")}
        _unheard(body.messages)
        # documents and spoken replies' transcripts become text as chat's own request reads them
        chat = heard_replies(svc, caller, await chat_files(svc, caller, chat))
        job = plan_chat(svc, parse(ChatCompletionRequest, chat))
        if job.images:
            raise bad_request("a chat's image parts are not tokenized here: count them with "
                              "POST /v1/responses/input_tokens", "messages")
        tok, cap = await tokenizer_of(spec.path), await _most_tokens(svc, spec)

        def chat_ids() -> list[int]:
            text = render(tok, job.messages, job.tools.template_tools(), job.template_kwargs,
                          add_generation_prompt=body.add_generation_prompt,
                          continue_final_message=body.continue_final_message)
            return _encoded(tok, text, body.add_special_tokens, cap, "messages")

        try:
            ids = await asyncio.to_thread(chat_ids)
        except InvalidParam as exc:  # the chat template refused the messages
            raise bad_request(str(exc), exc.param) from None
        except ValueError as exc:  # transformers: a last message continue_final_message cannot leave open
            raise bad_request(f"the chat template cannot continue the last message: {exc}",
                              "continue_final_message") from None
    elif "prompt" in raw:
        body = parse(TokenizeText, raw)
        spec = _allowed(svc, caller, body.model)
        tok, cap = await tokenizer_of(spec.path), await _most_tokens(svc, spec)
        ids = await asyncio.to_thread(_encoded, tok, body.prompt, body.add_special_tokens, cap, "prompt")
    else:
        raise bad_request("send prompt (a text) or messages (a chat) to tokenize", "prompt",
                          "missing_required_parameter")
    # a long answer's token strings and JSON take seconds: made off the loop, as the ids were
    return await asyncio.to_thread(_answer, tok, ids, await _context(svc, spec), bool(body.return_token_strs))


async def detokenize(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    body = parse(Detokenize, await read_json(request, svc.config.limits.max_body))
    spec = _allowed(svc, caller, body.model)
    tok = await tokenizer_of(spec.path)
    vocab = len(tok)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < vocab:
            raise bad_request(f"token {token} is not in this model's vocabulary (ids 0 to {vocab - 1})", f"tokens[{i}]")
    return JSONResponse({"prompt": await asyncio.to_thread(tok.decode, body.tokens)})


def _unheard(messages: list[Any]) -> None:
    """A 400 naming a chat's first ``input_audio`` part: chat hears one through a speech-to-text
    model, a transcription (gated and metered) that a request without model work does not run."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == "input_audio":
                raise bad_request("input_audio parts are not tokenized here: a chat hears them through a "
                                  "speech-to-text model (engine.audio_input), a transcription /tokenize does not "
                                  "run; transcribe the audio with POST /v1/audio/transcriptions and send its text "
                                  "as a text part",
                                  f"messages[{i}].content[{j}]")


async def _context(svc: Services, spec: ModelSpec) -> int | None:
    return svc.context_lengths.get(spec.name) or (await asyncio.to_thread(describe, spec)).context_length


async def _most_tokens(svc: Services, spec: ModelSpec) -> int:
    """The tokens one request may count: ``limits.tokenize_max_tokens``, or the model's context
    where that is longer (any prompt the model could take is counted)."""
    return max(svc.config.limits.tokenize_max_tokens, await _context(svc, spec) or 0)


def _encoded(tok: Any, text: str, special: bool, cap: int, param: str) -> list[int]:
    """``text``'s ids (in a thread); a 400 naming ``param`` above ``cap`` tokens, refused unread
    above 32 characters a token (as moderations' and rerank's limits are)."""
    too_long = f"above this server's limit of {cap} tokens per /tokenize request"
    if len(text) > 32 * cap:
        raise bad_request(f"{param} is {len(text)} characters, {too_long}", param, "too_many_tokens")
    ids = list(tok(text, add_special_tokens=special)["input_ids"])
    if len(ids) > cap:
        raise bad_request(f"{param} is {len(ids)} tokens, {too_long}", param, "too_many_tokens")
    return ids


def _answer(tok: Any, ids: list[int], context: int | None, token_strs: bool) -> Response:
    """vLLM's answer to ``/tokenize`` (in a thread: its JSON is made when it is built)."""
    return JSONResponse({"count": len(ids), "max_model_len": context, "tokens": ids,
                         "token_strs": tok.convert_ids_to_tokens(ids) if token_strs else None})


def _allowed(svc: Services, caller: Caller, name: str) -> ModelSpec:
    """The model whose tokenizer ``name`` uses: a model (or alias) of a kind with a tokenizer, or
    an adapter's base model; 404 for none, or for one the caller's key may not use (as if it did
    not exist); 400 for a model without a tokenizer."""
    model = svc.model_name(name)
    # an adapter's base model, found without reading the adapter (a folder adapter's read is a worker
    # thread's job, and its tokenizer is its base model's): on the event loop here
    base = svc.adapters.base_of(model)
    spec = svc.arbiter.specs.get(base[0] if base is not None else model)
    hidden = svc.accounts is not None and spec is not None and not (
        svc.accounts.allows(caller, spec.name) and (base is None or svc.accounts.allows_adapter(caller, model)))
    if spec is None or spec.kind == "train" or hidden:
        raise not_found(f"the model '{name}' does not exist", "model", "model_not_found")
    if spec.kind not in TEXT_KINDS:
        raise bad_request(f"the model '{name}' has no tokenizer to use here (chat, embedding, moderation and rerank models "
                          "have one)", "model", "model_not_supported")
    return spec
