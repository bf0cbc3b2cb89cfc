"""vLLM's classification endpoint (``POST /classify``, ``/v1/classify``) against a real uvicorn
serving tiny-moderation (a random-weight BERT classifier, multi-label), the same weights read as a
single-label classifier, and tiny-rerank's one-label head: each input's scores against
transformers' own text-classification pipeline, raw logits, token-id inputs, the context refused
or cut by ``truncate_prompt_tokens``, bad input naming its field, and a Batch API line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from tests.helpers import RunningServer, run_batch, start_server, write_config

TOLERANCE = 1e-5  # a text alone and padded among longer ones differs by the padded attention's fp32 rounding
TEXTS = ["I will find you.", "What a lovely day for a walk in the park with the dog.", "hello"]
LONG = " ".join(f"word{i} the dog ran over the hill" for i in range(40))  # ~400 tokens: over the 128 of context


@pytest.fixture(scope="module")
def server(tiny_moderation: Path, tiny_softmax: Path, tiny_rerank: Path, tiny_embed: Path,
           tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("classify-server")
    models = {"multi": ("moderation", tiny_moderation), "single": ("moderation", tiny_softmax),
              "one": ("moderation", tiny_rerank), "tiny-embed": ("embed", tiny_embed)}
    running = start_server(write_config(folder, models, "limits:\n  moderation_max_inputs: 4\n"
                                                        "  moderation_max_tokens: 600\n"))
    yield running
    running.stop()


def post(server: RunningServer, body: dict, path: str = "/v1/classify") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})


def reference(folder: Path, text: str, function: str) -> list[float]:
    """transformers' own pipeline: every label's score for ``text``, in label order."""
    pipe = pipeline("text-classification", model=str(folder), top_k=None, function_to_apply=function, device="cpu")
    labels = pipe.model.config.id2label
    by_label = {row["label"]: row["score"] for row in pipe([text])[0]}
    return [by_label[labels[i]] for i in range(len(labels))]


@pytest.mark.parametrize("model, folder, function", [("multi", "tiny_moderation", "sigmoid"),
                                                      ("single", "tiny_softmax", "softmax"),
                                                      ("one", "tiny_rerank", "sigmoid")])
def test_scores_are_transformers_pipelines(server, model, folder, function, request):
    """Each input's ``probs`` equal the text-classification pipeline's on the text alone (sigmoid
    for a multi-label or one-label config, softmax otherwise) within ``TOLERANCE``; its label is
    the likeliest, ``num_classes`` the labels' count; vLLM's shape, at both paths."""
    path = request.getfixturevalue(folder)
    r = post(server, {"model": model, "input": TEXTS}, "/classify" if model == "one" else "/v1/classify")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == model and body["id"].startswith("classify-")
    labels = AutoModelForSequenceClassification.from_pretrained(path).config.id2label
    for i, (text, item) in enumerate(zip(TEXTS, body["data"])):
        want = reference(path, text, function)
        assert item["index"] == i and item["num_classes"] == len(want) == len(labels)
        assert np.abs(np.array(item["probs"]) - want).max() < TOLERANCE
        assert item["label"] == labels[int(np.argmax(want))]
    tok = AutoTokenizer.from_pretrained(path)
    tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def test_raw_logits_token_ids_and_the_first_classifier_by_default(server, tiny_moderation):
    """``use_activation: false`` answers the model's logits; token ids are read as given (the
    tokenizer's own ids of a text classify as the text); without a model, the first classifier
    of tiers.yaml serves."""
    tok = AutoTokenizer.from_pretrained(tiny_moderation)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_moderation).eval()
    ids = tok(TEXTS[1])["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    raw = post(server, {"model": "multi", "input": TEXTS[1], "use_activation": False}).json()["data"][0]
    assert np.abs(np.array(raw["probs"]) - logits).max() < TOLERANCE
    by_ids = post(server, {"model": "multi", "input": ids}).json()
    by_text = post(server, {"input": TEXTS[1]}).json()
    assert by_text["model"] == "multi"
    assert np.abs(np.array(by_ids["data"][0]["probs"]) - by_text["data"][0]["probs"]).max() < TOLERANCE
    assert np.abs(np.array(by_text["data"][0]["probs"]) - 1 / (1 + np.exp(-logits))).max() < TOLERANCE


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_long_input_is_refused_or_cut_as_asked(server, tiny_moderation, side):
    """One distribution per input, so no pieces: over the context a 400 naming ``input``; with
    ``truncate_prompt_tokens`` the first (right) or last (left) tokens, special tokens kept,
    classify as those tokens do."""
    refused = post(server, {"model": "multi", "input": LONG})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    tok = AutoTokenizer.from_pretrained(tiny_moderation)
    tok.truncation_side = side
    kept = tok(LONG, truncation=True, max_length=40)["input_ids"]
    assert len(kept) == 40 and kept[0] == tok.cls_token_id and kept[-1] == tok.sep_token_id
    cut = post(server, {"model": "multi", "input": LONG, "truncate_prompt_tokens": 40, "truncation_side": side})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 40
    alone = post(server, {"model": "multi", "input": kept}).json()["data"][0]["probs"]
    assert np.abs(np.array(cut.json()["data"][0]["probs"]) - alone).max() < TOLERANCE
    whole = post(server, {"model": "multi", "input": LONG, "truncate_prompt_tokens": -1})
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 128


def test_truncate_below_the_special_tokens_keeps_that_many_of_them(server, tiny_moderation):
    """``truncate_prompt_tokens: 1`` on BERT, whose [CLS] and [SEP] are 2 tokens, classifies
    [CLS] alone (right) or [SEP] alone (left), as vLLM cuts it: for a short text and a long one,
    never the whole text nor a 400 on ``input``."""
    tok = AutoTokenizer.from_pretrained(tiny_moderation)
    for text in (TEXTS[1], LONG):
        for side, kept in (("right", tok.cls_token_id), ("left", tok.sep_token_id)):
            cut = post(server, {"model": "multi", "input": text, "truncate_prompt_tokens": 1, "truncation_side": side})
            assert cut.status_code == 200, cut.text
            assert cut.json()["usage"]["prompt_tokens"] == 1
            alone = post(server, {"model": "multi", "input": [kept]}).json()["data"][0]["probs"]
            assert np.abs(np.array(cut.json()["data"][0]["probs"]) - alone).max() < TOLERANCE


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [10**6]}, 400, "input"),  # outside the vocabulary
    ({"input": ["a"] * 5}, 400, "input"),  # moderation_max_inputs: 4
    ({"input": [LONG, LONG]}, 400, "input"),  # moderation_max_tokens: 600 (each cut to 128 would fit)
    ({"input": "hi", "model": "nope"}, 404, "model"),
    ({"input": "hi", "model": "tiny-embed"}, 400, "model"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 129}, 400, "truncate_prompt_tokens"),
    ({"input": "hi", "truncation_side": "middle"}, 400, "truncation_side"),
    ({"input": "hi", "use_activation": "no"}, 400, "use_activation"),
    ({"input": "hi", "top_k": 3}, 400, "top_k"),
])
def test_bad_requests_name_their_field(server, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str) and err["param"] == param


def test_a_batch_line_runs_through_the_batch_api(server):
    """Lines with and without a model (the first classifier's shape), and a bad one."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0)
    lines = [{"custom_id": "named", "method": "POST", "url": "/v1/classify",
              "body": {"model": "single", "input": TEXTS}},
             {"custom_id": "default", "method": "POST", "url": "/v1/classify", "body": {"input": TEXTS[0]}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/classify", "body": {"input": ""}}]
    batch = run_batch(c, "/v1/classify", lines)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 1)
    out = {x["custom_id"]: x["response"]["body"]
           for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())}
    live = post(server, {"model": "single", "input": TEXTS}).json()["data"]
    assert [d["label"] for d in out["named"]["data"]] == [d["label"] for d in live]
    assert np.abs(np.array([d["probs"] for d in out["named"]["data"]]) - [d["probs"] for d in live]).max() < TOLERANCE
    assert out["default"]["model"] == "multi"
    errors = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["param"]) for e in errors] == [("bad", "input")]
