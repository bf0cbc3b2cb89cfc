"""/v1/rerank and /v1/score (vLLM's shapes, Jina's and Cohere's paths) on a real server: a
cross-encoder's scores checked against the model run by plain transformers, long documents,
``max_tokens_per_doc``, an embedding model's cosine, and the 400s."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.helpers import run_batch, start_server, write_config

QUERY = "which tier comes first?"
DOCS = ["Paid requests come first, then subscribers.", "The quick brown fox jumps over the lazy dog.",
        "Batch work waits for idle time.", "One, two, three, four, five."]


@pytest.fixture(scope="module")
def server(tiny_rerank, tiny_embed, tiny_chat, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank")
    cfg = write_config(folder, {"tiny-rerank": ("rerank", tiny_rerank), "tiny-embed": ("embed", tiny_embed),
                                "tiny-chat": ("chat", tiny_chat)},
                       "limits:\n  rerank_max_documents: 8\n  rerank_max_tokens: 4000\n")
    running = start_server(cfg)
    yield running
    running.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['paid']}"})


def reference(folder, pairs: list[tuple[str, str]] | None = None, encoded: list[dict] | None = None) -> np.ndarray:
    """The cross-encoder's logits by plain transformers: each pair encoded as the tokenizer pairs
    texts (or each input of ``encoded``), one forward pass each (no padding), as
    sentence-transformers' CrossEncoder runs it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    inputs = encoded or [tok(a, b, return_token_type_ids=True) for a, b in pairs]
    with torch.no_grad():
        return np.array([model(input_ids=torch.tensor([e["input_ids"]]),
                               token_type_ids=torch.tensor([e["token_type_ids"]])).logits[0, 0].item() for e in inputs])


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_rerank_orders_documents_by_the_cross_encoders_scores(server, tiny_rerank):
    """Each relevance score is the model's sigmoid of its logit for (query, document) within
    1e-5 (padded shared passes against one pass per pair), best first; ``top_n``,
    ``return_documents`` and Cohere's ``{"text": ...}`` documents; the three paths answer alike."""
    want = sigmoid(reference(tiny_rerank, [(QUERY, d) for d in DOCS]))
    assert want.max() - want.min() > 0.05  # the model tells them apart: the order below means something
    r = post(server, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert [x["index"] for x in body["results"]] == list(np.argsort(-want))
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in body["results"])
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "tiny-rerank" and body["id"].startswith("rerank-")
    for path in ("/rerank", "/v2/rerank"):
        top = post(server, path, {"model": "tiny-rerank", "query": QUERY, "top_n": 2, "return_documents": False,
                                  "documents": [{"text": d} for d in DOCS]}).json()["results"]
        assert [x["index"] for x in top] == list(np.argsort(-want)[:2]) and all("document" not in x for x in top)
    raw = post(server, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS,
                                      "use_activation": False}).json()["results"]
    logits = reference(tiny_rerank, [(QUERY, d) for d in DOCS])
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(raw, key=lambda x: x["index"])], logits, atol=1e-4)


