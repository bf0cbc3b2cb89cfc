"""Moderations against a real uvicorn serving tiny-moderation (a random-weight BERT classifier over
OpenAI's categories): the openai SDK with and without a model, strings, lists and content parts,
the configured threshold, bad input naming its field, a Batch API line; and the worker's scores
against transformers' own text-classification pipeline, long texts scored in pieces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

from demo.moderation import CATEGORIES
from tests.helpers import run_batch, RunningServer, start_server, write_config
from workers.base import ModelSpec, StepContext
from workers.moderation import ModerationWorker, pieces

# A text alone and padded among longer ones differs only by the padded attention's fp32 rounding.
TOLERANCE = 1e-5
TEXTS = ["I will find you.", "What a lovely day for a walk in the park with the dog.", "hello"]


@pytest.fixture(scope="module")
def server(tiny_moderation: Path, tiny_softmax: Path, tiny_embed: Path, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("moderation-server")
    models = {"tiny-moderation": ("moderation", tiny_moderation), "tiny-moderation-softmax": ("moderation", tiny_softmax),
              "tiny-embed": ("embed", tiny_embed)}
    config = write_config(folder, models, "limits:\n  moderation_max_inputs: 4\n  moderation_max_tokens: 400\n")
    text = config.read_text().replace("    path: " + str(tiny_softmax), "    path: " + str(tiny_softmax) + "\n    threshold: 0.1")
    config.write_text(text)
    running = start_server(config)
    yield running
    running.stop()


def client(server: RunningServer, tier: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def post(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/moderations", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})


def reference(folder: Path, text: str, function: str) -> dict[str, float]:
    """transformers' own pipeline: every category's score for ``text``."""
    pipe = pipeline("text-classification", model=str(folder), top_k=None, function_to_apply=function, device="cpu")
    return {row["label"]: row["score"] for row in pipe([text])[0]}


def scores(result) -> np.ndarray:
    return np.array([result.category_scores.model_dump(by_alias=True)[c] for c in CATEGORIES])


# -- the worker ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, width, expected", [
    (5, 8, [(0, 5)]), (8, 8, [(0, 8)]),
    (9, 8, [(0, 8), (6, 9)]),  # the next piece starts a quarter of a piece before the last one ends
    (20, 8, [(0, 8), (6, 14), (12, 20)]),
    (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
])
def test_long_texts_are_cut_into_overlapping_pieces(n, width, expected):
    ids = list(range(n))
    assert pieces(ids, width) == [ids[a:b] for a, b in expected]


@pytest.mark.parametrize("folder, function", [("tiny_moderation", "sigmoid"), ("tiny_softmax", "softmax")])
def test_scores_are_transformers_pipelines(folder, function, request):
    """Each text's scores, several texts in one padded pass, equal transformers' text-
    classification pipeline on the text alone (sigmoid for a multi-label config, softmax for any
    other), within ``TOLERANCE``; a softmax's scores sum to 1."""
    path = request.getfixturevalue(folder)
    worker = ModerationWorker(ModelSpec("m", "moderation", path))
    assert worker.categories == CATEGORIES and worker.multi_label == (function == "sigmoid")
    worker.load(torch.device("cpu"))
    got = worker.classify(worker.tokenize(TEXTS), StepContext())
    for text, row in zip(TEXTS, got):
        want = reference(path, text, function)
        assert np.abs(row - np.array([want[c] for c in CATEGORIES])).max() < TOLERANCE
    if function == "softmax":
        assert np.allclose(got.sum(axis=1), 1.0, atol=1e-5)


