"""Test helpers: a real uvicorn server on 127.0.0.1 in a background thread, on a spare port."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import pytest
import uvicorn

from batch.runner import Runner
from gateway.app import build_services, create_app
from gateway.auth import KeyRing
from gateway.cli import server_config
from gateway.config import load_config
from gateway.service import Services


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from benchlib import spare_port  # noqa: E402,F401  (for servers in processes of their own)


def bound_socket(port: int = 0) -> socket.socket:
    """A listening-to-be socket on 127.0.0.1, on ``port`` or one the kernel chose: for a server in
    this process, which is handed the socket itself, so no other process can take its port first."""
    sock = socket.socket()
    # (so that a server can start again where one was: its connections, which inherit this, may linger)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@dataclass
class RunningServer:
    url: str
    keys: dict[str, str]
    services: Services
    batches: Runner  # the batch runner
    server: uvicorn.Server
    thread: threading.Thread
    app: Any = None  # the Starlette app (its ``state``)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the server's event loop (for inspecting its state safely)."""
        fut = asyncio.run_coroutine_threadsafe(_as_coro(fn, *args), self.loop)
        return fut.result(10)

    def wait(self, coro):
        """Run the coroutine ``coro`` on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def _as_coro(fn, *args):
    return fn(*args)


TIERS = ["paid", "subscriber", "free", "batch"]


def write_config(folder: Path, models: dict[str, tuple[str, Path]], extra: str = "", engine: str = "transformers") -> Path:
    lines = ["tiers:"]
    for t in TIERS:
        lines += [f"  - name: {t}", f"    keys_env: TEST_KEYS_{t.upper()}", "    max_inflight: 4",
                  "    max_queued: 64", "    latency_target_s: 600"] + (["    batch: true"] if t == "batch" else [])
    lines.append("models:")
    for name, (kind, path) in models.items():
        lines += [f"  - name: {name}", f"    kind: {kind}", f"    path: {path}"]
        if kind == "chat":  # vLLM engines take ~20 s to start: only the tests that want one ask
            lines.append(f"    engine: {engine}")
    lines += ["gpu:", "  device: cpu", "  vram_budget: 4GiB"]
    path = folder / "tiers.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def declare_vram(config: Path, vram: str, *paths: Path) -> None:
    """Each model at ``paths`` in a config ``write_config`` wrote declared ``vram`` (``"3GiB"``)."""
    text = config.read_text()
    for path in paths:
        assert f"    path: {path}\n" in text, f"no model at {path} in {config}"
        text = text.replace(f"    path: {path}\n", f"    path: {path}\n    vram: {vram}\n")
    config.write_text(text)


def engine_options(config: Path, model: str, path: Path, **options: str) -> None:
    """The chat model ``model``'s entry (at ``path``) in a config ``write_config`` wrote, its
    ``engine`` given ``options`` too (``audio_input="tiny-stt"``), in either of its forms."""
    text = config.read_text()
    head = f"  - name: {model}\n    kind: chat\n    path: {path}\n    engine: "
    assert head in text, f"no chat model {model} at {path} in {config}"
    at = text.index(head) + len(head)
    end = text.index("\n", at)
    engine, given = text[at:end], ", ".join(f"{k}: {v}" for k, v in options.items())
    engine = f"{{{given}, {engine[1:]}" if engine.startswith("{") else f"{{name: {engine}, {given}}}"
    config.write_text(text[:at] + engine + text[end:])


def stand_in_batch_server(folder: Path, tiny_chat: Path, extra: str, url: str) -> RunningServer:
    """A server on tiny-chat whose batch lines calling ``url`` go to a stand-in endpoint: set
    ``srv.fake`` (an ``async (svc, caller, body)``) before submitting."""
    srv = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))

    async def endpoint(svc, caller, body):
        return await srv.fake(svc, caller, body)

    srv.batches.endpoints = {url: endpoint}
    return srv


def start_server(config_path: Path, admin: bool = True, port: int = 0) -> RunningServer:
    config = load_config(config_path)
    keys = {t: f"key-{t}-{i}" for i, t in enumerate(config.tier_names)}
    if admin:
        keys["admin"] = "key-admin"
    ring = KeyRing({t: [keys[t]] for t in config.tier_names}, [keys["admin"]] if admin else [])
    services = build_services(config, ring)
    app = create_app(services)
    sock = bound_socket(port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning"))
    holder: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        loop.run_until_complete(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    running = RunningServer(f"http://127.0.0.1:{port}", keys, services, app.state.batches, server, thread, app)
    running.loop = holder["loop"]
    return running


def vocabulary_reads(monkeypatch) -> list[str]:
    """The names of the threads that read a tokenizer's table of token bytes from now on
    (``workers.grammar.Vocabulary``: xgrammar reads the whole vocabulary), its per-folder cache
    emptied first."""
    import xgrammar

    import workers.grammar as grammar

    readers: list[str] = []
    real = xgrammar.TokenizerInfo.from_huggingface

    def counted(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", counted)
    monkeypatch.setattr(grammar, "_BYTES", {})
    return readers


CHAT_ADAPTERS = ["tiny-chat-pirate", "tiny-chat-poet"]


def stream_and_leave(url: str, headers: dict, body: dict, chunks: int = 3) -> None:
    """POST a streamed chat request (or a Responses API request) to ``url`` and close the
    connection after ``chunks`` chunks of text, as a client that leaves mid-reply."""
    import httpx

    received = 0
    with httpx.stream("POST", url, headers=headers, timeout=60, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and _text_of(json.loads(line[6:])):
                received += 1
                if received == chunks:
                    return
    raise AssertionError(f"the stream ended after {received} chunks of text, before the client left")


def _text_of(event: dict) -> str | None:
    """The text a streamed chat chunk, or a Responses API event, carries."""
    if "choices" in event:
        return event["choices"][0]["delta"].get("content")
    return event["delta"] if event.get("type") == "response.output_text.delta" else None


def adapters_yaml(demo_dir: Path) -> str:
    """The demo's two tiny-chat adapters, built in ``demo_dir``, as a tiers.yaml section."""
    from demo import build_demo_models

    built = build_demo_models(demo_dir, names=CHAT_ADAPTERS)
    return "adapters:\n" + "".join(f"  - {{name: {a}, model: tiny-chat, path: {built[a]}}}\n" for a in CHAT_ADAPTERS)


