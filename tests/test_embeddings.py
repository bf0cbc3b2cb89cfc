"""Embeddings against a real uvicorn serving tiny-embed: the openai SDK (texts, token arrays, float
and base64), a decoder with last-token pooling (as Qwen3-Embedding), LangChain's OpenAIEmbeddings, bad input naming its field, a Batch API line, eviction
by a higher tier; and the worker's pooling, batching and folder reading."""

from __future__ import annotations

import base64
import json
import time
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.helpers import run_batch, RunningServer, start_server, write_config
from workers.base import ModelSpec, StepContext
from workers.embed import EmbedWorker, batches, pool, read_config

# One input alone and among longer ones differs only by the padded attention's fp32 rounding.
BATCH_TOLERANCE = 1e-5
LIMITS = "limits:\n  embed_max_inputs: 8\n"


@pytest.fixture(scope="module")
def tiny_embed_mrl(tiny_embed: Path, tmp_path_factory) -> Path:
    """tiny-embed whose config.json says it was trained for shorter vectors (matryoshka)."""
    folder = tmp_path_factory.mktemp("mrl") / "tiny-embed-mrl"
    shutil.copytree(tiny_embed, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return folder


@pytest.fixture(scope="module")
def tiny_decoder_embed(tiny_chat: Path, tmp_path_factory) -> Path:
    """A decoder embedding model laid out as Qwen3-Embedding's folder is: a Qwen3 decoder (causal
    attention) with sentence-transformers' last-token pooling and normalization."""
    from transformers import AutoModel, AutoTokenizer, Qwen3Config

    folder = tmp_path_factory.mktemp("decoder-embed") / "tiny-qwen3-embed"
    tok = AutoTokenizer.from_pretrained(tiny_chat)
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    AutoModel.from_config(Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, pad_token_id=tok.pad_token_id)).save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_lasttoken": True}))
    (folder / "2_Normalize").mkdir()
    return folder


