"""Operating tiergate, on a real ``tiergate serve`` process: one JSON log line per request with
no secret in it and the request's id echoed; ``/readyz``; and SIGTERM draining: a stream in flight
completes (a request on any path, a Realtime reply under way too), a new request gets 503
``shutting_down``, batch lines in flight go back to the store, and the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import websockets

from gateway.auth import key_id
from gateway.request_log import Formatter, valid_request_id
from tests.helpers import TIERS, spare_port, write_config

KEYS = {t: f"sk-{t}-{os.urandom(8).hex()}" for t in TIERS}  # the secrets that must never be logged
ROOT = Path(__file__).resolve().parents[1]
REQUEST_FIELDS = {"request_id", "method", "endpoint", "status", "reason", "key_id", "tier", "model",
                  "queue_wait_s", "load_wait_s", "service_s", "prompt_tokens", "completion_tokens", "duration_s"}


class Served:
    """``tiergate serve --log-format json`` in a subprocess, its output in a file."""

    def __init__(self, config: Path, *args: str, verify: str | bool = True, env: dict[str, str] | None = None) -> None:
        self.port = spare_port()
        self.url = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{self.port}"
        self.log_path = config.parent / "serve.log"
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TEST_KEYS_", "TIERGATE_KEYS_"))}
        env.update({f"TEST_KEYS_{t.upper()}": k for t, k in KEYS.items()}, PYTHONPATH=str(ROOT))  # this checkout's code
        env.update(extra)
        tiergate = Path(sys.executable).with_name("tiergate")
        command = [str(tiergate)] if tiergate.exists() else [sys.executable, "-m", "gateway.cli"]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [*command, "serve", "--config", str(config), "--port", str(self.port), "--log-format", "json", *args],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None and time.time() < deadline, self.output()
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1, verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def client(self, tier: str = "paid") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tier], max_retries=0)

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def lines(self) -> list[dict]:
        """Every line of output, each parsed as JSON (fails on one that is not)."""
        out = []
        for n, line in enumerate(self.output().splitlines()):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"log line {n} is not JSON: {line!r}")
        return out

    def requests(self) -> dict[str, dict]:
        return {ln["request_id"]: ln for ln in self.lines() if ln["logger"] == "tiergate.requests"}


def assert_no_secret(text: str) -> None:
    for tier, key in KEYS.items():
        assert key not in text, f"the {tier} key is in the log"


@pytest.fixture
def served(tiny_chat, tiny_embed, tmp_path):
    server = Served(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_embed)}))
    yield server
    server.stop()


def test_one_json_line_per_request_with_its_id_and_no_secret(served):
    client = served.client()
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, extra_headers={"x-request-id": "ops-plain-1"})
    assert raw.headers["x-request-id"] == "ops-plain-1"
    assert raw.parse().usage.completion_tokens == 4
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEYS['free']}", "x-request-id": "ops-stream-2"},
                      json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 3, "stream": True, "temperature": 0}) as sse:  # greedy: no early EOS
        assert sse.headers["x-request-id"] == "ops-stream-2"
        assert sse.read().decode().rstrip().endswith("data: [DONE]")
    bad = "not valid\tid" + "x" * 200
    r = httpx.get(f"{served.url}/v1/models", headers={"authorization": "Bearer wrong-key", "x-request-id": bad})
    assert r.status_code == 401 and r.headers["x-request-id"].startswith("req_")
    made = r.headers["x-request-id"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-request-id": "ops-missing-3"})
    assert missing.value.response.headers["x-request-id"] == "ops-missing-3"
    embedded = client.embeddings.create(model="tiny-embed", input=["one two three", "four"],
                                        extra_headers={"x-request-id": "ops-embed-4"})
    assert served.stop() == 0

    assert_no_secret(served.output())
    logged = served.requests()  # every line parsed as JSON
    plain, stream = logged["ops-plain-1"], logged["ops-stream-2"]
    assert REQUEST_FIELDS <= set(plain)
    assert plain | {"duration_s": 0, "service_s": 0, "load_wait_s": 0, "queue_wait_s": 0} == plain | {
        "request_id": "ops-plain-1", "method": "POST", "endpoint": "/v1/chat/completions", "status": 200,
        "reason": None, "key_id": key_id(KEYS["paid"]), "tier": "paid", "model": "tiny-chat",
        "prompt_tokens": plain["prompt_tokens"], "completion_tokens": 4,
        "duration_s": 0, "service_s": 0, "load_wait_s": 0, "queue_wait_s": 0}
    assert plain["prompt_tokens"] > 0
    assert 0 < plain["service_s"] <= plain["duration_s"] and plain["queue_wait_s"] >= 0 and plain["load_wait_s"] > 0
    assert (stream["tier"], stream["key_id"], stream["status"], stream["completion_tokens"]) == (
        "free", key_id(KEYS["free"]), 200, 3)
    assert stream["load_wait_s"] < plain["load_wait_s"]  # the model was resident by then
    assert (logged[made]["status"], logged[made]["reason"], logged[made]["key_id"]) == (401, "invalid_api_key", None)
    missing_line = logged["ops-missing-3"]
    assert (missing_line["status"], missing_line["reason"], missing_line["tier"]) == (404, "model_not_found", "paid")
    assert bad not in served.output()
    embed_line = logged["ops-embed-4"]
    assert (embed_line["model"], embed_line["prompt_tokens"], embed_line["completion_tokens"]) == (
        "tiny-embed", embedded.usage.prompt_tokens, None)
    # the garbage collector's freezes (gateway/collector.py): at startup, then after the first load of each worker class
    freezes = [ln["message"] for ln in served.lines() if ln["logger"] == "tiergate.collector"]
    assert [m.rsplit("(", 1)[1] for m in freezes] == ["startup)", "first load of ChatWorker)", "first load of EmbedWorker)"]


def test_key_files_are_read_at_start_again_when_they_change_and_at_once_on_sighup(tiny_chat, tmp_path):
    """``TEST_KEYS_PAID_FILE`` beside ``TEST_KEYS_PAID``: both keys serve; the file replaced (a new
    file renamed over it, as a secret's update is) is read within a few seconds, the key taken out
    refused from then on; the file changed in place and SIGHUP sent is read at once, and the
    server goes on serving. The log names each reload's cause and holds no key."""
    keys = tmp_path / "paid-keys"
    keys.write_text("sk-file-first\n")
    served = Served(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}), env={"TEST_KEYS_PAID_FILE": str(keys)})

    def status(key: str) -> int:
        return httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    def reloads(cause: str) -> int:
        return sum(ln["message"].startswith(f"API keys reloaded ({cause})") for ln in served.lines())

    try:
        assert status("sk-file-first") == 200 and status(KEYS["paid"]) == 200
        fresh = tmp_path / "paid-keys.new"
        fresh.write_text("sk-file-second\n")
        os.replace(fresh, keys)
        deadline = time.monotonic() + 30
        while status("sk-file-second") != 200:
            assert time.monotonic() < deadline, served.output()[-3000:]
            time.sleep(0.2)
        assert status("sk-file-first") == 401 and status(KEYS["paid"]) == 200
        assert reloads("a key file changed") == 1
        keys.write_text("sk-file-third\n")
        served.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while reloads("SIGHUP") < 1:
            assert time.monotonic() < deadline and served.proc.poll() is None, served.output()[-3000:]
            time.sleep(0.1)
        assert status("sk-file-third") == 200 and status("sk-file-second") == 401
        scrape = httpx.get(f"{served.url}/metrics").text
        assert 'tiergate_key_reloads_total{outcome="reloaded"} 2.0' in scrape
    finally:
        assert served.stop() == 0
    output = served.output()
    assert_no_secret(output)
    assert "sk-file" not in output