S = TypeVar("S")


def shared_store(request, folder: Path, sqlite: Callable[[Path], S], redis: Callable[[str, str], S]) -> Callable[[], S]:
    """For a fixture parametrized ``["sqlite", "redis"]``: a factory of (unopened) store instances
    that share one backing store, as processes do: ``sqlite(<folder>/batches.sqlite3)``, or
    ``redis(url, prefix)`` on the session's Redis with a key prefix of the test's own."""
    if request.param == "sqlite":
        return lambda: sqlite(folder / "batches.sqlite3")
    url, prefix = request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:8]}:"
    return lambda: redis(url, prefix)


def opened(make: Callable[[], S]) -> Callable[[], Any]:
    """An async factory of ``make``'s stores, each opened (the test closes those it opened)."""
    async def factory() -> S:
        store = make()
        await store.open()
        return store

    return factory


@contextlib.contextmanager
def redis_server(folder: Path, port: int | None = None, persist: bool = False) -> Iterator[str]:
    """A throwaway redis-server on 127.0.0.1 (on ``port`` or a spare one); yields its URL. No
    persistence, unless ``persist``: then every write is in ``folder``'s append-only file before
    it is answered, and a server started again on ``folder`` has the data back."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server); "
                    "the Redis store tests need the real server")
    port = port or spare_port()
    durable = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *durable,
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.time() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.02)
    client.close()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (RGB), with a few bytes of pixels: what a
    decompression bomb, or a file cut short, looks like before it is decoded."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def recorded(fmt: str, codec: str, seconds: float, rate: int = 48000, freq: float = 440.0, channels: int = 2) -> bytes:
    """A tone (or silence, at ``freq`` 0) as browsers and phones record: encoded by FFmpeg (PyAV)."""
    import av

    layout = "stereo" if channels == 2 else "mono"
    t = np.arange(int(seconds * rate)) / rate
    x = np.tile((0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), (channels, 1))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(x, format="fltp", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def chromium(tmp_path: Path):
    """Debian's headless Chromium through Debian's chromedriver; nothing is ever downloaded."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: install Debian's chromium and chromium-driver "
                    "(scripts/test does: scripts/install_system.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager may not fetch a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1300", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def spoken(text: str, rate: int = 16000) -> np.ndarray:
    """``text`` spoken by Debian's espeak-ng (float32 mono at ``rate``), trimmed to its sound: real
    speech for the voice activity detector, made offline."""
    import soundfile as sf

    from workers.audio import resample

    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.fail("espeak-ng missing: install Debian's espeak-ng (scripts/test does: scripts/install_system.sh)")
    wav = subprocess.run([exe, "--stdout", text], check=True, capture_output=True).stdout
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    x = resample(x, sr, rate)
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return x[loud[0]: loud[-1] + 1]


def run_batch(client, endpoint: str, lines: list[dict], timeout: float = 60):
    """``lines`` as a Batch API input file, run on ``endpoint`` through the openai SDK: the batch
    once it has ended (failing the test past ``timeout`` seconds)."""
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    upload = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    deadline = time.time() + timeout
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline, batch.status
        time.sleep(0.05)
    return batch


def tiny_pdf(pages: list[str]) -> bytes:
    """A PDF with one line of Helvetica text per page, written by hand (its xref's offsets counted)."""
    objs = ["<< /Type /Catalog /Pages 2 0 R >>",
            "<< /Type /Pages /Kids [" + " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages))) + f"] /Count {len(pages)} >>",
            "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for i, text in enumerate(pages):
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET"
        objs += [f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                 f"/Contents {5 + 2 * i} 0 R >>", f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream"]
    out, offsets = b"%PDF-1.4\n", []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode() + "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    return out + f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()


class FileServer:
    """A local HTTP server of ``files`` (path -> bytes) and of what can go wrong fetching one:
    ``/moved`` redirects to the first file, ``/slow`` sends it after 3 s, anything else is a 404."""

    def __init__(self, files: dict[str, bytes]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        first = next(iter(files))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", first)
                    self.end_headers()
                    return
                if self.path == "/slow":
                    time.sleep(3)
                data = files[first] if self.path == "/slow" else files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # /slow: the gateway gave up first
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.files = files
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
