"""The ingress's own start-up, without a cluster: its managed keys come from the shared store
(Redis), read at Serve's first health check; while that store does not answer, the health check
fails and a request gets a clean 503, and both try again, so the ingress recovers with the store."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from types import SimpleNamespace

import pytest
from starlette.requests import Request

pytest.importorskip("ray.serve")

from accounts.redis_store import RedisAccounts  # noqa: E402
from cluster.ingress import Ingress  # noqa: E402
from gateway.accounts import Accounts  # noqa: E402
from gateway.auth import KeyRing  # noqa: E402
from gateway.config import load_config  # noqa: E402
from gateway.errors import APIError  # noqa: E402
from tests.helpers import redis_server, spare_port, write_config  # noqa: E402


def asking(key: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/v1/models", "query_string": b"",
                    "headers": [(b"authorization", f"Bearer {key}".encode())]})


def test_the_ingress_waits_for_its_key_store_and_recovers_with_it(tmp_path, tiny_chat):
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    port = spare_port()
    ingress = object.__new__(Ingress)  # its constructor asks Serve for its replica context
    ingress.keys = KeyRing({"paid": ["key-paid"]}, [])
    ingress.accounts = Accounts(config, RedisAccounts(f"redis://127.0.0.1:{port}/0"))
    ingress._accounts_started = None

    async def scenario() -> None:
        with pytest.raises(Exception):  # Redis's own error: Serve marks the ingress unhealthy
            await ingress.check_health()
        with pytest.raises(APIError) as refused:
            await ingress._caller(asking("key-paid"))
        assert refused.value.status == 503 and refused.value.code == "store_unavailable"
        assert refused.value.headers == {"retry-after": "1"}
        with redis_server(tmp_path / "redis", port):  # the store answers now: both try again
            await ingress.check_health()
            assert (await ingress._caller(asking("key-paid"))).tier == "paid"
            with pytest.raises(APIError) as unknown:
                await ingress._caller(asking("key-nobody"))
            assert unknown.value.status == 401
            await ingress.accounts.stop()

    (tmp_path / "redis").mkdir()
    asyncio.run(scenario())


def test_a_folder_adapter_goes_to_its_base_models_replicas(tmp_path, tiny_chat):
    """An ``adapter_dirs`` adapter is routed by its folder's base model (its replica reads and
    checks the files); a name no folder holds, or one reaching outside them, is the ingress's 404."""
    (tmp_path / "dir" / "sailor").mkdir(parents=True)
    (tmp_path / "dir" / "inked.safetensors").write_bytes(b"")  # an image LoRA as one file
    (tmp_path / "outside").mkdir()
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)},
                                      f"adapter_dirs:\n  - {{model: m, path: {tmp_path / 'dir'}}}\n"))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m"}
    post = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                    "headers": [(b"content-type", b"application/json")]})
    assert ingress._model(post, b'{"model": "sailor"}')[0] == "m"
    assert ingress._model(post, b'{"model": "inked"}')[0] == "m"
    assert ingress._model(post, b'{"model": "m"}')[0] == "m"
    for name in ("nobody", "../outside", "../dir/sailor"):
        with pytest.raises(APIError) as e:
            ingress._model(post, b'{"model": "%s"}' % name.encode())
        assert e.value.status == 404 and e.value.code == "model_not_found"


def test_a_json_body_is_routed_by_its_model_whatever_the_case_of_its_content_type(tmp_path, tiny_chat):
    """Media types are case-insensitive: ``Application/JSON`` is JSON to the replicas' app, so the
    ingress reads its model too (it routed such a body as one naming no model, to any replica)."""
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m"}
    post = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
                    "headers": [(b"content-type", b"Application/JSON; charset=UTF-8")]})
    assert ingress._model(post, b'{"model": "m"}', "/v1/chat/completions")[0] == "m"


