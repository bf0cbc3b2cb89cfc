"""The one prompt encoding of both chat engines (workers/chat_prompt.py) and its context check.
That both engines give the same ids, also through vLLM's own chat path, is checked in
tests/test_vllm_engine.py, which has an engine running."""

from __future__ import annotations

import pytest

from workers.base import ChatParams, ChatRequest
from workers.chat_prompt import ContextTooLong, check_context, encode, request_ids, thinking_marker

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