def test_sigterm_drains_a_stream_refuses_new_work_hands_back_batch_lines_and_exits_0(tiny_chat, tiny_image, tmp_path):
    """SIGTERM during a stream and a background response, with batch lines running: new requests
    are refused, the stream and the background response run to their ends, the batch lines go
    back to the store, the process exits 0. (That a request off ``/v1/`` counts in flight as any:
    ``test_every_route_but_the_probes_and_the_dashboards_stream_counts_in_flight_for_the_drain``;
    a 1,000-document rerank added here delayed the signal until the stream could end first, once
    in a run with three test processes.)"""
    extra = "limits:\n  image_max_steps: 5000\nserver:\n  drain_timeout_s: 40\n"
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image)}, extra)
    served = Served(config)
    try:
        # batch lines that take long, claimed and running before the drain
        line = {"method": "POST", "url": "/v1/images/generations",
                "body": {"model": "tiny-image", "prompt": "slow", "size": "64x64", "num_inference_steps": 4000}}
        content = "".join(json.dumps({"custom_id": f"slow-{i}", **line}) + "\n" for i in range(2)).encode()
        batch_client = served.client("free")
        f = batch_client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = batch_client.batches.create(input_file_id=f.id, endpoint="/v1/images/generations", completion_window="24h")
        store = tmp_path / "tiergate-data" / "batches.sqlite3"
        deadline = time.time() + 30
        while not backlog(store, batch.id) or not any(claimed for claimed, _ in backlog(store, batch.id)):
            assert time.time() < deadline, "no batch line was claimed"
            time.sleep(0.05)

        # a long stream (greedy decoding of the random model runs to max_tokens), SIGTERM during it;
        # 480 of the model's 512 positions, so that a loaded machine's signal -> /readyz -> refusal still lands inside it
        chunks: list[tuple[float, dict]] = []
        first = threading.Event()

        def stream() -> None:
            events = served.client().chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=480, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_headers={"x-request-id": "drain-stream"})
            for chunk in events:
                chunks.append((time.monotonic(), chunk.model_dump()))
                first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30), served.output()
        # and a background response (no connection held for it) taken before the signal
        background = served.client().responses.create(model="tiny-chat", input="hi", max_output_tokens=480,
                                                      temperature=0, background=True)
        served.proc.send_signal(signal.SIGTERM)

        deadline = time.time() + 10
        while (ready := httpx.get(f"{served.url}/readyz", timeout=5)).status_code == 200:
            assert time.time() < deadline, "/readyz never turned 503"
            time.sleep(0.02)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as refused:
            served.client().chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        refused_at = time.monotonic()
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "shutting_down" and refused.value.body["type"] == "server_error"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.response.headers["x-request-id"].startswith("req_")

        reader.join(60)
        assert not reader.is_alive()
        assert served.proc.wait(60) == 0
    finally:
        served.stop()

    # the stream ran to its end after the refusal
    finished = [c for _, c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finished] in (["length"], ["stop"])
    usage = chunks[-1][1]["usage"]
    assert usage and usage["completion_tokens"] >= 1
    assert chunks[-1][0] > refused_at, "the stream had ended before the drain refused a request"
    # the background response ran to its end too, recorded in the store before the process exited
    with sqlite3.connect(store) as db:
        (doc,) = db.execute("SELECT doc FROM responses WHERE id = ?", (background.id,)).fetchone()
    kept = json.loads(doc)["response"]
    assert kept["status"] in ("completed", "incomplete") and kept["usage"]["output_tokens"] >= 1, kept
    # batch lines: back in the store, unclaimed, their hand-out not counted, nothing recorded
    rows = backlog(store, batch.id)
    assert len(rows) == 2 and rows == [(None, 0), (None, 0)]
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT count(*) FROM outcomes WHERE batch_id = ?", (batch.id,)).fetchone() == (0,)
        assert db.execute("SELECT status FROM batches WHERE id = ?", (batch.id,)).fetchone() == ("in_progress",)
    # the log: JSON lines, the drain's progress, the stream's line, no secret
    lines = served.lines()
    messages = [ln["message"] for ln in lines if ln["logger"] == "tiergate.drain"]
    assert any(m.startswith("draining: no new requests; 2 requests (1 streaming) in flight") for m in messages), messages
    assert any("batch line" in m and "handed back to the store" in m and not m.startswith("draining: 0 ") for m in messages)
    assert messages[-1] == "drained: nothing in flight"
    logged = {ln["request_id"]: ln for ln in lines if ln["logger"] == "tiergate.requests"}
    assert (logged["drain-stream"]["status"], logged["drain-stream"]["completion_tokens"]) == (200, usage["completion_tokens"])
    assert any(ln["status"] == 503 and ln["reason"] == "shutting_down" for ln in logged.values())
    assert "Traceback" not in served.output()
    assert_no_secret(served.output())


