"""The transformers engine's sampling (workers/chat.py ``_probs``, ``_process``) against plain
references: transformers' own logits processors, applied in vLLM's order (penalties; then the
temperature, min_p, top_k, top_p), so that a request reads the same on either engine. Tolerance:
1e-6 absolute on probabilities, fp32 logits (the engine samples from fp32 copies of any dtype)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from workers.base import ChatParams
from workers.chat import _probs, _process, _sample


def reference_probs(logits: torch.Tensor, p: ChatParams) -> torch.Tensor:
    scores = logits[None].clone()
    ids = torch.zeros((1, 1), dtype=torch.long)  # the warpers below do not read the ids
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize("vocab", [7, 1000, 32000])
@pytest.mark.parametrize("temperature,top_k,min_p,top_p", [
    (1.0, 0, 0.0, 1.0), (0.7, 0, 0.0, 0.9), (1.0, 1, 0.0, 1.0), (1.0, 5, 0.0, 1.0), (1.3, 40, 0.0, 0.8),
    (1.0, 0, 0.05, 1.0), (0.5, 0, 0.5, 1.0), (1.0, 20, 0.1, 0.95), (2.0, 3, 0.01, 0.5), (1.0, 0, 1.0, 1.0),
])
def test_probs_are_transformers_warpers_in_vllms_order(vocab, temperature, top_k, min_p, top_p):
    gen = torch.Generator().manual_seed(vocab + top_k)
    logits = torch.randn(vocab, generator=gen) * 3
    p = ChatParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    got = _probs(logits, p)
    want = reference_probs(logits, p)
    assert torch.allclose(got / got.sum(), want, atol=1e-6, rtol=0)
    if top_k:
        assert int((got > 0).sum()) <= top_k
    if top_k == 1 or min_p == 1.0:  # only the likeliest token is left: a draw is the greedy choice
        assert _sample(logits, p, gen) == int(logits.argmax())


def test_top_p_judges_what_top_k_left_as_vllm_does():
    """min_p keeps the tokens at least min_p as likely as the likeliest; top_p counts the
    probabilities of what top_k left, renormalized: three tokens of probabilities 0.5, 0.3, 0.2
    (and a tail)."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-4, 1e-4]))
    left = _probs(logits, ChatParams(temperature=1.0, min_p=0.5, top_k=0))  # 0.2 < 0.5 x 0.5: out
    assert (left > 0).tolist() == [True, True, False, False, False]
    left = _probs(logits, ChatParams(temperature=1.0, top_k=2, top_p=0.6))  # of 0.5/0.8 and 0.3/0.8, 0.625 >= 0.6
    assert (left > 0).tolist() == [True, False, False, False, False]
    left = _probs(logits, ChatParams(temperature=1.0, top_k=3, top_p=0.6))  # 0.5 alone is under 0.6
    assert (left > 0).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("penalty", [1.0, 1.2, 2.0, 0.8])