@pytest.fixture(scope="module")
def tiny_embed_prompts(tiny_embed: Path, tmp_path_factory) -> Path:
    """tiny-embed with the instructions an E5-style model is trained with, as sentence-transformers
    saves them (``config_sentence_transformers.json``'s ``prompts``)."""
    folder = tmp_path_factory.mktemp("prompts") / "tiny-embed-prompts"
    shutil.copytree(tiny_embed, folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: ", "topic": "the topic of: "}}))
    return folder


@pytest.fixture(scope="module")
def server(tiny_embed: Path, tiny_embed_mrl: Path, tiny_decoder_embed: Path, tiny_embed_prompts: Path,
           tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("embed-server")
    models = {"tiny-embed": ("embed", tiny_embed), "tiny-embed-mrl": ("embed", tiny_embed_mrl),
              "tiny-qwen3-embed": ("embed", tiny_decoder_embed), "tiny-embed-prompts": ("embed", tiny_embed_prompts)}
    running = start_server(write_config(folder, models, LIMITS))
    yield running
    running.stop()


def client(server: RunningServer, tier: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def post(server: RunningServer, body: dict, tier: str = "paid") -> httpx.Response:
    return httpx.post(f"{server.base_url}/embeddings", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {server.keys[tier]}"})


def refused(r: httpx.Response, param: str, code: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str)
    assert err["param"] == param, err
    if code:
        assert err["code"] == code, err
    return err["message"]


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float64)


def token_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 4, "one two three"]


# ---------------------------------------------------------------- the openai SDK


def test_a_string_and_a_list_in_float_and_base64(server):
    c = client(server)
    one = c.embeddings.create(model="tiny-embed", input="hello world", encoding_format="float")
    assert one.object == "list" and one.model == "tiny-embed" and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0 and len(one.data[0].embedding) == 64
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(token_ids(server_folder(server), "hello world"))

    floats = c.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    raw = post(server, {"model": "tiny-embed", "input": TEXTS, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert decoded.shape == (3, 64)
    assert np.array_equal(decoded.astype(np.float64), vectors(floats))  # the same float32 values, bit for bit
    assert raw["usage"] == {"prompt_tokens": floats.usage.prompt_tokens, "total_tokens": floats.usage.total_tokens}
    assert floats.usage.total_tokens == sum(len(token_ids(server_folder(server), t)) for t in TEXTS)
    # the SDK's default asks for base64 and decodes it itself
    default = c.embeddings.create(model="tiny-embed", input=TEXTS)
    assert np.array_equal(vectors(default), vectors(floats))


def test_normalized_and_the_same_alone_as_in_a_batch(server):
    c = client(server)
    batch = vectors(c.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float"))
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)  # modules.json has Normalize
    for i, text in enumerate(TEXTS):
        alone = vectors(c.embeddings.create(model="tiny-embed", input=text, encoding_format="float"))[0]
        assert np.abs(alone - batch[i]).max() < BATCH_TOLERANCE
    assert np.abs(batch[0] - batch[2]).max() > 1e-2  # different texts, different vectors


def test_a_decoder_with_last_token_pooling_embeds_each_input_as_alone(server, tiny_decoder_embed):
    """Inputs of different lengths in one padded forward pass (padding on the right, after the last
    real token a causal model reads) get the vectors each gets alone: the last token's hidden state
    of transformers' own model, normalized."""
    from transformers import AutoModel, AutoTokenizer

    got = vectors(client(server).embeddings.create(model="tiny-qwen3-embed", input=TEXTS))
    tok, model = AutoTokenizer.from_pretrained(tiny_decoder_embed), AutoModel.from_pretrained(tiny_decoder_embed)
    with torch.no_grad():
        alone = [model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1] for text in TEXTS]
    expected = torch.nn.functional.normalize(torch.stack(alone), dim=-1).double().numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=BATCH_TOLERANCE)
    assert np.abs(got[0] - got[2]).max() > 0.1  # not one vector for all


def test_token_arrays_embed_like_their_text(server):
    c = client(server)
    folder = server_folder(server)
    ids = [token_ids(folder, t) for t in TEXTS[:2]]
    texts = vectors(c.embeddings.create(model="tiny-embed", input=TEXTS[:2], encoding_format="float"))
    arrays = c.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    assert np.abs(vectors(arrays) - texts).max() < BATCH_TOLERANCE
    assert arrays.usage.total_tokens == len(ids[0]) + len(ids[1])
    single = vectors(c.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float"))
    assert single.shape == (1, 64) and np.abs(single[0] - texts[0]).max() < BATCH_TOLERANCE


def test_dimensions_where_the_model_allows_it(server):
    c = client(server)
    full = vectors(c.embeddings.create(model="tiny-embed-mrl", input=TEXTS, encoding_format="float"))
    short = vectors(c.embeddings.create(model="tiny-embed-mrl", input=TEXTS, encoding_format="float", dimensions=16))
    assert short.shape == (3, 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)  # cut, then normalized
    assert np.abs(short - expected).max() < 1e-5
    same = c.embeddings.create(model="tiny-embed", input="hi", encoding_format="float", dimensions=64)
    assert len(same.data[0].embedding) == 64  # the full length is always allowed
    msg = refused(post(server, {"model": "tiny-embed-mrl", "input": "hi", "dimensions": 20}), "dimensions")
    assert "16, 32" in msg
    msg = refused(post(server, {"model": "tiny-embed", "input": "hi", "dimensions": 16}), "dimensions",
                  "dimensions_not_supported")
    assert "matryoshka" in msg


def test_truncate_prompt_tokens_keeps_the_start_or_the_end_as_vllm_does(server):
    """vLLM's ``truncate_prompt_tokens`` (-1: the model's context) and ``truncation_side``: a text
    over the context is embedded as the tokenizer truncates it (its special tokens kept; checked
    by sending those ids), a token array is cut as given; without it the text is a 400."""
    from transformers import AutoTokenizer

    folder = server_folder(server)
    context = read_config(folder).context_length
    tok = AutoTokenizer.from_pretrained(folder)
    text = "one two three four five six seven eight nine ten " * (context // 4)  # words of its vocabulary
    refused(post(server, {"model": "tiny-embed", "input": text}), "input", "context_length_exceeded")
    c = client(server)

    def embed(**extra) -> np.ndarray:
        return vectors(c.embeddings.create(model="tiny-embed", encoding_format="float", **extra))[0]

    for side, k in (("right", -1), ("right", 10), ("left", 10), ("left", -1)):
        tok.truncation_side = side
        want = tok(text, truncation=True, max_length=context if k == -1 else k)["input_ids"]
        assert want[0] == tok.cls_token_id and want[-1] == tok.sep_token_id and len(want) == (context if k == -1 else k)
        got = embed(input=text, extra_body={"truncate_prompt_tokens": k, "truncation_side": side})
        assert np.abs(got - embed(input=want)).max() < BATCH_TOLERANCE, (side, k)
    head = embed(input=text, extra_body={"truncate_prompt_tokens": 10})  # right by default
    assert np.abs(head - embed(input=text, extra_body={"truncate_prompt_tokens": 10, "truncation_side": "right"})).max() == 0
    assert np.abs(head - embed(input=text, extra_body={"truncate_prompt_tokens": 10, "truncation_side": "left"})).max() > 1e-3
    ids = [5 + i % 97 for i in range(context + 20)]  # ids of its vocabulary
    assert np.abs(embed(input=ids, extra_body={"truncate_prompt_tokens": 7, "truncation_side": "left"})
                  - embed(input=ids[-7:])).max() < BATCH_TOLERANCE
    for k in (0, -2, context + 1):
        refused(post(server, {"model": "tiny-embed", "input": "hi", "truncate_prompt_tokens": k}), "truncate_prompt_tokens")
    refused(post(server, {"model": "tiny-embed", "input": "hi", "truncation_side": "middle"}), "truncation_side")


def test_truncate_below_the_special_tokens_keeps_that_many_of_them_as_vllm_does(server):
    """``truncate_prompt_tokens: 1`` (Cohere's ``max_tokens: 1``) on BERT, whose [CLS] and [SEP]
    are 2 tokens, is still a cut to 1 token, as vLLM's: [CLS] alone (right), [SEP] alone (left),
    for a text within the context and one over it; never the whole text, nor a 400 on ``input``."""
    from transformers import AutoTokenizer

    folder = server_folder(server)
    tok = AutoTokenizer.from_pretrained(folder)
    context = read_config(folder).context_length
    c = client(server)
    for text in ("the quick brown fox jumps", "one two three four five six seven eight nine ten " * (context // 4)):
        for side, kept in (("right", tok.cls_token_id), ("left", tok.sep_token_id)):
            r = c.embeddings.create(model="tiny-embed", input=text, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 1, "truncation_side": side})
            want = c.embeddings.create(model="tiny-embed", input=[kept], encoding_format="float")
            assert r.usage.prompt_tokens == 1, (text, side)
            assert np.abs(vectors(r) - vectors(want)).max() < BATCH_TOLERANCE, (text, side)
        co = cohere_client(server).embed(model="tiny-embed", texts=[text], input_type="search_query", max_tokens=1)
        assert co.meta.billed_units.input_tokens == 1
        want = c.embeddings.create(model="tiny-embed", input=[tok.cls_token_id], encoding_format="float")
        assert np.abs(np.array(co.embeddings.float_) - vectors(want)).max() < BATCH_TOLERANCE


# ---------------------------------------------------------------- Cohere's embed API (/v2/embed)


def cohere_client(server: RunningServer):
    import cohere

    return cohere.ClientV2(api_key=server.keys["paid"], base_url=server.url, timeout=60)


def post_v2(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/embed", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})


def test_coheres_client_embeds_with_the_models_instructions_in_every_type(server):
    """Cohere's ``ClientV2.embed``: each text with the model's instruction for its ``input_type``
    (``search_query`` finds ``query``, ``search_document`` finds ``passage``, a model's own name
    its own; Cohere's names without one, or a model without instructions, the texts as written)
    embeds as the OpenAI endpoint embeds the instructed text; ``base64`` is the same float32
    values, ``ubinary`` / ``binary`` one bit per value (>= 0), unsigned and less 128."""
    co, c = cohere_client(server), client(server)
    for model, input_type, prefix in (("tiny-embed-prompts", "search_query", "query: "),
                                      ("tiny-embed-prompts", "search_document", "passage: "),
                                      ("tiny-embed-prompts", "topic", "the topic of: "),
                                      ("tiny-embed-prompts", "clustering", ""), ("tiny-embed", "search_query", "")):
        r = co.embed(model=model, texts=TEXTS, input_type=input_type,
                     embedding_types=["float", "base64", "ubinary", "binary"])
        want = c.embeddings.create(model=model, input=[prefix + t for t in TEXTS], encoding_format="float")
        got = np.array(r.embeddings.float_, dtype=np.float64)
        assert np.abs(got - vectors(want)).max() < BATCH_TOLERANCE, (model, input_type)
        decoded = np.array([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in r.embeddings.base64])
        assert np.array_equal(decoded.astype(np.float64), got)
        assert r.embeddings.ubinary == np.packbits(got >= 0, axis=-1).tolist() and len(r.embeddings.ubinary[0]) == 8
        assert r.embeddings.binary == (np.packbits(got >= 0, axis=-1).astype(int) - 128).tolist()
        assert r.texts == TEXTS and r.meta.billed_units.input_tokens == want.usage.prompt_tokens
    assert co.embed(model="tiny-embed", texts=["hi"], input_type="search_query").embeddings.base64 is None  # float only
    msg = refused(post_v2(server, {"model": "tiny-embed-prompts", "texts": ["hi"], "input_type": "summary"}),
                  "input_type")
    assert "passage, query, topic" in msg


def test_coheres_v1_client_embeds_as_v2_and_defaults_to_the_first_embedding_model(server):
    """Cohere's v1 ``Client.embed`` (``/v1/embed``): floats alone (``embeddings_floats``) unless
    ``embedding_types`` asks for types; ``model`` optional there (the first embedding model,
    tiny-embed here), required on v2."""
    import cohere

    v1 = cohere.Client(api_key=server.keys["paid"], base_url=server.url, timeout=60)
    want = vectors(client(server).embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float"))
    for kw in ({"model": "tiny-embed"}, {}):
        r = v1.embed(texts=TEXTS, input_type="search_document", **kw)
        assert r.response_type == "embeddings_floats" and np.abs(np.array(r.embeddings) - want).max() < BATCH_TOLERANCE
    typed = v1.embed(texts=TEXTS, model="tiny-embed", embedding_types=["float", "ubinary"])
    assert typed.response_type == "embeddings_by_type"
    assert np.abs(np.array(typed.embeddings.float_) - want).max() < BATCH_TOLERANCE
    refused(post_v2(server, {"texts": ["hi"], "input_type": "search_query"}), "model", "missing_required_parameter")


def test_coheres_truncate_max_tokens_and_output_dimension(server):
    """``truncate`` ``END`` (the default) keeps a long text's start, ``START`` its end, to
    ``max_tokens`` or the context, as vLLM's ``truncate_prompt_tokens`` does; ``NONE`` refuses a
    text over either. ``output_dimension`` is ``dimensions``; errors name Cohere's fields."""
    co, c = cohere_client(server), client(server)
    context = read_config(server_folder(server)).context_length
    text = "one two three four five six seven eight nine ten " * (context // 4)

    def openai_vector(**extra) -> np.ndarray:
        r = c.embeddings.create(model="tiny-embed", input=text, encoding_format="float", extra_body=extra)
        return vectors(r)[0]

    def cohere_vector(**kw) -> np.ndarray:
        r = co.embed(model="tiny-embed", texts=[text], input_type="search_document", **kw)
        return np.array(r.embeddings.float_[0])

    for kw, extra in (({}, {"truncate_prompt_tokens": -1}), ({"truncate": "START"}, {"truncate_prompt_tokens": -1,
                      "truncation_side": "left"}), ({"max_tokens": 10}, {"truncate_prompt_tokens": 10}),
                      ({"max_tokens": 10, "truncate": "START"},
                       {"truncate_prompt_tokens": 10, "truncation_side": "left"})):
        assert np.abs(cohere_vector(**kw) - openai_vector(**extra)).max() < BATCH_TOLERANCE, kw
    refused(post_v2(server, {"model": "tiny-embed", "texts": [text], "truncate": "NONE"}), "texts",
            "context_length_exceeded")
    refused(post_v2(server, {"model": "tiny-embed", "texts": ["one two three four five"], "truncate": "NONE",
                             "max_tokens": 3}), "texts", "context_length_exceeded")
    short = co.embed(model="tiny-embed-mrl", texts=TEXTS, input_type="clustering", output_dimension=16)
    want = c.embeddings.create(model="tiny-embed-mrl", input=TEXTS, encoding_format="float", dimensions=16)
    assert np.abs(np.array(short.embeddings.float_) - vectors(want)).max() < BATCH_TOLERANCE
    refused(post_v2(server, {"model": "tiny-embed-mrl", "texts": ["hi"], "output_dimension": 20}), "output_dimension")
    refused(post_v2(server, {"model": "tiny-embed", "texts": ["hi"], "max_tokens": context + 1}), "max_tokens")
    refused(post_v2(server, {"model": "tiny-embed", "texts": ["hi"], "embedding_types": ["int8"]}),
            "embedding_types[0]")
    refused(post_v2(server, {"model": "tiny-embed", "images": ["data:image/png;base64,AAAA"]}), "images")
    refused(post_v2(server, {"model": "tiny-embed", "texts": []}), "texts")


def test_bad_input_is_a_400_naming_input(server):
    folder = server_folder(server)
    context = read_config(folder).context_length
    long_text = "hello world " * context
    msg = refused(post(server, {"model": "tiny-embed", "input": ["hi", long_text]}), "input", "context_length_exceeded")
    assert "input[1]" in msg and str(context) in msg
    refused(post(server, {"model": "tiny-embed", "input": [[5] * (context + 1)]}), "input", "context_length_exceeded")
    msg = refused(post(server, {"model": "tiny-embed", "input": ["hi"] * 9}), "input", "too_many_inputs")
    assert "8" in msg
    refused(post(server, {"model": "tiny-embed", "input": [[1, 2, 10**6]]}), "input")  # outside the vocabulary
    refused(post(server, {"model": "tiny-embed", "input": [[1, -2]]}), "input")
    for empty in ("", [], [""], [[]]):
        refused(post(server, {"model": "tiny-embed", "input": empty}), "input")
    refused(post(server, {"model": "tiny-embed", "input": [1, "a"]}), "input")
    refused(post(server, {"model": "tiny-embed", "input": "hi", "encoding_format": "int8"}), "encoding_format")
    with pytest.raises(openai.BadRequestError) as exc:  # the SDK sees the same 400
        client(server).embeddings.create(model="tiny-embed", input=["x"] * 9)
    assert exc.value.body["param"] == "input"
    r = post(server, {"model": "no-such-model", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_langchain_openai_embeddings(server, monkeypatch):
    """docs/MODALITIES.md's settings: ``check_embedding_ctx_length=False`` and ``chunk_size`` at
    ``limits.embed_max_inputs`` (8 here) embed more texts than the limit, in batches; LangChain's
    default chunk_size (1000) is a 400 that says the limit and how to batch."""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False sends the texts as they are; True would tokenize them with
    # tiktoken, whose encoding files are a download: any use of it fails here.
    for name in ("get_encoding", "encoding_for_model"):
        monkeypatch.setattr(tiktoken, name, lambda *a, **k: pytest.fail("tiktoken was used"))
    lc = OpenAIEmbeddings(model="tiny-embed", base_url=server.base_url, api_key=server.keys["paid"],
                          check_embedding_ctx_length=False, max_retries=0, chunk_size=8)
    docs = np.array(lc.embed_documents(TEXTS))
    query = np.array(lc.embed_query(TEXTS[0]))
    direct = vectors(client(server).embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float"))
    assert docs.shape == (3, 64) and np.abs(docs - direct).max() < BATCH_TOLERANCE
    assert np.abs(query - direct[0]).max() < BATCH_TOLERANCE
    chunks = [f"chunk {i}: " + TEXTS[i % 3] for i in range(20)]  # more than the limit's worth
    many = np.array(lc.embed_documents(chunks))
    assert many.shape == (20, 64) and np.abs(many[:3] - vectors(client(server).embeddings.create(
        model="tiny-embed", input=chunks[:3], encoding_format="float"))).max() < BATCH_TOLERANCE
    with pytest.raises(openai.BadRequestError) as exc:
        OpenAIEmbeddings(model="tiny-embed", base_url=server.base_url, api_key=server.keys["paid"],
                         check_embedding_ctx_length=False, max_retries=0).embed_documents(chunks)
    assert exc.value.body["code"] == "too_many_inputs"
    assert "limit of 8" in exc.value.body["message"] and "chunk_size=8" in exc.value.body["message"]


def test_models_list_shows_the_embed_kind(server):
    rows = {m.id: m for m in client(server).models.list().data}
    assert rows["tiny-embed"].model_extra["kind"] == "embed"


def test_a_batch_line_runs_through_the_batch_api(server):
    c = client(server)
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny-embed", "input": text, "encoding_format": "float"}}
             for i, text in enumerate(TEXTS[:2])]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "tiny-embed", "input": "hi", "dimensions": 8}})
    batch = run_batch(c, "/v1/embeddings", lines)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and batch.request_counts.failed == 1
    out = {x["custom_id"]: x for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())}
    live = vectors(c.embeddings.create(model="tiny-embed", input=TEXTS[:2], encoding_format="float"))
    for i in range(2):
        body = out[f"e{i}"]["response"]["body"]
        assert body["object"] == "list" and body["usage"]["total_tokens"] > 0
        assert np.abs(np.array(body["data"][0]["embedding"]) - live[i]).max() < BATCH_TOLERANCE
    errors = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert [e["response"]["body"]["error"]["param"] for e in errors] == ["dimensions"]


def test_batch_lines_run_together_and_share_passes(tiny_embed, tmp_path):
    """An embedding model's ``batch_width`` (16 by default) lines run at once (the batch tier's
    default ``max_inflight`` counts it), and lines that come while a pass runs share the next: 32
    lines with each pass held 20 ms take a few passes, not 32 (the path before ran one line at a
    time, a pass each), and each line gets what it gets alone."""
    config = write_config(tmp_path, {"tiny-embed": ("embed", tiny_embed)})
    text = config.read_text()
    at = text.index("name: batch")
    config.write_text(text[:at] + text[at:].replace("    max_inflight: 4\n", "", 1))  # the default: the widths
    srv = start_server(config)
    try:
        assert srv.services.gate.tiers["batch"].max_inflight == 16
        c = client(srv)
        texts = [f"line {i} " * (1 + i % 3) for i in range(32)]
        live = vectors(c.embeddings.create(model="tiny-embed", input=texts[:8], encoding_format="float"))  # loads it
        worker = srv.services.arbiter.workers["tiny-embed"]
        assert worker.batch_width == 16
        hook = worker.model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
        before = worker.passes
        try:
            batch = run_batch(c, "/v1/embeddings", [
                {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "tiny-embed", "input": t, "encoding_format": "float"}} for i, t in enumerate(texts)])
        finally:
            hook.remove()
        assert batch.status == "completed" and batch.request_counts.completed == 32
        assert worker.passes - before <= 8, worker.passes - before
        out = {x["custom_id"]: x for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())}
        for i in range(8):
            got = np.array(out[f"e{i}"]["response"]["body"]["data"][0]["embedding"])
            assert np.abs(got - live[i]).max() < BATCH_TOLERANCE
    finally:
        srv.stop()


def test_a_higher_tier_evicts_the_embed_model(tiny_embed, tiny_embed_mrl, tmp_path):
    """A budget with room for one of the two: paid takes the device from free's model, and free
    cannot take it back while paid's model is protected."""
    models = {"tiny-embed": ("embed", tiny_embed), "tiny-embed-mrl": ("embed", tiny_embed_mrl)}
    config = write_config(tmp_path, models, "eviction:\n  protect_window_s: 60\n")
    config.write_text(config.read_text().replace("vram_budget: 4GiB", "vram_budget: 700KiB"))
    srv = start_server(config)
    try:
        free, paid = client(srv, "free"), client(srv, "paid")
        refused(post(srv, {"model": "tiny-embed", "input": ["x"] * 300}, "free"), "input")
        places = {r["id"]: r["place"] for r in srv.call(srv.services.arbiter.table)}
        assert places == {"tiny-embed": "cold", "tiny-embed-mrl": "cold"}  # refused before any load
        free.embeddings.create(model="tiny-embed", input="hello")
        places = {r["id"]: r["place"] for r in srv.call(srv.services.arbiter.table)}
        assert places == {"tiny-embed": "resident", "tiny-embed-mrl": "cold"}
        paid.embeddings.create(model="tiny-embed-mrl", input="hello")
        places = {r["id"]: r["place"] for r in srv.call(srv.services.arbiter.table)}
        assert places == {"tiny-embed-mrl": "resident", "tiny-embed": "warm"}  # a host copy, like the others
        with pytest.raises(openai.RateLimitError) as exc:
            free.embeddings.create(model="tiny-embed", input="hello")
        assert exc.value.body["code"] == "model_protected"
    finally:
        srv.stop()


def server_folder(server: RunningServer) -> Path:
    return Path(server.services.arbiter.specs["tiny-embed"].path)


# ---------------------------------------------------------------- the worker


def test_many_inputs_share_one_forward_pass_split_only_at_the_token_cap(tiny_embed):
    worker = EmbedWorker(ModelSpec("e", "embed", tiny_embed), max_batch_tokens=64)
    worker.load(torch.device("cpu"))
    passes: list[tuple[int, ...]] = []
    worker.model.register_forward_hook(lambda m, args, kwargs, out: passes.append(tuple(kwargs["input_ids"].shape)),
                                       with_kwargs=True)
    ids = worker.tokenize(["a b", "one two three four", "hi", "the dog"])
    ctx = StepContext()
    together = worker.embed(ids, None, ctx)
    assert len(passes) == 1 and passes[0][0] == 4 and ctx.steps == 1
    long = worker.tokenize(["hello world " * 20])[0]  # 42 tokens: with the four above, over 64 padded
    passes.clear()
    mixed = worker.embed([long, *ids], None, StepContext())
    assert [p[0] for p in passes] == [1, 4]
    assert np.abs(mixed[1:] - together).max() < BATCH_TOLERANCE


def test_concurrent_requests_share_forward_passes(tiny_embed_mrl):
    """Requests that arrive while a pass runs share the next one: twelve at once, the first held in
    its pass until the other eleven wait, take two passes, not twelve. Each gets what it gets
    alone (within ``BATCH_TOLERANCE``), at its own ``dimensions`` in the same pass; the pass's
    time is charged to its requests equally (one row each); a request cancelled while it waited
    leaves (``Cancelled``) and the others are served."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from workers.base import Cancelled

    worker = EmbedWorker(ModelSpec("e", "embed", tiny_embed_mrl))
    worker.load(torch.device("cpu"))
    ids = worker.tokenize([f"text number {i} " * (1 + i % 4) for i in range(12)])
    dims = [(None, 16, 32)[i % 3] for i in range(12)]
    alone = [worker.embed([row], d, StepContext()) for row, d in zip(ids, dims)]
    held, release = threading.Event(), threading.Event()

    def hold(module, args):
        held.set()
        release.wait(10)

    hook = worker.model.register_forward_pre_hook(hold)
    contexts = [StepContext() for _ in ids]
    before = worker.passes
    try:
        with ThreadPoolExecutor(12) as pool:
            first = pool.submit(worker.embed, [ids[0]], dims[0], contexts[0])
            assert held.wait(10)  # the first request's pass is running
            rest = [pool.submit(worker.embed, [row], d, ctx) for row, d, ctx in zip(ids[1:], dims[1:], contexts[1:])]
            deadline = time.time() + 10
            while len(worker.shared.interactive.queued()) < 11 and time.time() < deadline:
                time.sleep(0.01)
            contexts[5].cancel()  # waiting: it leaves at its boundary
            release.set()
            got = [first.result(), *[f.result() if i != 4 else None for i, f in enumerate(rest)]]
            with pytest.raises(Cancelled):
                rest[4].result()
    finally:
        hook.remove()
    assert worker.passes - before == 2
    for i, (a, g) in enumerate(zip(alone, got)):
        if i != 5:
            assert g.shape == a.shape == (1, dims[i] or 64) and np.abs(a - g).max() < BATCH_TOLERANCE, i
    shared = [contexts[i].gpu_s for i in range(1, 12) if i != 5]
    assert all(s > 0 for s in shared) and max(shared) - min(shared) < 1e-12  # one pass, a row each


def test_batch_tier_work_shares_passes_in_a_lane_of_its_own(tiny_embed):
    """Work with a pause gate (the batch tier, which yields between passes) shares passes with
    batch work only: while an interactive pass runs it runs at once, on its own thread; batch
    jobs that come while a batch pass is paused share the next pass, get what they get alone and
    count the time they waited behind the pause as paused; an interactive request meanwhile runs
    its own pass, not held by the paused lane."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    worker = EmbedWorker(ModelSpec("e", "embed", tiny_embed))
    worker.load(torch.device("cpu"))
    ids = worker.tokenize(["hello", "one two three", "the dog ran"])
    alone = [worker.embed([row], None, StepContext()) for row in ids]
    may_run = threading.Event()
    may_run.set()

    def gate(ctx):
        assert may_run.wait(10)

    def batch_ctx():
        return StepContext(pause_gate=gate, pause_check=lambda: not may_run.is_set())

    worker.shared.interactive.leading = True  # someone's interactive pass is running
    ctx = batch_ctx()
    before = worker.passes
    assert worker.embed(ids[:1], None, ctx).shape == (1, 64) and ctx.steps == 1 and worker.passes == before + 1
    worker.shared.interactive.leading = False

    may_run.clear()  # the lane must yield: the first batch job's pass waits at its gate
    contexts = [batch_ctx() for _ in ids]
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(worker.embed, [ids[0]], None, contexts[0])
        deadline = time.time() + 10
        while not (worker.shared.batch.leading and contexts[0].paused) and time.time() < deadline:
            time.sleep(0.01)
        rest = [pool.submit(worker.embed, [row], None, c) for row, c in zip(ids[1:], contexts[1:])]
        while len(worker.shared.batch.queued()) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert len(worker.shared.batch.queued()) == 2 and not first.done()
        passes = worker.passes
        interactive = pool.submit(worker.embed, [ids[2]], None, StepContext())
        assert np.abs(interactive.result(10) - alone[2]).max() < BATCH_TOLERANCE  # not held by the pause
        assert worker.passes == passes + 1
        time.sleep(0.05)
        may_run.set()
        got = [first.result(10), *[f.result(10) for f in rest]]
    assert worker.passes == passes + 3  # the paused job's pass, then one pass for the two that waited
    for a, g in zip(alone, got):
        assert np.abs(a - g).max() < BATCH_TOLERANCE
    assert all(c.paused for c in contexts)
    assert contexts[1].paused_s >= 0.05 and contexts[2].paused_s >= 0.05  # waited behind the first one's pause
    shared = [contexts[1].gpu_s, contexts[2].gpu_s]
    assert max(shared) - min(shared) < 1e-12  # one pass, a row each

    from workers.embed import _Job

    may_run.clear()  # a pause ordered just before a shared pass: every job in it waits, and is paused
    pair = [batch_ctx(), batch_ctx()]

    def lift() -> None:  # 50 ms after both jobs saw the pause
        deadline = time.time() + 10
        while not (pair[0].paused and pair[1].paused) and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        may_run.set()

    threading.Thread(target=lift, daemon=True).start()
    worker._passes([_Job(pair[0], rows=[ids[0]]), _Job(pair[1], rows=[ids[1]])])
    assert all(c.paused and c.paused_s >= 0.05 for c in pair)


def test_a_batch_job_waiting_behind_a_paused_pass_leaves_when_cancelled(tiny_embed):
    """Cancelled while it waits behind another batch job's paused pass, a batch job leaves within
    the pause gate's poll (Cancelled), not when the pause lifts; the paused one then goes on."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from workers.base import Cancelled

    worker = EmbedWorker(ModelSpec("e", "embed", tiny_embed))
    worker.load(torch.device("cpu"))
    ids = worker.tokenize(["hello", "the dog ran"])
    may_run = threading.Event()

    def batch_ctx():
        return StepContext(pause_gate=lambda c: may_run.wait(10), pause_check=lambda: not may_run.is_set())

    first_ctx, second_ctx = batch_ctx(), batch_ctx()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(worker.embed, ids[:1], None, first_ctx)
        deadline = time.time() + 10
        while not (worker.shared.batch.leading and first_ctx.paused) and time.time() < deadline:
            time.sleep(0.01)
        second = pool.submit(worker.embed, ids[1:], None, second_ctx)
        while len(worker.shared.batch.queued()) < 1 and time.time() < deadline:
            time.sleep(0.01)
        second_ctx.cancel()
        started = time.time()
        with pytest.raises(Cancelled):
            second.result(5)
        assert time.time() - started < 1 and not first.done()  # the pause still holds the first
        may_run.set()
        assert first.result(10).shape == (1, 64)
    assert worker.shared.batch.jobs == [] and not worker.shared.batch.leading


def test_pooling_modes_over_right_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [9.0, 9.0]],
                           [[4.0, 0.0], [0.0, 8.0], [5.0, 4.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 2.0], [4.0, 0.0]]
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 4.0], [3.0, 4.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 6.0], [5.0, 8.0]]
    assert pool(hidden, mask, "lasttoken").tolist() == [[3.0, 6.0], [5.0, 4.0]]


def test_batches_group_longest_first_within_the_cap():
    assert batches([3, 10, 2], 100) == [[1, 0, 2]]
    assert batches([3, 10, 2], 20) == [[1, 0], [2]]
    assert batches([30], 8) == [[0]]  # one input longer than the cap still runs alone


def test_the_folder_decides_pooling_normalization_and_limits(tiny_embed, tmp_path):
    cfg = read_config(tiny_embed)
    assert (cfg.pooling, cfg.normalize, cfg.context_length, cfg.dimensions) == ("mean", True, 128, 64)
    assert cfg.matryoshka is False
    folder = tmp_path / "m"
    shutil.copytree(tiny_embed, folder)
    pooling = json.loads((folder / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (folder / "1_Pooling/config.json").write_text(json.dumps(pooling))
    modules = json.loads((folder / "modules.json").read_text())[:2]  # no Normalize
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    cfg = read_config(folder)
    assert (cfg.pooling, cfg.normalize, cfg.context_length) == ("cls", False, 32)
    assert cfg.prompts == {}
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "q: ", "n": 1}}))
    assert read_config(folder).prompts == {"query": "q: "}  # (strings only)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "task_instructions": {"query": "Q: "}}))
    assert read_config(folder).prompts == {"query": "Q: "}  # config.json's first, as vLLM reads them
    worker = EmbedWorker(ModelSpec("e", "embed", folder))
    worker.load(torch.device("cpu"))
    out = worker.embed(worker.tokenize(["hello world"]), None, StepContext())
    assert abs(float(np.linalg.norm(out[0])) - 1.0) > 1e-3  # not normalized
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 2, "name": "2", "path": "2_Dense",
                                                                "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="'Dense' is not supported"):
        read_config(folder)
