#!/usr/bin/env python
"""Turn detection: how soon after the user stops speaking a Realtime API session ends the turn,
with ``semantic_vad`` (a model's judgement at each pause: gateway/turn_end.py) against
``server_vad`` at its default 500 ms of silence, on one ``tiergate serve`` process (its own
process, as deployed) with the demo's tiny-stt.

The judge is ``demo.chat.build_sure_turn_judge`` (tiny-chat made sure that every message has
ended), named by tiny-stt's ``turn_model``: a judgement of p = 1, so ``semantic_vad`` asks for
the same 500 ms wait as ``server_vad`` and what it adds is the judgement's own time (a
transcription of the turn so far and a prompt pass of the judge, started at a 200 ms pause). A
judgement later than the 300 ms left before the wait ends the turn late by the difference.

Each session speaks a sentence (Debian's espeak-ng) again and again: 0.4 s of silence, the speech,
1.5 s of silence, sent in 40 ms chunks 40 ms apart (as a microphone sends them). A turn is timed
from the send of the chunk that holds its speech's last sample to its ``speech_stopped`` event.
One session, then ``--sessions`` at once, their starts spread evenly over a turn's length; the
modes alternate within each round; medians of the rounds' p50s. Beside each row: transcriptions and
judge's completions per turn (from /metrics).

Judged: semantic_vad/server_vad p50 <= 1.2x at 1 and at ``--sessions`` sessions (``n/a`` when
processes outside this benchmark used more than half a core meanwhile).

    python scripts/bench_turns.py            # ~2.5 min (the audio is real time)
    python scripts/bench_turns.py --smoke    # one turn a mode, sent as fast as it goes; no verdict
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import websockets  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, judge, pct, ratio_at_most, scratch_folder, tiergate_serve  # noqa: E402

RATE = 24000
CHUNK = 960  # 40 ms
TARGET = 1.2
MODES = {"server_vad": {"type": "server_vad", "silence_duration_ms": 500},
         "semantic_vad": {"type": "semantic_vad", "eagerness": "auto"}}


def speech(text: str = "Could you book me a table for two tonight?") -> np.ndarray:
    """``text`` said by espeak-ng, float32 at 24 kHz, trimmed to its sound."""
    import soundfile as sf

    from workers.audio import resample

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("espeak-ng is missing: install Debian's espeak-ng (scripts/test does)")
    x, sr = sf.read(io.BytesIO(subprocess.run([exe, "--stdout", text], check=True, capture_output=True).stdout),
                    dtype="float32")
    x = resample(x, sr, RATE)
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return x[loud[0]:loud[-1] + 1]


def start_server(folder: Path, models: Path) -> tuple[subprocess.Popen, str, str]:
    from demo import build_demo_models
    from demo.chat import build_sure_turn_judge

    built = build_demo_models(models, names=["tiny-chat", "tiny-stt"])
    sure = folder / "sure-turn-judge"
    build_sure_turn_judge(built["tiny-chat"], sure)
    key = f"tg-bench-{secrets.token_urlsafe(12)}"
    proc, url = tiergate_serve(folder, f"""tiers:
  - {{name: paid, keys_env: TIERGATE_BENCH_KEYS_PAID, max_inflight: 16, max_queued: 64, latency_target_s: 600}}
models:
  - {{name: sure-judge, kind: chat, path: {sure}, engine: transformers}}
  - {{name: tiny-stt, kind: stt, path: {built["tiny-stt"].resolve()}, turn_model: sure-judge}}
gpu: {{device: cpu, vram_budget: 4GiB}}
gate: {{slots: 16}}
""", key)
    return proc, url, key


LEAD_S, TAIL_S = 0.4, 1.5


PACE = 1.0  # seconds of sending per second of audio (the smoke run: 0, as fast as it goes)


async def session(url: str, key: str, mode: str, voice: np.ndarray, turns: int, out: list[float],
                  delay: float = 0.0) -> None:
    """One transcription session speaking ``turns`` turns in real time, the first ``delay`` s
    late; each turn's latency in ``out``."""
    await asyncio.sleep(delay)
    lead, tail = np.zeros(int(LEAD_S * RATE), np.float32), np.zeros(int(TAIL_S * RATE), np.float32)
    stream = np.concatenate([lead, voice, tail])
    pcm = (np.clip(stream, -1, 1) * 32767).astype("<i2")
    last_chunk = (len(lead) + len(voice) - 1) // CHUNK
    async with websockets.connect(url.replace("http", "ws") + "/v1/realtime?intent=transcription",
                                  additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "transcription": {"model": "tiny-stt", "language": "en"}, "turn_detection": MODES[mode]}}}}))
        stopped: asyncio.Queue[float] = asyncio.Queue()

        async def read() -> None:
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "input_audio_buffer.speech_stopped":
                    stopped.put_nowait(time.perf_counter())
                elif event["type"] == "error":
                    raise RuntimeError(f"{mode}: {event['error']}")

        reader = asyncio.create_task(read())
        try:
            for _ in range(turns):
                start = time.perf_counter()
                for i in range(0, len(pcm), CHUNK):
                    await asyncio.sleep(max(0.0, start + PACE * i / RATE - time.perf_counter()))  # real time
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[i:i + CHUNK].tobytes()).decode()}))
                    if i // CHUNK == last_chunk:
                        spoke = time.perf_counter()
                async with asyncio.timeout(30):
                    out.append(await stopped.get() - spoke)
        finally:
            reader.cancel()


