#!/usr/bin/env python
"""Batch work on an idle engine: throughput against the same requests sent interactively, a paid
probe's time to first token while batch fills the engine, and how fast batch stops for it.

    python scripts/bench_batch.py                    # about a minute on 2 quiet CPU cores
    python scripts/bench_batch.py --requests 2000 --tokens 2 --width 8 --engine vllm
    python scripts/bench_batch.py --smoke            # tiny counts: the code path, no verdict

The server is bench_tiers' instrumented one (``bench_tiers.py --serve``: the real services and
app, plus ``/bench/`` routes recording the gate's pause orders and, on the transformers engine,
every decode step and prefill with its rows by tier), in its own process, on the demo chat model
with ``max_num_seqs`` = ``--width``, ``gate.slots`` and paid ``max_inflight`` = ``--width``, and the
batch tier with no ``max_inflight`` (room for every engine's width) and no ``batch.concurrency``.

  (a) throughput, idle server: ``--requests`` chat requests (``--tokens`` each, greedy) sent by
      ``--width`` closed-loop paid clients, and the same requests as one Batch API job (upload,
      create, poll every 20 ms until completed; timed from create to completed), in ``--rounds``
      rounds, the order alternated. Target: the median of the per-round ratios, batch >= 0.9x
      interactive.
  (b) a paid probe's time to first token (streamed; send to first content chunk), ``--probes``
      times alone and as many times while a batch job of long lines (``--fill-tokens``) fills
      the engine (each probe waits until the engine is full of batch rows again), split over
      ``--rounds`` rounds (alone, then beside batch, then the batch cancelled and drained), so that
      a drift in the machine's speed meets both. Target: the median over all probes with batch
      <= 1.25x the median alone; the per-round ratios are printed beside it.
  (c) from the server's records, per probe: batch decode steps and resuming prefills that
      started after the pause order, as bench_tiers (c) counts them. Target: at most one (the
      engine checks for a pause before each step). Transformers engine only; on vLLM it is n/a.

Latency and throughput ratios are n/a when processes outside the benchmark's own tree (its
server and clients) used more than half a core meanwhile (``benchlib.OtherLoad``: the machine
is measured, not tiergate; see docs/BENCHMARKS.md); where /proc is missing, when the load
average exceeds the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_tiers import (BATCH_RANK, MODEL, PAID_PROMPT, TIERS, body, client_for, overloaded, pause_analysis,  # noqa: E402
                         start_server)
from benchlib import OTHER_LOAD_LIMIT, OtherLoad, Target, at_least, judge  # noqa: E402

TPUT_TARGET, TTFT_TARGET = 0.9, 1.25
DONE = ("completed", "failed", "expired", "cancelled")  # a batch's final states
BATCH_PROMPT = "Summarise the batch."


def write_config(folder: Path, model_path: Path, args: argparse.Namespace) -> Path:
    lines = ["tiers:"]
    for name in TIERS:
        lines += [f"  - name: {name}", f"    keys_env: TIERGATE_BENCH_KEYS_{name.upper()}", "    max_queued: 1000",
                  "    latency_target_s: 600"]
        lines += ["    batch: true"] if name == "batch" else [f"    max_inflight: {args.width}"]
    lines += ["models:", f"  - name: {MODEL}", "    kind: chat", f"    path: {model_path}",
              f"    engine: {{name: {args.engine}, max_num_seqs: {args.width}}}",
              "gpu:", "  device: auto", "  vram_budget: 4GiB",
              "gate:", f"  slots: {args.width}", "  slo_guard: {enabled: false}",
              "limits:", "  max_chat_tokens: 512",
              "batch:", f"  data_dir: {folder / 'data'}"]
    path = folder / "tiers.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def interactive(client: httpx.AsyncClient, key: str, n: int, width: int, tokens: int) -> float:
    """Requests per second of ``n`` requests from ``width`` closed-loop clients."""
    left = iter(range(n))

    async def worker() -> None:
        for i in left:
            r = await client.post("/v1/chat/completions", json=body(f"{BATCH_PROMPT} {i}", tokens), headers=auth(key))
            r.raise_for_status()

    start = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(width)])
    return n / (time.monotonic() - start)


async def submit(client: httpx.AsyncClient, key: str, n: int, tokens: int) -> str:
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": body(f"{BATCH_PROMPT} {i}", tokens)} for i in range(n)]
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    f = await client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                          files={"file": ("in.jsonl", io.BytesIO(content))})
    f.raise_for_status()
    b = await client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    b.raise_for_status()
    return b.json()["id"]


async def batch_status(client: httpx.AsyncClient, key: str, batch_id: str) -> dict:
    r = await client.get(f"/v1/batches/{batch_id}", headers=auth(key))
    r.raise_for_status()
    return r.json()


async def batch_job(client: httpx.AsyncClient, key: str, n: int, tokens: int) -> float:
    """Lines per second of one batch job of ``n`` lines, create to completed."""
    start = time.monotonic()
    batch_id = await submit(client, key, n, tokens)
    while True:
        b = await batch_status(client, key, batch_id)
        if b["status"] in DONE:
            break
        await asyncio.sleep(0.02)
    seconds = time.monotonic() - start
    counts = b["request_counts"]
    if b["status"] != "completed" or counts["completed"] != n:
        raise RuntimeError(f"the batch ended {b['status']} with {counts}")
    return n / seconds


async def ttft(client: httpx.AsyncClient, key: str, tokens: int) -> tuple[float, float, float]:
    """(sent, first content chunk, done) of one streamed paid request."""
    t0 = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body(PAID_PROMPT, tokens, stream=True),
                             headers=auth(key)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                first = time.monotonic()
    return t0, first or time.monotonic(), time.monotonic()


def records(server, since: float) -> dict:
    return httpx.get(f"{server.url}/bench/records", params={"since": since}, timeout=60).json()


async def engine_full(server, since: float, width: int, timeout: float = 60) -> bool:
    """Until a decode step that started after ``since`` holds ``width`` batch rows (False: no step
    records on this engine, or none came)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = await asyncio.to_thread(records, server, since)
        if not rec.get("steps_recorded"):
            await asyncio.sleep(1.0)  # vLLM: no step records; give its batch a moment to fill
            return False
        if any(d[2][BATCH_RANK] >= width for d in rec["decode"]):
            return True
        await asyncio.sleep(0.01)
    return False


