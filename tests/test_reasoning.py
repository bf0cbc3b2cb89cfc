"""Reasoning models on chat: the thinking split from the answer (``gateway.reasoning``), and the
chat template's own variables (``chat_template_kwargs``, ``reasoning_effort``). Served on copies
of tiny-chat whose templates open the thinking as DeepSeek-R1's does, or take Qwen3's
``enable_thinking``."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from gateway.reasoning import ThinkSplitter
from tests.helpers import start_server, write_config

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
PLAIN_PROMPT = "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
R1_PROMPT = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{%- if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
QWEN3_PROMPT = ("{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
                "<think>\n\n</think>\n\n{% endif %}{% endif %}")
V31_PROMPT = ("{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
              "</think>{% else %}<think>{% endif %}{% endif %}")  # DeepSeek-V3.1's: it opens or closes the thinking


@pytest.mark.parametrize("parser, pieces, thinking, answer", [
    ("qwen3", ["<think>\nrain", "bow</th", "ink>\n\nLight."], "\nrainbow", "\n\nLight."),
    ("qwen3", ["  <thi", "nk>a</think>b"], "a", "b"),
    ("qwen3", ["Light <think> is not thinking here."], "", "Light <think> is not thinking here."),
    ("qwen3", ["<thi"], "", "<thi"),  # cut inside the marker: what was written, as the answer
    ("qwen3", ["<think>never closed"], "never closed", ""),
    ("deepseek_r1", ["rain", "bow</think>Light."], "rainbow", "Light."),
    ("deepseek_r1", ["<think>again</think>x"], "again", "x"),  # the model opened it once more
    ("deepseek_r1", ["no end, cut by max_tokens </thi"], "no end, cut by max_tokens </thi", ""),
    ("deepseek_r1", ["</think>"], "", ""),
    ("deepseek_r1", ["a</think>b</think>c"], "a", "b</think>c"),  # only the first ends the thinking
    # what the prompt's last marker changes: a template that opened the thinking, or closed it
    ("qwen3/open", ["rain</think>Light."], "rain", "Light."),
    ("qwen3/closed", ["Light.</think>"], "", "Light.</think>"),
    ("deepseek_r1/closed", ["Light."], "", "Light."),
    ("deepseek_r1/closed", ["<think>a</think>b"], "a", "b"),  # the model opened it all the same
    ("deepseek_r1/open", ["a</think>b"], "a", "b"),
])
def test_think_splitter_whole_and_a_character_at_a_time(parser, pieces, thinking, answer):
    """The split of a table of replies (``parser/prompt``: the prompt's last thinking marker,
    ``none`` when not given), fed in the pieces given and one character at a time: the same
    thinking and answer either way (a marker split across pieces is held, never leaked)."""
    parser, _, prompt = parser.partition("/")
    for feed in (pieces, list("".join(pieces))):
        s = ThinkSplitter(parser, prompt or "none")
        out = [s.feed(p) for p in feed] + [s.finish()]
        assert ("".join(t for t, _ in out), "".join(a for _, a in out)) == (thinking, answer), feed
        if parser == "qwen3" and thinking:  # no piece of the answer before the thinking ended
            first_answer = next(i for i, (_, a) in enumerate(out) if a) if answer else len(out)
            assert all(not t for t, _ in out[first_answer + 1:])


ASSISTANT = "<|assistant|>{{ m['content'] or '' }}"
THINKING_ASSISTANT = ("<|assistant|>{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>"
                      "{% endif %}{{ m['content'] or '' }}")  # as Qwen3's renders a tool-calling turn's thinking


def _model(tiny_chat, folder, generation_prompt: str, assistant: str = ASSISTANT):
    folder.mkdir()
    for f in tiny_chat.iterdir():
        (folder / f.name).symlink_to(f)
    template = (tiny_chat / "chat_template.jinja").read_text()
    assert PLAIN_PROMPT in template and ASSISTANT in template
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").write_text(template.replace(PLAIN_PROMPT, generation_prompt)
                                                .replace(ASSISTANT, assistant))
    return folder


def _marker_model(tiny_chat, folder):
    """tiny-chat with ``<think>`` and ``</think>`` added to its vocabulary, one token each as in
    Qwen3's and DeepSeek's (tiny-chat's byte-level BPE spells them in several), and R1's
    generation prompt; its new rows are random like the rest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(tiny_chat)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    template = folder / "chat_template.jinja"
    template.write_text((tiny_chat / "chat_template.jinja").read_text().replace(PLAIN_PROMPT, R1_PROMPT))
    return folder


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    r1 = _model(tiny_chat, root / "r1", R1_PROMPT)
    qwen3 = _model(tiny_chat, root / "qwen3", QWEN3_PROMPT, THINKING_ASSISTANT)
    v31 = _model(tiny_chat, root / "v31", V31_PROMPT)
    marked = _marker_model(tiny_chat, root / "marked")
    models = {"r1-raw": ("chat", r1), "r1": ("chat", r1), "qwen3": ("chat", qwen3), "v31": ("chat", v31),
              "marked": ("chat", marked)}
    text = write_config(root, models, "limits:\n  max_chat_tokens: 64\n").read_text()
    for name, parser in (("r1", "deepseek_r1"), ("qwen3", "qwen3"), ("v31", "deepseek_r1"), ("marked", "deepseek_r1")):
        text = text.replace(f"  - name: {name}\n    kind: chat\n    path: {models[name][1]}\n    engine: transformers",
                            f"  - name: {name}\n    kind: chat\n    path: {models[name][1]}\n"
                            f"    engine: {{name: transformers, reasoning_parser: {parser}}}")
    (root / "tiers.yaml").write_text(text)
    running = start_server(root / "tiers.yaml")
    yield running
    running.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=120)


