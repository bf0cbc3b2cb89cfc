"""The ingress's own start-up, without a cluster: its managed keys come from the shared store
(Redis), read at Serve's first health check; while that store does not answer, the health check
fails and a request gets a clean 503, and both try again, so the ingress recovers with the store."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

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
        answer = asyncio.run(ingress(request))
        assert answer.status_code == 400
        assert json.loads(answer.body)["error"]["code"] == "unsupported_in_cluster"
