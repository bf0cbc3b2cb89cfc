"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (gateway/tokenize.py): the ids are the model's
own tokenizer's, a chat's are the ids a chat request's prompt is made of (its usage counts them),
and bad input is a 4xx naming its field."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers import start_server, write_config

PIRATE = "tiny-chat-pirate"
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAIAQMAAAD+wSzIAAAABlBMVEX///+/v7+jQ3Y5AAAADklEQVQI12P4AQQKDKQAAB+4AeW6S5UjAAAAAElFTkSuQmCC"
CAP = 1000  # limits.tokenize_max_tokens here: above tiny-chat's context (512)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]


def bos_chat(tiny_chat, folder):
    """tiny-chat whose tokenizer adds its BOS to every text it encodes with special tokens (as
    Llama's does; tiny-chat's adds none), for vLLM's ``add_special_tokens``."""
    from tokenizers.processors import TemplateProcessing

    folder.mkdir()
    for f in tiny_chat.iterdir():
        (folder / f.name).symlink_to(f)
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (folder / f).is_symlink():
            (folder / f).unlink()
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(demo_dir, tiny_chat, tiny_embed, tiny_tts, tiny_vlm, tmp_path_factory):
    from demo import build_demo_models

    pirate = build_demo_models(demo_dir, names=[PIRATE])[PIRATE]
    folder = tmp_path_factory.mktemp("tokenize")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed), "tiny-tts": ("tts", tiny_tts),
              "tiny-vlm": ("chat", tiny_vlm), "bos-chat": ("chat", bos_chat(tiny_chat, folder / "bos-chat"))}
    extra = (f"adapters:\n  - {{name: {PIRATE}, model: tiny-chat, path: {pirate}}}\n"
             f"limits: {{tokenize_max_tokens: {CAP}}}\n")
    running = start_server(write_config(folder, models, extra))
    yield running
    running.stop()


def post(server, path: str, body: dict, tier: str = "paid", key: str | None = None) -> httpx.Response:
    root = server.base_url.removesuffix("/v1")
    return httpx.post(f"{root}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key or server.keys[tier]}"})


