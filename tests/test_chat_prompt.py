"""The one prompt encoding of both chat engines (workers/chat_prompt.py) and its context check.
That both engines give the same ids, also through vLLM's own chat path, is checked in
tests/test_vllm_engine.py, which has an engine running."""

from __future__ import annotations

import pytest

from workers.base import ChatParams, ChatRequest
from workers.chat_prompt import (ON_LOOP_CHARS, ContextTooLong, check_context, encode, fit_context, request_ids,
                                 small_prompt, thinking_marker)

CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}],
    "multi-turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How are you?"},
        {"role": "user", "content": "fine, and you?"},
    ],
    "unicode": [{"role": "user", "content": "héllo wörld — 你好 🙂, tabs\tand\nnewlines"}],
}


@pytest.fixture(scope="module")
def tokenizer(tiny_chat):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat)


@pytest.fixture
def bos_tokenizer(tiny_chat):
    """The demo tokenizer with a template that writes bos, and a post-processor that adds bos too
    (as Llama's tokenizers do)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    bos = (tok.bos_token, tok.bos_token_id)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos])
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # the post-processor adds one
    return tok


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_encode_is_the_rendered_template_without_added_specials(tokenizer, name):
    messages = CONVERSATIONS[name]
    ids = encode(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE: decoding gives the rendered text back
    assert text.endswith("<|assistant|>") and ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    for m in messages:
        assert m["content"] in tokenizer.decode(ids)


def test_a_template_that_writes_bos_gets_exactly_one(bos_tokenizer):
    messages = CONVERSATIONS["system+user"]
    ids = encode(bos_tokenizer, messages)
    assert ids[0] == bos_tokenizer.bos_token_id
    assert ids.count(bos_tokenizer.bos_token_id) == 1


def test_context_check_allows_an_exact_fit_and_refuses_one_more():
    check_context(100, 412, 512)
    with pytest.raises(ContextTooLong, match=r"prompt \(100 tokens\) plus max_tokens \(413\) exceeds .* 512"):
        check_context(100, 413, 512)


def test_a_default_max_tokens_shrinks_to_the_room_left_and_an_asked_one_is_refused():
    """vLLM's default: a ``max_tokens`` the client did not ask becomes the room the prompt leaves
    (a copy: the request's choices share the original), not below ``min_tokens``; one it asked
    is checked as it is."""
    default = ChatParams(256, max_tokens_default=True)
    assert fit_context(default, 100, 512) is default
    fitted = fit_context(default, 400, 512)
    assert (fitted.max_tokens, default.max_tokens) == (112, 256)
    assert fit_context(default, 511, 512).max_tokens == 1
    with pytest.raises(ContextTooLong, match=r"prompt \(512 tokens\) leaves no room for a reply of at least 1 "):
        fit_context(default, 512, 512)
    with pytest.raises(ContextTooLong, match="at least 20 "):
        fit_context(ChatParams(256, max_tokens_default=True, min_tokens=20), 500, 512)
    with pytest.raises(ContextTooLong, match=r"plus max_tokens \(256\)"):
        fit_context(ChatParams(256), 400, 512)


def test_request_ids_refuse_a_prompt_over_the_context(tokenizer):
    messages = CONVERSATIONS["multi-turn"]
    n = len(encode(tokenizer, messages))

    def request(max_tokens: int) -> ChatRequest:
        return ChatRequest(messages, ChatParams(max_tokens, 1.0, 1.0, [], None))

    fits = request(512 - n)
    assert request_ids(tokenizer, fits, 512) == encode(tokenizer, messages)
    assert fits.ctx.prompt_thinking == "none"  # tiny-chat's template writes no <think>
    with pytest.raises(ContextTooLong):
        request_ids(tokenizer, request(513 - n), 512)


@pytest.mark.parametrize("text, marker", [
    ("<|assistant|>", "none"), ("<|assistant|><think>\n", "open"), ("<think>\n\n</think>\n\n", "closed"),
    ("<think>a</think>b<|user|>c<|assistant|><think>", "open"), ("<|assistant|></think>", "closed"),
])
def test_the_prompts_last_thinking_marker(text, marker):
    assert thinking_marker(text) == marker


LONG = "x" * ON_LOOP_CHARS


@pytest.mark.parametrize("messages, tools, ids, small", [
    (CONVERSATIONS["multi-turn"], None, None, True),
    ([{"role": "user", "content": LONG[4:]}], None, None, True),  # exactly the limit, "user" counted
    ([{"role": "user", "content": LONG[3:]}], None, None, False),
    ([{"role": "user", "content": [{"type": "text", "text": LONG[:1500]}, {"type": "text", "text": LONG[:600]}]}],
     None, None, False),  # parts count together
    ([{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f", "description": LONG}}],
     None, False),  # so do the tools' strings
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": LONG + "}"}}]}], None, None,
     False),
    (None, None, [1] * (ON_LOOP_CHARS // 4), True),  # a raw prompt: 4 characters an id
    (None, None, [1] * (ON_LOOP_CHARS // 4 + 1), False),
])
def test_a_prompt_over_the_limit_is_not_small(messages, tools, ids, small):
    req = ChatRequest(messages or [], ChatParams(8), tools=tools, prompt_ids=ids)
    assert small_prompt(req) is small


def test_a_long_prompt_is_encoded_on_a_thread_and_a_short_one_where_it_is_asked(tokenizer, monkeypatch):
    import asyncio
    import threading

    from workers import chat_prompt

    threads = []
    real = chat_prompt._ids
    monkeypatch.setattr(chat_prompt, "_ids", lambda *a: threads.append(threading.get_ident()) or real(*a))

    async def both():
        loop = threading.get_ident()
        short = ChatRequest(CONVERSATIONS["multi-turn"], ChatParams(8))
        long = ChatRequest([{"role": "user", "content": "word " * ON_LOOP_CHARS}], ChatParams(8))
        got = [await chat_prompt.prompt_ids(tokenizer, r, 1 << 20) for r in (short, long)]
        assert got == [request_ids(tokenizer, r, 1 << 20) for r in (short, long)]
        return loop

    loop = asyncio.run(both())
    assert threads[0] == loop and threads[1] != loop