def test_a_request_naming_an_id_a_replica_made_goes_to_that_replica(tmp_path, tiny_chat):
    """What one replica keeps in memory is named by ids with its origin (``gateway.origin``): an
    image url's file, and the first spoken reply a chat sends back by its audio id, are routed to
    the replica in them; an id made without one (``tiergate serve``'s) or by no replica routes as
    before. The stores make such ids when they have an origin, and the old ones when not."""
    from gateway.auth import Caller
    from gateway.image_store import ImageStore
    from gateway.output_audio import SpokenReplies
    from gateway.realtime_secrets import ClientSecrets

    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m"}
    made = {"image": ImageStore(60, 1 << 20, origin="r1").put("key", b"png"),
            "audio": SpokenReplies(origin="r2").new_id(),
            "secret": ClientSecrets(origin="r3").issue(Caller("paid", "k"), 60, None)[0]}
    plain = {"image": ImageStore(60, 1 << 20).put("key", b"png"), "audio": SpokenReplies().new_id(),
             "secret": ClientSecrets().issue(Caller("paid", "k"), 60, None)[0]}
    assert made["image"].startswith("img-r1~") and made["audio"].startswith("audio_r2~") and made["secret"].startswith("ek_r3~")
    assert "~" not in "".join(plain.values())

    def origin(method: str, path: str, body: bytes = b"") -> str | None:
        request = Request({"type": "http", "method": method, "path": path, "query_string": b"",
                           "headers": [(b"content-type", b"application/json")]})
        return ingress._model(request, body, path)[3]

    assert origin("GET", f"/v1/images/files/{made['image']}.png") == "r1"
    assert origin("GET", f"/v1/images/files/{plain['image']}.png") is None
    assert origin("GET", "/v1/models") is None

    def chat(*messages: dict) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, *messages]}).encode()

    assert origin("POST", "/v1/chat/completions", chat({"role": "assistant", "audio": {"id": made["audio"]}})) == "r2"
    assert origin("POST", "/v1/chat/completions", chat({"role": "assistant", "audio": {"id": plain["audio"]}},
                                                       {"role": "assistant", "audio": {"id": made["audio"]}})) == "r2"
    assert origin("POST", "/v1/chat/completions", chat({"role": "assistant", "audio": {"id": plain["audio"]}})) is None
    assert origin("POST", "/v1/chat/completions", chat({"role": "assistant", "audio": "odd"})) is None


def test_runtime_lora_loading_and_fine_tuning_are_refused_in_a_cluster(tmp_path, tiny_chat):
    """vLLM's load/unload endpoints change one process's adapters: through the ingress they would
    reach one replica, and the ingress would not route the name. A clear 400 points to adapter_dirs.
    Fine-tuning jobs, likewise: a job runs on a trainer that the replicas' arbiters do not share."""
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base, ingress.cors = config, {"m": "m"}, []
    ingress.keys = KeyRing({"paid": ["key-paid"]}, ["key-admin"])
    ingress.accounts, ingress._accounts_started = None, None
    ingress.answered = Counter()

    async def accounts_ready() -> None:
        return None

    ingress._accounts = accounts_ready
    ingress._serve = None  # never reached
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/x"):
        request = Request({"type": "http", "method": "POST", "path": path, "query_string": b"",
                           "headers": [(b"authorization", b"Bearer key-admin"), (b"content-type", b"application/json")]})
        answer = asyncio.run(ingress.handle(request))
        assert answer.status_code == 400
        assert json.loads(answer.body)["error"]["code"] == "unsupported_in_cluster"