def test_a_second_signal_cuts_what_is_left_as_the_drain_timeout_does(tiny_chat, tmp_path):
    """A second SIGTERM during a drain cuts what still runs the way the drain's timeout does: each
    request not yet answered (running or queued) gets a 503 ``shutting_down`` in OpenAI's shape, a
    stream is ended where it is and logged ``interrupted``; no bare text 500, no traceback in the
    log (hunt report L, finding 1), and the process exits 0."""
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "server:\n  drain_timeout_s: 60\n")
    served = Served(config)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "temperature": 0}
    headers = {"authorization": f"Bearer {KEYS['free']}"}  # free: 4 at a time, the rest queued

    async def main() -> tuple[list[httpx.Response], bytes]:
        async with httpx.AsyncClient(base_url=served.url, headers=headers, timeout=60) as client:
            plain = [asyncio.create_task(client.post("/v1/chat/completions", json=body,
                                                     headers={"x-request-id": f"cut-{i}"})) for i in range(8)]
            async with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True},
                                     headers={"x-request-id": "cut-stream"}) as sse:
                chunks = sse.aiter_raw()
                streamed = await anext(chunks)
                served.proc.send_signal(signal.SIGTERM)
                while (await client.get("/readyz")).status_code == 200:
                    await asyncio.sleep(0.02)
                served.proc.send_signal(signal.SIGTERM)
                async for chunk in chunks:
                    streamed += chunk
            return await asyncio.gather(*plain), streamed

    try:
        answers, streamed = asyncio.run(main())
        assert served.proc.wait(30) == 0
    finally:
        served.stop()
    cut = [r for r in answers if r.status_code != 200]
    assert cut, "the second signal cut nothing"
    for r in cut:
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert int(r.headers["retry-after"]) >= 1
    assert not streamed.rstrip().endswith(b"data: [DONE]")  # ended where it was
    output = served.output()
    assert "Traceback" not in output and "Exception in ASGI application" not in output, output[-5000:]
    logged = served.requests()
    assert (logged["cut-stream"]["status"], logged["cut-stream"]["reason"]) == (200, "interrupted")
    assert sum(logged[f"cut-{i}"]["reason"] == "shutting_down" for i in range(8)) == len(cut)


