"""Admin endpoints: only admin keys; load, unload, pin and unpin change the model table."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import start_server, write_config


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory):
    s = start_server(write_config(tmp_path_factory.mktemp("admin"), {"tiny-chat": ("chat", tiny_chat)}))
    yield s
    s.stop()


def post(s, path, key="admin"):
    return httpx.post(f"{s.url}/admin/models/{path}", headers={"Authorization": f"Bearer {s.keys[key]}"}, timeout=60)


def test_only_admin_keys(server):
    r = post(server, "tiny-chat/load", key="paid")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    assert httpx.post(f"{server.url}/admin/models/tiny-chat/load").status_code == 401


def test_load_unload_pin(server):
    r = post(server, "tiny-chat/load")
    assert r.status_code == 200 and r.json()["place"] == "resident"
    assert post(server, "tiny-chat/pin").json()["pinned"] is True
    r = post(server, "tiny-chat/unload")  # an admin unload is explicit: it works on a pinned model too
    assert r.status_code == 200 and r.json()["place"] == "warm"
    assert post(server, "tiny-chat/unpin").json()["pinned"] is False
    assert post(server, "tiny-chat/unload").status_code == 409  # not resident any more
    assert post(server, "tiny-chat/load").json()["place"] == "resident"


def test_a_load_that_cannot_be_served_answers_503_with_retry_after(server, monkeypatch):
    """A failed load's cooldown (the arbiter's ``Unavailable``) reaches the admin as the model API's
    503 gives it: with ``Retry-After`` and ``retry-after-ms`` (they were left out)."""
    from arbiter.residency import Unavailable

    async def cooling(name):
        raise Unavailable(f"'{name}' failed to load; cooling down", retry_after=4)

    monkeypatch.setattr(server.app.state.services.arbiter, "load", cooling)
    r = post(server, "tiny-chat/load")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
    assert r.headers["retry-after"] == "4" and r.headers["retry-after-ms"] == "4000"


def test_unknown_model_or_action(server):
    assert post(server, "nope/load").status_code == 404
    r = post(server, "tiny-chat/explode")
    assert r.status_code == 404 and "load, unload, pin or unpin" in r.json()["error"]["message"]


def test_admin_key_can_call_the_model_api(server):
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.keys['admin']}"},
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