def test_a_websocket_runs_through_an_app_in_process_as_a_replica_serves_a_realtime_session():
    """``cluster.asgi.session``: the app gets the handshake, then what the inbox holds, in order;
    every message it sends comes out (its accept's subprotocol and headers, its frames, its close)
    and the stream ends at its close. A refusal is its HTTP answer when the client's server can send
    one, and a policy close when it cannot. A stream closed early is the client gone."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    from cluster.asgi import Opening, session

    left: list[int] = []

    async def echo(ws: WebSocket) -> None:
        if ws.query_params.get("key") != "good":
            try:
                await ws.send_denial_response(PlainTextResponse("no", status_code=401))
            except RuntimeError:  # no denial extension
                await ws.close(code=1008, reason="no")
            return
        await ws.accept(subprotocol="realtime", headers=[(b"x-made-by", b"echo")])
        try:
            while (text := await ws.receive_text()) != "bye":
                await ws.send_text(text.upper())
        except WebSocketDisconnect as gone:
            left.append(gone.code)
            return
        await ws.close(code=1000)

    app = Starlette(routes=[WebSocketRoute("/ws", echo)])

    async def run(query: bytes, said: list[str], denial: bool = True, take: int | None = None) -> list[dict]:
        inbox: asyncio.Queue = asyncio.Queue()
        for text in said:
            inbox.put_nowait({"type": "websocket.receive", "text": text})
        out = []
        stream = session(app, Opening("/ws", query, [], ["realtime"], denial), inbox)
        async for message in stream:
            out.append(message)
            if take is not None and len(out) == take:
                break
        await stream.aclose()
        return out

    talk = asyncio.run(run(b"key=good", ["hi", "there", "bye", "never read"]))
    assert [m["type"] for m in talk] == ["websocket.accept", "websocket.send", "websocket.send", "websocket.close"]
    assert talk[0]["subprotocol"] == "realtime" and (b"x-made-by", b"echo") in talk[0]["headers"]
    assert [m["text"] for m in talk[1:3]] == ["HI", "THERE"] and talk[3]["code"] == 1000
    denied = asyncio.run(run(b"key=bad", []))
    assert [m["type"] for m in denied] == ["websocket.http.response.start", "websocket.http.response.body"]
    assert denied[0]["status"] == 401 and denied[1]["body"] == b"no"
    closed = asyncio.run(run(b"key=bad", [], denial=False))
    assert [(m["type"], m["code"]) for m in closed] == [("websocket.close", 1008)]
    assert left == []
    early = asyncio.run(run(b"key=good", ["hi"], take=2))  # the client gone after the first answer
    assert [m["type"] for m in early] == ["websocket.accept", "websocket.send"] and left == [1001]


def test_a_client_secret_s_session_goes_to_its_replica_in_the_deployment_of_its_model(tmp_path, tiny_chat):
    """A session opened with a client secret goes to the replica in the secret (``gateway.origin``)
    among the replicas of the deployment that serves the model the URL names (here a tensor-parallel
    model's own, not the pool), with no model for the router to rank by: that replica checks the
    secret. Serve's calls are stand-ins here that record what they were asked; the relay is the
    ingress's own (the Ray tests run it through Serve)."""
    from cluster.ingress import _Target

    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat), "big": ("chat", tiny_chat)}))
    calls: list[tuple[str, dict]] = []

    class Stream:  # a streaming call's reply, as Serve's generator hands it over
        def __init__(self, items: list[dict]) -> None:
            self.items = items

        def __aiter__(self):
            return self

        async def __anext__(self) -> dict:
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        def cancel(self) -> None:
            pass

    class Call:
        def __init__(self, name: str, reply) -> None:
            self.name, self.reply = name, reply

        def remote(self, *args, **kwargs):
            calls.append((self.name, kwargs))
            return self.reply()

    async def taken() -> bool:
        return True

    def deployment(name: str) -> _Target:
        session = [{"replica": "r9"}, {"type": "websocket.accept", "headers": []}, {"type": "websocket.close", "code": 1000}]
        return _Target(None, None, None, Call(name, lambda: Stream(list(session))), Call(f"{name} input", taken), 2)

    pool, tensor_parallel = deployment("pool"), deployment("tp")
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m", "big": "big"}
    ingress.deployments, ingress.default, ingress.by_model = [pool, tensor_parallel], pool, {"m": pool, "big": tensor_parallel}
    ingress.rank = {t.name: i for i, t in enumerate(config.tiers)}
    ingress.answered, ingress.sessions = Counter(), {}
    ingress.loop_watch = None  # (server.loop_stall_s: 0)
    scope = {"type": "websocket", "path": "/v1/realtime", "query_string": b"model=big", "subprotocols": [],
             "headers": [(b"authorization", b"Bearer ek_r9~made-there")]}
    arriving = [{"type": "websocket.connect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        if arriving:
            return arriving.pop(0)
        await asyncio.sleep(3600)  # the client says nothing more

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(ingress.asgi(scope, receive, send))
    opened = [(name, kw["replica"], kw["model"]) for name, kw in calls if not name.endswith("input")]
    assert opened == [("tp", "r9", None)]
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.close"] and ingress.sessions == {"-": 0}


def test_a_replica_dying_mid_stream_ends_a_messages_stream_with_anthropics_error_event(tmp_path, tiny_chat):
    """A replica that dies mid-stream ends the stream with an error event the client's SDK raises:
    on the Messages API Anthropic's ``event: error`` (the anthropic SDK ignored the OpenAI-shaped
    event and returned the cut message as whole), on chat completions OpenAI's; both are
    ``server_error``s (not ``invalid_request_error``, which blames the request). The replica's
    stream is a stand-in that sends a head and one event, then fails as Serve's does."""
    import anthropic
    import httpx
    import httpx2  # the anthropic SDK's own httpx
    import openai
    from ray.exceptions import RayError

    from cluster.ingress import _Target

    class Dying:  # a streaming call's reply: its head, one event, then the replica is gone
        def __init__(self, event: bytes) -> None:
            self.items = [{"status": 200, "headers": [(b"content-type", b"text/event-stream")]}, event]

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not self.items:
                raise RayError("the replica died")
            return self.items.pop(0)

        def cancel(self) -> None:
            pass

    class Forward:
        def remote(self, forwarded: dict, **kwargs) -> Dying:
            if forwarded["path"] == "/v1/messages":
                return Dying(b'event: message_start\ndata: {"type": "message_start", "message": {"id": "msg_1", '
                             b'"type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": '
                             b'null, "stop_sequence": null, "usage": {"input_tokens": 1, "output_tokens": 0}}}\n\n')
            return Dying(b'data: {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", '
                         b'"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}\n\n')

    ingress = _ingress_calling(tmp_path, tiny_chat, _Target(Forward(), None, None, None, None, 1))

    async def scenario() -> None:
        own = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=ingress.asgi), base_url="http://ingress")
        claude = anthropic.AsyncAnthropic(api_key="key-paid", base_url="http://ingress", http_client=own, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as failed:
            async for _ in await claude.messages.create(model="m", max_tokens=8, stream=True,
                                                        messages=[{"role": "user", "content": "hi"}]):
                pass
        assert failed.value.body["error"]["code"] == "replica_failed"
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.asgi), base_url="http://ingress")
        gpt = openai.AsyncOpenAI(api_key="key-paid", base_url="http://ingress/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.APIError) as failed:
            async for _ in await gpt.chat.completions.create(model="m", stream=True,
                                                             messages=[{"role": "user", "content": "hi"}]):
                pass
        assert failed.value.code == "replica_failed"
        assert failed.value.type == "server_error"  # the server's failure, not the request's
        assert ingress.inflight["paid"] == 0
        await ingress.accounts.stop()

    asyncio.run(scenario())


def test_a_429_after_every_replica_redirected_says_when_the_earliest_protection_ends(tmp_path, tiny_chat):
    """When the router's reports were stale and every replica asked answers "redirect" (its own
    arbiter would refuse), the ingress's cluster-wide 429 carries Retry-After the earliest of their
    protection ends (it said 1 s, and a client honouring it retried every second for a minute),
    and how many replicas were asked; 1 s where a replica's refusal was not a protection (the
    model waits on work that ends). The replicas are stand-ins answering as ``TierReplica``."""
    import httpx

    from accounts.sqlite_store import SQLiteAccounts
    from cluster.ingress import _Target

    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))

    class Answer:  # each replica asked redirects, with its protection's end (None: not a protection)
        def __init__(self, ends: list[int | None]) -> None:
            self.ends = ends

        async def remote(self, forwarded: dict, avoid: list[str], **kwargs) -> dict:
            return {"redirect": f"r{len(avoid)}", "retry_after": self.ends[len(avoid)]}

    ingress = object.__new__(Ingress)
    ingress.config, ingress.base, ingress.max_body = config, {"m": "m"}, 1 << 20
    ingress.keys = KeyRing({"free": ["key-free"]}, [])
    ingress.accounts = Accounts(config, SQLiteAccounts(tmp_path / "accounts.sqlite3"))
    ingress._accounts_started = None
    ingress.rank = {t.name: i for i, t in enumerate(config.tiers)}
    ingress.inflight = {t.name: 0 for t in config.tiers}
    ingress.capacity = {t.name: 100 for t in config.tiers}
    ingress.answered, ingress.redirects, ingress.cors = Counter(), 0, []
    ingress.loop_watch, ingress._watching = None, False

    async def refused(ends: list[int | None]) -> httpx.Response:
        pool = _Target(None, Answer(ends), None, None, None, len(ends))
        ingress.deployments, ingress.default, ingress.by_model = [pool], pool, {"m": pool}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.asgi), base_url="http://ingress") as c:
            return await c.post("/v1/chat/completions", headers={"authorization": "Bearer key-free"},
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    async def scenario() -> list[httpx.Response]:
        try:
            return [await refused([57, 41]), await refused([57, None, 30])]
        finally:
            await ingress.accounts.stop()

    protected, waiting = asyncio.run(scenario())
    assert protected.status_code == 429 and protected.json()["error"]["code"] == "model_protected"
    assert (protected.headers["retry-after"], protected.headers["x-tiergate-redirects"]) == ("41", "2")
    assert (waiting.headers["retry-after"], waiting.headers["x-tiergate-redirects"]) == ("1", "3")
    assert ingress.inflight["free"] == 0


def _ingress_answering(tmp_path, tiny_chat, replies: list[dict]) -> Ingress:
    """An ingress without Serve whose replicas' answers are stubbed: each forwarded request is
    appended to ``replies`` and answered 200 ``{}``."""
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base, ingress.cors = config, {"m": "m"}, []
    ingress.keys = KeyRing({"paid": ["key-paid"]}, [])
    ingress.accounts = Accounts.from_config(config)
    ingress.answered, ingress.redirects, ingress.max_body = Counter(), 0, 1 << 20
    ingress.rank = {t.name: i for i, t in enumerate(config.tiers)}
    ingress.inflight = {t.name: 0 for t in config.tiers}
    ingress.capacity = {t.name: 8 for t in config.tiers}

    async def accounts_ready() -> None:
        return None

    async def call(forwarded, model, tier, streamed, affinity=None, origin=None, **_):
        replies.append({"path": forwarded["path"], "model": model, "tier": tier})
        return {"status": 200, "headers": [(b"content-type", b"application/json")], "body": b"{}"}, None, 0

    ingress._accounts, ingress._call = accounts_ready, call
    return ingress


def _post(path: str, body: bytes, headers: list[tuple[bytes, bytes]], method: str = "POST") -> Request:
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    return Request({"type": "http", "method": method, "path": path, "query_string": b"", "headers": headers}, receive)


def test_the_ingress_s_own_refusals_on_the_messages_api_are_anthropic_shaped(tmp_path, tiny_chat):
    """A refusal the ingress makes itself (no key, a wrong key, bad JSON, an unknown model) has
    Anthropic's ``{"type": "error", ...}`` on the Messages API, as ``tiergate serve``'s (hunt 4 X1:
    it was OpenAI-shaped, so the anthropic SDK read no error type), and stays OpenAI-shaped elsewhere;
    a missing key is ``missing_api_key``, a wrong one ``invalid_api_key``, as serve names them."""
    ingress = _ingress_answering(tmp_path, tiny_chat, [])
    json_type = (b"content-type", b"application/json")
    cases = [([json_type], b'{"model": "m"}', 401, "missing_api_key"),
             ([json_type, (b"x-api-key", b"key-nobody")], b'{"model": "m"}', 401, "invalid_api_key"),
             ([json_type, (b"x-api-key", b"key-paid")], b"{not json", 400, "invalid_json"),
             ([json_type, (b"x-api-key", b"key-paid")], b'{"model": "nobody"}', 404, "model_not_found")]
    for headers, body, status, code in cases:
        for path, anthropic in (("/v1/messages", True), ("/v1/chat/completions", False)):
            answer = asyncio.run(ingress.handle(_post(path, body, headers)))
            got = json.loads(answer.body)
            assert (answer.status_code, got["error"]["code"]) == (status, code), (path, got)
            assert (got.get("type") == "error") is anthropic, (path, got)


def test_a_form_s_model_part_with_headers_of_its_own_is_routed_by_its_model(tmp_path, tiny_chat):
    """RFC 7578 lets a part carry a Content-Type after its Content-Disposition (curl's
    ``-F 'model=m;type=text/plain'`` sends one): such a ``model`` part was not found, and the
    request was routed as one needing no model, to any replica, which loaded a second copy (hunt 4
    X2). A file part whose *filename* is "model" is not the model field."""
    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m"}
    form = [(b"content-type", b"multipart/form-data; boundary=XyZ")]

    def model_of(*parts: bytes) -> str | None:
        body = b"".join(b"--XyZ\r\n" + part + b"\r\n" for part in parts) + b"--XyZ--\r\n"
        return ingress._model(_post("/v1/audio/transcriptions", body, form), body, "/v1/audio/transcriptions")[0]

    plain = b'Content-Disposition: form-data; name="model"\r\n\r\nm'
    typed = b'Content-Disposition: form-data; name="model"\r\nContent-Type: text/plain\r\n\r\nm'
    typed_first = b'Content-Type: text/plain\r\nContent-Disposition: form-data; name="model"\r\n\r\nm'
    a_file = b'Content-Disposition: form-data; name="file"; filename="model"\r\nContent-Type: audio/wav\r\n\r\nRIFF'
    assert model_of(plain) == model_of(typed) == model_of(typed_first) == "m"
    assert model_of(a_file, typed) == "m"
    assert model_of(a_file) is None


def test_the_ingress_answers_a_model_that_is_no_string_and_a_keyless_readiness_probe_as_serve_does(tmp_path, tiny_chat):
    """``"model": 5`` is a 400 ``invalid_type`` naming ``model`` (it was a 404 saying the model '5'
    does not exist), and ``/readyz`` needs no key, as on ``tiergate serve`` (it was a 401, so a
    probe copied from a serve deployment failed on a cluster): it goes to a replica (hunt 4 X3)."""
    replies: list[dict] = []
    ingress = _ingress_answering(tmp_path, tiny_chat, replies)
    answer = asyncio.run(ingress.handle(_post("/v1/chat/completions", b'{"model": 5}', [
        (b"content-type", b"application/json"), (b"authorization", b"Bearer key-paid")])))
    error = json.loads(answer.body)["error"]
    assert (answer.status_code, error["code"], error["param"]) == (400, "invalid_type", "model")
    answer = asyncio.run(ingress.handle(_post("/readyz", b"", [], method="GET")))
    assert answer.status_code == 200
    assert replies == [{"path": "/readyz", "model": None, "tier": 0}]


def test_a_realtime_transcription_session_picks_an_stt_model_the_key_may_use(tmp_path, tiny_chat, tiny_stt):
    """With no ``?model``, a transcription session is routed by the first speech-to-text model
    the key's allow-list holds; a key with none gets serve's 404, which names no model (it named
    the first one configured: a model that key's ``/v1/models`` hides; hunt 4 X3)."""
    from gateway.auth import Caller

    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat), "s1": ("stt", tiny_stt),
                                                 "s2": ("stt", tiny_stt)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base = config, {"m": "m", "s1": "s1", "s2": "s2"}

    class Allowing:
        def __init__(self, models: set[str]) -> None:
            self.models = models

        def allows(self, caller, model: str) -> bool:
            return model in self.models

    caller = Caller("paid", "key_1")
    ingress.accounts = Allowing({"m", "s2"})
    assert ingress._session_model(None, caller) == "s2"
    assert ingress._session_model(None) == "s1"  # a client secret's session: its replica checks it
    ingress.accounts = Allowing({"m"})
    with pytest.raises(APIError) as refused:
        ingress._session_model(None, caller)
    assert refused.value.status == 404 and "s1" not in refused.value.message and "s2" not in refused.value.message