def test_sigterm_lets_a_realtime_reply_under_way_end_then_closes_its_session(tiny_chat, tmp_path):
    """SIGTERM during a Realtime conversation's reply: the reply runs to its end (its ``response.done``,
    its usage metered), a new response is refused meanwhile, then an ``error`` event ``shutting_down``
    and a close with 1012, reason ``shutting_down``; a session idle at the signal gets the same at
    once. (The drain closed every session with 1012 at once: the reply cut without a ``response.done``
    and not metered; hunt report BB, finding 2.)"""
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "server:\n  drain_timeout_s: 60\n")
    served = Served(config)
    url = served.url.replace("http", "ws") + "/v1/realtime?model=tiny-chat"
    headers = {"Authorization": f"Bearer {KEYS['paid']}"}

    async def until_closed(ws, seen: list[dict]) -> tuple[int, str]:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in ws:
                seen.append(json.loads(message))
        return ws.close_code, ws.close_reason

    async def main():
        async with websockets.connect(url, additional_headers=headers) as idle, \
                websockets.connect(url, additional_headers=headers) as busy:
            for ws in (idle, busy):
                assert json.loads(await ws.recv())["type"] == "session.created"
            for event in ({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                                  "max_output_tokens": 400}},
                          {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                              {"type": "input_text", "text": "Tell me a long story."}]}},
                          {"type": "response.create"}):
                await busy.send(json.dumps(event))
            before: list[dict] = []
            while sum(e["type"] == "response.output_text.delta" for e in before) < 3:
                before.append(json.loads(await busy.recv()))
            served.proc.send_signal(signal.SIGTERM)
            idle_seen, busy_seen = [], []
            idle_closed = await until_closed(idle, idle_seen)
            await busy.send(json.dumps({"type": "response.create", "event_id": "late", "response": {
                "conversation": "none"}}))
            busy_closed = await until_closed(busy, busy_seen)
            return before, busy_seen, busy_closed, idle_seen, idle_closed

    try:
        before, after, busy_closed, idle_seen, idle_closed = asyncio.run(main())
        assert served.proc.wait(60) == 0
    finally:
        served.stop()
    # the idle session: told why at once, and closed
    assert [e["type"] for e in idle_seen] == ["error"] and idle_seen[0]["error"]["code"] == "shutting_down"
    assert idle_closed == (1012, "shutting_down")
    # the busy one: its reply ran to its end, the late response refused, then told why and closed
    kinds = [e["type"] for e in after]
    done = next(e["response"] for e in after if e["type"] == "response.done")
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] >= 3, done
    assert "response.output_text.done" in kinds and kinds.index("response.output_text.done") < kinds.index("response.done")
    refused = [e["error"] for e in after if e["type"] == "error" and e["error"]["event_id"] == "late"]
    assert [(r["code"], r["type"]) for r in refused] == [("shutting_down", "server_error")]
    assert kinds[-1] == "error" and after[-1]["error"]["code"] == "shutting_down" and after[-1]["error"]["event_id"] is None
    assert kinds.count("response.created") == 0  # (the late one never began)
    assert busy_closed == (1012, "shutting_down")
    # metered: the key's usage holds the reply's tokens (written before the process exited)
    with sqlite3.connect(tmp_path / "tiergate-data" / "accounts.sqlite3") as db:
        metered = db.execute("SELECT requests, output_tokens FROM usage WHERE key = ? AND model = 'tiny-chat'",
                             (key_id(KEYS["paid"]),)).fetchall()
    assert metered == [(1, done["usage"]["output_tokens"])]
    messages = [ln["message"] for ln in served.lines() if ln["logger"] == "tiergate.drain"]
    assert messages[0].startswith("draining: no new requests; 0 requests (0 streaming) and 2 realtime sessions in "
                                  "flight"), messages
    assert messages[-1] == "drained: nothing in flight"
    assert "Traceback" not in served.output()


