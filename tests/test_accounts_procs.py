"""Accounts across real tiergate processes: two servers sharing one real Redis enforce one key's
requests per minute exactly and see a revoke within a second; usage survives kill -9 right after
a response (SQLite and Redis), nothing lost and nothing counted twice; no secret in any log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from accounts.redis_store import RedisAccounts
from accounts.sqlite_store import SQLiteAccounts
from tests.helpers import TIERS, write_config
from tests.test_batch_store import redis_server
from tests.test_batches import ROOT, Proc, _no_stray_processes  # noqa: F401 - the fixture kills strays

HI = [{"role": "user", "content": "hi"}]
KEYS = {t: f"key-{t}" for t in TIERS}


def cli_key(config: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "--config", str(config), "create", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def chat(proc: Proc, secret: str, stream: bool = False) -> tuple[httpx.Response, dict | None]:
    body = {"model": "tiny-chat", "messages": HI, "max_tokens": 3}
    headers = {"Authorization": f"Bearer {secret}"}
    if not stream:
        r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        return r, (r.json().get("usage") if r.status_code == 200 else None)
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        lines = list(r.iter_lines())
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    return r, [json.loads(x[6:]) for x in lines if x.startswith("data: {")][-1]["usage"]


def start(config: Path, folder: Path, name: str, monkeypatch) -> Proc:
    monkeypatch.setenv("TIERGATE_KEYS_ADMIN", "key-admin")
    return Proc(config, KEYS, folder / f"{name}.log")


def ready(*procs: Proc) -> None:
    """Wait for every process to answer /healthz (importing diffusers and torch takes long on a
    busy machine, so the wait is longer than Proc.ready's)."""
    deadline = time.time() + 180
    for p in procs:
        while True:
            try:
                if httpx.get(f"{p.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if p.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"tiergate did not start:\n{p.log.read_text()[-3000:]}")
            time.sleep(0.1)


def wait_known(proc: Proc, secret: str) -> None:
    """Until ``proc`` knows a key made in another process: within a second (it refreshes every 0.5 s)."""
    at = time.monotonic()
    while httpx.get(f"{proc.url}/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 401:
        assert time.monotonic() - at < 1.0, "a key made elsewhere was not known within a second"
        time.sleep(0.02)


def test_two_processes_on_one_redis_share_limits_revokes_and_usage(tiny_chat, tmp_path, monkeypatch):
    with redis_server(tmp_path) as url:
        config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, f"batch:\n  store: {url}\n")
        made = cli_key(config, "--tier", "free", "--name", "shared", "--limit", "requests_per_min=5")
        secret, key_id = made["value"], made["id"]
        a, b = start(config, tmp_path, "a", monkeypatch), start(config, tmp_path, "b", monkeypatch)
        ready(a, b)
        for p in (a, b):  # each loads its model first, so the counted requests come quickly
            assert chat(p, KEYS["paid"])[0].status_code == 200
        remaining = []
        for p in (a, b, a, b, a):
            r, _ = chat(p, secret)
            assert r.status_code == 200, r.text
            remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [4, 3, 2, 1, 0]
        for p in (b, a):  # the sixth is refused whichever process gets it
            r, _ = chat(p, secret)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert r.headers["x-ratelimit-limit-requests"] == "5" and int(r.headers["retry-after"]) >= 1
        usage = httpx.get(f"{b.url}/v1/usage", headers={"Authorization": f"Bearer {secret}"}).json()["data"]
        assert usage[0]["requests"] == 5

        # a revoke on one process is seen by every process within a second
        revoked = httpx.delete(f"{a.url}/admin/keys/{key_id}", headers={"Authorization": "Bearer key-admin"})
        assert revoked.status_code == 200
        at = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < 2 and time.monotonic() - at < 3:
            for p in (a, b):
                if p.url not in seen and httpx.get(f"{p.url}/v1/models",
                                                   headers={"Authorization": f"Bearer {secret}"}).status_code == 401:
                    seen[p.url] = time.monotonic() - at
            time.sleep(0.02)
        assert len(seen) == 2 and max(seen.values()) < 1.0, seen

        # usage written by a process killed right after its response, read from the other
        other = cli_key(config, "--tier", "paid", "--name", "kill")
        wait_known(b, other["value"])  # a key made elsewhere reaches a process within its refresh
        r, first = chat(b, other["value"])
        assert r.status_code == 200, r.text
        r2, second = chat(b, other["value"], stream=True)
        b.kill9()
        rows = httpx.get(f"{a.url}/admin/usage", params={"key": other["id"]},
                         headers={"Authorization": "Bearer key-admin"}).json()["data"]
        assert [(x["requests"], x["input_tokens"], x["output_tokens"]) for x in rows] == \
            [(2, first["prompt_tokens"] + second["prompt_tokens"], first["completion_tokens"] + second["completion_tokens"])]
        a.proc.terminate()
        a.proc.wait(30)
        logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
        for s in (secret, other["value"]):
            assert s.removeprefix("sk-tg-") not in logs
        assert key_id in logs  # the request log names keys by id

        async def stored_keys() -> bytes:
            store = RedisAccounts(url)
            await store.open()
            raw = b""
            async for k in store._r.scan_iter("tg:acct:*"):
                raw += k + (await store._r.dump(k) or b"")
            await store.close()
            return raw

        raw = asyncio.run(stored_keys())
        assert raw and all(s.removeprefix("sk-tg-").encode() not in raw for s in (secret, other["value"]))


def test_usage_survives_kill_9_right_after_the_response_sqlite(tiny_chat, tmp_path, monkeypatch):
    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)}, "batch:\n  store: sqlite\n")
    made = cli_key(config, "--tier", "paid")
    p = start(config, tmp_path, "one", monkeypatch)
    ready(p)
    totals = [0, 0]
    for stream in (False, True, False, True):
        _, usage = chat(p, made["value"], stream)
        totals[0] += usage["prompt_tokens"]
        totals[1] += usage["completion_tokens"]
    p.kill9()  # at once: the last record was written before [DONE] went out

    async def read():
        store = SQLiteAccounts(tmp_path / "tiergate-data" / "accounts.sqlite3")
        await store.open()
        try:
            return await store.usage(made["id"], None, None, None)
        finally:
            await store.close()

    [row] = asyncio.run(read())
    assert (row.usage.requests, row.usage.input_tokens, row.usage.output_tokens) == (4, *totals)
    assert row.usage.gpu_seconds > 0 and row.tier == "paid" and row.model == "tiny-chat"
    # the usage journal: the killed server's was folded and removed by the store opened after it,
    # which removed its own on closing, as the key command did
    assert list((tmp_path / "tiergate-data" / "accounts.sqlite3.usage").iterdir()) == []