def test_a_template_that_opens_the_thinking_answers_with_it_apart(server):
    """deepseek_r1: the reply (on random weights, never closing it) is all thinking: the same text
    the model without the parser answers, as ``reasoning_content`` (and vLLM's ``reasoning``),
    whole and streamed; ``include_reasoning: false`` leaves it out."""
    kw = dict(messages=ASK, max_tokens=12, seed=5)
    raw = client(server).chat.completions.create(model="r1-raw", **kw).choices[0].message
    assert raw.content and "</think>" not in raw.content
    r = client(server).chat.completions.create(model="r1", **kw)
    m = r.choices[0].message
    assert m.content is None and m.reasoning_content == m.reasoning == raw.content
    chunks = list(client(server).chat.completions.create(model="r1", stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == raw.content
    assert not "".join(d.content or "" for d in deltas)
    # the SDK's message goes back as the next turn's history, its reasoning fields with it (not rendered)
    again = client(server).chat.completions.create(model="r1", messages=[*ASK, m, {"role": "user", "content": "and?"}],
                                                   max_tokens=2)
    spelt = client(server).chat.completions.create(model="r1", max_tokens=2, messages=[
        *ASK, {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}])  # what the history renders as
    assert again.usage.prompt_tokens == spelt.usage.prompt_tokens
    left_out = client(server).chat.completions.create(model="r1", extra_body={"include_reasoning": False}, **kw)
    assert left_out.choices[0].message.content is None  # no answer: null, as with the thinking shown
    assert getattr(left_out.choices[0].message, "reasoning_content", None) is None
    assert left_out.usage.completion_tokens == r.usage.completion_tokens == 12
    # vLLM's return_token_ids: the thinking's tokens too; left out with the thinking, as vLLM leaves them
    told = client(server).chat.completions.create(model="r1", extra_body={"return_token_ids": True}, **kw)
    assert len(told.choices[0].model_extra["token_ids"]) == 12 and told.model_extra["prompt_token_ids"]
    hidden = client(server).chat.completions.create(model="r1", extra_body={"return_token_ids": True,
                                                                             "include_reasoning": False}, **kw)
    assert hidden.choices[0].model_extra["token_ids"] is None and hidden.model_extra["prompt_token_ids"]


def test_template_variables_reach_the_template(server):
    """``chat_template_kwargs`` (vLLM's extension) and ``reasoning_effort`` set the template's own
    variables: Qwen3's ``enable_thinking: false`` writes an empty thinking block into the prompt
    (more prompt tokens), and so does ``reasoning_effort: "none"``; ``low`` thinks. A reply that
    does not open ``<think>`` (random weights) is all answer under the qwen3 parser."""
    def prompt_tokens(**kw) -> int:
        r = client(server).chat.completions.create(model="qwen3", messages=ASK, max_tokens=2, seed=1, **kw)
        assert r.choices[0].message.content is not None  # a string, maybe empty (two tokens may decode to nothing)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        return r.usage.prompt_tokens

    thinking = prompt_tokens()
    quiet = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert quiet > thinking
    assert prompt_tokens(reasoning_effort="none") == quiet
    assert prompt_tokens(reasoning_effort="low") == thinking
    assert prompt_tokens(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == thinking


@pytest.mark.parametrize("extra, param", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"include_reasoning": "no"}, "include_reasoning"),
])
def test_bad_reasoning_fields_are_400_naming_the_param(server, extra, param):
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"model": "qwen3", "messages": ASK, "max_tokens": 2, **extra},
                   headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_engine_block_takes_a_reasoning_parser_and_refuses_another(tmp_path, tiny_chat):
    from gateway.config import ConfigError, load_config

    path = write_config(tmp_path, {"m": ("chat", tiny_chat)}, engine="{name: transformers, reasoning_parser: qwen3}")
    assert load_config(path).models[0].engine.reasoning_parser == "qwen3"
    shutil.copy(path, tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text(path.read_text().replace("reasoning_parser: qwen3", "reasoning_parser: o1"))
    with pytest.raises(ConfigError, match="reasoning_parser"):
        load_config(tmp_path / "bad.yaml")


def test_responses_reasoning_effort_and_the_thinking_as_a_reasoning_item(server):
    """Responses' ``reasoning.effort`` is chat's ``reasoning_effort``: ``none`` writes Qwen3's
    empty thinking block into the prompt. On a template that opens the thinking, the thinking (all
    of the reply, on random weights) is a ``reasoning`` item with ``reasoning_text`` content, out
    of ``output_text``, whole and streamed (``response.reasoning_text.delta`` events), and goes
    back as input without being rendered."""
    c = client(server)
    default = c.responses.create(model="qwen3", input="hi", max_output_tokens=2)
    quiet = c.responses.create(model="qwen3", input="hi", max_output_tokens=2, reasoning={"effort": "none"})
    assert quiet.usage.input_tokens > default.usage.input_tokens and quiet.reasoning.effort == "none"
    kw = dict(input="hi", max_output_tokens=6, temperature=0)
    raw = c.responses.create(model="r1-raw", **kw).output_text
    r1 = c.responses.create(model="r1", reasoning={"effort": "high", "summary": "auto"}, store=True, **kw)
    assert r1.output_text == "" and r1.usage.output_tokens == 6 and r1.reasoning.effort == "high"
    assert r1.reasoning.summary == "auto"  # accepted and shown; no summary is written (below: summary == [])
    assert c.responses.create(model="r1", reasoning={"generate_summary": "concise"}, **kw).reasoning.summary == "concise"
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model="r1", reasoning={"summary": "brief"}, **kw)
    assert bad.value.body["param"] == "reasoning.summary"
    assert [(o.type, o.status) for o in r1.output] == [("reasoning", "incomplete")]
    assert raw and [p.text for p in r1.output[0].content] == [raw] and r1.output[0].summary == []
    with c.responses.stream(model="r1", **kw) as stream:
        events = list(stream)
    final = events[-1].response  # response.incomplete: cut by max_output_tokens
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == raw
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == raw and final.output[0].content[0].text == raw and final.output_text == ""
    follow = c.responses.create(model="r1", input="and?", previous_response_id=r1.id, max_output_tokens=2)
    spelt = c.responses.create(model="r1", max_output_tokens=2, input=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}])
    assert follow.usage.input_tokens == spelt.usage.input_tokens  # the thinking went back unrendered