def _ingress_calling(tmp_path, tiny_chat, target) -> Ingress:
    """An ingress without Serve whose every model's deployment is ``target`` (stand-ins for Serve's
    calls), with the real ``_serve`` and ``_call``; the key ``key-paid`` is the paid tier's."""
    from accounts.sqlite_store import SQLiteAccounts

    config = load_config(write_config(tmp_path, {"m": ("chat", tiny_chat)}))
    ingress = object.__new__(Ingress)
    ingress.config, ingress.base, ingress.max_body = config, {"m": "m"}, 1 << 20
    ingress.keys = KeyRing({"paid": ["key-paid"]}, [])
    ingress.accounts = Accounts(config, SQLiteAccounts(tmp_path / "accounts.sqlite3"))
    ingress._accounts_started = None
    ingress.deployments, ingress.default, ingress.by_model = [target], target, {"m": target}
    ingress.rank = {t.name: i for i, t in enumerate(config.tiers)}
    ingress.inflight = {t.name: 0 for t in config.tiers}
    ingress.capacity = {t.name: 100 for t in config.tiers}
    ingress.answered, ingress.redirects, ingress.cors = Counter(), 0, []
    ingress.loop_watch, ingress._watching = None, False
    return ingress


class _Replies:
    """A streaming call's reply, as Serve's generator hands it over; ``None`` for a replica that
    died before its first message (Serve raises then, not at the call)."""

    def __init__(self, items: list | None) -> None:
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import RayError

        if self.items is None:
            raise RayError("the replica died")
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)


