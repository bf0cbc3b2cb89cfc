"""Reasoning models on chat: the thinking split from the answer (``gateway.reasoning``), and the
chat template's own variables (``chat_template_kwargs``, ``reasoning_effort``). Served on copies
of tiny-chat whose templates open the thinking as DeepSeek-R1's does, or take Qwen3's
``enable_thinking``."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    r1 = _model(tiny_chat, root / "r1", R1_PROMPT)
    qwen3 = _model(tiny_chat, root / "qwen3", QWEN3_PROMPT, THINKING_ASSISTANT)
    v31 = _model(tiny_chat, root / "v31", V31_PROMPT)
    models = {"r1-raw": ("chat", r1), "r1": ("chat", r1), "qwen3": ("chat", qwen3), "v31": ("chat", v31)}
    text = write_config(root, models, "limits:\n  max_chat_tokens: 64\n").read_text()
    for name, parser in (("r1", "deepseek_r1"), ("qwen3", "qwen3"), ("v31", "deepseek_r1")):
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
    assert not left_out.choices[0].message.content
    assert getattr(left_out.choices[0].message, "reasoning_content", None) is None
    assert left_out.usage.completion_tokens == r.usage.completion_tokens == 12


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
    r1 = c.responses.create(model="r1", reasoning={"effort": "high"}, store=True, **kw)
    assert r1.output_text == "" and r1.usage.output_tokens == 6 and r1.reasoning.effort == "high"
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