def test_a_template_that_refuses_the_messages_is_a_400_naming_them(server):
    """A chat template's own ``raise_exception`` (Gemma's "System role not supported", Mistral's
    "roles must alternate") is the request's fault: a 400 on ``messages`` with the template's
    words, not a 500."""
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60, headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   json={"model": "r1", "max_tokens": 2, "messages": [{"role": "system", "content": "be brief"}, *ASK]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "System role not supported" in err["message"]


def test_responses_input_tokens_count_with_the_template_variables_and_a_refusal_is_a_400(server):
    """``POST /v1/responses/input_tokens`` renders as the response would: ``reasoning.effort``
    ``none`` counts Qwen3's empty thinking block too; a template's refusal is a 400 on ``input``."""
    c = client(server)
    plain = c.responses.input_tokens.count(model="qwen3", input="hi").input_tokens
    quiet = c.responses.input_tokens.count(model="qwen3", input="hi", reasoning={"effort": "none"}).input_tokens
    assert quiet == c.responses.create(model="qwen3", input="hi", max_output_tokens=1,
                                       reasoning={"effort": "none"}).usage.input_tokens > plain
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.input_tokens.count(model="r1", input="hi", instructions="be brief")
    assert refused.value.body["param"] == "input" and "System role" in refused.value.body["message"]


def test_past_thinking_reaches_a_template_that_reads_it(server):
    """An assistant message's ``reasoning_content`` (or vLLM's ``reasoning``) and a Responses
    ``reasoning`` item go to the chat template as ``reasoning_content`` of the assistant message
    they belong to: a template that renders it (as Qwen3's does within a tool-calling turn) gets
    it; tiny-chat's, which does not, is unchanged (the other tests)."""
    def prompt(history_reply: dict) -> int:
        messages = [*ASK, {"role": "assistant", "content": "Light.", **history_reply}, {"role": "user", "content": "and?"}]
        return client(server).chat.completions.create(model="qwen3", messages=messages, max_tokens=1).usage.prompt_tokens

    bare = prompt({})
    thought = prompt({"reasoning_content": "because of scattering"})
    assert thought > bare and prompt({"reasoning": "because of scattering"}) == thought
    items = [{"role": "user", "content": ASK[0]["content"]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "because of scattering"}]},
             {"role": "assistant", "content": "Light."}, {"role": "user", "content": "and?"}]
    c = client(server)
    assert c.responses.input_tokens.count(model="qwen3", input=items).input_tokens == thought


def test_a_template_that_closes_the_thinking_is_answered_without_it(server):
    """DeepSeek-V3.1's template opens the thinking (``<think>``) or, asked for none, closes it
    (``</think>``): under ``deepseek_r1`` the same reply (seeded) is all thinking in the first
    case and all answer in the second, as the rendered prompt's last marker says."""
    def reply(**kw):
        return client(server).chat.completions.create(model="v31", messages=ASK, max_tokens=6, seed=2, **kw).choices[0].message

    thought = reply()
    assert thought.content is None and thought.reasoning_content
    answered = reply(reasoning_effort="none")
    assert answered.content and getattr(answered, "reasoning_content", None) is None