def test_a_text_is_the_tokenizers_own_ids_and_detokenizes_back(server, tiny_chat, tiny_embed):
    for model, path in (("tiny-chat", tiny_chat), ("tiny-embed", tiny_embed), (PIRATE, tiny_chat)):
        tok = AutoTokenizer.from_pretrained(path)
        text = "The quick brown fox, 42 times."
        r = post(server, "/tokenize", {"model": model, "prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["tokens"] == tok(text)["input_ids"] and got["count"] == len(got["tokens"])
        assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
        plain = post(server, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}).json()
        assert plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and plain["token_strs"] is None
        back = post(server, "/detokenize", {"model": model, "tokens": got["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(got["tokens"])}


def test_a_chat_is_the_prompt_a_chat_request_is_made_of(server, tiny_chat):
    """The chat form's ids are the chat template's (generation prompt on), and as many as a chat
    completion of the same messages counts in its usage; the template's options change them as
    ``apply_chat_template``'s do; tools go to the template."""
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    r = post(server, "/tokenize", {"model": "tiny-chat", "messages": CHAT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tok(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"]
    completion = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                            headers={"Authorization": f"Bearer {server.keys['paid']}"},
                            json={"model": "tiny-chat", "messages": CHAT, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(ids)
    closed = post(server, "/tokenize", {"model": "tiny-chat", "messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tok(tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False),
                                   add_special_tokens=False)["input_ids"] and len(closed["tokens"]) < len(ids)
    prefill = CHAT + [{"role": "assistant", "content": "I am"}]
    open_ = post(server, "/tokenize", {"model": "tiny-chat", "messages": prefill, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
    assert tok.decode(open_["tokens"]).endswith("I am")  # the reply left open, for the model to go on
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    with_tools = post(server, "/tokenize", {"model": "tiny-chat", "messages": CHAT, "tools": [tool]}).json()
    assert "get_weather" in tok.decode(with_tools["tokens"]) and with_tools["count"] > len(ids)


def test_max_model_len_is_the_models_context_here_and_in_the_models_list(server, tiny_chat, tiny_embed):
    """vLLM's ``max_model_len``: each text model's context window, in ``/tokenize``'s answer and in
    its ``/v1/models`` row (an adapter's is its base model's; a model without one has none)."""
    import json

    chat = json.loads((tiny_chat / "config.json").read_text())["max_position_embeddings"]
    embed = json.loads((tiny_embed / "config.json").read_text())["max_position_embeddings"]
    assert chat != embed
    assert post(server, "/tokenize", {"model": "tiny-chat", "prompt": "x"}).json()["max_model_len"] == chat
    assert post(server, "/tokenize", {"model": "tiny-embed", "prompt": "x"}).json()["max_model_len"] == embed
    listed = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {server.keys['paid']}"}).json()
    rows = {row["id"]: row for row in listed["data"]}
    assert rows["tiny-chat"]["max_model_len"] == rows[PIRATE]["max_model_len"] == chat
    assert rows["tiny-embed"]["max_model_len"] == embed and "max_model_len" not in rows["tiny-tts"]


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/tokenize", {"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ("/tokenize", {"model": "tiny-chat"}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"model": "tiny-chat", "prompt": "x", "messages": CHAT}, 400, "prompt", None),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/tokenize", {"model": "tiny-tts", "prompt": "x"}, 400, "model", "model_not_supported"),
    ("/tokenize", {"model": "tiny-embed", "messages": CHAT}, 400, "messages", "model_not_supported"),
    ("/tokenize", {"model": "tiny-chat", "prompt": 7}, 400, "prompt", None),
    ("/tokenize", {"model": "tiny-chat", "prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template",
     "unknown_parameter"),
    ("/tokenize", {"model": "tiny-chat", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     None),
    ("/tokenize", {"model": "tiny-chat", "messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message", None),
    ("/tokenize", {"model": "tiny-vlm", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": PNG}}]}]}, 400, "messages",
     None),  # a model that reads images: counted by /v1/responses/input_tokens, not here
    ("/detokenize", {"model": "tiny-chat", "tokens": [1, -1]}, 400, "tokens[1]", None),
    ("/detokenize", {"model": "tiny-chat", "tokens": [10**9]}, 400, "tokens[0]", None),
    ("/detokenize", {"model": "tiny-chat", "tokens": "1 2"}, 400, "tokens", None),
    ("/detokenize", {"model": "tiny-tts", "tokens": [1]}, 400, "model", "model_not_supported"),
])
def test_bad_input_is_a_4xx_naming_its_field(server, path, body, status, param, code):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (param is None or error["param"] == param)
    assert code is None or error["code"] == code


def test_a_key_is_needed_and_its_model_list_applies(server):
    assert post(server, "/tokenize", {"model": "tiny-chat", "prompt": "x"}, key="sk-nope").status_code == 401
    admin = httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=30,
                         headers={"Authorization": f"Bearer {server.keys['admin']}"})
    made = admin.post("/admin/keys", json={"name": "embed-only", "tier": "free", "models": ["tiny-embed"]})
    assert made.status_code == 201, made.text
    key = made.json()["value"]
    assert post(server, "/tokenize", {"model": "tiny-embed", "prompt": "x"}, key=key).status_code == 200
    for model in ("tiny-chat", PIRATE):  # as if it did not exist, an adapter of it too
        hidden = post(server, "/tokenize", {"model": model, "prompt": "x"}, key=key)
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    assert post(server, "/detokenize", {"model": "tiny-chat", "tokens": [1]}, key=key).status_code == 404


def test_add_special_tokens_puts_the_tokenizers_bos_on_a_chat_and_leaves_it_off_a_completion(server):
    """vLLM's ``add_special_tokens``: a chat's prompt is the template's alone by default, and with
    it the tokenizer's special tokens too (its BOS here), as ``/tokenize`` counts it either way; a
    completion's text prompt has them by default, and false leaves them off. Read back with
    ``return_token_ids``; on a model that reads images it is a 400."""
    tok = AutoTokenizer.from_pretrained(next(m.path for m in server.services.config.models if m.name == "bos-chat"))
    assert tok("hi")["input_ids"][0] == tok.bos_token_id != tok("hi", add_special_tokens=False)["input_ids"][0]

    def chat_prompt(**extra) -> list[int]:
        r = post(server, "/v1/chat/completions", {"model": "bos-chat", "messages": CHAT, "max_tokens": 1,
                                                  "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]

    def counted(special: bool) -> list[int]:
        r = post(server, "/tokenize", {"model": "bos-chat", "messages": CHAT, "add_special_tokens": special})
        return r.json()["tokens"]

    plain, special = chat_prompt(), chat_prompt(add_special_tokens=True)
    assert plain == counted(False) and special == counted(True) == [tok.bos_token_id, *plain]

    def completion_prompt(**extra) -> list[int]:
        r = post(server, "/v1/completions", {"model": "bos-chat", "prompt": "The cat", "max_tokens": 1,
                                             "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_token_ids"]

    assert completion_prompt() == tok("The cat")["input_ids"]
    assert completion_prompt(add_special_tokens=False) == tok("The cat", add_special_tokens=False)["input_ids"]
    r = post(server, "/v1/chat/completions", {"model": "tiny-vlm", "max_tokens": 1, "add_special_tokens": True,
                                              "messages": [{"role": "user", "content": [
                                                  {"type": "image_url", "image_url": {"url": PNG}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


def test_a_request_counts_at_most_the_servers_limit_of_tokens(server, tiny_chat):
    """``limits.tokenize_max_tokens`` (or the model's context, if longer) bounds what one request
    counts, in either form: above it a 400 ``too_many_tokens`` naming ``prompt`` or ``messages``
    (refused unread above 32 characters a token); a 9 MB prompt was answered with 40 MB."""
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    words = tok.decode(tok("hello " * CAP)["input_ids"][:CAP])
    assert len(tok(words)["input_ids"]) == CAP
    assert post(server, "/tokenize", {"model": "tiny-chat", "prompt": words}).json()["count"] == CAP
    for body, param in (({"prompt": words + "hello"}, "prompt"),
                        ({"prompt": "x" * (32 * CAP + 1)}, "prompt"),
                        ({"messages": [{"role": "user", "content": words}]}, "messages")):
        r = post(server, "/tokenize", {"model": "tiny-chat", **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "too_many_tokens")
        assert f"limit of {CAP} tokens" in error["message"]


def test_the_answer_is_made_off_the_event_loop(server, tiny_chat, monkeypatch):
    """A long answer's token strings and JSON held the event loop, every tier's requests with it
    (2.7 s for 4.5 M tokens): they are made in a thread, as the ids are."""
    import asyncio

    from starlette.responses import JSONResponse

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    where: dict[str, bool] = {}
    kind = type(AutoTokenizer.from_pretrained(tiny_chat))
    spell, render = kind.convert_ids_to_tokens, JSONResponse.render

    def spelled(self, ids, *args, **kwargs):
        where["token_strs"] = on_loop()
        return spell(self, ids, *args, **kwargs)

    def rendered(self, content):
        if isinstance(content, dict) and "token_strs" in content:
            where["json"] = on_loop()
        return render(self, content)

    monkeypatch.setattr(kind, "convert_ids_to_tokens", spelled)
    monkeypatch.setattr(JSONResponse, "render", rendered)
    r = post(server, "/tokenize", {"model": "tiny-chat", "prompt": "hello " * 100, "return_token_strs": True})
    assert r.status_code == 200 and len(r.json()["token_strs"]) == r.json()["count"], r.text
    assert where == {"token_strs": False, "json": False}


def test_a_chats_documents_are_counted_as_chat_reads_them(server, tiny_chat):
    """A ``file`` part (a document) is read as chat reads it, its text where the part was, so the
    count is chat's ``prompt_tokens`` for the same messages (a 400 that listed 'file' among the
    supported types refused it); an assistant's ``audio`` is read as chat reads it too."""
    import base64

    doc = base64.b64encode(b"Paid requests come first.").decode()
    messages = [{"role": "user", "content": [
                    {"type": "text", "text": "Summarize this."},
                    {"type": "file", "file": {"file_data": f"data:text/plain;base64,{doc}", "filename": "a.txt"}}]},
                {"role": "assistant", "content": "Paid first.", "audio": None},
                {"role": "user", "content": "Shorter?"}]
    r = post(server, "/tokenize", {"model": "tiny-chat", "messages": messages})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    assert "[file: a.txt]\nPaid requests come first." in tok.decode(r.json()["tokens"])
    chat = post(server, "/v1/chat/completions", {"model": "tiny-chat", "messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_a_chats_audio_is_refused_with_why(server):
    """An ``input_audio`` part is heard by a speech-to-text model (a transcription), which
    ``/tokenize`` does not run: a 400 naming the part that says so and where to transcribe it,
    not one that lists ``input_audio`` as supported while refusing it."""
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    r = post(server, "/tokenize", {"model": "tiny-chat", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What was said?"}, audio]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "/v1/audio/transcriptions" in error["message"]
    assert "not supported: the chat models here take" not in error["message"]
