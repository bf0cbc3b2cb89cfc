"""Model aliases (tiers.yaml ``aliases:``): a client written for OpenAI's model names runs
unchanged. Through the openai SDK on a real server: chat (with an adapter stack on the alias),
embeddings, moderations, a transcription's multipart ``model``, ``GET /v1/models/{alias}``, a key
whose allow-list names the model, and a Batch API line; and the config's refusals."""

from __future__ import annotations

import io
import json

import httpx
import numpy as np
import openai
import pytest

from gateway.config import ConfigError, load_config
from tests.helpers import run_batch, adapters_yaml, start_server, write_config

ALIASES = {"tiny-chat": ["gpt-4o-mini", "gpt-4.1"], "tiny-embed": ["text-embedding-3-small"],
           "tiny-moderation": ["omni-moderation-latest"], "tiny-stt": ["whisper-1"]}


def with_aliases(config_text: str, aliases: dict[str, list[str]]) -> str:
    for model, names in aliases.items():
        entry = f"  - name: {model}\n"
        config_text = config_text.replace(entry, entry + f"    aliases: {json.dumps(names)}\n")
    return config_text


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_embed, tiny_moderation, tiny_stt, demo_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("aliases")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed),
              "tiny-moderation": ("moderation", tiny_moderation), "tiny-stt": ("stt", tiny_stt)}
    config = write_config(folder, models, adapters_yaml(demo_dir) + "batch:\n  store: sqlite\n")
    config.write_text(with_aliases(config.read_text(), ALIASES))
    running = start_server(config)
    yield running
    running.stop()


def client(server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key or server.keys["paid"], max_retries=0)


def ask(c: openai.OpenAI, model: str, **kw) -> str:
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, **kw)
    return r.choices[0].message.content


def test_an_alias_calls_its_model_on_every_endpoint(server):
    """The same answers by alias as by name (greedy chat, an adapter stack on the alias's model,
    embeddings, moderation scores, a transcript); a name nobody configured is still a 404."""
    c = client(server)
    assert ask(c, "gpt-4o-mini") == ask(c, "gpt-4.1") == ask(c, "tiny-chat")
    stack = {"adapters": [{"name": "tiny-chat-pirate", "weight": 1.0}]}
    assert ask(c, "gpt-4o-mini", extra_body=stack) == ask(c, "tiny-chat", extra_body=stack)
    by_alias = c.embeddings.create(model="text-embedding-3-small", input="hello").data[0].embedding
    assert by_alias == c.embeddings.create(model="tiny-embed", input="hello").data[0].embedding
    moderated = c.moderations.create(model="omni-moderation-latest", input="hello").results[0]
    assert moderated.category_scores == c.moderations.create(model="tiny-moderation", input="hello").results[0].category_scores
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    import soundfile as sf

    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    said = [c.audio.transcriptions.create(model=m, file=("a.wav", buf.getvalue(), "audio/wav"), language="en",
                                          temperature=0).text for m in ("whisper-1", "tiny-stt")]
    assert said[0] == said[1]
    with pytest.raises(openai.NotFoundError):
        ask(c, "gpt-5")
    with pytest.raises(openai.BadRequestError) as caught:  # an alias of a chat model is not an embedding model
        c.embeddings.create(model="gpt-4o-mini", input="hello")
    assert caught.value.body["code"] == "model_not_supported"
    assert caught.value.body["message"] == "the model 'gpt-4o-mini' is a chat model, not an embed model"


def test_models_list_their_aliases_and_each_alias_as_a_model(server):
    """A client checking a name against the model list finds an alias there: a row of its own
    naming its model (``alias_of``), as ``GET /v1/models/{alias}`` answers; the model's row lists
    its aliases. A key limited to some models sees their aliases only."""
    c = client(server)
    rows = {m.id: m.model_extra for m in c.models.list().data}
    assert rows["tiny-chat"]["aliases"] == ["gpt-4o-mini", "gpt-4.1"] and rows["tiny-stt"]["aliases"] == ["whisper-1"]
    assert rows["gpt-4o-mini"] == rows["gpt-4.1"] == {"alias_of": "tiny-chat"}
    assert rows["whisper-1"] == {"alias_of": "tiny-stt"} and "text-embedding-3-small" in rows
    whisper = c.models.retrieve("whisper-1")
    assert (whisper.id, whisper.model_extra["alias_of"]) == ("whisper-1", "tiny-stt")
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("whisper-2")
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    with admin:
        secret = admin.post("/admin/keys", json={"name": "stt", "tier": "paid", "models": ["tiny-stt"]}).json()["value"]
    assert sorted(m.id for m in client(server, secret).models.list().data) == ["tiny-stt", "whisper-1"]


