"""A chat request's prompt as token ids: the one encoding both chat engines use.

The model's chat template is rendered to text with the generation prompt, and that text is
encoded WITHOUT adding special tokens: the template writes them itself (bos), so a tokenizer whose
post-processor also adds bos would otherwise start the prompt with two. This is what vLLM's own
chat path does (``renderer.render_messages`` then ``default_chat_tok_params``, which has
``add_special_tokens=False``), so a prompt gives the same ids on the transformers engine, through
``VllmChatEngine`` and under ``vllm serve``. A legacy completion's raw prompt
(``ChatRequest.prompt_ids``) skips the template: :func:`request_ids` takes its ids as they are.
"""

from __future__ import annotations

from typing import Any, Callable

from workers.base import ChatRequest, InvalidParam


class ContextTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context window (HTTP 400)."""


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt's text: ``messages`` (with their tool calls and tool results) and ``tools``
    through the tokenizer's chat template, generation prompt on; ``template_kwargs`` are the
    template's own variables (``enable_thinking``, ``reasoning_effort``, ...)."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as exc:  # the template's own raise_exception ("roles must alternate"), or a
        # variable it cannot use: the request's, not the server's fault
        raise InvalidParam(f"the model's chat template refused the request: {exc}", "messages") from None


def encode(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt token ids of :func:`render`'s text."""
    return _ids(tokenizer, render(tokenizer, messages, tools, template_kwargs))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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


def check_context(prompt_len: int, max_tokens: int, context_length: int) -> None:
    """Refuse a prompt that leaves no room for ``max_tokens`` in the context window."""
    if prompt_len + max_tokens > context_length:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the model's context of {context_length} tokens"
        )


def request_ids(tokenizer: Any, req: ChatRequest, context_length: int) -> list[int]:
    """The prompt of ``req``: its raw ``prompt_ids`` when it has them (legacy completions, no
    template), else its messages and tools through :func:`encode`; refused with
    :class:`ContextTooLong` when the reply cannot fit. The rendered prompt's last thinking marker
    goes to ``req.ctx.prompt_thinking`` (a raw prompt's too, for a reasoning model: a background
    response resumed part-way through its thinking)."""
    if req.prompt_ids is None:
        text = render(tokenizer, req.messages, req.tools, req.template_kwargs)
        ids = _ids(tokenizer, text)
        check_context(len(ids), req.params.max_tokens, context_length)
        req.ctx.prompt_thinking = thinking_marker(text)
        return ids
    check_context(len(req.prompt_ids), req.params.max_tokens, context_length)
    if req.reasoning:
        req.ctx.prompt_thinking = thinking_marker(tokenizer.decode(req.prompt_ids, skip_special_tokens=False))
    return list(req.prompt_ids)
