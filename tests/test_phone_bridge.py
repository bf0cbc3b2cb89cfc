"""scripts/phone_bridge.py: a phone call as Twilio's Media Streams carry it, bridged to a voice
conversation on this server. The test plays Twilio: it connects to the bridge's media stream,
says a question in 20 ms frames of G.711 mu-law (espeak-ng's speech), hears the agent's reply
come back as mu-law media events each followed by a mark, then speaks over the reply and gets
Twilio's ``clear`` while tiergate truncates the reply at what was heard."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
import websockets

from tests.helpers import RunningServer, bound_socket, spoken, start_server, write_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import phone_bridge  # noqa: E402

RATE = 8000  # Twilio's audio: G.711 mu-law at 8 kHz, 20 ms (160 bytes) a media event


@pytest.fixture(scope="module")
def server(tiny_stt, tiny_chat, tiny_tts, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("phone")
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-stt": ("stt", tiny_stt),
                                                 "tiny-tts": ("tts", tiny_tts)}))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def bridge(server) -> str:
    app = phone_bridge.create_app(server.url, server.keys["paid"], "tiny-chat", "Answer briefly.", "alloy")
    sock = bound_socket()
    port = sock.getsockname()[1]
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=running.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert time.monotonic() < deadline, "the bridge did not start"
        time.sleep(0.05)
    yield f"ws://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


def mulaw(x: np.ndarray) -> bytes:
    from workers.audio import G711Stream

    encoder = G711Stream("pcmu", RATE, encode=True)
    return encoder.feed((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()) + encoder.flush()


def test_a_call_is_answered_in_mulaw_and_the_caller_can_interrupt(server, bridge, caplog):
    question = mulaw(np.concatenate([spoken("Where is the gold hidden?", rate=RATE), np.zeros(RATE, np.float32)]))
    interruption = mulaw(spoken("Wait, stop, listen to me please.", rate=RATE))

    async def call():
        got: list[dict] = []
        async with websockets.connect(bridge + "/media-stream") as twilio:
            clock = 0

            async def say(audio: bytes) -> None:
                nonlocal clock
                for i in range(0, len(audio), 160):
                    await twilio.send(json.dumps({"event": "media", "media": {
                        "timestamp": str(clock), "payload": base64.b64encode(audio[i:i + 160]).decode()}}))
                    clock += 20

            async def until(enough) -> None:
                async with asyncio.timeout(90):
                    while not enough():
                        got.append(json.loads(await twilio.recv()))

            await twilio.send(json.dumps({"event": "start", "start": {"streamSid": "MZ0001"}}))
            await say(question)
            await until(lambda: sum(len(base64.b64decode(m["media"]["payload"])) for m in got
                                    if m["event"] == "media") >= RATE // 2)  # half a second of the reply
            heard = len(got)
            await say(interruption)  # the marks are never echoed: all of it is still queued at "Twilio"
            await until(lambda: any(m["event"] == "clear" for m in got[heard:]))
            async with asyncio.timeout(30):  # tiergate's answer to the truncate, logged by the bridge
                while not [r for r in caplog.records if r.name == "phone_bridge"]:
                    await asyncio.sleep(0.05)
            await twilio.send(json.dumps({"event": "stop"}))
        return got

    with caplog.at_level(logging.INFO, logger="phone_bridge"):
        got = asyncio.run(call())
    media = [m for m in got if m["event"] == "media"]
    assert media and all(m["streamSid"] == "MZ0001" for m in media)
    kinds = [m["event"] for m in got]
    assert all(kinds[kinds.index("media", i):][1] == "mark" for i in range(len(kinds)) if kinds[i] == "media")
    reply = b"".join(base64.b64decode(m["media"]["payload"]) for m in media)
    from workers.audio import G711Stream

    decoded = np.frombuffer(G711Stream("pcmu", RATE, encode=False).feed(reply), "<i2")
    assert np.abs(decoded).max() > 1000  # speech, not silence
    assert "clear" in kinds
    said = [r for r in caplog.records if r.name == "phone_bridge"]
    assert [r.levelno for r in said] == [logging.INFO] and "after hearing" in said[0].getMessage()  # truncated