def test_a_keys_allow_list_covers_its_models_aliases(server):
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    with admin:
        r = admin.post("/admin/keys", json={"name": "chat only", "tier": "paid", "models": ["tiny-chat"]})
    assert r.status_code == 201, r.text
    c = client(server, r.json()["value"])
    assert ask(c, "gpt-4o-mini") == ask(c, "tiny-chat")
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="text-embedding-3-small", input="hello")


def test_a_hidden_model_is_named_only_as_the_key_asked_for_it(server):
    """A model outside a key's allow-list is a 404 that names what the request named (an alias),
    or no model where it named none (the first moderation, classification or embedding model is
    then the first the key may use: here there is none), and is refused before its kind is said:
    the answer a name nobody has gets, never the hidden model's own name."""
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    with admin:
        r = admin.post("/admin/keys", json={"name": "chat only", "tier": "paid", "models": ["tiny-chat"]})
    assert r.status_code == 201, r.text
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {r.json()['value']}"}, timeout=30)

    def missing(path: str, body: dict, name: str) -> None:
        hidden = http.post(path, json={**body, "model": name})
        nobody = http.post(path, json={**body, "model": "no-such-model"})
        assert hidden.status_code == nobody.status_code == 404, (path, name, hidden.text)
        assert hidden.json() == json.loads(json.dumps(nobody.json()).replace("no-such-model", name)), (path, name)

    missing("/v1/moderations", {"input": "hi"}, "omni-moderation-latest")
    missing("/v1/embeddings", {"input": "hi"}, "text-embedding-3-small")
    missing("/v1/embeddings", {"input": "hi"}, "tiny-moderation")  # not a 400 saying it is a moderation model
    missing("/classify", {"input": "hi"}, "tiny-moderation")
    for path, body in (("/v1/moderations", {"input": "hi"}), ("/classify", {"input": "hi"}),
                       ("/v1/embed", {"texts": ["hi"]})):
        r = http.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
        assert "tiny-" not in r.json()["error"]["message"] and "this server has no" in r.json()["error"]["message"]
    assert client(server).moderations.create(input="hi").model == "tiny-moderation"  # other keys: the first


def test_a_batch_line_may_name_an_alias(server):
    c = client(server)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}}
             for i, model in enumerate(["gpt-4o-mini", "tiny-chat"])]
    batch = run_batch(c, "/v1/chat/completions", lines)
    assert (batch.status, batch.request_counts.completed) == ("completed", 2)
    out = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())}
    assert out["r0"]["choices"][0]["message"]["content"] == out["r1"]["choices"][0]["message"]["content"]
    from batch.shapes import shape_of

    assert shape_of(server.services, "/v1/chat/completions", {"model": "gpt-4o-mini"}) == "tiny-chat"


@pytest.mark.parametrize("aliases, problem", [
    ({"tiny-chat": ["tiny-embed"]}, "'tiny-embed' is the name of a model or adapter"),
    ({"tiny-chat": ["tiny-chat-pirate"]}, "'tiny-chat-pirate' is the name of a model or adapter"),
    ({"tiny-chat": ["gpt-4o"], "tiny-embed": ["gpt-4o"]}, "'gpt-4o' is another model's alias too"),
    ({"tiny-chat": ["gpt 4o"]}, "should match pattern"),
])
def test_an_alias_that_names_something_else_is_refused(tiny_chat, tiny_embed, demo_dir, tmp_path, aliases, problem):
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed)},
                          adapters_yaml(demo_dir))
    config.write_text(with_aliases(config.read_text(), aliases))
    with pytest.raises(ConfigError, match=problem):
        load_config(config)