def test_the_repetition_penalty_is_transformers_on_the_prompt_and_the_reply(penalty):
    """Every token of the prompt and of the reply so far, repeats or not: positive logits divided by
    the penalty, negative ones multiplied (transformers' and vLLM's definition); the rest as they were."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=gen) * 4
    ids = [3, 7, 7, 11, 3, 42, 0]
    seq = SimpleNamespace(params=ChatParams(repetition_penalty=penalty), ids=ids, generated=ids[4:], grammar=None,
                          thinking=False, outside=None, bad_words=[], think=None)
    got = _process(logits.clone(), seq)
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]
    assert torch.allclose(got, want, atol=0, rtol=0)
    untouched = [i for i in range(50) if i not in ids]
    assert torch.equal(got[untouched], logits[untouched])


# -- the model's own sampling defaults (its generation_config.json), as vllm serve reads them --------


def with_generation_config(tiny_chat, folder, **fields):
    """tiny-chat's folder (its files linked) with ``fields`` in its generation_config.json, as a
    model card's recommended settings are shipped."""
    import json

    for f in tiny_chat.iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((tiny_chat / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.fixture(scope="module")
def tuned_chat(tiny_chat, tmp_path_factory):
    """top_k 1 and temperature 0.7 by default, and replies of 20 tokens where a request sets no length."""
    return with_generation_config(tiny_chat, tmp_path_factory.mktemp("tuned-chat"), do_sample=True, top_k=1,
                                  temperature=0.7, max_new_tokens=20)


@pytest.fixture(scope="module")
def cold_chat(tiny_chat, tmp_path_factory):
    """temperature 0 by default: greedy unless a request asks otherwise."""
    return with_generation_config(tiny_chat, tmp_path_factory.mktemp("cold-chat"), do_sample=False, temperature=0.0)


def test_a_folders_sampling_defaults_are_what_its_generation_config_sets(tuned_chat, tiny_chat, tmp_path):
    from workers.chat import folder_sampling_defaults

    assert folder_sampling_defaults(tuned_chat) == {"temperature": 0.7, "top_k": 1, "max_tokens": 20}
    assert folder_sampling_defaults(tiny_chat) == {}  # the demo's sets no sampling field
    assert folder_sampling_defaults(tmp_path) == {}  # no generation_config.json


@pytest.fixture(scope="module")
def defaults_server(tuned_chat, cold_chat, tmp_path_factory):
    from tests.helpers import start_server, write_config

    folder = tmp_path_factory.mktemp("defaults-server")
    config = write_config(folder, {"tuned": ("chat", tuned_chat), "plain": ("chat", tuned_chat),
                                   "cold": ("chat", cold_chat)})
    text = config.read_text().replace(f"  - name: plain\n    kind: chat\n    path: {tuned_chat}\n",
                                      f"  - name: plain\n    kind: chat\n    path: {tuned_chat}\n    sampling_defaults: none\n")
    config.write_text(text)
    running = start_server(config)
    yield running
    running.stop()


def test_a_request_that_leaves_a_field_out_gets_the_models_default(defaults_server):
    """On ``tuned`` (top_k 1 by its generation_config.json) a request that sets no sampling field
    samples from the likeliest token alone: the greedy reply, on chat, completions and responses. One
    that sets ``top_k`` 0 samples freely, and so does every request to ``plain``, the same folder with
    ``sampling_defaults: none`` (24 tokens of near-even odds: not the greedy reply)."""
    import openai

    c = openai.OpenAI(base_url=defaults_server.base_url, api_key=defaults_server.keys["paid"], max_retries=0)
    ask = [{"role": "user", "content": "Tell me a story"}]

    def chat(model: str, **kw) -> str:
        return c.chat.completions.create(model=model, messages=ask, max_tokens=24, **kw).choices[0].message.content

    greedy = chat("tuned", temperature=0)
    assert chat("tuned") == greedy
    assert chat("tuned", temperature=1, extra_body={"top_k": 0}) != greedy
    assert chat("plain") != greedy and chat("plain", temperature=0) == greedy
    legacy = c.completions.create(model="tuned", prompt="Once", max_tokens=24)
    assert legacy.choices[0].text == c.completions.create(model="tuned", prompt="Once", max_tokens=24,
                                                          temperature=0).choices[0].text
    response = c.responses.create(model="tuned", input="Tell me a story", max_output_tokens=24)
    assert response.output_text == c.responses.create(model="tuned", input="Tell me a story", max_output_tokens=24,
                                                      temperature=0).output_text
    # temperature 0 by default on ``cold``: greedy unless asked otherwise, on chat and on responses, whose
    # object says the temperature it sampled at
    assert chat("cold") == greedy and chat("cold", temperature=1) != greedy
    cold = c.responses.create(model="cold", input="Tell me a story", max_output_tokens=24)
    story = cold.output_text
    assert story == response.output_text and cold.temperature == 0 and response.temperature == 0.7
    assert c.responses.create(model="cold", input="Tell me a story", max_output_tokens=24,
                              temperature=1).output_text != story


def test_a_request_that_sets_no_length_gets_the_models_max_new_tokens(defaults_server):
    """``tuned``'s generation_config.json sets ``max_new_tokens`` 20: chat, completions and
    responses that set no length reply in 20 tokens (the end of text ignored), as vllm serve's
    default max_tokens; a length the request sets wins; ``plain`` (``sampling_defaults: none``)
    keeps the server's own defaults (chat 256 capped by limits.max_chat_tokens; completions 16)."""
    import openai

    c = openai.OpenAI(base_url=defaults_server.base_url, api_key=defaults_server.keys["paid"], max_retries=0)
    ask, go_on = [{"role": "user", "content": "Tell me a story"}], {"ignore_eos": True}

    def chat(model: str, **kw):
        return c.chat.completions.create(model=model, messages=ask, extra_body=go_on, **kw)

    first = chat("tuned")
    assert (first.usage.completion_tokens, first.choices[0].finish_reason) == (20, "length")
    assert chat("tuned", max_tokens=7).usage.completion_tokens == 7
    assert chat("tuned", max_completion_tokens=30).usage.completion_tokens == 30
    cap = defaults_server.services.config.limits.max_chat_tokens
    assert chat("plain").usage.completion_tokens == min(256, cap) != 20
    assert c.completions.create(model="tuned", prompt="Once", extra_body=go_on).usage.completion_tokens == 20
    assert c.completions.create(model="plain", prompt="Once", extra_body=go_on).usage.completion_tokens == 16
    assert c.responses.create(model="tuned", input="Tell me a story").usage.output_tokens <= 20
