#!/usr/bin/env python
"""Voice conversations: how soon a spoken reply starts to sound in a Realtime API conversation
session (``/v1/realtime?model=tiny-chat``) and in a streamed spoken chat completion, against the
cascade a client would run itself over HTTP on the same server: a chat completion, then
``/v1/audio/speech`` of its text, streamed as PCM.

One ``tiergate serve`` process (its own process, as deployed) on the demo models (tiny-chat on
the transformers engine, tiny-tts), one client at a time; each turn asks the same question with
``--tokens`` greedy tokens, so both paths say the same words:

  realtime  a text item and ``response.create``: timed from ``response.create``'s send to the
            first ``response.output_audio.delta`` (first sound) and to ``response.done`` (whole);
  spoken    ``POST /v1/chat/completions`` streamed with ``modalities: ["text", "audio"]`` and
            ``audio: {"format": "pcm16"}``: timed from the send to the first ``delta.audio.data``
            and to ``[DONE]``;
  http      ``POST /v1/chat/completions`` streamed (the words shown as they are written, as the
            session sends them), then ``POST /v1/audio/speech`` of the whole text
            (``response_format: pcm``, streamed): timed from the chat request's send to the first
            audio bytes and to the speech's last byte. (Streaming the words is the fair baseline:
            64 tokens streamed cost ~8 ms more than the same reply read whole, over SSE and over
            the session's WebSocket alike.)

The session and the spoken chat completion say the reply a phrase at a time while it is still
written, so their first sound waits for the first phrase, not the last word. Modes alternate
within each round; medians.

Judged, for the session and for the spoken chat completion each: its first sound at most 0.8x the
HTTP cascade's, and the whole reply at most 1.2x (its phrases are several speech requests, where
the cascade makes one); ``n/a`` when other processes used more than half a core meanwhile.

    python scripts/bench_voice.py            # ~1 min on 2 quiet cores
    python scripts/bench_voice.py --smoke    # a few turns; no verdict
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import httpx  # noqa: E402
import websockets  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, judge, ratio_at_most, scratch_folder, tiergate_serve  # noqa: E402

ASK = "Tell me about the harbour."
MODES = ("realtime", "spoken", "http")
FIRST, WHOLE = 0.8, 1.2


def start_server(folder: Path, chat: Path, tts: Path, stt: Path) -> tuple[subprocess.Popen, str, str]:
    key = f"tg-bench-{secrets.token_urlsafe(12)}"
    proc, url = tiergate_serve(folder, f"""tiers:
  - {{name: paid, keys_env: TIERGATE_BENCH_KEYS_PAID, max_inflight: 16, max_queued: 64, latency_target_s: 600}}
models:
  - {{name: tiny-chat, kind: chat, path: {chat}, engine: {{name: transformers, audio_output: tiny-tts}}}}
  - {{name: tiny-tts, kind: tts, path: {tts}}}
  - {{name: tiny-stt, kind: stt, path: {stt}}}
gpu: {{device: cpu, vram_budget: 4GiB}}
gate: {{slots: 16}}
""", key)
    return proc, url, key


async def realtime_turns(url: str, key: str, tokens: int, n: int) -> list[tuple[float, float, str]]:
    """(first sound s, whole reply s, transcript) of ``n`` turns, each the first of a session of its
    own (so that each answers the same conversation; the session's opening is not timed)."""
    out = []
    for _ in range(n):
        async with websockets.connect(url.replace("http", "ws") + "/v1/realtime?model=tiny-chat",
                                      additional_headers={"Authorization": f"Bearer {key}"}, max_size=2**24) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": tokens, "audio": {"input": {"turn_detection": None}}}}))
            while json.loads(await ws.recv())["type"] != "session.updated":
                pass
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}}))
            start, first, transcript = time.perf_counter(), None, ""
            await ws.send(json.dumps({"type": "response.create"}))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_audio.delta" and first is None:
                    first = time.perf_counter() - start
                elif event["type"] == "response.output_audio_transcript.done":
                    transcript = event["transcript"]
                elif event["type"] == "error":
                    raise RuntimeError(f"realtime: {event}")
                elif event["type"] == "response.done":
                    out.append((first, time.perf_counter() - start, transcript))
                    break
    return out