def test_coheres_clients_rerank_through_v1_and_v2(server):
    """Cohere's SDK pointed at the server (its v2 client calls /v2/rerank, its v1 client
    /v1/rerank, with ``return_documents``): the same order and scores as the plain request."""
    import cohere

    want = post(server, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": DOCS, "top_n": 3}).json()
    v2 = cohere.ClientV2(api_key=server.keys["paid"], base_url=server.url, timeout=60).rerank(
        model="tiny-rerank", query=QUERY, documents=DOCS, top_n=3)
    v1 = cohere.Client(api_key=server.keys["paid"], base_url=server.url, timeout=60).rerank(
        model="tiny-rerank", query=QUERY, documents=DOCS, top_n=3, return_documents=True)
    for got in (v2, v1):
        assert [(r.index, round(r.relevance_score, 6)) for r in got.results] == [
            (r["index"], round(r["relevance_score"], 6)) for r in want["results"]]
    assert [r.document.text for r in v1.results] == [DOCS[r["index"]] for r in want["results"]]


def test_a_long_document_is_scored_in_pieces_and_max_tokens_per_doc_cuts_it(server, tiny_rerank):
    """A document over the model's 128 tokens is scored, not refused: its score is its best
    piece's (the pieces the tokenizer's overflow makes beside the query, neighbours overlapping
    by a quarter of the document's room, each run alone by the reference), here not its first
    piece's; with ``max_tokens_per_doc`` it is the reference on its first so many tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_rerank)
    long = " ".join(DOCS[1:] * 12 + [DOCS[0]])
    room = 128 - len(tok(QUERY, add_special_tokens=False)["input_ids"]) - tok.num_special_tokens_to_add(pair=True)
    enc = tok(QUERY, long, truncation="only_second", max_length=128, stride=room // 4, return_overflowing_tokens=True,
              return_token_type_ids=True)
    each = sigmoid(reference(tiny_rerank, encoded=[{"input_ids": ids, "token_type_ids": types} for ids, types in
                                                   zip(enc["input_ids"], enc["token_type_ids"])]))
    assert len(each) > 2 and each.argmax() > 0, each  # the best is a later piece
    r = post(server, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": [long, DOCS[0]]})
    assert r.status_code == 200, r.text
    scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert math.isclose(scores[0], each.max(), abs_tol=1e-5)
    assert r.json()["usage"]["total_tokens"] > 128 * 2  # every piece counted
    words = tok(long, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cut = post(server, "/v1/rerank", {"model": "tiny-rerank", "query": QUERY, "documents": [long],
                                      "max_tokens_per_doc": 6}).json()["results"][0]["relevance_score"]
    assert math.isclose(cut, sigmoid(reference(tiny_rerank, [(QUERY, long[: words[5][1]])]))[0], abs_tol=1e-5)


def test_score_pairs_one_against_many_and_pairwise(server, tiny_rerank):
    one = post(server, "/v1/score", {"model": "tiny-rerank", "text_1": QUERY, "text_2": DOCS})
    assert one.status_code == 200, one.text
    data = one.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCS))) and {d["object"] for d in data} == {"score"}
    np.testing.assert_allclose([d["score"] for d in data], sigmoid(reference(tiny_rerank, [(QUERY, d) for d in DOCS])),
                               atol=1e-5)
    firsts = ["a question", "another one"]
    pairwise = post(server, "/score", {"model": "tiny-rerank", "queries": firsts, "documents": DOCS[:2]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               sigmoid(reference(tiny_rerank, list(zip(firsts, DOCS[:2])))), atol=1e-5)


def test_an_embedding_model_scores_by_cosine_similarity(server):
    """On ``kind: embed`` both endpoints score by the cosine of the texts' embeddings, as vLLM
    does: the same figures as /v1/embeddings' vectors give."""
    embedded = post(server, "/v1/embeddings", {"model": "tiny-embed", "input": [QUERY, *DOCS]}).json()["data"]
    vectors = np.array([e["embedding"] for e in embedded])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    want = unit[1:] @ unit[0]
    r = post(server, "/v1/rerank", {"model": "tiny-embed", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
    scored = post(server, "/v1/score", {"model": "tiny-embed", "data_1": QUERY, "data_2": DOCS}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in scored], want, atol=1e-5)
    from transformers import AutoTokenizer  # max_tokens_per_doc: each document's embedding of its first 4 tokens

    tok = AutoTokenizer.from_pretrained(server.services.arbiter.specs["tiny-embed"].path)
    cut = [tok(d, truncation=True, max_length=4)["input_ids"] for d in DOCS]
    short = np.array([e["embedding"] for e in post(server, "/v1/embeddings", {"model": "tiny-embed", "input": cut})
                      .json()["data"]])
    want = (short / np.linalg.norm(short, axis=1, keepdims=True)) @ unit[0]
    r = post(server, "/v1/rerank", {"model": "tiny-embed", "query": QUERY, "documents": DOCS, "max_tokens_per_doc": 4})
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)


def test_batch_lines_rerank_and_score_as_live_requests_do(server):
    """The Batch API takes both endpoints (as vLLM's batch runner does): each line's answer has the
    live request's scores; a bad line fails alone, naming its field."""
    c = openai.OpenAI(base_url=server.base_url, api_key=server.keys["paid"], max_retries=0, timeout=60)
    rerank = {"model": "tiny-rerank", "query": QUERY, "documents": DOCS}
    score = {"model": "tiny-rerank", "queries": QUERY, "items": DOCS[:2]}
    for endpoint, body, bad in (("/v1/rerank", rerank, {**rerank, "documents": []}),
                                ("/v1/score", score, {"model": "tiny-rerank", "text_1": QUERY})):
        lines = [{"custom_id": "good", "method": "POST", "url": endpoint, "body": body},
                 {"custom_id": "bad", "method": "POST", "url": endpoint, "body": bad}]
        batch = run_batch(c, endpoint, lines)
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 1, 1)
        (line,) = map(json.loads, c.files.content(batch.output_file_id).text.splitlines())
        live = post(server, endpoint, body).json()
        key, value = ("results", "relevance_score") if endpoint == "/v1/rerank" else ("data", "score")
        got = line["response"]["body"][key]
        assert [x["index"] for x in got] == [x["index"] for x in live[key]]  # padded with other rows or not: 1e-6
        np.testing.assert_allclose([x[value] for x in got], [x[value] for x in live[key]], atol=1e-6)
        (error,) = map(json.loads, c.files.content(batch.error_file_id).text.splitlines())
        assert error["response"]["body"]["error"]["param"] == ("documents" if endpoint == "/v1/rerank" else "text_2")