def backlog(store: Path, batch_id: str) -> list[tuple[str | None, int]]:
    """(claimed_by, deliveries) of each backlog entry of the batch, read beside the server."""
    if not store.exists():
        return []
    with sqlite3.connect(store, timeout=10) as db:
        try:
            return db.execute("SELECT claimed_by, deliveries FROM backlog WHERE batch_id = ? ORDER BY idx",
                              (batch_id,)).fetchall()
        except sqlite3.OperationalError:  # the schema is not there yet
            return []


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own issuer) and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tiergate test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_serve_speaks_https_with_a_certificate_and_refuses_a_wrong_one(tiny_chat, tmp_path):
    """``--ssl-certfile``/``--ssl-keyfile``: the SDK talks HTTPS to it, trusting that certificate
    (and plain HTTP to the same port gets no answer); a certificate that does not load is one line
    and exit 2 before the server starts; one flag without the other is a usage error."""
    cert, key = self_signed(tmp_path)
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    server = Served(config, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), verify=str(cert))
    try:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["paid"], max_retries=0,
                               http_client=httpx.Client(verify=str(cert)))
        r = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(f"{server.url}/healthz", timeout=5)
    finally:
        assert server.stop() == 0, server.output()[-3000:]
    tiergate = Path(sys.executable).with_name("tiergate")
    command = [str(tiergate)] if tiergate.exists() else [sys.executable, "-m", "gateway.cli"]
    env = {**os.environ, **{f"TEST_KEYS_{t.upper()}": k for t, k in KEYS.items()}, "PYTHONPATH": str(ROOT)}
    wrong = subprocess.run([*command, "serve", "--config", str(config), "--ssl-certfile", str(key), "--ssl-keyfile", str(key)],
                           env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "tiergate: --ssl-certfile" in wrong.stderr, wrong.stderr[-2000:]
    alone = subprocess.run([*command, "serve", "--ssl-certfile", str(cert)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 2 and "--ssl-certfile and --ssl-keyfile go together" in alone.stderr


def test_request_ids_are_printable_ascii_of_bounded_length():
    assert valid_request_id("abc-123_XYZ.~!") and valid_request_id("x" * 128)
    for bad in ("", "x" * 129, "has space", "tab\there", "caf\u00e9", "new\nline"):
        assert not valid_request_id(bad)


def test_text_lines_put_the_request_fields_after_the_message():
    import logging

    record = logging.LogRecord("tiergate.requests", logging.INFO, __file__, 1, "request", None, None)
    record.request = {"request_id": "r1", "status": 429, "reason": "queue_full", "model": None, "endpoint": "/v1/x y"}
    text = Formatter(json_lines=False).format(record)
    assert text.endswith(' INFO tiergate.requests: request request_id=r1 status=429 reason=queue_full endpoint="/v1/x y"')
    doc = json.loads(Formatter(json_lines=True).format(record))
    assert (doc["message"], doc["status"], doc["model"], doc["level"]) == ("request", 429, None, "info")


def test_readyz_follows_the_batch_store(tiny_chat, tmp_path):
    from tests.helpers import start_server
    from tests.test_batch_store import redis_server

    with redis_server(tmp_path) as url:
        extra = f"batch:\n  store: {url}\n"
        server = start_server(write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, extra))
        try:
            ready = httpx.get(f"{server.url}/readyz")
            assert ready.status_code == 200 and ready.json()["store"] == "RedisStore"
        except BaseException:
            server.stop()
            raise
    try:  # Redis is gone
        gone = httpx.get(f"{server.url}/readyz", timeout=10)
        assert gone.status_code == 503 and gone.json()["status"] == "store_unavailable", gone.text
        assert httpx.get(f"{server.url}/healthz").status_code == 200  # alive, not ready
    finally:
        server.stop()


def test_preloaded_models_are_resident_before_any_request_and_readyz_names_a_failure(tiny_chat, tmp_path):
    """``preload: true``: the model is loaded when the server starts, not at its first request;
    one that cannot load (declared bigger than the whole budget) is named by /readyz, which
    still turns ready, and the server serves the rest."""
    from tests.helpers import start_server

    cfg = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    text = cfg.read_text().replace(f"    path: {tiny_chat}\n", f"    path: {tiny_chat}\n    preload: true\n")
    text = text.replace("models:\n", f"models:\n  - name: broken\n    kind: chat\n    path: {tiny_chat}\n"
                                      "    engine: transformers\n    vram: 64GiB\n    preload: true\n")
    cfg.write_text(text)
    server = start_server(cfg)
    try:
        deadline = time.time() + 60
        while (ready := httpx.get(f"{server.url}/readyz", timeout=10)).status_code != 200:
            assert ready.json()["status"] == "loading" and time.time() < deadline, ready.text
            time.sleep(0.05)
        assert list(ready.json()["preload_failed"]) == ["broken"], ready.text
        table = {row["id"]: row for row in server.services.arbiter.table()}
        assert table["tiny-chat"]["place"] == "resident" and table["broken"]["place"] != "resident"
        assert server.services.gate.admitted["paid"] == 0  # loaded by no request
        r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                       json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        server.app.state.preload.pending.append("tiny-chat")  # as while a load is going
        loading = httpx.get(f"{server.url}/readyz", timeout=10)
        assert loading.status_code == 503 and loading.json() == {"status": "loading", "models": ["tiny-chat"]}
    finally:
        server.stop()


def test_a_model_that_fails_to_load_answers_503_without_the_servers_paths(tiny_chat, tmp_path, caplog):
    """A folder that is not the model its kind reads (a chat folder as ``kind: image``) fails to
    load: the 503 names the model and the library's reason, but a free key is shown no server
    path; the log has the folder."""
    from tests.helpers import start_server

    cfg = write_config(tmp_path, {"pictures": ("image", tiny_chat)})
    server = start_server(cfg)
    try:
        with caplog.at_level(logging.ERROR, "tiergate"):
            r = httpx.post(f"{server.url}/v1/images/generations",
                           headers={"Authorization": f"Bearer {server.keys['free']}"},
                           json={"model": "pictures", "prompt": "a cat", "size": "64x64"}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "model_unavailable", r.text
        assert error["message"].startswith("loading pictures failed: ") and "<pictures's folder>" in error["message"]
        assert str(tiny_chat) not in r.text and str(tmp_path) not in r.text
        assert str(tiny_chat) in caplog.text  # the operator's log has it
    finally:
        server.stop()


def test_preload_loads_one_model_after_another_and_keeps_going_past_a_failure():
    """``Preload`` on its own: ``pending`` (what /readyz reports as loading) shrinks as each
    load ends, in order; a failure is recorded and the next one still loads; stop cancels."""
    from gateway.drain import Preload

    async def main():
        gates = {name: asyncio.Event() for name in ("a", "b", "c")}
        loaded = []

        async def load(name: str) -> None:
            await gates[name].wait()
            if name == "b":
                raise RuntimeError("out of memory")
            loaded.append(name)

        preload = Preload(["a", "b", "c"])
        await preload.start(load)
        states = [list(preload.pending)]
        for name in ("a", "b", "c"):
            gates[name].set()
            for _ in range(5):
                await asyncio.sleep(0)
            states.append(list(preload.pending))
        stopped = Preload(["d"])
        await stopped.start(lambda name: asyncio.sleep(3600))
        await stopped.stop()
        return states, loaded, preload.failed, stopped.pending

    states, loaded, failed, stopped = asyncio.run(main())
    assert states == [["a", "b", "c"], ["b", "c"], ["c"], []]
    assert loaded == ["a", "c"] and failed == {"b": "RuntimeError: out of memory"}
    assert stopped == ["d"]  # cancelled, not loaded


@pytest.mark.parametrize("started", [False, True], ids=["before its answer", "mid-stream"])
def test_a_drain_that_times_out_answers_what_is_left_itself(started, caplog):
    """Past ``drain_timeout_s`` the drain cancels the API requests still in flight, and each
    answers for itself: one not yet answered gets a 503 ``shutting_down`` in OpenAI's shape (left
    to uvicorn's cancellation it got a bare text 500, logged as a traceback), a stream is ended
    where it is and logged ``interrupted``; neither raises on."""
    from gateway.drain import Drain, DrainGate
    from gateway.request_log import RequestLog

    async def handler(scope, receive, send) -> None:
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(3600)  # a first token (or the next) that never comes

    async def main() -> list[dict]:
        drain, sent = Drain(timeout_s=0.2), []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            await asyncio.sleep(3600)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
        request = asyncio.create_task(RequestLog(DrainGate(handler, drain))(scope, receive, send))
        await asyncio.sleep(0.05)
        assert drain.inflight == 1
        await drain.run()  # times out: cuts it
        await request  # answered, not raised
        assert drain.inflight == 0 and not drain.tasks
        return sent

    caplog.set_level("INFO", logger="tiergate.requests")
    sent = asyncio.run(main())
    logged = [r.request for r in caplog.records if hasattr(r, "request")]
    if started:
        assert [m.get("status") for m in sent[:1]] == [200] and sent[-1] == {
            "type": "http.response.body", "body": b"", "more_body": False}
        assert (logged[-1]["status"], logged[-1]["reason"]) == (200, "interrupted")
    else:
        assert sent[0]["status"] == 503 and dict(sent[0]["headers"])[b"retry-after"] == b"5"
        error = json.loads(sent[1]["body"])["error"]
        assert (error["code"], error["type"]) == ("shutting_down", "server_error")
        assert (logged[-1]["status"], logged[-1]["reason"]) == (503, "shutting_down")


@pytest.mark.parametrize("path, headers, anthropic", [
    ("/v1/messages", [], True), ("/v1/chat/completions", [(b"anthropic-version", b"2023-06-01")], True),
    ("/v1/chat/completions", [], False),
])
def test_a_draining_servers_refusal_speaks_anthropic_where_its_sdk_asks(path, headers, anthropic):
    """The drain's 503 ``shutting_down`` carries Anthropic's ``"type": "error"`` on its paths and
    with its SDK's header, as every other error there does (README, Anthropic's Messages API)."""
    from gateway.drain import Drain, DrainGate

    async def main() -> list[dict]:
        drain, sent = Drain(timeout_s=1), []
        drain.begin()

        async def send(message: dict) -> None:
            sent.append(message)

        async def never(scope, receive, send) -> None:
            raise AssertionError("a draining server passes nothing on")

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
        await DrainGate(never, drain)(scope, None, send)
        return sent

    sent = asyncio.run(main())
    body = json.loads(sent[1]["body"])
    assert sent[0]["status"] == 503 and body["error"]["code"] == "shutting_down"
    assert (body.get("type") == "error") is anthropic


def test_every_route_but_the_probes_and_the_dashboards_stream_counts_in_flight_for_the_drain():
    """A request on any path the server serves counts in flight, so that SIGTERM waits for it:
    vLLM's ``/rerank``, ``/score``, ``/classify``, ``/tokenize``, Cohere's ``/v2/embed`` and the
    admin API as much as ``/v1/...`` (only ``/v1/`` counted, and the server stopped under the rest:
    a bare text 500, their usage not written; hunt report BB, finding 1). Not the probes, nor the
    dashboard's event stream, which ends itself as the drain begins (a reader that stopped reading
    would hold the drain to its timeout)."""
    from starlette.routing import Route

    from gateway import dashboard
    from gateway.app import routes
    from gateway.drain import PROBES, Drain, DrainGate

    async def counted(method: str, path: str) -> bool:
        drain, seen = Drain(timeout_s=1), []

        async def handler(scope, receive, send) -> None:
            seen.append(drain.inflight)

        gate = DrainGate(handler, drain, unwaited=frozenset({dashboard.EVENTS}))
        await gate({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}, None, None)
        return seen == [1]

    paths = {(method, re.sub(r"\{[^}]*\}", "x", route.path)) for route in routes() if isinstance(route, Route)
             for method in route.methods - {"HEAD"}}
    for path in ("/rerank", "/v2/rerank", "/score", "/classify", "/v2/embed", "/tokenize", "/detokenize", "/admin/keys"):
        assert any(p == path for _, p in paths), path  # (the paths this test is about are still served)

    async def main() -> dict[tuple[str, str], bool]:
        return {(method, path): await counted(method, path) for method, path in sorted(paths)}

    waited = asyncio.run(main())
    assert {key for key, is_counted in waited.items() if not is_counted} == {
        ("GET", path) for path in (*PROBES, dashboard.EVENTS)}