async def spoken_turns(url: str, key: str, tokens: int, n: int) -> list[tuple[float, float, str]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(n):
            start, first, words = time.perf_counter(), None, []
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny-chat", "messages": [{"role": "user", "content": ASK}], "max_tokens": tokens,
                    "temperature": 0, "stream": True, "modalities": ["text", "audio"],
                    "audio": {"voice": "alloy", "format": "pcm16"}}) as chat:
                chat.raise_for_status()
                async for line in chat.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"spoken: {event}")
                    for c in event["choices"]:
                        audio = c["delta"].get("audio") or {}
                        words.append(audio.get("transcript") or "")
                        if audio.get("data") and first is None:
                            first = time.perf_counter() - start
            out.append((first, time.perf_counter() - start, "".join(words)))
    return out


async def http_turns(url: str, key: str, tokens: int, n: int) -> list[tuple[float, float, str]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(n):
            start, words = time.perf_counter(), []
            async with client.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny-chat", "messages": [{"role": "user", "content": ASK}], "max_tokens": tokens,
                    "temperature": 0, "stream": True}) as chat:
                chat.raise_for_status()
                async for line in chat.aiter_lines():
                    if line.startswith("data: {"):
                        words += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
            text, first = "".join(words), None
            async with client.stream("POST", "/v1/audio/speech", json={
                    "model": "tiny-tts", "input": text, "voice": "alloy", "response_format": "pcm"}) as speech:
                speech.raise_for_status()
                async for chunk in speech.aiter_bytes():
                    if chunk and first is None:
                        first = time.perf_counter() - start
            out.append((first, time.perf_counter() - start, text))
    return out


def run(mode: str, url: str, key: str, tokens: int, n: int) -> list[tuple[float, float, str]]:
    turns = {"realtime": realtime_turns, "spoken": spoken_turns, "http": http_turns}[mode]
    return asyncio.run(turns(url, key, tokens, n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="the reply's tokens (greedy)")
    ap.add_argument("--turns", type=int, default=8, help="per mode per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models-dir", type=Path, default=None, help="where the demo models are (built there if missing)")
    ap.add_argument("--smoke", action="store_true", help="2 turns, 1 round, 12 tokens; no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.turns, args.rounds, args.tokens = 2, 1, 12
    from demo import build_demo_models

    with scratch_folder("bench-voice-") as folder:
        models = build_demo_models(args.models_dir or folder, names=["tiny-chat", "tiny-tts", "tiny-stt"])
        proc, url, key = start_server(folder, *(models[n].resolve() for n in ("tiny-chat", "tiny-tts", "tiny-stt")))
        results: dict[str, list[list[tuple[float, float, str]]]] = {m: [] for m in MODES}
        try:
            for mode in MODES:  # warm-up: the models' loads, the first session
                run(mode, url, key, args.tokens, 1)
            with OtherLoad() as other:
                for r in range(args.rounds):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        results[mode].append(run(mode, url, key, args.tokens, args.turns))
        finally:
            proc.terminate()
            proc.wait(30)
        said = {t[2] for rounds in results.values() for turns in rounds for t in turns}
        if len(said) != 1:
            raise AssertionError(f"the paths said different words: {sorted(said)[:2]}")
        print(f"tiny-chat (transformers engine) and tiny-tts on the CPU, one tiergate serve process, one client; "
              f"{args.tokens}-token greedy replies ({len(next(iter(said)))} characters); {args.rounds} rounds alternated, "
              f"{args.turns} turns each, medians; other processes used "
              f"{other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
        print(f"{'mode':<9} {'first sound ms':>15} {'whole reply ms':>15}")
        first, whole = {}, {}
        for mode in MODES:
            first[mode] = [statistics.median(t[0] for t in turns) for turns in results[mode]]
            whole[mode] = [statistics.median(t[1] for t in turns) for turns in results[mode]]
            print(f"{mode:<9} {statistics.median(first[mode]) * 1e3:>15.1f} {statistics.median(whole[mode]) * 1e3:>15.1f}")
        why_not = other.why_not(OTHER_LOAD_LIMIT)
        targets = []
        for mode, label in (("realtime", "realtime session"), ("spoken", "spoken chat completion")):
            for name, values, limit in (("first sound", first, FIRST), ("whole reply", whole, WHOLE)):
                targets.append(ratio_at_most(f"{label} / HTTP cascade, {name}", f"{name}, {mode}/http",
                                             values[mode], values["http"], limit, why_not))
        return judge(targets, smoke=args.smoke, note="a voice conversation's spoken reply")


if __name__ == "__main__":
    sys.exit(main())
