"""A chat request's prompt as token ids: the one encoding both chat engines use.

The model's chat template is rendered to text with the generation prompt, and that text is
encoded WITHOUT adding special tokens: the template writes them itself (bos), so a tokenizer whose
post-processor also adds bos would otherwise start the prompt with two. This is what vLLM's own
chat path does (``renderer.render_messages`` then ``default_chat_tok_params``, which has
``add_special_tokens=False``), so a prompt gives the same ids on the transformers engine, through
``VllmChatEngine`` and under ``vllm serve``. A legacy completion's raw prompt
(``ChatRequest.prompt_ids``) skips the template: :func:`request_ids` takes its ids as they are.

A request with images (``ChatRequest.images``, for a vision-language model) renders the same way,
its image parts as the template writes them (LLaVA's ``<image>``), and then goes through the
model's processor (:func:`vision_inputs`): it expands each placeholder into the image's tokens and
makes the vision tower's inputs (``pixel_values``), which the engine hands to the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any, Callable

from workers.base import ChatParams, ChatRequest, InvalidParam, PromptEnd


class ContextTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context window (HTTP 400)."""


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None, *, add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> str:
    """The prompt's text: ``messages`` (with their tool calls and tool results) and ``tools``
    through the tokenizer's chat template, generation prompt on (a request's prompt; vLLM's
    ``/tokenize`` may ask for it off, or for the last message left open); ``template_kwargs`` are
    the template's own variables (``enable_thinking``, ``reasoning_effort``, ...)."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as exc:  # the template's own raise_exception ("roles must alternate"), or a
        # variable it cannot use: the request's, not the server's fault
        raise InvalidParam(f"the model's chat template refused the request: {exc}", "messages") from None
    except ValueError as exc:  # transformers: a last message continue_final_message cannot leave open
        if not continue_final_message:
            raise
        raise InvalidParam(f"the last message cannot be continued: {exc}", "continue_final_message") from None


def end_kwargs(end: PromptEnd) -> dict[str, bool]:
    """:func:`render`'s keyword arguments for a prompt that ends at ``end``."""
    return {"add_generation_prompt": end == "generation", "continue_final_message": end == "open"}