@pytest.mark.parametrize("parser, pieces, think_tokens, completion, expected", [
    ("deepseek_r1", ["a</think>b"], 3, 5, 3),  # through the marker
    ("deepseek_r1", ["cut before the end"], None, 7, 7),  # never closed: all of it
    ("deepseek_r1/closed", ["Light.</think>"], 4, 6, 0),  # the prompt closed it: a marker in the answer is not thinking
    ("qwen3", ["Light."], None, 3, 0),
    ("qwen3", ["<think>x</think>y"], 4, 6, 4),
    ("qwen3", ["<thi"], None, 2, 0),  # cut inside the marker: an answer
    ("qwen3/open", [""], None, 0, 0),
    ("deepseek_r1", ["</think>"], 9, 5, 5),  # never more than were generated (a stop cut the text)
])
def test_reasoning_tokens_of_a_table_of_replies(parser, pieces, think_tokens, completion, expected):
    """The reasoning tokens of a reply: the engine's count through its first ``</think>`` when it
    thought, every completion token when it was cut while thinking, none when it did not think."""
    from workers.base import ChatFinished

    parser, _, prompt = parser.partition("/")
    s = ThinkSplitter(parser, prompt or "none")
    for p in pieces:
        s.feed(p)
    s.finish()
    assert s.reasoning_tokens(ChatFinished("stop", 10, completion, think_tokens)) == expected


def test_tokens_through_the_first_think_end_on_real_tokenizers(tiny_chat, tmp_path):
    """``tokens_through_think_end``: the fewest of a reply's ids whose text holds ``</think>``, on
    tiny-chat's tokenizer (which spells the marker in several tokens) and on one that has it as a
    single token; the vLLM engine's ChatFinished carries the same count."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from workers.chat_prompt import think_end_id, tokens_through_think_end
    from workers.chat_vllm import VllmChatEngine

    spelt = AutoTokenizer.from_pretrained(tiny_chat)
    single = AutoTokenizer.from_pretrained(tiny_chat)
    single.add_tokens(["<think>", "</think>"])
    for tok in (spelt, single):
        def decode(ids):
            return tok.decode(ids, skip_special_tokens=True)

        for text in ("rain and bow</think>Light.", "</think>x", "x</think>", "a</think>b</think>c"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            n = tokens_through_think_end(decode, ids)
            assert "</think>" in decode(ids[:n]) and "</think>" not in decode(ids[:n - 1]), (text, n)
            assert tokens_through_think_end(decode, ids, think_end_id(tok)) == n  # the one-token path agrees
        for end in (None, think_end_id(tok)):
            assert tokens_through_think_end(decode, tok("no marker </thi", add_special_tokens=False)["input_ids"], end) is None
            assert tokens_through_think_end(decode, [], end) is None
    assert think_end_id(spelt) is None and think_end_id(single) == single.convert_tokens_to_ids("</think>")
    # the marker spelt in pieces before the one token: the pieces' place, which the text shows first
    pieces = spelt("a</think>b", add_special_tokens=False)["input_ids"]
    both = pieces + [think_end_id(single)] + pieces
    first = tokens_through_think_end(lambda i: spelt.decode(i), pieces)
    assert tokens_through_think_end(lambda i: single.decode(i), both, think_end_id(single)) == first
    ids = single("ab</think>cd", add_special_tokens=False)["input_ids"]
    assert tokens_through_think_end(lambda i: single.decode(i), ids) == ids.index(single.convert_tokens_to_ids("</think>")) + 1
    engine = SimpleNamespace(tokenizer=single, _think_end_token=single.convert_tokens_to_ids("</think>"))
    asked = SimpleNamespace(reasoning=True)
    finished = VllmChatEngine._finished(engine, "stop", asked, [1, 2, 3], ids, 2)
    assert (finished.prompt_tokens, finished.completion_tokens, finished.think_tokens, finished.cached_tokens) == (
        3, len(ids), ids.index(single.convert_tokens_to_ids("</think>")) + 1, 2)
    assert VllmChatEngine._finished(engine, "stop", SimpleNamespace(reasoning=False), [1], ids, 0).think_tokens is None


def test_usage_counts_the_reasoning_tokens(server):
    """``usage.completion_tokens_details.reasoning_tokens`` (chat, whole and in a stream's usage
    chunk, summed over ``n``) and Responses' ``output_tokens_details.reasoning_tokens``: every
    token of a reply that thought to the end (random weights never close it), none of a reply
    without thinking, and thinking left out of the answer still counted."""
    c = client(server)
    kw = dict(messages=ASK, max_tokens=12, seed=5)
    r = c.chat.completions.create(model="r1", **kw)
    assert r.usage.completion_tokens == 12 and r.usage.completion_tokens_details.reasoning_tokens == 12
    left_out = c.chat.completions.create(model="r1", extra_body={"include_reasoning": False}, **kw)
    assert left_out.usage.completion_tokens_details.reasoning_tokens == 12
    two = c.chat.completions.create(model="r1", n=2, **kw)
    assert two.usage.completion_tokens == 24 and two.usage.completion_tokens_details.reasoning_tokens == 24
    chunks = list(c.chat.completions.create(model="r1", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12
    for plain in ("r1-raw", "qwen3"):
        assert c.chat.completions.create(model=plain, **kw).usage.completion_tokens_details.reasoning_tokens == 0
    resp = c.responses.create(model="r1", input="hi", max_output_tokens=6, temperature=0)
    assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 6
    assert c.responses.create(model="qwen3", input="hi", max_output_tokens=6).usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_tokens_end_at_the_marker_the_model_wrote(server):
    """On a model whose vocabulary has ``</think>`` as one token, a bias makes the model write it
    part-way through a sampled reply: the reasoning tokens are the tokens through it, as the
    reply's own logprobs list them, and the text after it is the answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(next(m.path for m in server.services.config.models if m.name == "marked"))
    end = tok.convert_tokens_to_ids("</think>")
    seen = []
    for seed in range(40):
        r = client(server).chat.completions.create(
            model="marked", messages=ASK, max_tokens=16, seed=seed, temperature=1.0, logprobs=True,
            logit_bias={str(end): 4})
        tokens = [t.token for t in r.choices[0].logprobs.content]
        if "</think>" not in tokens or tokens.index("</think>") == 0:
            continue
        at = tokens.index("</think>")
        assert r.usage.completion_tokens_details.reasoning_tokens == at + 1, (tokens, r.usage)
        assert r.choices[0].message.reasoning_content and "</think>" not in r.choices[0].message.reasoning_content
        seen.append(at)
        if len(seen) == 3:
            break
    assert len(seen) == 3, "the bias should put </think> part-way through some of 40 seeded replies"