def _dying_first(asked: list[tuple[str, str]], whole: dict):
    """A deployment of two stand-in replicas: the first asked dies before answering, the next
    answers ``whole``; each call is recorded in ``asked`` as (how it was called, its path)."""
    from ray.exceptions import RayError

    from cluster.ingress import _Target

    class Forward:
        def remote(self, forwarded: dict, **kwargs) -> _Replies:
            asked.append(("forward", forwarded["path"]))
            return _Replies(None if len(asked) == 1 else [dict(whole)])

    class Answer:
        async def remote(self, forwarded: dict, **kwargs) -> dict:
            asked.append(("answer", forwarded["path"]))
            if len(asked) == 1:
                raise RayError("the replica died")
            return dict(whole)

    return _Target(Forward(), Answer(), None, None, None, 2)


COMPLETION = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
JSON_HEADERS = [(b"content-type", b"application/json")]


async def _answered(send) -> tuple[int, dict]:
    """The status and error object of what ``send()`` got: an SDK call's error, or httpx's response
    (200 and no error for the object an SDK call returned)."""
    import httpx
    import openai

    try:
        got = await send()
    except openai.APIStatusError as failed:
        return failed.status_code, failed.body
    if isinstance(got, httpx.Response):
        return got.status_code, got.json().get("error", {}) if got.status_code >= 400 else {}
    return 200, {}


