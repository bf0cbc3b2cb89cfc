#!/usr/bin/env python3
"""A phone line for a tiergate voice agent: Twilio's Media Streams bridged to a Realtime API
conversation session, the port of OpenAI's own Twilio sample to this server.

    TIERGATE_KEY=... python scripts/phone_bridge.py --tiergate http://127.0.0.1:8000 --model tiny-chat --port 5050

Point a Twilio number's voice webhook at ``https://<this host>/incoming-call``: it answers with
TwiML that connects the call's audio to ``wss://<this host>/media-stream``. For each call the
bridge opens ``/v1/realtime?model=<model>`` on tiergate with G.711 mu-law both ways (Twilio's own
format: nothing is transcoded here), ``server_vad`` turns (with ``--idle-timeout-ms``, the agent
speaks again when the caller stays silent that long after its reply), and ``--instructions``, then:

* the caller's audio (Twilio ``media`` events, 20 ms of mu-law each) goes to
  ``input_audio_buffer.append``;
* the agent's speech (``response.output_audio.delta``) goes back as Twilio ``media`` events,
  each followed by a ``mark``, which Twilio echoes once it has played the audio before it;
* when the caller speaks over the agent (``input_audio_buffer.speech_started``) while audio is
  still unplayed, the bridge sends Twilio ``clear`` (drop what is queued) and tiergate
  ``conversation.item.truncate`` at what the caller heard, so the next reply reads only that.

The key comes from ``$TIERGATE_KEY`` (never logged). Only the bridge's own plumbing is here:
tiergate does the listening, the thinking and the speaking.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys

import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

log = logging.getLogger("phone_bridge")


def session_settings(instructions: str, voice: str, idle_timeout_ms: int | None = None) -> dict:
    mulaw = {"type": "audio/pcmu"}
    turns = {"type": "server_vad", "idle_timeout_ms": idle_timeout_ms}
    return {"type": "realtime", "instructions": instructions, "output_modalities": ["audio"],
            "audio": {"input": {"format": mulaw, "turn_detection": turns}, "output": {"format": mulaw, "voice": voice}}}


class Call:
    """One call: Twilio's socket on one side, the tiergate session on the other, and what the
    caller has heard of the agent's reply in progress."""

    def __init__(self, twilio: WebSocket, agent) -> None:
        self.twilio, self.agent = twilio, agent
        self.stream_sid: str | None = None
        self.now_ms = 0  # the call's clock: the latest inbound media timestamp
        self.reply_item: str | None = None  # the agent message being played
        self.reply_started_ms: int | None = None  # the call's time when its first audio went out
        self.marks: list[str] = []  # sent, not yet echoed: audio queued at Twilio

    async def from_twilio(self) -> None:
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                event = json.loads(await self.twilio.receive_text())
                kind = event.get("event")
                if kind == "start":
                    self.stream_sid = event["start"]["streamSid"]
                elif kind == "media":
                    self.now_ms = int(event["media"].get("timestamp", self.now_ms))
                    await self.agent.send(json.dumps({"type": "input_audio_buffer.append",
                                                      "audio": event["media"]["payload"]}))
                elif kind == "mark" and self.marks:
                    self.marks.pop(0)
                elif kind == "stop":
                    return

    async def from_agent(self) -> None:
        async for raw in self.agent:
            event = json.loads(raw)
            kind = event["type"]
            if kind == "response.output_audio.delta" and self.stream_sid is not None:
                if event["item_id"] != self.reply_item:
                    self.reply_item, self.reply_started_ms = event["item_id"], self.now_ms
                await self.twilio.send_text(json.dumps({"event": "media", "streamSid": self.stream_sid,
                                                        "media": {"payload": event["delta"]}}))
                self.marks.append(event["item_id"])
                await self.twilio.send_text(json.dumps({"event": "mark", "streamSid": self.stream_sid,
                                                        "mark": {"name": event["item_id"]}}))
            elif kind == "input_audio_buffer.speech_started":
                await self.barge_in()
            elif kind == "conversation.item.truncated":
                log.info("the caller spoke over the reply after hearing %d ms of it", event["audio_end_ms"])
            elif kind == "error":
                log.warning("tiergate: %s", event["error"].get("message"))

    async def barge_in(self) -> None:
        """The caller speaks over the agent: drop the audio Twilio still holds, and tell tiergate
        how much of the reply was heard (tiergate cancels the reply itself: interrupt_response)."""
        if not self.marks or self.reply_item is None or self.reply_started_ms is None:
            return
        heard_ms = max(0, self.now_ms - self.reply_started_ms)
        await self.twilio.send_text(json.dumps({"event": "clear", "streamSid": self.stream_sid}))
        await self.agent.send(json.dumps({"type": "conversation.item.truncate", "item_id": self.reply_item,
                                          "content_index": 0, "audio_end_ms": heard_ms}))
        self.marks.clear()
        self.reply_item, self.reply_started_ms = None, None


def create_app(tiergate: str, key: str, model: str, instructions: str, voice: str,
               idle_timeout_ms: int | None = None) -> Starlette:
    realtime = tiergate.rstrip("/").replace("http", "ws", 1) + f"/v1/realtime?model={model}"

    async def incoming_call(request: Request) -> Response:
        stream = f"wss://{request.url.netloc}/media-stream"
        twiml = f'<?xml version="1.0" encoding="UTF-8"?><Response><Connect><Stream url="{stream}"/></Connect></Response>'
        return Response(twiml, media_type="application/xml")

    async def media_stream(twilio: WebSocket) -> None:
        await twilio.accept()
        async with websockets.connect(realtime, additional_headers={"Authorization": f"Bearer {key}"}) as agent:
            await agent.send(json.dumps({"type": "session.update",
                                         "session": session_settings(instructions, voice, idle_timeout_ms)}))
            call = Call(twilio, agent)
            listening = asyncio.create_task(call.from_agent())
            try:
                await call.from_twilio()
            finally:
                listening.cancel()
                with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                    await listening
        with contextlib.suppress(RuntimeError):
            await twilio.close()

    return Starlette(routes=[Route("/incoming-call", incoming_call, methods=["GET", "POST"]),
                             WebSocketRoute("/media-stream", media_stream)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiergate", default=os.environ.get("TIERGATE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--model", default="tiny-chat", help="the chat model that answers the phone")
    p.add_argument("--instructions", default="You answer the phone. Be brief and friendly.")
    p.add_argument("--voice", default="alloy")
    p.add_argument("--idle-timeout-ms", type=int, default=None,
                   help="after the agent's reply has played, this long a silence makes it speak again")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=5050)
    args = p.parse_args(argv)
    key = os.environ.get("TIERGATE_KEY")
    if not key:
        p.error("set TIERGATE_KEY to a tiergate API key")
    logging.basicConfig(level=logging.INFO)
    app = create_app(args.tiergate, key, args.model, args.instructions, args.voice, args.idle_timeout_ms)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
