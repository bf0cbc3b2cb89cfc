#!/usr/bin/env python
"""Live transcription: what a Realtime API session (``/v1/realtime``, a WebSocket) adds to an
utterance's latency over uploading the same audio to ``/v1/audio/transcriptions``, on one
``tiergate serve`` process (its own process, as deployed) with the demo's tiny-stt.

Each client sends the same utterance (2 s of PCM16 at 24 kHz) again and again, closed loop:

  realtime  one session per client, ``turn_detection: null``; an utterance is one
            ``input_audio_buffer.append`` (all its audio) and a ``commit``, timed from the
            append's send to the ``...transcription.completed`` event;
  http      one keep-alive connection per client; an utterance is a multipart upload of the same
            audio as a WAV, timed from the request's send to the response's end.

Modes alternate within each round (so drifting machine load hits both); p50 / p99 per mode and
client count, medians over the rounds. The work behind both is the same serving core
(``gateway.audio.stream_transcription``: gate, lease, the model); what differs is the transport,
the parsing (base64 JSON against multipart and a WAV decode) and the events.

Judged: realtime/http p50 latency <= 1.1x at 1 and at ``--clients`` concurrent clients (``n/a``
when processes outside this benchmark used more than half a core meanwhile).

    python scripts/bench_realtime.py            # ~1 min on 2 quiet cores
    python scripts/bench_realtime.py --smoke    # a few utterances; no verdict
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
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
import numpy as np  # noqa: E402
import websockets  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, judge, pct, ratio_at_most, scratch_folder, tiergate_serve  # noqa: E402

RATE = 24000
TARGET = 1.1
MODES = ("realtime", "http")


def utterance(seconds: float = 2.0) -> np.ndarray:
    """A fixed, speech-like signal (a gliding tone with a syllable rhythm): the model's work is
    the same on both paths, whatever it hears."""
    t = np.arange(int(seconds * RATE)) / RATE
    pitch = 140 + 60 * np.sin(2 * np.pi * 0.7 * t)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.3 * envelope * np.sin(2 * np.pi * np.cumsum(pitch) / RATE)).astype(np.float32)


def start_server(folder: Path, model: Path) -> tuple[subprocess.Popen, str, str]:
    key = f"tg-bench-{secrets.token_urlsafe(12)}"
    proc, url = tiergate_serve(folder, f"""tiers:
  - {{name: paid, keys_env: TIERGATE_BENCH_KEYS_PAID, max_inflight: 16, max_queued: 64, latency_target_s: 600}}
models:
  - {{name: tiny-stt, kind: stt, path: {model}}}
gpu: {{device: cpu, vram_budget: 4GiB}}
gate: {{slots: 16}}
""", key)
    return proc, url, key


async def realtime_client(url: str, key: str, audio_b64: str, n: int, out: list[float]) -> None:
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime",
                                  additional_headers={"Authorization": f"Bearer {key}"}, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        for _ in range(n):
            start = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio_b64}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "conversation.item.input_audio_transcription.completed":
                    break
                if event["type"] in ("error", "conversation.item.input_audio_transcription.failed"):
                    raise RuntimeError(f"realtime: {event}")
            out.append(time.perf_counter() - start)


async def http_client(url: str, key: str, wav: bytes, n: int, out: list[float]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(n):
            start = time.perf_counter()
            r = await client.post("/v1/audio/transcriptions", files={"file": ("u.wav", wav)}, data={"model": "tiny-stt"})
            r.raise_for_status()
            out.append(time.perf_counter() - start)


async def run(mode: str, url: str, key: str, payload: str | bytes, clients: int, per_client: int) -> list[float]:
    out: list[float] = []
    client = realtime_client if mode == "realtime" else http_client
    await asyncio.gather(*(client(url, key, payload, per_client, out) for _ in range(clients)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--utterances", type=int, default=24, help="per client per mode per round (1 client: 3x)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models-dir", type=Path, default=None, help="where tiny-stt is (built there if missing)")
    ap.add_argument("--smoke", action="store_true", help="2 clients, 2 utterances, 1 round; no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.utterances, args.rounds = 2, 2, 1
    from demo import build_demo_models
    import soundfile as sf

    with scratch_folder("bench-realtime-") as folder:
        model = build_demo_models(args.models_dir or folder, names=["tiny-stt"])["tiny-stt"].resolve()
        audio = utterance()
        pcm = (audio * 32767).astype("<i2")
        payloads = {"realtime": base64.b64encode(pcm.tobytes()).decode()}
        wav = io.BytesIO()
        sf.write(wav, pcm.astype(np.float32) / 32768, RATE, format="WAV", subtype="PCM_16")
        payloads["http"] = wav.getvalue()
        proc, url, key = start_server(folder, model)
        results: dict[tuple[str, int], list[list[float]]] = {}
        try:
            for mode in MODES:  # warm-up: the model's load, the first session
                asyncio.run(run(mode, url, key, payloads[mode], 1, 2))
            with OtherLoad() as other:
                for r in range(args.rounds):
                    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                        for clients in (1, args.clients):
                            per = args.utterances * (3 if clients == 1 else 1) if not args.smoke else args.utterances
                            results.setdefault((mode, clients), []).append(
                                asyncio.run(run(mode, url, key, payloads[mode], clients, per)))
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"tiny-stt on the CPU, one tiergate serve process; {len(audio) / RATE:.1f} s utterances; {args.rounds} rounds "
              f"alternated, medians over them; other processes used "
              f"{other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
        print(f"{'mode':<9} {'clients':>7} {'utterances':>10} {'p50 ms':>8} {'p99 ms':>8}")
        p50 = {}
        for (mode, clients), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            p50[(mode, clients)] = [pct(x, 50) * 1000 for x in rounds]
            print(f"{mode:<9} {clients:>7} {sum(map(len, rounds)):>10} {statistics.median(p50[(mode, clients)]):>8.1f} "
                  f"{statistics.median(pct(x, 99) * 1000 for x in rounds):>8.1f}")
        why_not = other.why_not(OTHER_LOAD_LIMIT)
        targets = [ratio_at_most(f"realtime/http p50 latency at {n} client{'s' if n > 1 else ''}",
                                 f"realtime/http p50 at {n} clients", p50[("realtime", n)], p50[("http", n)], TARGET,
                                 why_not) for n in (1, args.clients)]
        return judge(targets, smoke=args.smoke, note="what a realtime session adds over an upload")


if __name__ == "__main__":
    sys.exit(main())