FLAG = {"type": "json_schema", "json_schema": {"name": "flag", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}


def test_a_constrained_reply_thinks_first_then_answers_in_the_format(server):
    """With ``response_format``, a reasoning model thinks freely and its answer, after the first
    ``</think>``, is constrained (as vLLM's structured outputs with a reasoning parser do): on the
    model with ``</think>`` as a token, biased so that it ends its thinking part-way, the thinking
    is free text and the answer is the schema's JSON. A prompt that closed the thinking (V3.1's
    template, ``reasoning_effort: none``) is constrained from the first token; a reply cut while
    thinking (R1's template on random weights never closes it) has no answer."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(next(m.path for m in server.services.config.models if m.name == "marked"))
    end = tok.convert_tokens_to_ids("</think>")
    answered = 0
    for seed in range(40):
        r = client(server).chat.completions.create(
            model="marked", messages=ASK, max_tokens=48, seed=seed, temperature=1.0, logit_bias={str(end): 4},
            response_format=FLAG)
        m = r.choices[0].message
        if not m.reasoning_content or r.choices[0].finish_reason != "stop":
            continue
        assert set(json.loads(m.content)) == {"ok"} and isinstance(json.loads(m.content)["ok"], bool), m
        answered += 1
        if answered == 2:
            break
    assert answered == 2, "some of 40 seeded replies should think, close the thinking and answer"
    closed = client(server).chat.completions.create(model="v31", messages=ASK, max_tokens=48, seed=1,
                                                    reasoning_effort="none", response_format=FLAG)
    assert closed.choices[0].finish_reason == "stop" and set(json.loads(closed.choices[0].message.content)) == {"ok"}
    cut = client(server).chat.completions.create(model="r1", messages=ASK, max_tokens=12, seed=1, response_format=FLAG)
    assert cut.choices[0].message.content is None and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens_details.reasoning_tokens == 12
    # the limit the README states: under qwen3, a reply that never opens <think> is never constrained
    free = client(server).chat.completions.create(model="qwen3", messages=ASK, max_tokens=12, seed=1, response_format=FLAG)
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content.startswith('{"ok":')


def test_the_vllm_engine_gates_its_structured_outputs_on_the_thinking(tiny_chat, tmp_path):
    """A vLLM-engine model with a ``reasoning_parser`` starts vLLM's structured outputs with a
    reasoning parser (so the grammar applies after ``</think>``), where its tokenizer has both
    markers as tokens (vLLM's parsers find them by id); otherwise, and without a parser, none."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from gateway.config import load_config
    from workers.chat_vllm import VllmChatEngine

    path = write_config(tmp_path, {"m": ("chat", tiny_chat)}, engine="{name: vllm, reasoning_parser: qwen3}")
    spec = load_config(path).models[0].spec()
    assert spec.options["reasoning_parser"] == "qwen3"
    assert "reasoning_parser" not in load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}, engine="vllm")).models[0].spec().options
    marked = AutoTokenizer.from_pretrained(tiny_chat)
    marked.add_tokens(["<think>", "</think>"])
    spelt = AutoTokenizer.from_pretrained(tiny_chat)
    for parser, tok, gate in (("qwen3", marked, "deepseek_r1"), ("deepseek_r1", marked, "deepseek_r1"),
                              ("deepseek_r1", spelt, ""), ("none", marked, "")):
        assert VllmChatEngine._thinking_gate(SimpleNamespace(reasoning_parser=parser, tokenizer=tok)) == gate
    engine = VllmChatEngine(spec, **spec.options)
    engine.tokenizer = marked
    args = engine.engine_args()
    assert args.structured_outputs_config.reasoning_parser == "deepseek_r1"
    # and thinking_token_budget's markers (tests/test_vllm_engine.py cuts a reply with them)
    markers = (args.reasoning_config.reasoning_start_str, args.reasoning_config.reasoning_end_str)
    assert markers == ("<think>", "</think>")
    plain = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}, engine="vllm")).models[0].spec()
    assert VllmChatEngine(plain, **plain.options).engine_args().reasoning_config is None


def test_a_resumed_stream_renders_its_prompt_with_the_template_variables(server, tiny_chat):
    """A dead process's streamed background response on DeepSeek-V3.1's template asked for no
    thinking (``reasoning.effort: none``: the prompt closes it), resumed from part of its answer by
    another process: its prompt is rendered with the template variables as the first run's was
    (the same input tokens), and what it adds stays answer (no reasoning item appears mid-stream),
    as the whole run's did (``check_a_response_goes_on_from_its_text``)."""
    from tests.test_completions_responses import check_a_response_goes_on_from_its_text

    check_a_response_goes_on_from_its_text(server, tiny_chat, 5, 30.0, reclaim_now=True, model="v31",
                                           extra={"reasoning": {"effort": "none"}},
                                           template_kwargs={"reasoning_effort": "none", "enable_thinking": False})


