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

from typing import Any

from workers.base import ChatRequest, InvalidParam


class ContextTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context window (HTTP 400)."""


def encode(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt token ids: ``messages`` (with their tool calls and tool results) and ``tools``
    through the tokenizer's chat template, generation prompt on; ``template_kwargs`` are the
    template's own variables (``enable_thinking``, ``reasoning_effort``, ...)."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                                             **(template_kwargs or {}))
    except jinja2.TemplateError as exc:  # the template's own raise_exception ("roles must alternate"), or a
        # variable it cannot use: the request's, not the server's fault
        raise InvalidParam(f"the model's chat template refused the request: {exc}", "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_context(prompt_len: int, max_tokens: int, context_length: int) -> None:
    """Refuse a prompt that leaves no room for ``max_tokens`` in the context window."""
    if prompt_len + max_tokens > context_length:
        raise ContextTooLong(
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the model's context of {context_length} tokens"
        )


def encode_within(tokenizer: Any, messages: list[dict], max_tokens: int, context_length: int,
                  tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """:func:`encode`, refused with :class:`ContextTooLong` when the reply cannot fit."""
    ids = encode(tokenizer, messages, tools, template_kwargs)
    check_context(len(ids), max_tokens, context_length)
    return ids


def request_ids(tokenizer: Any, req: ChatRequest, context_length: int) -> list[int]:
    """The prompt of ``req``: its raw ``prompt_ids`` when it has them (legacy completions, no
    template), else its messages and tools through :func:`encode`; refused with
    :class:`ContextTooLong` when the reply cannot fit."""
    if req.prompt_ids is None:
        return encode_within(tokenizer, req.messages, req.params.max_tokens, context_length, req.tools,
                             req.template_kwargs)
    check_context(len(req.prompt_ids), req.params.max_tokens, context_length)
    return list(req.prompt_ids)