def encode(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt token ids of :func:`render`'s text."""
    return _ids(tokenizer, render(tokenizer, messages, tools, template_kwargs))


def _ids(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def thinking_marker(text: str) -> str:
    """Whether the prompt ``text`` ends inside a ``<think>`` block (``open``: the template opened
    the reply's thinking), after a ``</think>`` (``closed``: it asked for none), or has neither."""
    opened, closed = text.rfind("<think>"), text.rfind("</think>")
    return "none" if opened < 0 and closed < 0 else "open" if opened > closed else "closed"


def think_end_id(tokenizer: Any) -> int | None:
    """The id of ``</think>`` where the vocabulary has it as one token (Qwen3's, DeepSeek's)."""
    return tokenizer.get_vocab().get("</think>")


def tokens_through_think_end(decode: Callable[[list[int]], str], ids: list[int], end_id: int | None = None) -> int | None:
    """How many of a reply's ``ids`` it took to write its first ``</think>`` (None: it did not):
    the fewest whose text holds it. Where the marker is one token (``end_id``) that is its first
    place, checked with one decode of the text before it; else (or when that text already holds
    the marker, spelt in pieces) it is found by halving, a dozen decodes for a long reply, once at
    its end."""
    if end_id is not None and end_id in ids:
        at = ids.index(end_id) + 1
        if "</think>" not in decode(ids[:at - 1]):
            return at
        high = at - 1
    elif "</think>" not in decode(ids):
        return None
    else:
        high = len(ids)
    low = 1
    while low < high:
        mid = (low + high) // 2
        if "</think>" in decode(ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low


def fit_context(params: ChatParams, prompt_len: int, context_length: int) -> ChatParams:
    """``params`` for a prompt of ``prompt_len`` tokens, checked as :func:`check_context` checks
    it; a ``max_tokens`` the client did not ask (``max_tokens_default``) first shrinks to the room
    the prompt leaves, as vLLM's default does (not below ``min_tokens``): a copy then, since the
    n choices and the prompts of one request share ``params``."""
    if params.max_tokens_default and prompt_len + params.max_tokens > context_length:
        room = max(context_length - prompt_len, params.min_tokens, 1)
        if prompt_len + room > context_length:
            raise ContextTooLong(f"the prompt ({prompt_len} tokens) leaves no room for a reply of at least {room} "
                                 f"in the model's context of {context_length} tokens")
        return dataclasses.replace(params, max_tokens=room)
    check_context(prompt_len, params.max_tokens, context_length)
    return params


def check_context(prompt_len: int, max_tokens: int, context_length: int) -> None:
    """Refuse a prompt that leaves no room for ``max_tokens`` in the context window."""
    if prompt_len + max_tokens > context_length:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the model's context of {context_length} tokens"
        )


def truncated(tokenizer: Any, ids: list[int], keep: int, side: str | None, context_length: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: ``ids`` cut to ``keep`` tokens (-1: the context less one,
    which leaves a token of room for the reply), the first kept (``side`` right) or the last (left;
    None: the tokenizer's own ``truncation_side``)."""
    keep = context_length - 1 if keep == -1 else keep
    side = side or getattr(tokenizer, "truncation_side", "right")
    return ids if len(ids) <= keep else ids[-keep:] if side == "left" else ids[:keep]


# The most characters of text a chat prompt may have to be rendered and tokenized on the event loop, where
# the engines are asked for a reply: ~0.6 ms of it here (tiny-chat's tokenizer: 1.3 ms at 4,000 characters,
# 5 ms at 16,000, 0.57 s at 1,000,000). A longer prompt goes to a thread (a hop: ~0.1 ms): one near the body
# cap held every tier's requests for 0.4 s on the loop (gateway.loop_watch found it).
ON_LOOP_CHARS = 2048


def small_prompt(req: ChatRequest) -> bool:
    """Whether ``req``'s prompt is at most ``ON_LOOP_CHARS`` characters of text: its messages' and
    tools' strings, counted until over (a raw prompt: 4 characters an id)."""
    if req.prompt_ids is not None:
        return len(req.prompt_ids) * 4 <= ON_LOOP_CHARS
    budget, stack = ON_LOOP_CHARS, [req.messages, req.tools]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            budget -= len(node)
            if budget < 0:
                return False
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return True


async def prompt_ids(tokenizer: Any, req: ChatRequest, context_length: int) -> list[int]:
    """:func:`request_ids`, on a thread for a prompt longer than ``ON_LOOP_CHARS``."""
    if small_prompt(req):
        return request_ids(tokenizer, req, context_length)
    return await asyncio.to_thread(request_ids, tokenizer, req, context_length)


def request_ids(tokenizer: Any, req: ChatRequest, context_length: int) -> list[int]:
    """The prompt of ``req``: its raw ``prompt_ids`` when it has them (legacy completions, no
    template), else its messages and tools through :func:`encode` (with the tokenizer's special
    tokens too where ``req.add_special_tokens``, vLLM's); refused with
    :class:`ContextTooLong` when the reply cannot fit. The rendered prompt's last thinking marker
    goes to ``req.ctx.prompt_thinking`` (a raw prompt's too, for a reasoning model: a background
    response resumed part-way through its thinking)."""
    if req.prompt_ids is None:
        text = render(tokenizer, req.messages, req.tools, req.template_kwargs, **end_kwargs(req.prompt_end))
        ids = _ids(tokenizer, text, req.add_special_tokens)
        if req.truncate is not None:
            ids = truncated(tokenizer, ids, req.truncate, req.truncation_side, context_length)
            text = tokenizer.decode(ids, skip_special_tokens=False)  # (its thinking marker: the kept part's)
        req.params = fit_context(req.params, len(ids), context_length)
        req.ctx.prompt_thinking = thinking_marker(text)
        return ids
    req.params = fit_context(req.params, len(req.prompt_ids), context_length)
    if req.reasoning:
        req.ctx.prompt_thinking = thinking_marker(tokenizer.decode(req.prompt_ids, skip_special_tokens=False))
    return list(req.prompt_ids)


def vision_inputs(processor: Any, req: ChatRequest, context_length: int) -> tuple[list[int], dict[str, Any]]:
    """The prompt ids of ``req`` (messages with image parts, ``req.images`` in order) and the
    vision tower's inputs for them (``pixel_values``, and what else the processor makes: tensors,
    batch of one), through the model's processor; checked as :func:`request_ids` checks a prompt.
    Runs off the event loop: it decodes every image."""
    from PIL import Image

    images = []
    for i, data in enumerate(req.images):
        try:
            with Image.open(io.BytesIO(data)) as image:
                images.append(image.convert("RGB"))
        except Exception:  # noqa: BLE001 - the gateway read the header; the pixels themselves may be damaged
            raise InvalidParam(f"image {i + 1} of the request cannot be decoded (damaged or cut short)", "messages") from None
    text = render(processor.tokenizer, req.messages, req.tools, req.template_kwargs, **end_kwargs(req.prompt_end))
    try:
        enc = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    except ValueError as exc:  # placeholders and images do not pair up (a template that drops image parts)
        raise InvalidParam(f"the model's processor refused the request's images: {exc}", "messages") from None
    except StopIteration:  # more placeholders than images (the text spells the model's own): as an error here, a
        # StopIteration out of a thread cannot be set on its asyncio future, and the request would wait forever
        token = getattr(processor, "image_token", None) or "image placeholder"
        raise InvalidParam(f"the messages hold more image placeholders ({token}) than the request has images: the "
                           "text may not spell the model's own", "messages") from None
    ids = enc["input_ids"][0].tolist()
    req.params = fit_context(req.params, len(ids), context_length)
    req.ctx.prompt_thinking = thinking_marker(text)
    return ids, {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
