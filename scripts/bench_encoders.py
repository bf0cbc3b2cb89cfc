"""Shared passes for encoders: concurrent embedding requests on one loaded ``EmbedWorker`` with
their forward passes shared (``EncoderWorker.run_rows``, the worker's default) against each
request running its own passes on its own thread (``share_passes = False``: the path before
2026-12-04), in this one process, rounds alternated so drifting machine load hits both.

Each request embeds one short text (8-12 tokens) on the demo's tiny-embed, as a RAG ingestion or
a search box sends them; ``--clients`` threads send back to back (closed loop). Printed per mode:
requests per second, p50 / p99 latency, and forward passes per request.

Batch-tier work (a step context with a pause gate, as Batch API lines get) shares passes in a lane
of its own: ``--batch-lines`` (16, an embedding model's default ``batch_width``: the lines the batch
runner keeps in flight) concurrent batch jobs, shared against own passes; and one job at a time
(``batch 1``), the path before 2026-12-04 (the runner ran one embedding line at a time).

Judged: shared/own throughput at ``--clients`` concurrent requests >= 2x, and the same for the
batch lane at ``--batch-lines`` (``n/a`` when processes outside this one used more than half a core
meanwhile). A pass's fixed cost (the model's Python
and kernel launches per layer) is what sharing saves, on a GPU as on a CPU; with one client there
is nothing to share (printed, not judged).

    python scripts/bench_encoders.py            # ~30 s on 2 quiet cores
    python scripts/bench_encoders.py --smoke    # a few requests; no verdict
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, at_least, closed_loop, judge, scratch_folder  # noqa: E402
from workers.base import ModelSpec, StepContext  # noqa: E402
from workers.embed import EmbedWorker  # noqa: E402

TARGET = 2.0


def run(worker: EmbedWorker, ids: list[list[list[int]]], clients: int, requests: int, batch: bool = False) -> dict:
    """``requests`` requests by ``clients`` closed-loop threads: throughput, latencies, passes;
    ``batch``: each with a step context that has a pause gate (never paused), as batch lines'."""

    def call(i: int) -> None:
        ctx = StepContext(pause_gate=lambda c: None, pause_check=lambda: False) if batch else StepContext()
        worker.embed(ids[i % len(ids)], None, ctx)

    passes = worker.passes
    wall, latencies = closed_loop(call, clients, requests)
    latencies.sort()
    return {"rps": requests / wall, "p50": statistics.median(latencies) * 1e3,
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3,
            "passes": (worker.passes - passes) / requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=1500, help="per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-lines", type=int, default=16, help="concurrent batch-tier jobs (the batch runner's width)")
    parser.add_argument("--models-dir", type=Path, default=None, help="where tiny-embed is (built there if missing)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.requests, args.rounds, args.batch_lines = 4, 20, 1, 4
    torch.set_num_threads(1)
    from demo import build_demo_models

    with scratch_folder("bench-encoders-") as scratch:
        folder = args.models_dir or scratch
        path = build_demo_models(folder, names=["tiny-embed"])["tiny-embed"]
        worker = EmbedWorker(ModelSpec("tiny-embed", "embed", path))
        worker.load(torch.device("cpu"))
        texts = [" ".join(f"word{j}" for j in range(2 + i % 4)) + f" item {i}" for i in range(64)]
        ids = [worker.tokenize([t]) for t in texts]
        run(worker, ids, args.clients, min(args.requests, 200))  # warm-up, not measured
        results: dict[tuple[str, int], list[dict]] = {}
        with OtherLoad() as other:
            for r in range(args.rounds):
                for mode in (("shared", "own") if r % 2 == 0 else ("own", "shared")):
                    worker.share_passes = mode == "shared"
                    for clients in (1, args.clients):
                        results.setdefault((mode, clients), []).append(
                            run(worker, ids, clients, args.requests if clients > 1 else args.requests // 4))
                    results.setdefault((f"batch {mode}", args.batch_lines), []).append(
                        run(worker, ids, args.batch_lines, args.requests, batch=True))
                    if mode == "own":  # the path before: the runner ran one embedding line at a time
                        results.setdefault(("batch own", 1), []).append(run(worker, ids, 1, args.requests // 4, batch=True))
        print(f"tiny-embed on the CPU, torch threads 1; {args.rounds} rounds alternated, medians over them; "
              f"other processes used {other.cores if other.cores is not None else float('nan'):.2f} cores meanwhile")
        print(f"{'mode':<12} {'clients':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'passes/req':>11}")
        med = {}
        for (mode, clients), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            m = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            med[(mode, clients)] = m
            print(f"{mode:<12} {clients:>7} {m['rps']:>9.1f} {m['p50']:>8.2f} {m['p99']:>8.2f} {m['passes']:>11.3f}")
        ratios = [s["rps"] / o["rps"] for s, o in zip(results[("shared", args.clients)], results[("own", args.clients)])]
        print(f"shared/own throughput at {args.clients} clients, per round: " + " ".join(f"{x:.2f}x" for x in ratios))
        why_not = other.why_not(OTHER_LOAD_LIMIT)
        lines = args.batch_lines
        batch_ratios = [s["rps"] / o["rps"] for s, o in zip(results[("batch shared", lines)], results[("batch own", lines)])]
        print(f"batch lane shared/own throughput at {lines} lines, per round: " + " ".join(f"{x:.2f}x" for x in batch_ratios))
        ratio = None if why_not else statistics.median(ratios)
        batch_ratio = None if why_not else statistics.median(batch_ratios)
        one = med[("shared", 1)]["rps"] / med[("own", 1)]["rps"]
        before = med[("batch shared", lines)]["rps"] / med[("batch own", 1)]["rps"]
        targets = [at_least(f"shared/own throughput at {args.clients} concurrent requests", ratio, TARGET, why_not=why_not),
                   at_least(f"batch lane shared/own throughput at {lines} concurrent lines", batch_ratio, TARGET,
                            why_not=why_not),
                   at_least("shared/own throughput at 1 client (nothing to share)", one, 0.9, judged=False),
                   at_least(f"batch lines: {lines} sharing passes / one at a time (the path before)", before, 1.0,
                            judged=False)]
        return judge(targets, smoke=args.smoke, note="encoders' shared passes")


if __name__ == "__main__":
    sys.exit(main())