def test_a_long_text_is_scored_in_full(tiny_moderation):
    """A text of ~3 pieces: each category's score is the highest over its pieces, each piece
    scored as the model scores it alone ([CLS] piece [SEP]); the text's end is in a piece."""
    worker = ModerationWorker(ModelSpec("m", "moderation", tiny_moderation))
    worker.load(torch.device("cpu"))
    text = " ".join(f"word{i} the dog ran over the hill" for i in range(60)) + " finally the end"
    (cut,) = worker.tokenize([text])
    tok = AutoTokenizer.from_pretrained(tiny_moderation)
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert len(cut) >= 3 and all(len(p) <= 128 for p in cut)
    assert all(p[0] == tok.cls_token_id and p[-1] == tok.sep_token_id for p in cut)
    assert cut[0][1:-1] == plain[: len(cut[0]) - 2] and cut[-1][1:-1] == plain[-(len(cut[-1]) - 2):]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_moderation).eval()
    with torch.no_grad():
        each = [torch.sigmoid(model(input_ids=torch.tensor([p])).logits[0]).numpy() for p in cut]
    ctx = StepContext()
    got = worker.classify([cut], ctx)[0]
    assert np.abs(got - np.max(each, axis=0)).max() < TOLERANCE
    assert not np.allclose(got, each[0])  # the later pieces count
    assert ctx.steps == 1  # all the pieces in one forward pass


def test_concurrent_texts_share_passes_and_score_as_alone(tiny_moderation):
    """Moderation runs on the encoders' shared passes (``EncoderWorker.run_rows``, whose sharing
    tests/test_embeddings.py pins down): eight requests at once, long texts' pieces among them,
    score as each does alone."""
    from concurrent.futures import ThreadPoolExecutor

    worker = ModerationWorker(ModelSpec("m", "moderation", tiny_moderation))
    worker.load(torch.device("cpu"))
    texts = [TEXTS[i % 3] * (1 + 40 * (i % 2)) for i in range(8)]  # every other one in several pieces
    cut = [worker.tokenize([t]) for t in texts]
    alone = [worker.classify(c, StepContext()) for c in cut]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: worker.classify(c, StepContext()), cut))
    for a, g in zip(alone, got):
        assert np.abs(a - g).max() < TOLERANCE


# -- over HTTP ----------------------------------------------------------------------------------------


def test_the_sdk_moderates_with_the_first_model_when_none_is_named(server):
    c = client(server)
    got = c.moderations.create(input=TEXTS[0])
    assert got.id.startswith("modr-") and got.model == "tiny-moderation" and len(got.results) == 1
    (result,) = got.results
    flags = result.categories.model_dump(by_alias=True)
    assert list(flags) == CATEGORIES
    want = reference(server.services.arbiter.specs["tiny-moderation"].path, TEXTS[0], "sigmoid")
    assert np.abs(scores(result) - np.array([want[c] for c in CATEGORIES])).max() < TOLERANCE
    assert flags == {c: want[c] >= 0.5 for c in CATEGORIES}  # the default threshold
    assert result.flagged == any(flags.values()) and 0 < sum(flags.values()) < len(CATEGORIES)
    assert result.category_applied_input_types.model_dump(by_alias=True) == {c: ["text"] for c in CATEGORIES}
    named = c.moderations.create(model="tiny-moderation", input=TEXTS[0]).results[0]
    assert np.array_equal(scores(named), scores(result))


def test_a_list_is_one_result_per_text_and_parts_are_one(server):
    c = client(server)
    alone = [scores(c.moderations.create(input=t).results[0]) for t in TEXTS]
    together = c.moderations.create(input=TEXTS).results
    assert len(together) == 3
    for a, b in zip(alone, together):
        assert np.abs(a - scores(b)).max() < TOLERANCE
    parts = c.moderations.create(input=[{"type": "text", "text": "I will"}, {"type": "text", "text": "find you."}])
    joined = c.moderations.create(input="I will\nfind you.")
    assert len(parts.results) == 1 and np.abs(scores(parts.results[0]) - scores(joined.results[0])).max() < TOLERANCE