def _dead_stream(server, model: str, output_events) -> tuple[str, list[str]]:
    """A streamed background response on ``model`` (48 tokens at most) whose process died after storing its opening
    events and ``output_events(at)`` (a function of the event number to start at), stale now."""
    import time
    from dataclasses import replace

    from gateway.auth import key_id
    from gateway.responses import sse_event
    from tests.test_completions_responses import wait_until_done

    c, store = client(server), server.app.state.responses
    ask = dict(model=model, input="Tell me a story", max_output_tokens=48, temperature=0)
    done = wait_until_done(c, c.responses.create(**ask, background=True).id)
    record = server.wait(store.get(done.id, key_id(server.keys["paid"])))
    rid = f"resp_deadthought{time.monotonic_ns()}"
    dead = replace(record, id=rid, beat=time.time(), runner="a-dead-process",
                   request={**record.request, "body": {**record.request["body"], "stream": True}},
                   response={**record.response, "id": rid, "status": "in_progress", "output": []})
    server.wait(store.put(dead))
    before = [sse_event(kind, n, response=dead.response)
              for n, kind in enumerate(["response.created", "response.queued", "response.in_progress"])]
    before += output_events(len(before))
    server.wait(store.add_events(rid, dead.created_at, 0, before))
    assert server.wait(store.update_running(replace(dead, beat=time.time() - 60)))
    return rid, before


