"""Web pages on other origins calling the API (``server.cors_origins``): preflights answered before
authentication, CORS headers on every answer (errors included, with the headers a page needs
exposed), none at all when unset; and a real page in Debian's headless Chromium, on an allowed
origin and on another, calling chat with a key."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import httpx
import pytest

from gateway.config import ConfigError, load_config
from tests.helpers import RunningServer, chromium, start_server, write_config

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


class _Pages:
    """An origin of its own: a static file server on 127.0.0.1 at ``port``, serving one empty page."""

    def __init__(self, folder: Path) -> None:
        (folder / "index.html").write_text("<!doctype html><title>app</title>")
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        handler.log_message = lambda *a: None
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.origin = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    allowed, other = _Pages(tmp_path_factory.mktemp("app")), _Pages(tmp_path_factory.mktemp("elsewhere"))
    yield allowed, other
    allowed.stop()
    other.stop()


@pytest.fixture(scope="module")
def server(tiny_chat, pages, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("cors")
    extra = f'server:\n  cors_origins: ["{pages[0].origin}", "https://app.example"]\n'
    s = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))
    yield s
    s.stop()


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization, content-type"})


def test_preflight_and_answers_carry_cors_headers_for_an_allowed_origin(server):
    url = f"{server.url}/v1/chat/completions"
    r = preflight(url, "https://app.example")  # no key: a preflight never carries one
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    ok = httpx.post(url, json=CHAT, headers={"Origin": "https://app.example", "Authorization": f"Bearer {server.keys['paid']}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    exposed = {h.strip() for h in ok.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "x-ratelimit-remaining-requests", "retry-after"} <= exposed and "x-request-id" in ok.headers
    refused = httpx.post(url, json=CHAT, headers={"Origin": "https://app.example", "Authorization": "Bearer nope"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://app.example"
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_another_origin_gets_no_cors_headers(server):
    url = f"{server.url}/v1/chat/completions"
    r = preflight(url, "https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    ok = httpx.post(url, json=CHAT, headers={"Origin": "https://evil.example", "Authorization": f"Bearer {server.keys['paid']}"})
    assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers  # the browser withholds it


def test_without_cors_origins_nothing_changes(chat_server):
    r = preflight(f"{chat_server.url}/v1/chat/completions", "https://app.example")
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    ok = httpx.post(f"{chat_server.url}/v1/chat/completions", json=CHAT,
                    headers={"Origin": "https://app.example", "Authorization": f"Bearer {chat_server.keys['paid']}"})
    assert ok.status_code == 200 and not any(h.startswith("access-control-") for h in ok.headers)


@pytest.mark.parametrize("origin", ["app.example", "https://app.example/path", "ftp://app.example", ""])
def test_an_origin_that_is_not_one_is_a_config_error(tmp_path, tiny_chat, origin):
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f'server:\n  cors_origins: ["{origin}"]\n')
    with pytest.raises(ConfigError, match="cors_origins"):
        load_config(path)


FETCH = """
const [url, key, body, done] = arguments;
fetch(url, {method: "POST", headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
            body: JSON.stringify(body)})
  .then(async r => done({status: r.status, id: r.headers.get("x-request-id"), body: await r.json()}))
  .catch(e => done({error: String(e)}));
"""


def test_a_page_on_an_allowed_origin_calls_chat_in_a_real_browser(server, pages, tmp_path):
    """Chromium enforces CORS: the page on the allowed origin reads the reply, its request id (an
    exposed header) and a 401 as a 401; the same script on another origin is refused by the
    browser (fetch rejects), though the server answered."""
    allowed, other = pages
    driver = chromium(tmp_path)
    try:
        driver.set_script_timeout(60)
        url = f"{server.url}/v1/chat/completions"
        driver.get(f"{allowed.origin}/index.html")
        got = driver.execute_async_script(FETCH, url, server.keys["paid"], CHAT)
        assert got.get("status") == 200, got
        assert got["id"].startswith("req_") and got["body"]["choices"][0]["finish_reason"] in ("length", "stop")
        bad = driver.execute_async_script(FETCH, url, "nope", CHAT)
        assert bad.get("status") == 401 and bad["body"]["error"]["code"] == "invalid_api_key", bad
        driver.get(f"{other.origin}/index.html")
        blocked = driver.execute_async_script(FETCH, url, server.keys["paid"], CHAT)
        assert "error" in blocked and "Failed to fetch" in blocked["error"], blocked
    finally:
        driver.quit()