def test_the_models_threshold_is_the_configs(server):
    """tiny-moderation-softmax flags at 0.1 (tiers.yaml): a category is flagged exactly when its
    score is 0.1 or more (some are between 0.1 and the default 0.5 here)."""
    result = client(server).moderations.create(model="tiny-moderation-softmax", input=TEXTS[1]).results[0]
    values, flags = scores(result), result.categories.model_dump(by_alias=True)
    assert abs(values.sum() - 1) < 1e-5 and ((values >= 0.1) & (values < 0.5)).any()
    assert [flags[c] for c in CATEGORIES] == [bool(v >= 0.1) for v in values]
    assert result.flagged == bool((values >= 0.1).any())


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": ""}, 400, "input", "invalid_value"),
    ({"input": []}, 400, "input", "invalid_value"),
    ({"input": ["ok", "  "]}, 400, "input", "invalid_value"),
    ({"input": ["a", "b", "c", "d", "e"]}, 400, "input", "too_many_inputs"),
    ({"input": "the dog ran " * 150}, 400, "input", "too_many_tokens"),  # ~450 tokens, in pieces
    ({"input": ["x" * 6400, "y" * 6401]}, 400, "input", "too_many_tokens"),  # refused unread: 32 chars a token
    ({"input": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
     400, "input[1]", "image_not_supported"),
    ({"input": [{"type": "audio", "text": "hi"}]}, 400, "input", "invalid_value"),
    ({"input": [{"type": "text"}]}, 400, "input[0].text", "missing_required_parameter"),
    ({"input": 5}, 400, "input", "invalid_type"),
    ({}, 400, "input", "missing_required_parameter"),
    ({"input": "hi", "model": "nope"}, 404, "model", "model_not_found"),
    ({"input": "hi", "model": "tiny-embed"}, 400, "model", "model_not_supported"),
    ({"input": "hi", "bogus": 1}, 400, "bogus", "unknown_parameter"),
])
def test_bad_requests_name_their_field(server, body, status, param, code):
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str)
    assert (err["param"], err["code"]) == (param, code), err


def test_a_folder_that_is_not_a_classifier_is_a_503_before_any_slot(tiny_moderation, tmp_path):
    """A moderation entry whose folder has weights but no config: the request is answered 503
    ``model_unavailable`` when its folder is read (before it takes a slot), and the server goes on."""
    folder = tmp_path / "broken"
    folder.mkdir()
    shutil.copy(tiny_moderation / "model.safetensors", folder / "model.safetensors")
    running = start_server(write_config(tmp_path, {"broken": ("moderation", folder),
                                                   "tiny-moderation": ("moderation", tiny_moderation)}))
    try:
        for _ in range(2):  # not cached: asked again, read again
            r = post(running, {"model": "broken", "input": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
            assert "'broken' cannot be used" in r.json()["error"]["message"]
        assert post(running, {"model": "tiny-moderation", "input": "hi"}).status_code == 200
        assert running.services.gate.admitted["paid"] == 1  # the refused ones never took a slot
    finally:
        running.stop()


def test_without_a_moderation_model_it_is_a_404(tiny_embed, tmp_path):
    running = start_server(write_config(tmp_path, {"tiny-embed": ("embed", tiny_embed)}))
    try:
        r = httpx.post(f"{running.base_url}/moderations", json={"input": "hi"},
                       headers={"Authorization": f"Bearer {running.keys['paid']}"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        assert "no moderation model" in r.json()["error"]["message"]
    finally:
        running.stop()


def test_a_batch_line_runs_through_the_batch_api(server):
    """Lines with and without a model (the first moderation model's shape), and a bad one."""
    c = client(server)
    lines = [{"custom_id": "named", "method": "POST", "url": "/v1/moderations",
              "body": {"model": "tiny-moderation", "input": TEXTS[0]}},
             {"custom_id": "default", "method": "POST", "url": "/v1/moderations", "body": {"input": TEXTS[:2]}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/moderations", "body": {"input": ""}}]
    batch = run_batch(c, "/v1/moderations", lines)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 1)
    out = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, c.files.content(batch.output_file_id).text.splitlines())}
    live = [scores(r) for r in c.moderations.create(input=TEXTS[:2]).results]
    assert out["named"]["model"] == out["default"]["model"] == "tiny-moderation"
    assert np.abs(np.array([out["named"]["results"][0]["category_scores"][k] for k in CATEGORIES]) - live[0]).max() < TOLERANCE
    assert [len(out[k]["results"]) for k in ("named", "default")] == [1, 2]
    errors = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["param"]) for e in errors] == [("bad", "input")]
    from batch.shapes import shape_of

    assert shape_of(server.services, "/v1/moderations", {"input": "x"}) == "tiny-moderation"  # the one that runs it