def _reasoning_events(at: int, thought: list[str], done: bool, text: list[str] = ()) -> list[str]:
    """A reasoning item's stored events, numbered from ``at``: begun, its ``thought`` pieces, and
    when ``done`` its end and a message begun with the ``text`` pieces."""
    from gateway.responses import sse_event

    rs = {"id": "rs_before", "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
    at_rs = dict(item_id="rs_before", output_index=0, content_index=0)
    out = [("response.output_item.added", dict(output_index=0, item=rs)),
           ("response.content_part.added", dict(part={"type": "reasoning_text", "text": ""}, **at_rs))]
    out += [("response.reasoning_text.delta", dict(delta=d, **at_rs)) for d in thought]
    if done:
        whole = {"type": "reasoning_text", "text": "".join(thought)}
        msg = {"id": "msg_before", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        at_msg = dict(item_id="msg_before", output_index=1, content_index=0)
        out += [("response.reasoning_text.done", dict(text=whole["text"], **at_rs)),
                ("response.content_part.done", dict(part=whole, **at_rs)),
                ("response.output_item.done", dict(output_index=0, item={**rs, "content": [whole], "status": "completed"})),
                ("response.output_item.added", dict(output_index=1, item=msg)),
                ("response.content_part.added", dict(part={"type": "output_text", "text": "", "annotations": []}, **at_msg))]
        out += [("response.output_text.delta", dict(delta=d, logprobs=[], **at_msg)) for d in text]
    return [sse_event(kind, at + n, **data) for n, (kind, data) in enumerate(out)]


@pytest.mark.parametrize("model, done", [("r1", False), ("r1", True), ("qwen3", False)],
                         ids=["r1-cut-while-thinking", "r1-cut-in-the-answer", "qwen3-cut-while-thinking"])
def test_a_resumed_stream_goes_on_from_its_thinking(server, model, done):
    """A reasoning model's streamed background response whose process died part-way through its
    thinking (or, once the thinking ended, part-way through its answer) is run again by another
    process from there: a follower sees one stream, numbered on, no item begun again; the same
    reasoning item goes on thinking (or is kept whole, and the same message goes on answering).
    What it adds is what the model makes from the prompt, ``<think>``-opened by R1's template (or,
    on Qwen3's, by the model: ``<think>`` is put back), and the reply so far (``</think>`` and the
    answer so far when the thinking ended) as a raw prompt,
    greedy, with what is left of ``max_output_tokens``; the reply so far counts as output, and as
    reasoning tokens as far as the thinking went."""
    import gateway.response_runs as runs
    from transformers import AutoTokenizer

    from workers.chat_prompt import encode

    thought, text = ["The sky ", "scatters blue"], ["Because of ", "Rayleigh"]
    rid, before = _dead_stream(server, model, lambda at: _reasoning_events(at, thought, done, text))
    state = server.app.state
    assert rid in server.wait(runs.reclaim(server.services, state.responses, state.conversations, state.background))
    c = client(server)
    events = list(c.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    after = [e.type for e in events[len(before):]]
    assert "response.in_progress" not in after and "response.output_item.added" not in after, after
    tok = AutoTokenizer.from_pretrained(next(m.path for m in server.services.config.models if m.name == model))
    so_far = ("<think>" if model == "qwen3" else "") + "".join(thought) + ("</think>" + "".join(text) if done else "")
    prompt = encode(tok, [{"role": "user", "content": "Tell me a story"}]) + tok(so_far, add_special_tokens=False)["input_ids"]
    said = len(prompt) - len(encode(tok, [{"role": "user", "content": "Tell me a story"}]))
    assert 0 < said < 48
    added = c.completions.create(model=model, prompt=prompt, max_tokens=48 - said, temperature=0).choices[0].text
    final = c.responses.retrieve(rid)
    assert final.status == "incomplete" and final.output[0].id == "rs_before"
    if done:  # the thinking kept whole, the answer goes on
        assert [(o.type, o.id) for o in final.output] == [("reasoning", "rs_before"), ("message", "msg_before")]
        assert final.output[0].content[0].text == "".join(thought) and final.output_text == "".join(text) + added
        assert after[0] == "response.output_text.delta"
        thinking = len(tok("".join(thought) + "</think>", add_special_tokens=False)["input_ids"])
    else:  # it goes on thinking (random weights never close it)
        assert [o.type for o in final.output] == ["reasoning"]
        assert final.output[0].content[0].text == "".join(thought) + added and added
        assert after[0] == "response.reasoning_text.delta" and "response.output_text.delta" not in after
        thinking = 48
    assert final.usage.output_tokens == 48 and final.usage.output_tokens_details.reasoning_tokens == thinking


@pytest.mark.parametrize("constrained, generated, thinking, may", [
    (False, True, False, True),  # a free reply pauses at any token
    (True, False, False, True),  # a constrained one before its first token
    (True, True, True, True),  # ... or while a reasoning reply still thinks (its grammar has seen nothing)
    (True, True, False, False),  # not once its grammar has seen a token: a resubmission would restart it
])
def test_when_a_vllm_request_may_pause(constrained, generated, thinking, may):
    """The vLLM engine resubmits a paused request, which restarts its grammar: a constrained
    reply may pause only before the grammar has seen a token. Checked by hand on the engine (a
    seeded constrained reply on a tiny-chat copy with ``</think>`` as a token, paused at its
    second delta: two passes and valid JSON after the thinking; paused after ``</think>``: one)."""
    from workers.chat_vllm import _may_pause

    assert _may_pause(constrained, generated, thinking) is may


# -- thinking_token_budget ------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, budget, wants, got", [
    ([1, 7], 2, [3, 3, 3, 3], [3, 3, 8, 3]),  # the prompt opened the thinking: two tokens, then </think> forced
    ([1, 7], 0, [3, 3], [8, 3]),
    ([1, 7, 3, 3], 2, [3, 3], [8, 3]),  # the thinking the prompt already holds counts
    ([1, 7, 3, 3, 3], 2, [3], [8]),  # ... and past the budget, </think> comes first
    ([1, 7, 8], 1, [3, 3, 3], [3, 3, 3]),  # the prompt closed it: nothing to cut
    ([1], 1, [7, 3, 3, 3], [7, 3, 8, 3]),  # the reply opens it itself (Qwen3's): counted after <think>
    ([1], 1, [3, 3, 3], [3, 3, 3]),  # never opened: never cut
    ([1, 7], 2, [3, 8, 3, 3, 7, 3, 3, 3], [3, 8, 3, 3, 7, 3, 3, 8]),  # closed in time; opened again, a new count
    ([1, 5, 6], 1, [3, 3, 3, 3, 3], [3, 5, 9, 6, 3]),  # markers of several tokens: </think>'s forced one by one
    ([1, 5, 6], 2, [5, 9, 3, 3, 3, 3], [5, 9, 5, 9, 6, 3]),  # a marker begun by the model counts as thinking
    ([1, 5, 6], 5, [3, 5, 9, 6, 3, 3], [3, 5, 9, 6, 3, 3]),  # ... and one it finished closes it
])
def test_a_thinking_budget_forces_the_end_of_a_table_of_replies(prompt, budget, wants, got):
    """``ThinkBudget`` (vLLM's rule, ``workers.think_budget``): the reply the model ``wants`` (the
    token it would pick at each step) and the one it ``got`` with the budget forcing
    ``</think>``; markers <think> = 7 and </think> = 8, or (5, 6) and (5, 9, 6)."""
    from workers.think_budget import ThinkBudget

    start, end = ((7,), (8,)) if 7 in prompt else ((5, 6), (5, 9, 6)) if 5 in prompt else ((7,), (8,))
    b = ThinkBudget.after_prompt(start, end, budget, prompt)
    ids = list(prompt)
    for want in wants:
        forced = b.forced()
        ids.append(want if forced is None else forced)
        b.advance(ids)
    assert ids[len(prompt):] == got


def _tokens(r) -> list[str]:
    return [t.token for t in r.choices[0].logprobs.content]


@pytest.mark.parametrize("budget", [0, 3])
def test_a_thinking_token_budget_cuts_the_thinking_where_it_says(server, budget):
    """vLLM's ``thinking_token_budget`` on the model whose ``</think>`` is one token and whose
    template opens the thinking: the reply thinks as it would without it for ``budget`` tokens,
    then ``</think>`` comes (random weights never write it), and the rest is the answer; the
    reasoning tokens are those through it. The prompt's tokens after its ``<think>`` (R1's
    template writes a newline there) count, as on vLLM. -1 is no budget."""
    kw = dict(model="marked", messages=ASK, max_tokens=10, temperature=0, logprobs=True)
    free = client(server).chat.completions.create(**kw)
    assert "</think>" not in _tokens(free) and free.choices[0].message.content is None
    cut = client(server).chat.completions.create(extra_body={"thinking_token_budget": budget, "return_token_ids": True},
                                                 **kw)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(next(m.path for m in server.services.config.models if m.name == "marked"))
    prompt = cut.prompt_token_ids
    kept = max(budget - (len(prompt) - prompt.index(tok.convert_tokens_to_ids("<think>")) - 1), 0)
    tokens = _tokens(cut)
    assert tokens[:kept] == _tokens(free)[:kept] and tokens[kept] == "</think>", tokens
    assert budget == 0 or kept < budget  # (the template's newline was counted)
    assert (getattr(cut.choices[0].message, "reasoning_content", None) or "") == "".join(tokens[:kept])
    assert cut.choices[0].message.content == "".join(tokens[kept + 1:]) and len(tokens) == 10
    assert cut.usage.completion_tokens_details.reasoning_tokens == kept + 1
    unlimited = client(server).chat.completions.create(extra_body={"thinking_token_budget": -1}, **kw)
    assert _tokens(unlimited) == _tokens(free)


@pytest.mark.parametrize("model, value, code", [
    ("r1-raw", 4, "invalid_value"),  # a model without a reasoning_parser has no thinking to cut
    ("r1", -2, "invalid_value"),
    ("r1", 2.5, "invalid_type"),
    ("r1", True, "invalid_type"),
])
def test_a_bad_thinking_token_budget_is_a_400_naming_it(server, model, value, code):
    for path, body in (("chat/completions", {"messages": ASK}), ("completions", {"prompt": "hi"})):
        r = httpx.post(f"{server.base_url}/{path}", timeout=60,
                       json={"model": model, "max_tokens": 2, "thinking_token_budget": value, **body},
                       headers={"Authorization": f"Bearer {server.keys['paid']}"})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("thinking_token_budget", code), r.text


def test_a_completion_is_cut_by_the_thinking_its_prompt_opened(server):
    """Legacy completions: the raw prompt's last marker decides, as on vLLM: a prompt ending in
    ``<think>`` is cut after the budget; one without it is not."""
    c = client(server)
    kw = dict(model="marked", max_tokens=6, temperature=0, logprobs=0)
    opened = c.completions.create(prompt="Why?<think>", extra_body={"thinking_token_budget": 2}, **kw)
    assert opened.choices[0].logprobs.tokens[2] == "</think>", opened.choices[0].logprobs.tokens
    plain = c.completions.create(prompt="Why?", **kw)
    assert c.completions.create(prompt="Why?", extra_body={"thinking_token_budget": 2}, **kw).choices[0].text == \
        plain.choices[0].text


def test_a_messages_thinking_budget_is_the_thinking_token_budget(server):
    """Anthropic's ``thinking.budget_tokens`` cuts the thinking as chat's ``thinking_token_budget``
    does: the same thinking block and text; on a model without a reasoning parser it cuts nothing
    (and is no error: Anthropic's clients send it to any model)."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server.url, api_key=server.keys["paid"], max_retries=0, timeout=120)
    for model in ("marked", "r1-raw"):
        msg = claude.messages.create(model=model, messages=ASK, max_tokens=10, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 3})
        chat = client(server).chat.completions.create(
            model=model, messages=ASK, max_tokens=10, temperature=0,
            extra_body={"thinking_token_budget": 3} if model == "marked" else {})
        blocks = {b.type: b for b in msg.content}
        assert blocks["text"].text == chat.choices[0].message.content, model
        thought = getattr(chat.choices[0].message, "reasoning_content", None)
        assert getattr(blocks.get("thinking"), "thinking", None) == thought
    assert "</think>" not in blocks["text"].text and "thinking" not in blocks  # r1-raw: no parser, nothing cut or split


@pytest.mark.parametrize("ids, marker, at", [
    ([1, 7, 2, 7, 3], (7,), 3), ([1, 2], (7,), -1), ([], (7,), -1), ([7], (7,), 0),
    ([5, 6, 1, 5, 9, 5, 6, 2], (5, 6), 5), ([5, 6, 1, 5], (5, 6), 0),  # a first token alone at the end is no match
    ([5, 6, 5], (5, 6, 5, 7), -1),
])
def test_where_a_marker_last_starts(ids, marker, at):
    from workers.think_budget import last_at

    assert last_at(ids, marker) == at


def test_a_stream_whose_thinking_is_left_out_starts_at_once_and_keeps_alive(server, monkeypatch):
    """``include_reasoning: false`` on a reply that thinks: the stream starts (its headers and
    opening chunk) as the model begins, so that keep-alives cover the thinking, where the first
    byte waited for the answer (all thinking here: the end). The engine slowed to one event per
    0.3 s, keep-alives every 0.1 s."""
    from tests.test_messages import keepalive, slowed

    kw = dict(model="r1", messages=ASK, max_tokens=6, seed=5, stream=True, include_reasoning=False)
    client(server).chat.completions.create(model="r1", messages=ASK, max_tokens=1)  # (loads it: its worker exists)
    slowed(server, monkeypatch, "r1", 0.3)
    keepalive(server, monkeypatch, 0.1)
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=kw, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines.count(": keep-alive") >= 3, lines
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 2 and not chunks[1]["choices"][0]["delta"]  # nothing of the thinking, no empty chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