def test_a_request_that_needs_no_model_is_not_sent_again_when_its_replica_dies(tmp_path, tiny_chat):
    """A request that needs no model (a file's upload, any body that is not JSON, a DELETE) whose
    replica dies before answering is answered 502 ``replica_failed``, as docs/CLUSTER.md says: it may
    have taken effect there (the file stored). A read (GET) is tried once more, as a model request is. Such a request is a streamed call (its answer may be a
    file's content), and a streamed call exists before its first message fails, so it went to
    another replica, and an upload was stored twice (hunt CC, finding 2). A chat whose replica died
    before answering is still tried once more elsewhere, streamed or not."""
    import httpx
    import openai

    asked: list[tuple[str, str]] = []
    whole = {"status": 200, "headers": JSON_HEADERS, "body": json.dumps(COMPLETION).encode()}
    ingress = _ingress_calling(tmp_path, tiny_chat, _dying_first(asked, whole))
    key = {"authorization": "Bearer key-paid"}

    async def scenario() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.asgi), base_url="http://ingress")
        gpt = openai.AsyncOpenAI(api_key="key-paid", base_url="http://ingress/v1", http_client=http, max_retries=0)
        upload = ("a.jsonl", b"{}\n", "application/jsonl")
        not_twice = {"/v1/files": lambda: gpt.files.create(file=upload, purpose="batch"),
                     "/v1/files/file-1": lambda: gpt.files.delete("file-1"),
                     "/v1/uploads/upload_1/parts": lambda: http.post("/v1/uploads/upload_1/parts", content=b"raw",
                                                                     headers={**key, "content-type": "text/plain"})}
        for path, send in not_twice.items():
            asked.clear()
            status, error = await _answered(send)
            assert (status, error.get("code"), error.get("type")) == (502, "replica_failed", "server_error"), path
            assert asked == [("forward", path)]
        asked.clear()
        answer = await gpt.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert answer.choices[0].message.content == "hi" and asked == [("answer", "/v1/chat/completions")] * 2
        asked.clear()
        got = await http.post("/v1/chat/completions", headers=key,
                              json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert got.status_code == 200 and asked == [("forward", "/v1/chat/completions")] * 2
        asked.clear()  # a read takes no effect: once more elsewhere (a batch polled as its replica died got 502)
        read = await http.get("/v1/batches/batch_1", headers=key)
        assert read.status_code == 200 and asked == [("forward", "/v1/batches/batch_1")] * 2
        assert ingress.inflight["paid"] == 0
        await ingress.accounts.stop()

    asyncio.run(scenario())


def test_a_request_that_writes_what_outlives_it_is_not_sent_again_when_its_replica_dies(tmp_path, tiny_chat):
    """A model request that writes state outliving the call before it answers is answered 502
    ``replica_failed`` when its replica dies before answering, not sent to another replica: a
    background response (its record stored, then run by another replica's reclaim: it ran twice and
    was metered twice; hunt CC, finding 4), a stored response (``store`` is true unless false), one
    added to a conversation, a stored chat completion, a vector store made with its embedding model.
    The same request with ``store: false`` is still tried once more elsewhere."""
    import httpx
    import openai

    asked: list[tuple[str, str]] = []
    queued = {"id": "resp_1", "object": "response", "created_at": 1, "status": "queued", "model": "m", "output": []}
    whole = {"status": 200, "headers": JSON_HEADERS, "body": json.dumps(queued).encode()}
    ingress = _ingress_calling(tmp_path, tiny_chat, _dying_first(asked, whole))
    said = [{"role": "user", "content": "hi"}]

    async def scenario() -> None:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.asgi), base_url="http://ingress")
        gpt = openai.AsyncOpenAI(api_key="key-paid", base_url="http://ingress/v1", http_client=http, max_retries=0)
        respond = gpt.responses.create
        not_twice = [lambda: respond(model="m", input="hi", background=True),
                     lambda: respond(model="m", input="hi", background=True, stream=True),
                     lambda: respond(model="m", input="hi"),
                     lambda: respond(model="m", input="hi", store=False, conversation="conv_1"),
                     lambda: gpt.chat.completions.create(model="m", messages=said, store=True),
                     lambda: gpt.vector_stores.create(name="docs", extra_body={"model": "m"})]
        for i, send in enumerate(not_twice):
            asked.clear()
            status, error = await _answered(send)
            assert (status, error.get("code")) == (502, "replica_failed"), i
            assert len(asked) == 1, i
        asked.clear()
        answer = await gpt.responses.create(model="m", input="hi", store=False)
        assert answer.id == "resp_1" and asked == [("answer", "/v1/responses")] * 2
        assert ingress.inflight["paid"] == 0
        await ingress.accounts.stop()

    asyncio.run(scenario())