def test_a_classifier_with_several_labels_is_not_taken_for_a_reranker(tiny_moderation, tmp_path, capsys, monkeypatch):
    """A sequence classifier of many labels listed as ``kind: rerank``: ``tiergate check`` names
    it (exit 1) before any request, and a request to it is a clean 503 saying why."""
    from gateway.cli import main

    monkeypatch.delenv("TEST_KEYS_PAID_FILE", raising=False)
    cfg = write_config(tmp_path, {"wrong": ("rerank", tiny_moderation)})
    assert main(["check", "--config", str(cfg)]) == 1
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("wrong"))
    assert "a reranker scores with one label; this config has 13" in row
    running = start_server(cfg)
    try:
        r = post(running, "/v1/rerank", {"model": "wrong", "query": QUERY, "documents": DOCS})
        assert r.status_code == 503 and "one label" in r.json()["error"]["message"], r.text
    finally:
        running.stop()


@pytest.mark.parametrize("path,extra,status,param", [
    ("/v1/rerank", {"documents": []}, 400, "documents"),
    ("/v1/rerank", {"documents": ["ok", " "]}, 400, "documents[1]"),
    ("/v1/rerank", {"documents": " "}, 400, "documents"),
    ("/v1/rerank", {"query": ""}, 400, "query"),
    ("/v1/rerank", {"query": "why " * 120}, 400, "query"),  # no room left for a document
    ("/v1/rerank", {"model": "tiny-embed", "query": "why " * 200}, 400, "query"),  # over the encoder's context
    ("/v1/rerank", {"documents": ["d"] * 9}, 400, "documents"),  # rerank_max_documents: 8
    ("/v1/rerank", {"documents": ["word " * 3000]}, 400, "documents"),  # rerank_max_tokens: 4000
    ("/v1/rerank", {"model": "tiny-chat"}, 400, "model"),
    ("/v1/rerank", {"model": "nope"}, 404, "model"),
    ("/v1/rerank", {"top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"max_tokens_per_doc": -1}, 400, "max_tokens_per_doc"),
    ("/v1/rerank", {"documents": [{"txt": "x"}]}, 400, "documents"),
    ("/v1/rerank", {"rank_fields": ["x"]}, 400, "rank_fields"),
    ("/v1/score", {"query": None, "documents": None, "text_2": ["a"]}, 400, "text_1"),
    ("/v1/score", {"query": None, "documents": None, "text_1": "a", "queries": "b", "text_2": "c"}, 400, "text_1"),
    ("/v1/score", {"query": None, "documents": None, "text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_1"),
    ("/v1/score", {"query": None, "documents": None, "text_1": "a", "text_2": []}, 400, "text_2"),
    ("/v1/score", {"query": None, "documents": None, "text_1": ["a", ""], "text_2": ["b", "c"]}, 400, "text_1[1]"),
    ("/v1/score", {"query": None, "documents": None, "model": "tiny-embed", "data_1": "a", "data_2": ["b", "c " * 300]},
     400, "data_2"),  # an embedding model does not read a text in pieces
    ("/v1/score", {"query": None, "documents": None, "model": "tiny-embed", "data_1": ["a " * 300], "data_2": "b"},
     400, "data_1"),
])
def test_bad_requests_are_clean_errors_naming_the_field(server, path, extra, status, param):
    body = {"model": "tiny-rerank", "query": QUERY, "documents": DOCS, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and isinstance(err["code"], str) and err["message"]


def test_concurrent_reranks_share_forward_passes(tiny_rerank):
    """Requests that arrive while a pass runs share the next one (``workers.embed.EncoderWorker``,
    as embeddings do): eight at once, the first held in its pass until the other seven wait,
    take two passes, not eight, and each gets the scores it gets alone (within 1e-5)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from workers.base import ModelSpec, StepContext
    from workers.rerank import RerankWorker

    worker = RerankWorker(ModelSpec("r", "rerank", tiny_rerank))
    worker.load(torch.device("cpu"))
    requests = [worker.tokenize(f"question {i}", DOCS[: 1 + i % 4]) for i in range(8)]
    alone = [worker.score(pieces, StepContext()) for pieces in requests]
    held, release = threading.Event(), threading.Event()

    def hold(module, args):
        held.set()
        release.wait(10)

    hook = worker.model.register_forward_pre_hook(hold)
    before = worker.passes
    try:
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(worker.score, requests[0], StepContext())
            assert held.wait(10)  # the first request's pass is running
            rest = [pool.submit(worker.score, pieces, StepContext()) for pieces in requests[1:]]
            deadline = time.time() + 10
            while len(worker.shared.interactive.queued()) < 7 and time.time() < deadline:
                time.sleep(0.01)
            release.set()
            got = [first.result(), *[f.result() for f in rest]]
    finally:
        hook.remove()
    assert worker.passes - before == 2
    for a, g in zip(alone, got):
        np.testing.assert_allclose(g, a, atol=1e-5)
