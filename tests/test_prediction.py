"""Predicted Outputs (``prediction`` on chat completions): the transformers engine checks the
predicted text in the prefill's one pass and keeps the tokens the reply would have had anyway.
Checked through the openai SDK against the same request without a prediction: the same reply
(greedy and seeded sampling, whole and streamed), the engine's decode steps fewer by exactly the
tokens it accepted, and the usage's accepted and rejected counts adding up to the prediction's
tokens."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import start_server, write_config

ASK = [{"role": "user", "content": "Copy this file."}]  # the demo model's reply to it: mostly the tokenizer's own pieces
LONG = 24


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    running = start_server(write_config(tmp_path_factory.mktemp("prediction"), {"tiny-chat": ("chat", tiny_chat)}))
    client(running).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=1)  # loaded: its engine counts
    yield running
    running.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)


def engine(server):
    return server.services.arbiter.workers["tiny-chat"]


def passes(server) -> int:
    """The engine's forward passes after the prefills: decode steps, and re-sync checks."""
    return engine(server).steps + engine(server).checks


def reply(server, prediction: str | None = None, **kw):
    """The reply, and the passes the engine ran for it after its prefill (``passes``)."""
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else {}
    before = passes(server)
    r = client(server).chat.completions.create(**{"model": "tiny-chat", "messages": ASK, "max_tokens": LONG,
                                                  "temperature": 0, **kw, **extra})
    return r, passes(server) - before


def predicted_tokens(server, text: str) -> int:
    return min(len(engine(server).tokenizer.encode(text, add_special_tokens=False)), LONG - 1)


def kept(server, written, prediction: str) -> range:
    """How many predicted tokens a reply begins with: its own tokens (``written``: a reply's
    logprobs name them) against the prediction's, as the tokenizer splits it. A model writes its
    tokens its own way: the random demo model often writes a word in other pieces than the
    tokenizer makes of it ("d" "type" where the tokenizer makes "d" "ty" "per"), and there the
    check stops. A piece of a character (shown as U+FFFD) may be either of two tokens, so from the
    first such piece on the count is a range."""
    tokenizer = engine(server).tokenizer
    predicted = [tokenizer.decode([i]) for i in tokenizer.encode(prediction, add_special_tokens=False)][:LONG - 1]
    made = [t.token for t in written.choices[0].logprobs.content]
    same = 0
    while same < min(len(made), len(predicted)) and made[same] == predicted[same]:
        same += 1
    sure = next((n for n in range(same) if "\ufffd" in made[n]), same)
    return range(sure, same + 1)


def test_a_prediction_the_reply_repeats_is_written_in_one_pass(server):
    plain, steps = reply(server, logprobs=True)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens == LONG and steps == LONG - 1  # the prefill writes the first token
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    same, fewer = reply(server, text)
    accepted = same.usage.completion_tokens_details.accepted_prediction_tokens
    rejected = same.usage.completion_tokens_details.rejected_prediction_tokens
    assert same.choices[0].message.content == text
    assert kept(server, plain, text).start >= 10, "the premise: the reply is written in the pieces the tokenizer makes"
    assert accepted in kept(server, plain, text) and accepted + rejected == predicted_tokens(server, text)
    assert fewer == steps - accepted  # each accepted token is a decode step not run
    # the model's own pieces, as text, are accepted as far as the tokenizer splits them the same way
    pieces = "".join(t.token for t in plain.choices[0].logprobs.content[:3])
    assert reply(server, pieces)[0].usage.completion_tokens_details.accepted_prediction_tokens in kept(server, plain, pieces)