def test_streamed_speech_through_the_ingress_and_a_replica_arrives_as_it_is_made(tmp_path, tiny_chat):
    """Speech's audio (``stream_format: audio``, its default) is sent as it is made, as ``tiergate
    serve`` sends it: the ingress calls the replica streamed, and the replica (``TierReplica.forward``)
    sends back any body of no declared length as the app sends it. It held such a body to its end or
    1 MiB, and the ingress made one plain call for it, so a voice client got all of its audio at once
    at the end (hunt CC, finding 3). Here the app's second sentence is made only once the client has
    the first (or after 3 s). An answer made whole (JSON) still crosses as one message."""
    import httpx
    import openai
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from cluster.ingress import _Target
    from cluster.replica import TierReplica

    happened: list[str] = []

    async def speech(request) -> StreamingResponse:
        async def sentences():
            yield b"one. "
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    await heard.wait()
            happened.append("made the second")
            yield b"two."
        return StreamingResponse(sentences(), media_type="audio/pcm")

    async def models(request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": []})

    class Replica(TierReplica):
        def __del__(self) -> None:  # (it stops the app's lifespan, which this one never started)
            pass

    replica = object.__new__(Replica)
    replica.app = Starlette(routes=[Route("/v1/audio/speech", speech, methods=["POST"]), Route("/v1/models", models)])
    replica.id, replica.node = "r1", "n1"
    replica.services = SimpleNamespace(arbiter=SimpleNamespace(states={}))

    async def started() -> None:
        return None

    replica._start = started
    asked: list[str] = []

    class Forward:
        def remote(self, forwarded: dict, **kwargs):
            asked.append("forward")
            return replica.forward(forwarded, **kwargs)

    class Answer:
        async def remote(self, forwarded: dict, **kwargs) -> dict:
            asked.append("answer")
            return await replica.answer(forwarded, **kwargs)

    ingress = _ingress_calling(tmp_path, tiny_chat, _Target(Forward(), Answer(), None, None, None, 1))

    async def spied(scope, receive, send) -> None:  # the ingress's app, seen from the client's side
        async def sent(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                happened.append(f"sent {message['body'].decode()!r}")
                heard.set()
            await send(message)

        await ingress.asgi(scope, receive, sent)

    async def scenario() -> bytes:
        nonlocal heard
        heard = asyncio.Event()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=spied), base_url="http://ingress")
        gpt = openai.AsyncOpenAI(api_key="key-paid", base_url="http://ingress/v1", http_client=http, max_retries=0)
        audio = await gpt.audio.speech.create(model="m", voice="alloy", input="One. Two.", response_format="pcm")
        whole = [item async for item in replica.forward({"method": "GET", "path": "/v1/models"})]
        assert [sorted(item) for item in whole] == [["body", "headers", "status"]]  # one message
        await ingress.accounts.stop()
        return audio.content

    heard: asyncio.Event
    assert asyncio.run(scenario()) == b"one. two."
    assert happened == ["sent 'one. '", "made the second", "sent 'two.'"]
    assert asked == ["forward"] and ingress.inflight["paid"] == 0


