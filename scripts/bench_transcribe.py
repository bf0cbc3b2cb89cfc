"""Shared decodes for transcriptions: concurrent transcription requests on one loaded
``STTWorker`` with their audio windows decoded together (``STTWorker._run``, the worker's
default) against each request decoding its own windows, one at a time, on its own thread
(``share_decodes = False``: the path before 2026-12-06), in this one process, rounds alternated so
drifting machine load hits both.

Two loads on the demo's tiny-stt (a Whisper of random weights; its decoder writes up to 24
tokens a window):

- ``--clients`` threads send short clips (2-6 s, one window each) back to back (closed loop),
  as a voice app's backend or a realtime server's turns do. Printed per mode: requests per
  second, p50 / p99 latency, ``generate`` calls per request.
- One long file (``--long-s`` seconds, cut into 30 s windows), alone: its time in each mode,
  ``batch_windows`` (8) windows to a decode against one window at a time.

Judged: shared/own throughput at ``--clients`` concurrent requests >= 1.5x, and the long file's
own/shared time >= 1.5x (``n/a`` when processes outside this one used more than half a core
meanwhile). What a decode shares is its fixed cost per token (the decoder's Python and kernel
launches per layer, and on a GPU the weights read once for every row); with one client there is
nothing to share (printed, not judged).

    python scripts/bench_transcribe.py            # ~2 min on 2 quiet cores
    python scripts/bench_transcribe.py --smoke    # a few requests; no verdict
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, at_least, closed_loop, judge, pct, scratch_folder  # noqa: E402
from workers.base import ModelSpec, StepContext  # noqa: E402
from workers.stt import STTWorker, TranscriptionRequest  # noqa: E402

TARGET = 1.5
RATE = 16000
REQUEST = TranscriptionRequest(language="en")


def clip(seconds: float, seed: int) -> np.ndarray:
    """A gliding tone under a little noise: each clip its own audio."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    tone = 0.3 * np.sin(2 * np.pi * (150 + 20 * seed % 200 + 40 * t) * t)
    return (tone + rng.normal(0, 0.02, len(t))).astype(np.float32)


def run(worker: STTWorker, clips: list[np.ndarray], clients: int, requests: int) -> dict:
    """``requests`` transcriptions by ``clients`` closed-loop threads: throughput, latencies, decodes."""
    decodes = worker.decodes
    wall, latencies = closed_loop(lambda i: worker.transcribe(clips[i % len(clips)], REQUEST, StepContext()),
                                  clients, requests)
    return {"rps": requests / wall, "p50": pct(latencies, 50) * 1e3, "p99": pct(latencies, 99) * 1e3,
            "decodes": (worker.decodes - decodes) / requests}


def long_file(worker: STTWorker, audio: np.ndarray) -> float:
    start = time.perf_counter()
    worker.transcribe(audio, REQUEST, StepContext())
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="per mode per round")
    parser.add_argument("--long-s", type=float, default=240.0, help="the long file's length in seconds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=None, help="where tiny-stt is (built there if missing)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.requests, args.long_s, args.rounds = 2, 4, 35.0, 1
    torch.set_num_threads(1)
    from demo import build_demo_models

    with scratch_folder("bench-transcribe-") as scratch:
        folder = args.models_dir or scratch
        path = build_demo_models(folder, names=["tiny-stt"])["tiny-stt"]
        worker = STTWorker(ModelSpec("tiny-stt", "stt", path))
        worker.load(torch.device("cpu"))
        clips = [clip(2 + i % 5, i) for i in range(16)]
        audio = clip(args.long_s, 99)
        if not args.smoke:
            run(worker, clips, args.clients, min(args.requests, 16))  # warm-up, not measured
        results: dict[tuple[str, int], list[dict]] = {}
        longs: dict[str, list[float]] = {"shared": [], "own": []}
        with OtherLoad() as other:
            for r in range(args.rounds):
                for mode in (("shared", "own") if r % 2 == 0 else ("own", "shared")):
                    worker.share_decodes = mode == "shared"
                    for clients in (1, args.clients):
                        results.setdefault((mode, clients), []).append(
                            run(worker, clips, clients, args.requests if clients > 1 else max(2, args.requests // 4)))
                    longs[mode].append(long_file(worker, audio))
        print(f"tiny-stt on the CPU, torch threads 1, batch_windows {worker.batch_windows}; {args.rounds} rounds "
              f"alternated, medians over them; other processes used "
              f"{other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
        print(f"{'mode':<8} {'clients':>7} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'decodes/req':>12}")
        for (mode, clients), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            m = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
            print(f"{mode:<8} {clients:>7} {m['rps']:>9.2f} {m['p50']:>9.1f} {m['p99']:>9.1f} {m['decodes']:>12.3f}")
        print(f"a {args.long_s:.0f} s file alone: shared {statistics.median(longs['shared']):.3f} s, "
              f"own {statistics.median(longs['own']):.3f} s")
        ratios = [s["rps"] / o["rps"] for s, o in zip(results[("shared", args.clients)], results[("own", args.clients)])]
        print(f"shared/own throughput at {args.clients} clients, per round: " + " ".join(f"{x:.2f}x" for x in ratios))
        long_ratios = [o / s for s, o in zip(longs["shared"], longs["own"])]
        print("the long file's own/shared time, per round: " + " ".join(f"{x:.2f}x" for x in long_ratios))
        one = [s["rps"] / o["rps"] for s, o in zip(results[("shared", 1)], results[("own", 1)])]
        why_not = other.why_not(OTHER_LOAD_LIMIT)
        targets = [at_least(f"shared/own throughput at {args.clients} concurrent requests",
                            None if why_not else statistics.median(ratios), TARGET, why_not=why_not),
                   at_least(f"a {args.long_s:.0f} s file: own/shared time", None if why_not else statistics.median(long_ratios),
                            TARGET, why_not=why_not),
                   at_least("shared/own throughput at 1 client (nothing to share)", statistics.median(one), 0.9, judged=False)]
        return judge(targets, smoke=args.smoke, note="transcriptions' shared decodes")


if __name__ == "__main__":
    sys.exit(main())