@pytest.mark.parametrize("change", ["middle", "start", "unrelated", "empty", "longer"])
def test_the_reply_is_the_same_whatever_the_prediction(server, change):
    """An edit to the prediction (in the middle, at the start) costs only its own tokens: after
    the reply leaves the prediction, its next tokens that are a run of the prediction pick it up
    again (a re-sync check), so more is kept than the prefix the prefill's check keeps."""
    plain, steps = reply(server, logprobs=True)
    text = plain.choices[0].message.content
    prediction = {"middle": text[:8] + "#~#~" + text[12:], "start": "#~#~" + text, "unrelated": "The sea is wide. " * 6,
                  "empty": "", "longer": text + " and then much more that the reply never says"}[change]
    got, ran = reply(server, prediction)
    details = got.usage.completion_tokens_details
    assert got.choices[0].message.content == text
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == \
        (predicted_tokens(server, prediction) if prediction else 0)
    assert ran == steps - details.accepted_prediction_tokens
    if change in ("unrelated", "empty"):
        assert details.accepted_prediction_tokens == 0
    if change in ("middle", "start"):
        assert details.accepted_prediction_tokens > kept(server, plain, prediction).stop - 1 + 3


def test_sampled_and_streamed_replies_are_the_same_with_a_prediction(server):
    plain, _ = reply(server, temperature=1.0, seed=11, logprobs=True)
    text = plain.choices[0].message.content
    got, _ = reply(server, text, temperature=1.0, seed=11)
    assert got.choices[0].message.content == text
    assert got.usage.completion_tokens_details.accepted_prediction_tokens in kept(server, plain, text)
    chunks = list(client(server).chat.completions.create(
        model="tiny-chat", messages=ASK, max_tokens=LONG, temperature=1.0, seed=11, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": [{"type": "text", "text": text}]}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
        got.usage.completion_tokens_details.accepted_prediction_tokens


def test_a_short_max_tokens_ends_within_the_prediction(server):
    plain, _ = reply(server)
    text = plain.choices[0].message.content
    short, _ = reply(server, text, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == reply(server, max_tokens=3)[0].choices[0].message.content
    details = short.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == 2  # max_tokens - 1 checked


def test_a_malformed_prediction_is_a_400(server):
    for bad, param in [({"type": "text", "content": "x"}, "prediction.type"), ({"type": "content"}, "prediction.content"),
                       ({"type": "content", "content": [{"type": "image_url", "text": "x"}]}, "prediction.content")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client(server).chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, prediction=bad)
        assert caught.value.body["param"].startswith(param), (bad, caught.value.body)


@pytest.mark.parametrize("shaped", ["json_schema", "tools", "penalties", "logprobs"])
def test_a_constrained_or_penalized_reply_is_the_same_with_its_own_text_predicted(server, shaped):
    """What changes the sampling place by place (a grammar, tool-call parsing, penalties on the
    tokens so far, logprobs) sees the predicted places in order, as it sees decode steps."""
    kw = {"json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
              "type": "object", "properties": {"a": {"type": "string", "maxLength": 8}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}}}},
          "tools": {"tools": [{"type": "function", "function": {"name": "look", "parameters": {
              "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"]}}}],
                    "tool_choice": "required", "parallel_tool_calls": False},
          "penalties": {"presence_penalty": 1.5, "frequency_penalty": 1.0, "temperature": 0.8, "seed": 3},
          "logprobs": {"logprobs": True, "top_logprobs": 2}}[shaped]
    plain, steps = reply(server, **kw)
    message = plain.choices[0].message
    text = message.content if message.content is not None else message.tool_calls[0].function.arguments
    got, ran = reply(server, text, **kw)

    def said(m):  # a call's id is new each time
        return m.content, [(call.function.name, call.function.arguments) for call in m.tool_calls or []]

    assert said(got.choices[0].message) == said(message)
    if shaped != "tools":  # (a call's raw text is its <tool_call> markup, which the arguments do not begin)
        assert got.usage.completion_tokens_details.accepted_prediction_tokens > 0  # the places were checked
    if shaped == "logprobs":  # one pass and many steps sum in other orders: within fp32's reach
        assert [e.token for e in got.choices[0].logprobs.content] == [e.token for e in plain.choices[0].logprobs.content]
        assert [e.logprob for e in got.choices[0].logprobs.content] == \
            pytest.approx([e.logprob for e in plain.choices[0].logprobs.content], abs=1e-4)
    assert ran == steps - got.usage.completion_tokens_details.accepted_prediction_tokens