async def run(url: str, key: str, mode: str, voice: np.ndarray, sessions: int, turns: int,
              in_step: bool = False) -> list[float]:
    """``sessions`` sessions, their starts spread evenly over one turn's length (people do not
    speak in step), or with ``in_step`` all at once: every pause, and so every judgement, in the
    same instant."""
    out: list[float] = []
    period = 0.0 if in_step else LEAD_S + len(voice) / RATE + TAIL_S
    await asyncio.gather(*(session(url, key, mode, voice, turns, out, i * period / sessions) for i in range(sessions)))
    return out


def requests(url: str) -> dict[str, float]:
    """Requests served so far by endpoint, from /metrics (a completion is served as chat)."""
    import re

    import httpx

    out: dict[str, float] = {}
    for endpoint, count in re.findall(r'^tiergate_request_seconds_count\{[^}]*endpoint="([a-z_]+)"[^}]*\} (\S+)$',
                                      httpx.get(f"{url}/metrics").text, re.M):
        out[endpoint] = out.get(endpoint, 0.0) + float(count)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="per session per mode per round (1 session: 3x)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models-dir", type=Path, default=None, help="where tiny-chat and tiny-stt are (built if missing)")
    ap.add_argument("--in-step", action="store_true",
                    help="the sessions speak in step (the worst case: every judgement at once) instead of spread")
    ap.add_argument("--smoke", action="store_true", help="1 session, 1 turn a mode, 1 round; no verdict")
    args = ap.parse_args()
    if args.smoke:
        global PACE
        args.sessions, args.turns, args.rounds, PACE = 1, 1, 1, 0.0
    with scratch_folder("bench-turns-") as folder:
        voice = speech()
        proc, url, key = start_server(folder, args.models_dir or folder)
        levels = (1,) if args.smoke else (1, args.sessions)
        results: dict[tuple[str, int], list[list[float]]] = {}
        served: dict[tuple[str, int], dict[str, float]] = {}  # requests per turn, by endpoint
        try:
            for mode in MODES if not args.smoke else ():  # warm-up: the models' loads, the detectors
                asyncio.run(run(url, key, mode, voice, 1, 1))
            with OtherLoad() as other:
                for r in range(args.rounds):
                    for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                        for n in levels:
                            turns = args.turns * (3 if n == 1 and not args.smoke else 1)
                            before = requests(url)
                            results.setdefault((mode, n), []).append(asyncio.run(run(url, key, mode, voice, n, turns,
                                                                                                   args.in_step)))
                            after = requests(url)
                            for endpoint in ("transcriptions", "chat"):
                                count = served.setdefault((mode, n), {})
                                count[endpoint] = count.get(endpoint, 0.0) + after.get(endpoint, 0.0) - before.get(endpoint, 0.0)
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"tiny-stt and a sure judge on the CPU, one tiergate serve process; {len(voice) / RATE:.1f} s of speech a "
              f"turn, in real time, sessions {'in step' if args.in_step else 'spread'}; {args.rounds} rounds alternated, medians over them; other processes used "
              f"{other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
        print(f"{'mode':<13} {'sessions':>8} {'turns':>6} {'p50 ms':>8} {'p99 ms':>8} {'stt/turn':>9} {'judge/turn':>10}"
              "   (ms: speech's end to speech_stopped)")
        p50 = {}
        for (mode, n), rounds in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            p50[(mode, n)] = [pct(x, 50) * 1000 for x in rounds]
            turns = sum(map(len, rounds))
            print(f"{mode:<13} {n:>8} {turns:>6} {statistics.median(p50[(mode, n)]):>8.1f} "
                  f"{statistics.median(pct(x, 99) * 1000 for x in rounds):>8.1f} "
                  f"{served[(mode, n)]['transcriptions'] / turns:>9.2f} {served[(mode, n)]['chat'] / turns:>10.2f}")
        why_not = other.why_not(OTHER_LOAD_LIMIT)
        sessions = {n: f"{n} session{'s' if n > 1 else ''}" for n in levels}
        targets = [ratio_at_most(f"semantic_vad/server_vad turn end p50 at {sessions[n]}",
                                 f"semantic_vad/server_vad p50 at {sessions[n]}", p50[("semantic_vad", n)],
                                 p50[("server_vad", n)], TARGET, why_not) for n in levels]
        return judge(targets, smoke=args.smoke, note="what a judgement adds to a turn's end")


if __name__ == "__main__":
    sys.exit(main())