def test_a_replica_that_does_not_answer_is_left_out_of_the_scrape_not_waited_for(tmp_path, tiny_chat, monkeypatch):
    """A hung replica (its metrics call never answers) is left out of ``GET /metrics`` after
    ``SCRAPE_ASK_S``, the others' metrics still come, and the miss is counted; when every replica
    hangs, the scrape ends after ``SCRAPE_S`` with the ingress's own metrics."""
    import cluster.ingress as ingress_module
    from cluster.ingress import _Target

    monkeypatch.setattr(ingress_module, "SCRAPE_ASK_S", 0.2)
    monkeypatch.setattr(ingress_module, "SCRAPE_S", 5.0)
    hung: set[int] = set()
    asked = []

    class Metrics:
        async def remote(self, avoid: list[str]) -> dict:
            asked.append(len(asked))
            if asked[-1] in hung:
                await asyncio.Event().wait()  # the replica never answers
            return {"replica": f"r{asked[-1]}", "node": "n1", "text": "tiergate_up 1\n"}

    ingress = _ingress_calling(tmp_path, tiny_chat, _Target(None, None, Metrics(), None, None, 2))
    ingress.id, ingress.sessions, ingress.scrape_misses = "i1", {}, 0

    async def scrape() -> str:
        async with asyncio.timeout(10):  # a scrape that waits for the hung replica fails here
            return (await ingress._scrape()).decode()

    hung.add(0)
    text = asyncio.run(scrape())
    assert 'tiergate_up{node="n1",replica="r1"} 1.0' in text and 'replica="r0"' not in text
    assert 'tiergate_ingress_scrape_misses_total{ingress="i1"} 1.0' in text
    asked.clear()
    hung.update(range(10))
    ingress.deployments = [_Target(None, None, Metrics(), None, None, 10)]
    monkeypatch.setattr(ingress_module, "SCRAPE_S", 0.5)
    text = asyncio.run(scrape())
    assert "tiergate_up" not in text and 'tiergate_ingress_scrape_misses_total{ingress="i1"}' in text
    assert 1 <= len(asked) <= 3  # asked until SCRAPE_S had passed (0.2 + 0.2 + what was left), not ten times