async def probes_beside_batch(server, client: httpx.AsyncClient, args: argparse.Namespace,
                              n: int) -> tuple[list, dict, int]:
    """(b)/(c): a long batch job fills the engine; ``n`` paid probes arrive one at a time, each
    once the engine is full of batch rows again; then the job is cancelled and drained. Returns
    the probes, the server records, batch width seen."""
    keys = server.keys
    lines = args.width * args.fill_factor * max(1, -(-n // 20))  # enough to outlast the probes
    fill_id = await submit(client, keys["free"], lines, args.fill_tokens)
    start = time.monotonic()
    full = await engine_full(server, start, args.width)
    probes = []
    try:
        for _ in range(n):
            await asyncio.sleep(args.probe_gap * (0.5 + secrets.randbelow(1000) / 1000))  # land anywhere in a step
            t0, first, t1 = await ttft(client, keys["paid"], args.probe_tokens)
            probes.append({"t0": t0, "t1": t1, "first": first, "ttft": first - t0})
            if full:
                await engine_full(server, t1, args.width)
    finally:
        await client.post(f"/v1/batches/{fill_id}/cancel", headers=auth(keys["free"]))
    deadline = time.monotonic() + 120  # drained: the next round's probes alone meet no batch rows
    while (status := (await batch_status(client, keys["free"], fill_id))["status"]) not in DONE:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fill batch did not stop within 120 s of its cancel (still {status})")
        await asyncio.sleep(0.05)
    rec = await asyncio.to_thread(records, server, start)
    widest = max((d[2][BATCH_RANK] for d in rec.get("decode", [])), default=0)
    return probes, rec, widest


async def run(args: argparse.Namespace) -> int:
    from demo import build_demo_models

    model = build_demo_models(args.models_dir, names=[MODEL])[MODEL].resolve()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        folder = Path(tmp)
        load_start = os.getloadavg()[0]
        server = start_server(write_config(folder, model, args), folder, timeout=300, threads=args.server_threads,
                              switch_interval=args.switch_interval)
        try:
            with OtherLoad() as other:  # the CPU processes outside this benchmark's tree use meanwhile
                async with client_for(server.url) as client:
                    paid, free = server.keys["paid"], server.keys["free"]
                    await interactive(client, paid, args.width * 2, args.width, args.tokens)  # warm-up
                    speeds = []  # (interactive req/s, batch lines/s) per round
                    for r in range(args.rounds):
                        if r % 2 == 0:
                            rps = await interactive(client, paid, args.requests, args.width, args.tokens)
                            lps = await batch_job(client, free, args.requests, args.tokens)
                        else:
                            lps = await batch_job(client, free, args.requests, args.tokens)
                            rps = await interactive(client, paid, args.requests, args.width, args.tokens)
                        speeds.append((rps, lps))
                    alone, rec_alone, probes, rec, widest, rounds = [], {}, [], {}, 0, []
                    per_round = max(1, args.probes // args.rounds)
                    for _ in range(args.rounds):
                        since = time.monotonic()
                        a = [await ttft(client, paid, args.probe_tokens) for _ in range(per_round)]
                        merge(rec_alone, await asyncio.to_thread(records, server, since))
                        p, rec_b, w = await probes_beside_batch(server, client, args, per_round)
                        merge(rec, rec_b)
                        alone += a
                        probes += p
                        widest = max(widest, w)
                        rounds.append(statistics.median(x["ttft"] for x in p) / statistics.median(c - t for t, c, _ in a))
        except BaseException:
            print(f"--- server log tail ---\n{server.log.read_text()[-4000:]}", file=sys.stderr)
            raise
        finally:
            server.stop()
        alone_probes = [{"t0": a, "first": b, "t1": c, "ttft": b - a} for a, b, c in alone]
        if args.records:
            args.records.write_text(json.dumps({"alone": {"probes": alone_probes, "records": rec_alone},
                                                "beside": {"probes": probes, "records": rec}}))
        return report(args, speeds, alone_probes, rec_alone, probes, rec, widest, rounds,
                      (load_start, os.getloadavg()[0]), other)


def merge(into: dict, rec: dict) -> None:
    """Add one stretch of the server's records to ``into`` (their lists are time-stamped: each
    probe finds its own by its times)."""
    for key, value in rec.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = value


PHASES = ("send -> pause order", "order -> paid prefill", "paid prefill", "prefill end -> delta on loop",
          "delta -> client")


def phases(rec: dict, probes: list[dict]) -> list[tuple[float, ...]]:
    """Per probe, where its time to first token went, from the server's records (see ``PHASES``):
    the request reaching the gate (the order: the gate turning busy), reaching the engine (its
    prefill starting), the prefill, its first text delta reaching the event loop, and the response
    chunk reaching the client. Probes the records do not cover are left out."""
    out = []
    for p in probes:
        order = next((t for t, busy in rec.get("gate", []) if busy and p["t0"] <= t <= p["t1"]), None)
        prefill = next((x for x in rec.get("prefill", []) if x[2] == 0 and p["t0"] <= x[0] <= p["t1"]), None)
        emit = next((e[0] for e in rec.get("emits", []) if e[1] == 0 and p["t0"] <= e[0] <= p["t1"]), None)
        if order is None or prefill is None or emit is None:
            continue
        out.append((order - p["t0"], prefill[0] - order, prefill[1] - prefill[0], emit - prefill[1], p["first"] - emit))
    return out


def print_phases(label: str, rows: list[tuple[float, ...]]) -> None:
    if not rows:
        return
    med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(len(PHASES))]
    print(f"    {label:<12} " + ", ".join(f"{name} {m:.2f}" for name, m in zip(PHASES, med)) + " ms (p50s)")


def report(args, speeds: list[tuple[float, float]], alone_probes: list[dict], rec_alone: dict, probes: list[dict],
           rec: dict, widest: int, rounds: list[float], loads: tuple[float, float], other: OtherLoad) -> int:
    alone = [p["ttft"] for p in alone_probes]
    smoke = args.smoke
    busy = overloaded(loads) if other.cores is None else other.why_not(OTHER_LOAD_LIMIT)
    ms = 1e3
    others = "n/a" if other.cores is None else f"{other.cores:.2f} cores"
    print(f"bench_batch: {MODEL} on {args.engine}, engine width {args.width}; load average {loads[0]:.1f} -> "
          f"{loads[1]:.1f} on {os.cpu_count()} cores; other processes used {others} meanwhile")
    ratio = statistics.median(lps / rps for rps, lps in speeds)
    rps, lps = statistics.median(r for r, _ in speeds), statistics.median(b for _, b in speeds)
    print(f"(a) {args.requests} requests x {args.tokens} tokens, {len(speeds)} rounds: interactive ({args.width} paid "
          f"clients) p50 {rps:.1f} req/s, batch job p50 {lps:.1f} lines/s; batch/interactive per round "
          + " ".join(f"{b / r:.2f}x" for r, b in speeds) + f", median {ratio:.2f}x")
    targets = [at_least("(a) batch throughput / interactive at the engine's width", ratio, TPUT_TARGET,
                        why_not=busy)]
    if busy:
        targets[-1] = Target(targets[-1].claim, f"{ratio:.2f}x", None, busy)
    with_batch = [p["ttft"] for p in probes]
    med_alone, med_batch = statistics.median(alone), statistics.median(with_batch)
    tratio = med_batch / med_alone
    print(f"(b) paid time to first token, {len(probes)} probes: alone p50 {med_alone * ms:.1f} ms "
          f"(max {max(alone) * ms:.1f}), beside a batch filling the engine p50 {med_batch * ms:.1f} ms "
          f"(max {max(with_batch) * ms:.1f}) = {tratio:.2f}x; per round " + " ".join(f"{x:.2f}x" for x in rounds)
          + f"; batch rows per step at most {widest} of {args.width}")
    print_phases("alone", phases(rec_alone, alone_probes))
    print_phases("beside batch", phases(rec, probes))
    claim = f"(b) paid TTFT beside batch / alone <= {TTFT_TARGET:g}x"
    targets.append(Target(claim, f"{tratio:.2f}x", None, busy) if busy else
                   Target(claim, f"{tratio:.2f}x", tratio <= TTFT_TARGET))
    claim = "(c) batch steps started after a pause order <= 1"
    if rec.get("steps_recorded"):
        an = pause_analysis(rec, probes)
        rows = [r for r in an["rows"] if r is not None]
        worst = max((r["decode_after"] + r["prefill_after"] for r in rows), default=0)
        seen = f"max {worst} in {len(rows)}/{len(probes)} probes seen"
        print(f"(c) batch steps (decode or resuming prefill) started after the pause order: {seen}; "
              f"median batch-only step {an['step'] * ms:.2f} ms")
        targets.append(Target(claim, seen, len(rows) == len(probes) and worst <= 1))
    else:
        print("(c) no step records on this engine")
        targets.append(Target(claim, "n/a", None, "(no step records on this engine)"))
    return judge(targets, smoke=smoke, note="(a) throughput, (b) paid TTFT, (c) batch yielding")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "demo-models")
    ap.add_argument("--width", type=int, default=8, help="the engine's max_num_seqs (and the paid clients of (a))")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--probes", type=int, default=60, help="paid probes alone and as many beside batch, over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (a) and of (b), to meet the machine's drift")
    ap.add_argument("--probe-tokens", type=int, default=8)
    ap.add_argument("--probe-gap", type=float, default=0.05, help="mean extra seconds between probes")
    ap.add_argument("--fill-tokens", type=int, default=200, help="tokens of each line of the batch that fills (b)")
    ap.add_argument("--fill-factor", type=int, default=8, help="lines of that batch per engine row (per 20 probes)")
    ap.add_argument("--server-threads", type=int, default=1, help="torch intra-op threads of the server (see bench_tiers)")
    ap.add_argument("--switch-interval", type=float, help="diagnostic: the server's sys.setswitchinterval (the engine lowers it to 0.5 ms)")
    ap.add_argument("--records", type=Path, help="write (b)'s probes and the server's records there (JSON)")
    ap.add_argument("--smoke", action="store_true", help="tiny counts: the code path, no verdict (~20 s)")
    args = ap.parse_args()
    if args.smoke:
        args.engine, args.width, args.requests, args.tokens, args.probes, args.rounds = "transformers", 4, 16, 2, 2, 2
        args.fill_tokens, args.fill_factor = 48, 3
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
