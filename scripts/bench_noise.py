"""Noise reduction in realtime sessions: what denoising a stream costs, against the library's own path.

    python scripts/bench_noise.py            # 12 s of noisy speech, 20 ms pieces, 5 rounds (~15 s)
    python scripts/bench_noise.py --smoke    # 2 s, 1 round: the code path, no verdict

A session with ``noise_reduction`` feeds every append through ``workers.audio.NoiseReducer``:
RNNoise at 48 kHz, the 24 kHz stream taken up and back down by a windowed-sinc low-pass with its
state kept (docs/MODALITIES.md, "Noise reduction"). The baseline is pyrnnoise's own streaming
path, ``RNNoise.denoise_chunk``, fed the same pieces: the same RNNoise library, with its
resampling through FFmpeg filter graphs (audiolab), which hold back a varying part of the stream.
Both are timed in CPU seconds per second of audio (``time.process_time``, one torch thread);
Silero VAD's detector, which every ``server_vad`` session runs on the same audio, is printed
beside them for scale, not judged.

Target: NoiseReducer's CPU per second of audio at most 1.0x the library path's (median of the
rounds' ratios); n/a while other processes use more than half a core (``benchlib.OtherLoad``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, judge, ratio_at_most  # noqa: E402

RATE = 24_000  # a realtime session's
TARGET = 1.0


def noisy_speech(seconds: float) -> np.ndarray:
    """espeak-ng speech (sentences with pauses) under white noise at -26 dB: int16 at RATE."""
    import io

    import soundfile as sf

    from workers.audio import resample

    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SystemExit("espeak-ng missing: install Debian's espeak-ng (scripts/install_system.sh)")
    wav = subprocess.run([exe, "--stdout", "The quick brown fox jumps over the lazy dog. Then it rests a while."],
                         check=True, capture_output=True).stdout
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    x = resample(x, sr, RATE)
    x = np.tile(x, int(np.ceil(seconds * RATE / len(x))))[: int(seconds * RATE)]
    x = x + np.random.default_rng(0).standard_normal(len(x)).astype(np.float32) * 0.05
    return (np.clip(x, -1, 1) * 32767).astype(np.int16)


def ours(pieces: list[np.ndarray]) -> tuple[float, int]:
    from workers.audio import NoiseReducer

    reducer = NoiseReducer(RATE)
    started, out = time.process_time(), 0
    for piece in pieces:
        out += len(reducer.feed(piece))
    spent = time.process_time() - started
    reducer.close()
    return spent, out


def library(pieces: list[np.ndarray]) -> tuple[float, int]:
    from pyrnnoise import RNNoise

    denoiser = RNNoise(RATE)
    started, out = time.process_time(), 0
    for piece in pieces:
        for _, frame in denoiser.denoise_chunk(piece[None, :], partial=False):
            out += frame.shape[-1]
    return time.process_time() - started, out


def silero(pieces: list[np.ndarray]) -> tuple[float, int | None]:
    from workers.stt import ServerVad, TurnDetector

    detector = TurnDetector(ServerVad(), RATE)
    started = time.process_time()
    for piece in pieces:
        detector.feed(piece.astype(np.float32) / 32768)
    spent = time.process_time() - started
    detector.close()
    return spent, None  # it says where speech is; it gives back no samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="of audio per round")
    ap.add_argument("--piece-ms", type=int, default=20, help="each append's audio (a microphone's frame)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="2 s, 1 round; no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.rounds = 2.0, 1
    import torch

    torch.set_num_threads(1)
    audio = noisy_speech(args.seconds)
    step = RATE * args.piece_ms // 1000
    pieces = [audio[i:i + step] for i in range(0, len(audio), step)]
    paths = {"NoiseReducer": ours, "pyrnnoise": library, "silero vad": silero}
    for run in paths.values():  # warm-up: the libraries' loads, the first frames
        run(pieces[:50])
    spent: dict[str, list[float]] = {name: [] for name in paths}
    made: dict[str, int | None] = {}
    with OtherLoad() as other:
        for r in range(args.rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                cpu, made[name] = paths[name](pieces)
                spent[name].append(cpu / args.seconds * 1000)
    print(f"{args.seconds:g} s of noisy speech at {RATE} Hz in {args.piece_ms} ms pieces, one thread; "
          f"{args.rounds} rounds alternated, medians; other processes used "
          f"{other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
    print(f"{'path':<14} {'CPU ms per s of audio':>22} {'sessions a core keeps up with':>30} {'samples out / in':>17}")
    for name, values in spent.items():
        per_s = statistics.median(values)
        ratio = "-" if made[name] is None else f"{made[name] / len(audio):.4f}"
        print(f"{name:<14} {per_s:>22.1f} {1000 / per_s:>30.1f} {ratio:>17}")
    target = ratio_at_most("NoiseReducer/pyrnnoise CPU per second of audio", "NoiseReducer/pyrnnoise CPU",
                           spent["NoiseReducer"], spent["pyrnnoise"], TARGET, other.why_not(OTHER_LOAD_LIMIT))
    return judge([target], smoke=args.smoke, note="the library's own streaming path as the baseline")


if __name__ == "__main__":
    sys.exit(main())
