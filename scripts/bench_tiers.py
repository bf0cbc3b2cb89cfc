#!/usr/bin/env python
"""Tiers under load: paid latency alone vs beside free and batch work, how fast running batch work
yields to a paid arrival, and who gets refused. Over real HTTP on 127.0.0.1.

    python scripts/bench_tiers.py                   # about 45 s on 2 quiet CPU cores
    python scripts/bench_tiers.py --rounds 5 --paid 300 --free-clients 48 --probes 60
    python scripts/bench_tiers.py --engine vllm     # the vLLM chat engine (where it imports)
    python scripts/bench_tiers.py --smoke           # tiny counts, transformers engine: the code path, no verdict

The server runs in its own process, as ``tiergate serve`` does (the same services, app, request
log and uvicorn settings: ``gateway.cli.server_config``'s h11 protocol, no uvicorn access log), so
the load generators do not share its interpreter. This script starts it as
``bench_tiers.py --serve``, which adds routes under ``/bench/`` that record on the server: when
the gate's demand changes (that is when the arbiter orders batch work to pause or resume), when
each text delta of each request reaches the event loop, and, on the transformers engine, every
decode step and prefill with its rows by tier. The server gets a temporary tiers.yaml (below),
fresh random keys per tier, the demo chat model (built if missing) and, by default, ONE torch
intra-op thread (``--server-threads``; see docs/BENCHMARKS.md: with torch's default of one thread
per core, a tiny model's steps stall for hundreds of ms whenever other processes want the cores).

Every round runs three phases with the same paid load, ``--paid`` requests (``--paid-tokens``
each, greedy) from ``--paid-concurrency`` closed-loop clients; latency = send to last byte,
client side:

  alone  (a) paid only.
  share  + ``--batch-streams`` long batch-tier streams (started first, so they are running when
         the others arrive) + free at exactly its ``max_inflight`` (closed-loop clients in another
         process): free uses its whole share, nobody is refused. Skip with ``--no-share``.
  flood  (b) + the same batch streams + ``--free-clients`` free clients, each retrying
         ``--free-backoff`` s after a 429 (impatient: they ignore Retry-After). The free clients
         use benchlib's minimal HTTP/1.1 client, so that their own CPU on the shared cores is small.

``--rounds`` rounds alternate the phases, so drifting machine load hits all of them; the samples
are pooled. Target: paid p99 under flood <= 1.25x alone. Then:

  (c) batch yielding: ``--batch-streams`` streams decode alone (a finished one is replaced) and
      ``--probes`` times a paid request arrives. From the server's records, per probe: the pause
      order (the gate turning busy), the batch work (decode steps, prefills of resuming rows) in
      flight then and started after it, when the last of it ended and when the paid prefill
      started, in ms and in decode steps (the median step with only the batch rows). Target: at
      most one batch step starts after the order (the engine checks for a pause after each step,
      so an order that lands between that check and the next step lets that step run); on
      engines without step records (vLLM), at most one batch text delta per stream after the
      order. ``tiergate_batch_pauses`` must rise by one per probe. The client's view (batch
      tokens received after the order, including tokens already in transit) is printed too.
  (d) refusals per tier and reason over the flood phases, from the responses (status, error
      code) and from ``/metrics`` (``tiergate_rejected``). Target: no paid request refused.
  (e) the SLO guard: every phase also runs, in the same rounds (order alternated), on a second
      server whose ``gate.slo_guard`` is off; (a)-(d) are the guarded server's (the shipped
      default). Paid's ``latency_target_s`` is ``--paid-target`` (the guard shrinks free while
      paid's time to first token nears it). Shown side by side: paid p50/p99 flood/alone and free
      served and refused per second in the flood. Target: free served with the guard on >= 0.5x
      what it gets with the guard off ((b) judges paid's p99 with the guard on); n/a above the
      core count, like (b): the guard then reacts to the machine's latency.

The config gives paid all the room it asks for: ``gate.slots`` 8, paid ``max_inflight`` 4 >=
``--paid-concurrency`` 2, free ``max_inflight`` 2 and ``max_queued`` 4, so at most 2 paid + 2 free
rows share a forward pass (the engine batches up to 8) and most of the flood meets 429s. The claim
measured is "paid keeps its latency while free is held to its share and batch yields", not "free
gets served". Everything (server, load generators) shares one machine: the output shows the
load average and the CPU each process used.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, Target, flood, http_head, judge, pct, spare_port  # noqa: E402

TIERS = ["paid", "subscriber", "free", "batch"]
BATCH_RANK = TIERS.index("batch")
MODEL = "tiny-chat"
P99_TARGET = 1.25
# Greedy on the demo model, these run to max_tokens (no early EOS), so every request does the same work.
PAID_PROMPT = "Tell me about the tiers."
FREE_PROMPT = "Free question, please answer."
BATCH_PROMPT = "Summarise the batch."


# -- the instrumented server (its own process) ----------------------------------------------------


class Recorder:
    """Server-side records, read over ``GET /bench/records``. Times are ``time.monotonic()``, one
    clock for every process of the machine, so they compare with the client's."""

    def __init__(self, services) -> None:
        self.services = services
        self.gate: list[tuple[float, bool]] = []  # (t, others busy) at each change
        self.decode: list[tuple[float, float, tuple[int, ...]]] = []  # (start, end, rows per tier rank)
        self.gc_pauses: list[tuple[float, float, int]] = []  # (start, end, generation) of each collection
        self._gc_start = 0.0

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_start = time.monotonic()
            elif info["generation"] == 2:
                self.gc_pauses.append((self._gc_start, time.monotonic(), 2))

        gc.callbacks.append(on_gc)
        self.prefill: list[tuple[float, float, int, int, bool]] = []  # (start, end, rank, tokens, resumed)
        self.emits: list[tuple[float, int, int, bool]] = []  # (t, rank, request, finished) per event delivered
        self.instrumented = False
        self.steps_recorded = False  # decode steps and prefills (transformers engine)
        self.threads = {"loop": threading.get_native_id(), "engine": None}  # native thread ids
        gate = services.gate
        previous = gate.on_change
        self._busy = False

        def on_change() -> None:
            previous()  # the arbiter pauses or resumes batch work in here
            busy = gate.others_busy()
            if busy != self._busy:
                self._busy = busy
                self.gate.append((time.monotonic(), busy))

        gate.on_change = on_change

    def instrument(self) -> bool:
        """Wrap the chat worker's ``chat`` (every engine: when each text delta reaches the event
        loop) and, on the transformers engine, its decode step and prefill."""
        from workers.base import ChatFinished, TextDelta

        worker = self.services.arbiter.workers.get(MODEL)
        if self.instrumented or worker is None:
            return self.instrumented
        chat = worker.chat

        def recorded_chat(req, *args, **kwargs):
            events = chat(req, *args, **kwargs)

            async def wrapped():
                try:
                    async for ev in events:
                        if isinstance(ev, (TextDelta, ChatFinished)):
                            self.emits.append((time.monotonic(), req.priority, id(req), isinstance(ev, ChatFinished)))
                        yield ev
                finally:
                    await events.aclose()

            return wrapped()

        worker.chat = recorded_chat
        self.instrumented = True
        if not hasattr(worker, "_decode_step"):
            return True
        self.steps_recorded = True
        decode, prefill, together = worker._decode_step, worker._prefill_into, worker._prefill_together

        def timed_decode(batch) -> None:
            self.threads["engine"] = threading.get_native_id()
            rows = [0] * len(TIERS)
            for seq in batch.seqs:
                rows[seq.req.priority] += 1
            start = time.monotonic()
            decode(batch)
            self.decode.append((start, time.monotonic(), tuple(rows)))  # tuples of atoms: the GC stops tracking them

        def timed_prefill(batch, seq) -> None:
            resumed = bool(seq.generated)
            start = time.monotonic()
            prefill(batch, seq)
            self.prefill.append((start, time.monotonic(), seq.req.priority, len(seq.ids), resumed))

        def timed_together(batch, seqs) -> None:  # rows prefilled in one pass: a record each
            resumed = [bool(seq.generated) for seq in seqs]
            start = time.monotonic()
            together(batch, seqs)
            end = time.monotonic()
            self.prefill.extend((start, end, seq.req.priority, len(seq.ids), r) for seq, r in zip(seqs, resumed))

        worker._decode_step, worker._prefill_into, worker._prefill_together = timed_decode, timed_prefill, timed_together
        return True

    def routes(self) -> list:
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def instrument(request):
            return JSONResponse({"instrumented": self.instrument()})

        async def records(request):
            since = float(request.query_params.get("since", "-inf"))
            return JSONResponse({
                "instrumented": self.instrumented,
                "steps_recorded": self.steps_recorded,
                "emits": [r for r in list(self.emits) if r[0] >= since],
                "gate": [r for r in self.gate if r[0] >= since],
                "decode": [r for r in list(self.decode) if r[0] >= since],
                "prefill": [r for r in list(self.prefill) if r[0] >= since],
                "batch_pauses": self.services.arbiter.counters.batch_pauses,
                "gc": [r for r in self.gc_pauses if r[0] >= since],
                "threads": self.threads,
            })

        return [Route("/bench/instrument", instrument, methods=["POST"]),
                Route("/bench/records", records, methods=["GET"])]


def serve(config_path: str, port: int, switch_interval: float | None = None, threads: int = 0) -> int:
    """What ``tiergate serve`` does (gateway/cli.py), plus the Recorder's routes."""
    import uvicorn

    from gateway import collector, request_log
    from gateway.app import build_services, create_app
    from gateway.cli import resolve_keys, server_config
    from gateway.config import load_config

    request_log.configure(json_lines=False)  # the request log's lines, as tiergate serve writes them
    if switch_interval is not None:  # diagnostic only: how much of the tail is GIL hand-over
        sys.setswitchinterval(switch_interval)
    if threads:
        import torch

        torch.set_num_threads(threads)
    config = load_config(config_path)
    keyring, _ = resolve_keys(config, demo=False)
    services = build_services(config, keyring)
    collector.attach(services)
    recorder = Recorder(services)
    app = create_app(services, recorder.routes())
    # tiergate serve's uvicorn: its h11 protocol, the request log instead of uvicorn's access log
    # (until 2026-12-02 this ran uvicorn's defaults: httptools and the access log)
    uvicorn.Server(server_config(app, "127.0.0.1", port, log_config=None, access_log=False)).run()
    return 0


# -- starting it -------------------------------------------------------------------------------------


def write_config(folder: Path, model_path: Path, args: argparse.Namespace, guard: bool = True,
                 paid_token_target: float | None = None) -> Path:
    tiers = {
        "paid": (args.paid_inflight, 64, args.paid_target),
        "subscriber": (4, 64, 30),
        "free": (args.free_inflight, args.free_queued, args.free_target),
        "batch": (args.batch_streams, 1000, 3600),
    }
    lines = ["tiers:"]
    for name, (inflight, queued, target) in tiers.items():
        lines += [f"  - name: {name}", f"    keys_env: TIERGATE_BENCH_KEYS_{name.upper()}",
                  f"    max_inflight: {inflight}", f"    max_queued: {queued}", f"    latency_target_s: {target:g}"]
        lines += [f"    token_latency_target_s: {paid_token_target:.6f}"] if name == "paid" and paid_token_target else []
        lines += ["    batch: true"] if name == "batch" else []
    lines += ["models:", f"  - name: {MODEL}", "    kind: chat", f"    path: {model_path}", f"    engine: {args.engine}",
              "gpu:", "  device: auto", "  vram_budget: 4GiB",
              "gate:", f"  slots: {args.slots}", "  slo_guard:", f"    enabled: {'true' if guard else 'false'}",
              "limits:", "  max_chat_tokens: 512"]
    path = folder / "tiers.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    keys: dict[str, str]
    log: Path
    instrumented: bool = False
    threads: dict = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def records(self, since: float = float("-inf")) -> dict:
        return httpx.get(f"{self.url}/bench/records", params={"since": since}, timeout=60).json()


def start_server(config: Path, folder: Path, timeout: float, switch_interval: float | None = None,
                 threads: int = 0) -> Server:
    keys = {t: f"tg-bench-{t}-{secrets.token_urlsafe(12)}" for t in [*TIERS, "admin"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERGATE_KEYS_")}
    env.update({f"TIERGATE_BENCH_KEYS_{t.upper()}": keys[t] for t in TIERS})
    env["TIERGATE_KEYS_ADMIN"] = keys["admin"]
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    port = spare_port()
    log = folder / "server.log"
    extra = ["--switch-interval", str(switch_interval)] if switch_interval else []
    extra += ["--server-threads", str(threads)] if threads else []
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(config), "--port", str(port),
                             *extra],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", keys, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("the server did not come up")
        time.sleep(0.1)
    r = httpx.post(f"{server.url}/admin/models/{MODEL}/load", timeout=timeout,
                   headers={"Authorization": f"Bearer {keys['admin']}"})
    if r.status_code != 200:
        server.stop()
        raise RuntimeError(f"loading {MODEL} failed: {r.status_code} {r.text}")
    server.instrumented = httpx.post(f"{server.url}/bench/instrument", timeout=10).json()["instrumented"]
    return server


def thread_cpu(pid: int, threads: dict) -> Counter:
    """CPU seconds of a process's threads (Linux /proc) by kind: the event loop (uvicorn's main
    thread), the chat engine thread, and the rest (torch's intra-op pool, worker threads)."""
    out = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    names = {str(tid): kind for kind, tid in threads.items() if tid}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[names.get(task.name, "other")] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    for child in _descendants(pid):  # e.g. vLLM's engine core
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out["children"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Prometheus samples: (name, sorted label items) -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$', line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def rejected_by_metrics(before: dict, after: dict) -> Counter:
    out = Counter()
    for (name, labels), v in after.items():
        if name == "tiergate_rejected_total":
            d = dict(labels)
            out[(d["tier"], d["reason"])] = int(v - before.get((name, labels), 0))
    return out


def counter(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


# -- clients -------------------------------------------------------------------------------------


def body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def outcome(r: httpx.Response) -> str:
    """'ok', or '<status> <error code>'."""
    if r.status_code == 200:
        return "ok"
    try:
        code = r.json()["error"]["code"]
    except Exception:  # noqa: BLE001
        code = "?"
    return f"{r.status_code} {code}"


def client_for(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.AsyncClient(base_url=url, timeout=300, limits=limits)


@dataclass
class PaidRun:
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    short: int = 0  # answers that stopped before max_tokens (EOS)
    windows: list[tuple[float, float]] = field(default_factory=list)
    server_cpu: Counter = field(default_factory=Counter)  # CPU seconds of the server's threads meanwhile
    client_cpu: float = 0.0  # CPU seconds of this (the paid client's) process meanwhile

    @property
    def wall(self) -> float:
        return sum(b - a for a, b in self.windows)

    def merge(self, other: "PaidRun") -> None:
        self.latencies += other.latencies
        self.outcomes += other.outcomes
        self.short += other.short
        self.windows += other.windows
        self.server_cpu += other.server_cpu
        self.client_cpu += other.client_cpu


async def paid_load(client: httpx.AsyncClient, key: str, n: int, concurrency: int, tokens: int,
                    server: "Server | None" = None) -> PaidRun:
    run = PaidRun()
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body(PAID_PROMPT, tokens),
                                  headers={"Authorization": f"Bearer {key}"})
            dt = time.monotonic() - t0
            run.outcomes[outcome(r)] += 1
            if r.status_code == 200:
                run.latencies.append(dt)
                run.short += r.json()["usage"]["completion_tokens"] < tokens

    cpu = thread_cpu(server.proc.pid, server.threads) if server else Counter()
    start, own = time.monotonic(), time.process_time()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    run.windows.append((start, time.monotonic()))
    run.client_cpu = time.process_time() - own
    if server:
        run.server_cpu = thread_cpu(server.proc.pid, server.threads)
        run.server_cpu.subtract(cpu)
    return run


@dataclass
class BatchStream:
    """One streamed batch-tier request: the receive time of each content chunk."""

    tokens: list[float] = field(default_factory=list)
    finish: str | None = None
    completion_tokens: int | None = None
    status: str = ""


async def batch_stream(client: httpx.AsyncClient, key: str, tokens: int, out: BatchStream) -> None:
    req = {**body(BATCH_PROMPT, tokens, stream=True), "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=req,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            out.status = outcome(r)
            return
        out.status = "ok"
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                choice = chunk["choices"][0]
                if choice["delta"].get("content"):
                    out.tokens.append(time.monotonic())
                if choice.get("finish_reason"):
                    out.finish = choice["finish_reason"]


async def wait_streaming(streams: list[BatchStream], n_tokens: int, timeout: float) -> None:
    """Until every stream is answered and has produced ``n_tokens`` (or finished)."""
    deadline = time.monotonic() + timeout
    while not all(s.status == "ok" and (len(s.tokens) >= n_tokens or s.finish) for s in streams):
        refused = [s.status for s in streams if s.status not in ("", "ok")]
        if refused:
            raise RuntimeError(f"batch streams refused: {refused}")
        if time.monotonic() > deadline:
            raise RuntimeError("batch streams did not start")
        await asyncio.sleep(0.01)


# -- the free flood, in its own process ------------------------------------------------------------


def flood_main(url: str, key: str, clients: int, tokens: int, backoff: float, stop, ready, results) -> None:
    message = http_head("POST", "/v1/chat/completions", key, json.dumps(body(FREE_PROMPT, tokens)).encode())
    asyncio.run(flood(int(url.rsplit(":", 1)[1]), message, clients, backoff, stop, ready, results))


# -- the phases ------------------------------------------------------------------------------------


@dataclass
class FloodPhase:
    paid: PaidRun = field(default_factory=PaidRun)
    free_outcomes: Counter = field(default_factory=Counter)
    free_latencies: list[float] = field(default_factory=list)
    free_seconds: float = 0.0
    free_cpu: float = 0.0
    streams: list[BatchStream] = field(default_factory=list)
    rejected_metrics: Counter = field(default_factory=Counter)
    unfinished_batch: int = 0
    pauses: float = 0.0

    def merge(self, o: "FloodPhase") -> None:
        self.paid.merge(o.paid)
        self.free_outcomes += o.free_outcomes
        self.free_latencies += o.free_latencies
        self.free_seconds += o.free_seconds
        self.free_cpu += o.free_cpu
        self.streams += o.streams
        self.rejected_metrics += o.rejected_metrics
        self.unfinished_batch += o.unfinished_batch
        self.pauses += o.pauses


async def phase_flood(server: Server, args: argparse.Namespace, free_clients: int) -> FloodPhase:
    """(b): batch streams first, then ``free_clients`` free clients, then the paid load; refusals
    over it all. With ``free_clients`` = free's max_inflight this is the "share" phase: free uses
    its whole share but nobody is refused."""
    keys = server.keys
    out = FloodPhase()
    before = metrics(server.url)
    async with client_for(server.url) as client:
        out.streams = [BatchStream() for _ in range(args.batch_streams)]
        tasks = [asyncio.create_task(batch_stream(client, keys["batch"], args.batch_tokens, s)) for s in out.streams]
        await wait_streaming(out.streams, 3, 60)
        ctx = mp.get_context("spawn")
        stop, ready, results = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=flood_main, args=(server.url, keys["free"], free_clients, args.free_tokens,
                                                    args.free_backoff, stop, ready, results), daemon=True)
        proc.start()
        try:
            if not await asyncio.to_thread(ready.wait, 60):
                raise RuntimeError("the flood process did not start")
            await asyncio.sleep(args.flood_warmup)  # the flood fills free's slots and queue
            out.paid = await paid_load(client, keys["paid"], args.paid, args.paid_concurrency, args.paid_tokens, server)
            stop.set()
            flood = await asyncio.to_thread(results.get, True, 120)
            await asyncio.to_thread(proc.join, 30)
        finally:
            stop.set()
            if proc.is_alive():
                proc.terminate()
        out.free_outcomes = Counter(flood["outcomes"])
        out.free_latencies = flood["latencies"]
        out.free_seconds = flood["seconds"]
        out.free_cpu = flood["cpu"]
        _, pending = await asyncio.wait(tasks, timeout=args.batch_finish_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        out.unfinished_batch = len(pending)
    after = metrics(server.url)
    out.rejected_metrics = rejected_by_metrics(before, after)
    out.pauses = counter(after, "tiergate_batch_pauses_total") - counter(before, "tiergate_batch_pauses_total")
    return out


async def phase_pause(server: Server, args: argparse.Namespace) -> dict:
    """(c): batch streams alone (a finished one is replaced at once); paid probes arrive one at a
    time while they decode."""
    keys = server.keys
    before = metrics(server.url)
    probes = []
    done = asyncio.Event()
    slots: list[list[BatchStream]] = [[] for _ in range(args.batch_streams)]

    async def keeper(client: httpx.AsyncClient, mine: list[BatchStream]) -> None:
        while not done.is_set():
            mine.append(BatchStream())
            await batch_stream(client, keys["batch"], args.batch_tokens, mine[-1])

    async with client_for(server.url) as client:
        tasks = [asyncio.create_task(keeper(client, mine)) for mine in slots]
        while not all(mine for mine in slots):
            await asyncio.sleep(0.005)
        await wait_streaming([mine[-1] for mine in slots], 5, 60)
        for _ in range(args.probes):
            # every stream has resumed and produced a few tokens since the last probe
            current = [mine[-1] for mine in slots]
            marks = [len(s.tokens) for s in current]
            deadline = time.monotonic() + 10
            while any(s.finish is None and len(s.tokens) < n + args.probe_wait_tokens for s, n in zip(current, marks)):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.002)
            await asyncio.sleep(args.probe_gap * (0.5 + secrets.randbelow(1000) / 1000))  # land anywhere in a step
            live = [mine[-1] for mine in slots if mine[-1].status == "ok" and mine[-1].finish is None]
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body(PAID_PROMPT, args.probe_tokens),
                                  headers={"Authorization": f"Bearer {keys['paid']}"})
            t1 = time.monotonic()
            after = [[t for t in s.tokens if t0 < t <= t1] for s in live]  # received while the probe ran
            probes.append({"status": outcome(r), "latency": t1 - t0, "received": after, "t0": t0, "t1": t1})
        done.set()
        await asyncio.gather(*tasks)
    m_after = metrics(server.url)
    return {"probes": probes, "streams": [s for mine in slots for s in mine],
            "pauses": counter(m_after, "tiergate_batch_pauses_total") - counter(before, "tiergate_batch_pauses_total")}


async def warm_up(server: Server, args: argparse.Namespace) -> None:
    """A few requests per tier, so the gate's cost model has measured service times."""
    async with client_for(server.url) as client:
        for tier, prompt, tokens in (("paid", PAID_PROMPT, args.paid_tokens), ("free", FREE_PROMPT, args.free_tokens),
                                     ("batch", BATCH_PROMPT, 16)):
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json=body(prompt, tokens),
                                      headers={"Authorization": f"Bearer {server.keys[tier]}"})
                if r.status_code != 200:
                    raise RuntimeError(f"warm-up {tier}: {r.status_code} {r.text}")


# -- server-side analysis ----------------------------------------------------------------------------


def engine_summary(rec: dict, windows: list[tuple[float, float]]) -> dict:
    """What the engine did inside ``windows``: decode steps, rows per step by tier, prefills."""
    inside = lambda t: any(a <= t <= b for a, b in windows)  # noqa: E731
    decode = [d for d in rec["decode"] if inside(d[0])]
    prefill = [p for p in rec["prefill"] if inside(p[0])]
    wall = sum(b - a for a, b in windows)
    if not decode:
        return {}
    return {
        "steps": len(decode),
        "step_ms": statistics.median(d[1] - d[0] for d in decode) * 1e3,
        "step_p99_ms": pct([d[1] - d[0] for d in decode], 99) * 1e3,
        "step_max_ms": max(d[1] - d[0] for d in decode) * 1e3,
        "step_mean_ms": statistics.mean(d[1] - d[0] for d in decode) * 1e3,
        "rows": statistics.mean(sum(d[2]) for d in decode),
        "rows_by_tier": [statistics.mean(d[2][i] for d in decode) for i in range(len(TIERS))],
        "prefills_per_s": Counter(TIERS[p[2]] for p in prefill),
        "prefill_ms": statistics.median(p[1] - p[0] for p in prefill) * 1e3 if prefill else 0.0,
        "by_rows": {n: statistics.median(d[1] - d[0] for d in decode if sum(d[2]) == n) * 1e3
                    for n in sorted({sum(d[2]) for d in decode})},
        "busy_decode": sum(d[1] - d[0] for d in decode) / wall,
        "busy_prefill": sum(end - start for start, end in {(p[0], p[1]) for p in prefill}) / wall,  # a shared pass once
        "wall": wall,
    }


def emission_analysis(rec: dict, probes: list[dict]) -> list[int]:
    """Per probe and batch request: text deltas the engine delivered between the pause order and
    the resume (every engine; server side)."""
    counts = []
    for p in probes:
        orders = [t for t, busy in rec.get("gate", []) if busy and p["t0"] <= t <= p["t1"]]
        if not orders:
            continue
        order = orders[0]
        resume = next((t for t, busy in rec["gate"] if not busy and t > order), p["t1"])
        batch = [e for e in rec["emits"] if e[1] == BATCH_RANK]
        ended = {e[2] for e in batch if e[3] and e[0] < order}
        live = {e[2] for e in batch if order - 1.0 <= e[0] < order} - ended
        after = Counter(e[2] for e in batch if order < e[0] < resume and not e[3])
        counts += [after[r] for r in live]
    return counts


def pause_analysis(rec: dict, probes: list[dict]) -> dict:
    """Per probe, from the server's records: the pause order (the gate turning busy after the
    paid send), the batch work that started after it, and when the paid prefill started."""
    batch_only = [d[1] - d[0] for d in rec["decode"] if d[2][BATCH_RANK] and sum(d[2]) == d[2][BATCH_RANK]]
    step = statistics.median(batch_only) if batch_only else float("nan")
    rows = []
    for p in probes:
        orders = [t for t, busy in rec["gate"] if busy and p["t0"] <= t <= p["t1"]]
        if not orders:
            rows.append(None)
            continue
        order = orders[0]
        resumes = [t for t, busy in rec["gate"] if not busy and t > order]
        resume = resumes[0] if resumes else p["t1"]
        batch_decode = [d for d in rec["decode"] if d[2][BATCH_RANK] and d[0] < resume and d[1] > order]
        batch_prefill = list({(x[0], x[1]): x for x in rec["prefill"]  # a pass shared by rows: once
                              if x[2] == BATCH_RANK and x[0] < resume and x[1] > order}.values())
        started_after = [d for d in batch_decode if d[0] >= order]
        prefills_after = [x for x in batch_prefill if x[0] >= order]
        ends = [d[1] for d in batch_decode] + [x[1] for x in batch_prefill]
        paid_prefill = [x[0] for x in rec["prefill"] if x[2] == 0 and x[0] >= order]
        in_flight = [d for d in batch_decode if d[0] < order] + [x for x in batch_prefill if x[0] < order]
        rows.append({
            "in_flight": len(in_flight),
            "in_flight_ms": max((x[1] - x[0] for x in in_flight), default=0.0) * 1e3,
            "decode_after": len(started_after),
            "prefill_after": len(prefills_after),
            "last_batch_end": (max(ends) - order) if ends else 0.0,
            "paid_start": (paid_prefill[0] - order) if paid_prefill else float("nan"),
        })
    return {"step": step, "rows": rows}


# -- report ----------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def note(targets: list[Target], claim: str, measured: str, ok: bool, smoke: bool, why_not: str = "") -> str:
    """Record a target (not judgeable when ``why_not`` says why); return its state for the line that shows it."""
    targets.append(Target(claim, measured, None, why_not) if why_not else Target(claim, measured, ok))
    return "n/a (smoke)" if smoke else f"n/a {why_not}" if why_not else verdict(ok)


def overloaded(loads: tuple) -> str:
    """Why a latency ratio cannot be judged: other processes than this benchmark's own (server,
    load generators) used more than half a core meanwhile, so it measures the machine
    (docs/BENCHMARKS.md: at load 3-5 on 2 cores, p99s of seconds in every phase)."""
    return loads[2].why_not(OTHER_LOAD_LIMIT)


def report(args, server: Server, alone: PaidRun, share: FloodPhase | None, flood: FloodPhase, per_round: list,
           pause: dict, rec: dict, loads: tuple, unguarded: tuple[PaidRun, FloodPhase] | None = None,
           limits: dict | None = None) -> int:
    ms = 1e3
    threads = args.server_threads or "torch's default"
    print(f"engine: {args.engine}; server in its own process (tiergate serve's app + /bench records, torch threads "
          f"{threads}) on 127.0.0.1; {os.cpu_count()} CPUs; load average (1 min) {loads[0]:.1f} at the start, "
          f"{loads[1]:.1f} at the end; other processes than this benchmark's used "
          f"{'n/a' if loads[2].cores is None else f'{loads[2].cores:.2f}'} cores meanwhile")
    print(f"config: gate.slots {args.slots}; paid max_inflight {args.paid_inflight}, latency_target_s "
          f"{args.paid_target:g}; free max_inflight "
          f"{args.free_inflight}, max_queued {args.free_queued}, latency_target_s {args.free_target:g}; batch "
          f"max_inflight {args.batch_streams}")
    print(f"load: paid {args.rounds} rounds x {args.paid} requests x {args.paid_tokens} tokens by {args.paid_concurrency} "
          f"clients per phase; free {args.free_clients} clients x {args.free_tokens} tokens (flood) or "
          f"{args.free_inflight} (share), retrying {args.free_backoff:g}s after a 429; batch {args.batch_streams} "
          f"streams x {args.batch_tokens} tokens started first; greedy")
    print("phases: alone = paid only; share = + free at exactly its max_inflight (nobody refused) + batch; "
          "flood = + the free flood + batch\n")

    targets: list[Target] = []
    smoke = args.smoke
    runs = [("alone", alone)] + ([("share", share.paid)] if share else []) + [("flood", flood.paid)]
    head = "".join(f"{name:>10}" for name, _ in runs)
    ratios = "".join(f"{name + '/alone':>13}" for name, _ in runs[1:])
    print(f"{'(a)/(b) paid latency, ms':<26}{head}{ratios}{'target':>10}  result")
    for q in ("p50", "p90", "p99", "max"):
        f = (lambda xs: max(xs)) if q == "max" else (lambda xs, q=q: pct(xs, int(q[1:])))
        vals = [f(r.latencies) for _, r in runs]
        line = f"{q:<26}" + "".join(f"{v * ms:>10.1f}" for v in vals)
        line += "".join(f"{v / vals[0]:>12.2f}x" for v in vals[1:])
        if q == "p99":
            ratio = vals[-1] / vals[0]
            state = note(targets, f"(b) paid p99 flood/alone <= {P99_TARGET:.2f}x", f"{ratio:.2f}x",
                         ratio <= P99_TARGET, smoke, overloaded(loads))
            line += f"{'<= %.2fx' % P99_TARGET:>10}  {state} (flood)"
        print(line)
    tput = [len(r.latencies) / r.wall for _, r in runs]
    print(f"{'throughput, req/s':<26}" + "".join(f"{t:>10.1f}" for t in tput)
          + "".join(f"{t / tput[0]:>12.2f}x" for t in tput[1:]))
    rounds = "; ".join("/".join(f"{pct(r.latencies, 99) * ms:.0f}" for r in rnd if r is not None) for rnd in per_round)
    print(f"p99 per round ({'/'.join(n for n, _ in runs)}), ms: {rounds}")
    print("answers shorter than asked (EOS): " + ", ".join(f"{n} {r.short}" for n, r in runs))
    cols = "".join(f"{name:>10}" for name, _ in runs)
    if rec.get("steps_recorded"):
        es = [engine_summary(rec, r.windows) for _, r in runs]
        print(f"server, while paid ran:{'':<3}{cols}")

        def row(label: str, values: list[str]) -> None:
            print(f"  {label:<24}" + "".join(f"{v:>10}" for v in values))

        row("decode step, median ms", [f"{e['step_ms']:.2f}" for e in es])
        row("decode step, mean ms", [f"{e['step_mean_ms']:.2f}" for e in es])
        row("decode step, p99 ms", [f"{e['step_p99_ms']:.1f}" for e in es])
        row("decode step, max ms", [f"{e['step_max_ms']:.0f}" for e in es])
        for i, tier in ((0, "paid"), (2, "free"), (3, "batch")):
            row(f"{tier} rows per step", [f"{e['rows_by_tier'][i]:.2f}" for e in es])
        for tier in ("paid", "free", "batch"):
            row(f"{tier} prefills per s", [f"{e['prefills_per_s'][tier] / e['wall']:.1f}" for e in es])
        row("prefill, median ms", [f"{e['prefill_ms']:.2f}" for e in es])
        row("engine busy (decode)", [f"{e['busy_decode']:.0%}" for e in es])
        row("engine busy (prefill)", [f"{e['busy_prefill']:.0%}" for e in es])
        for label, key in (("full GC pauses (n)", None), ("full GC pause max ms", "max")):
            vals = []
            for _, r in runs:
                pauses = [g[1] - g[0] for g in rec.get("gc", []) if any(a <= g[0] <= b for a, b in r.windows)]
                vals.append(f"{max(pauses, default=0) * 1e3:.0f}" if key else str(len(pauses)))
            row(label, vals)
        by_rows = engine_summary(rec, [w for _, r in runs for w in r.windows])["by_rows"]
        print("  decode step by rows in it, median ms: " + ", ".join(f"{n}: {v:.2f}" for n, v in sorted(by_rows.items())))
    if alone.server_cpu:
        print(f"CPU, cores:{'':<15}{cols}")
        kinds = [("loop", "server event loop"), ("engine", "server engine thread"), ("other", "server other threads")]
        if any(r.server_cpu["children"] for _, r in runs):
            kinds.append(("children", "server child processes"))
        for kind, label in kinds:
            print(f"  {label:<24}" + "".join(f"{r.server_cpu[kind] / r.wall:>10.2f}" for _, r in runs))
        print(f"  {'paid client process':<24}" + "".join(f"{r.client_cpu / r.wall:>10.2f}" for _, r in runs))
        phases = ([share] if share else []) + [flood]
        print(f"  {'free client process':<24}{'':>10}" + "".join(f"{p.free_cpu / p.free_seconds:>10.2f}" for p in phases)
              + "  (all on the same machine)")
    print()

    probes = pause["probes"]
    print(f"(c) batch yielding: {len(probes)} paid probes x {args.probe_tokens} tokens while {args.batch_streams} "
          f"batch streams decode")
    em = emission_analysis(rec, probes)
    if rec.get("steps_recorded"):
        an = pause_analysis(rec, probes)
        rows = [r for r in an["rows"] if r is not None]
        step = an["step"]
        after = Counter(r["decode_after"] + r["prefill_after"] for r in rows)
        worst = max(after, default=0)
        state = note(targets, "(c) batch steps started after a pause order <= 1",
                     f"max {worst} in {len(rows)}/{len(probes)} probes seen", len(rows) == len(probes) and worst <= 1,
                     smoke)
        ends = [r["last_batch_end"] for r in rows]
        starts = [r["paid_start"] for r in rows]
        flight = [r["in_flight_ms"] for r in rows]
        print(f"  server: pause orders seen {len(rows)}/{len(probes)}; a batch step was in flight at "
              f"{sum(r['in_flight'] > 0 for r in rows)} of them (it took p50 {pct(flight, 50):.2f} ms, max "
              f"{max(flight):.2f} ms)")
        print("  batch steps (decode or resuming prefill) started after the order, probes by count: "
              + ", ".join(f"{k}: {after[k]}" for k in sorted(after))
              + f"  (decode max {max(r['decode_after'] for r in rows)}, prefill max "
              f"{max(r['prefill_after'] for r in rows)}); target <= 1: the batch stops within one step  {state}")
        print(f"  order -> last batch compute ends: p50 {pct(ends, 50) * ms:.2f} ms, max {max(ends) * ms:.2f} ms "
              f"= {pct(ends, 50) / step:.2f} / {max(ends) / step:.2f} steps of {step * ms:.2f} ms "
              f"({args.batch_streams} batch rows)")
        print(f"  order -> paid prefill starts:      p50 {pct(starts, 50) * ms:.2f} ms, max {max(starts) * ms:.2f} ms "
              f"= {pct(starts, 50) / step:.2f} / {max(starts) / step:.2f} steps")
    if em:
        hist = Counter(em)
        print("  server: batch text deltas the engine delivered per stream after the order: "
              + ", ".join(f"{k}: {hist[k]}x" for k in sorted(hist)))
        if not rec.get("steps_recorded"):
            state = note(targets, "(c) batch text deltas per stream after a pause order <= 1", f"max {max(em)}",
                         bool(probes) and max(em) <= 1, smoke)
            print(f"  (no step records on this engine: judged on the deltas, target <= 1 per stream)  {state}")
    # client view: batch tokens received after the pause order (the server's record of it; else the paid send)
    counts = []
    for p in probes:
        orders = [t for t, busy in rec.get("gate", []) if busy and p["t0"] <= t <= p["t1"]]
        since = orders[0] if orders else p["t0"]
        counts += [len([t for t in ts if t > since]) for ts in p["received"]]
    hist = Counter(counts)
    print("  client: batch tokens received per stream after the order: "
          + ", ".join(f"{k}: {hist[k]}x" for k in sorted(hist)) + " (includes tokens already in transit)")
    if not rec:
        state = note(targets, "(c) batch tokens per stream after a pause order (client view) <= 1",
                     f"max {max(counts, default=0)}", bool(probes) and max(counts) <= 1, smoke)
        print(f"  (no server records: judged on the client view, <= 1)  {state}")
    state = note(targets, "(c) tiergate_batch_pauses rises by one per probe", f"+{pause['pauses']:.0f} for {len(probes)}",
                 pause["pauses"] >= len(probes), smoke)
    print(f"  tiergate_batch_pauses +{pause['pauses']:.0f} for {len(probes)} probes  {state}")
    lat = [p["latency"] for p in probes]
    print(f"  probe latency p50 {pct(lat, 50) * ms:.1f} ms, max {max(lat) * ms:.1f} ms; outcomes "
          f"{dict(Counter(p['status'] for p in probes))}; batch streams {dict(Counter((s.finish, s.completion_tokens) for s in pause['streams']))}\n")

    print("(d) refusals in the flood phases; paid: every phase (responses; /metrics tiergate_rejected in brackets)")
    outcomes = {"paid": flood.paid.outcomes + alone.outcomes + (share.paid.outcomes if share else Counter()),
                "free": flood.free_outcomes,
                "batch": Counter(s.status for s in flood.streams)}
    rej = flood.rejected_metrics
    print(f"  {'tier':<7}{'sent':>7}{'ok':>7}{'429 queue_full':>18}{'429 latency_target':>22}{'429 other':>11}{'other':>7}")
    for tier, oc in outcomes.items():
        sent = sum(oc.values())
        qf, lt = oc.get("429 queue_full", 0), oc.get("429 latency_target", 0)
        other429 = sum(v for k, v in oc.items() if k.startswith("429") and k not in ("429 queue_full", "429 latency_target"))
        other = sum(v for k, v in oc.items() if k != "ok" and not k.startswith("429"))
        mq, ml = rej.get((tier, "queue_full"), 0), rej.get((tier, "latency_target"), 0)
        print(f"  {tier:<7}{sent:>7}{oc.get('ok', 0):>7}{f'{qf} [{mq}]':>18}{f'{lt} [{ml}]':>22}{other429:>11}{other:>7}")
    paid_refused = sum(v for k, v in outcomes["paid"].items() if k != "ok")
    state = note(targets, "(d) paid requests refused or failed == 0", str(paid_refused), paid_refused == 0, smoke)
    print(f"  paid refused or failed: {paid_refused} (target 0)  {state}")
    sent = sum(flood.free_outcomes.values())
    served = f"served ones p50 {pct(flood.free_latencies, 50) * ms:.0f} ms" if flood.free_latencies else "none served"
    print(f"  free flood: {sent} requests in {flood.free_seconds:.0f}s ({sent / flood.free_seconds:.0f}/s); {served}")
    print(f"  batch streams, paused through the flood and resumed after: "
          f"{dict(Counter((s.finish, s.completion_tokens) for s in flood.streams))}, unfinished "
          f"{flood.unfinished_batch}; batch pauses +{flood.pauses:.0f}")
    if unguarded is not None:
        guard_rows(args, (alone, flood), unguarded, limits, targets, smoke, loads)
    return judge(targets, smoke=smoke, note="(b) paid latency, (c) batch yielding, (d) refusals, (e) the SLO guard")


def guard_rows(args, guarded: tuple[PaidRun, FloodPhase], unguarded: tuple[PaidRun, FloodPhase], limits: dict,
               targets: list[Target], smoke: bool, loads: tuple) -> None:
    """(e) The same phases, same run, on a second server whose SLO guard is off: paid's latency
    and what free got served in the flood, side by side."""
    print("\n(e) the SLO guard (gate.slo_guard: on, the shipped default) vs a second server with it off, same run, "
          f"phases alternated; paid latency_target_s {args.paid_target:g}, token_latency_target_s "
          f"{args.paid_token_target * 1e3:.2f} ms (the guard judges chat by time to first token and by time per later token)")
    print(f"  {'':<34}{'guard on':>10}{'guard off':>10}")
    rows = []
    for q in (50, 99):
        ratio = [pct(f.paid.latencies, q) / pct(a.latencies, q) for a, f in (guarded, unguarded)]
        rows.append(ratio)
        print(f"  {'paid p%d flood/alone' % q:<34}{ratio[0]:>9.2f}x{ratio[1]:>9.2f}x")
    served = [f.free_outcomes.get("ok", 0) / max(f.free_seconds, 1e-9) for _, f in (guarded, unguarded)]
    print(f"  {'free served in the flood, req/s':<34}{served[0]:>10.1f}{served[1]:>10.1f}")
    refused = [sum(v for k, v in f.free_outcomes.items() if k != "ok") / max(f.free_seconds, 1e-9) for _, f in (guarded, unguarded)]
    print(f"  {'free refused in the flood, req/s':<34}{refused[0]:>10.1f}{refused[1]:>10.1f}")
    print(f"  effective max_inflight after the last flood (guard on): {limits or 'n/a'}")
    ratio = served[0] / served[1] if served[1] else float("inf")
    state = note(targets, "(e) free served in the flood, guard on / guard off >= 0.5x", f"{ratio:.2f}x", ratio >= 0.5,
                 smoke, overloaded(loads))
    print(f"  free served, guard on / guard off: {ratio:.2f}x (target >= 0.5x)  {state}")
    print(f"  paid p99 flood/alone with the guard off: {rows[1][1]:.2f}x (shown; (b) judges the guard on)")


async def run(args: argparse.Namespace) -> int:
    from demo import build_demo_models

    model = build_demo_models(args.models_dir, names=[MODEL])[MODEL].resolve()
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        folders = {guard: Path(tmp) / f"guard-{'on' if guard else 'off'}" for guard in (True, False)}
        for folder in folders.values():
            folder.mkdir()
        t_start = time.monotonic()
        load_start = os.getloadavg()[0]
        other = OtherLoad().__enter__()  # left at the end of the measuring, before the report
        say = lambda msg: print(f"bench_tiers: {msg} ({time.monotonic() - t_start:.0f}s)", file=sys.stderr, flush=True)  # noqa: E731
        start = lambda guard, token_target=None: start_server(  # noqa: E731
            write_config(folders[guard], model, args, guard, token_target), folders[guard], timeout=300,
            switch_interval=args.switch_interval, threads=args.server_threads)
        servers = {False: start(False)}
        try:
            await warm_up(servers[False], args)
            token_target = args.paid_token_target
            if token_target is None:  # calibrated: 1.25x paid's time per token alone, the ratio (b) judges
                async with client_for(servers[False].url) as client:
                    calib = await paid_load(client, servers[False].keys["paid"], args.paid // 3 or 1,
                                            args.paid_concurrency, args.paid_tokens)
                token_target = 1.25 * pct(calib.latencies, 50) / args.paid_tokens
            args.paid_token_target = token_target
            servers[True] = start(True, token_target or None)
            server = servers[True]  # the shipped default: everything below but (e)'s guard-off column is its
            say(f"servers up (guard off, guard on with paid token_latency_target_s {token_target * 1e3:.2f} ms)")
            await warm_up(server, args)
            for s in servers.values():
                s.threads = s.records(since=float("inf"))["threads"]
            phases = {guard: (PaidRun(), FloodPhase(), FloodPhase()) for guard in servers}
            per_round = []
            for i in range(args.rounds):  # alternate, so that drifting machine load hits every phase alike
                for guard in ((True, False) if i % 2 == 0 else (False, True)):
                    s = servers[guard]
                    alone, share, flood = phases[guard]
                    async with client_for(s.url) as client:
                        a = await paid_load(client, s.keys["paid"], args.paid, args.paid_concurrency,
                                            args.paid_tokens, s)
                    sh = await phase_flood(s, args, args.free_inflight) if args.share else None
                    b = await phase_flood(s, args, args.free_clients)
                    if guard:
                        per_round.append((a, sh.paid if sh else None, b.paid))
                    alone.merge(a)
                    if sh:
                        share.merge(sh)
                    flood.merge(b)
                    say(f"round {i + 1}, guard {'on' if guard else 'off'}: paid alone {a.wall:.1f}s, share "
                        f"{sh.paid.wall if sh else 0:.1f}s, flood {b.paid.wall:.1f}s")
            limits = {labels[0][1]: int(v) for (name, labels), v in metrics(server.url).items()
                      if name == "tiergate_effective_max_inflight"}
            pause = await phase_pause(server, args)
            say("pause probes done")
            rec = server.records(since=t_start) if server.instrumented else {}
        except BaseException:
            for s in servers.values():
                print(f"--- server log tail ({s.log}) ---\n{s.log.read_text()[-4000:]}", file=sys.stderr)
            raise
        finally:
            other.__exit__(None, None, None)
            for s in servers.values():
                s.stop()
        alone, share, flood = phases[True]
        off_alone, _, off_flood = phases[False]
        return report(args, server, alone, share if args.share else None, flood, per_round, pause, rec,
                      (load_start, os.getloadavg()[0], other), (off_alone, off_flood), limits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "auto"])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "demo-models")
    ap.add_argument("--rounds", type=int, default=3, help="alone/flood pairs, alternated")
    ap.add_argument("--paid", type=int, default=150, help="paid requests per phase and round")
    ap.add_argument("--paid-concurrency", type=int, default=2)
    ap.add_argument("--paid-tokens", type=int, default=32)
    ap.add_argument("--free-clients", type=int, default=24)
    ap.add_argument("--free-tokens", type=int, default=64)
    ap.add_argument("--no-share", dest="share", action="store_false",
                    help="skip the 'share' phase (free at exactly its max_inflight, nobody refused)")
    ap.add_argument("--free-backoff", type=float, default=0.2, help="seconds a free client waits after a 429")
    ap.add_argument("--flood-warmup", type=float, default=1.0, help="seconds of flood before the paid load starts")
    ap.add_argument("--batch-streams", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=400)
    ap.add_argument("--batch-finish-timeout", type=float, default=60)
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--probe-tokens", type=int, default=8)
    ap.add_argument("--probe-gap", type=float, default=0.05, help="mean extra seconds between probes")
    ap.add_argument("--probe-wait-tokens", type=int, default=3,
                    help="tokens every batch stream must produce between probes (0: the next probe may land while "
                         "the paused rows are still resuming)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--paid-inflight", type=int, default=4)
    ap.add_argument("--free-inflight", type=int, default=2)
    ap.add_argument("--free-queued", type=int, default=4)
    ap.add_argument("--free-target", type=float, default=10)
    ap.add_argument("--paid-target", type=float, default=0.015,
                    help="paid's latency_target_s: the SLO guard shrinks free while paid's time to first token "
                         "(p90 over 10 s) is above 0.8x this, lets it grow back below 0.5x")
    ap.add_argument("--paid-token-target", type=float, default=None,
                    help="paid's token_latency_target_s (seconds per token): the SLO guard shrinks free while "
                         "paid's replies' mean time per later token (p90) is above 0.8x this. Default: calibrated "
                         "as 1.25x paid's p50 latency alone per token, on the guard-off server before the rounds "
                         "(the ratio (b) judges); 0: none (the guard judges time to first token only)")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="torch intra-op threads of the server process (OMP_NUM_THREADS); 0: torch's default "
                         "(one per core). See docs/BENCHMARKS.md for why the default is 1")
    ap.add_argument("--switch-interval", type=float, help="diagnostic: the server's sys.setswitchinterval "
                    "(Python's default 0.005 s)")
    ap.add_argument("--smoke", action="store_true", help="tiny counts on the transformers engine, one round, no "
                    "share phase: the code path, no verdict (~20 s)")
    ap.add_argument("--serve", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: the server process
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.port, args.switch_interval, args.server_threads)
    if args.smoke:
        args.engine = "transformers"
        args.rounds, args.paid, args.free_clients, args.free_tokens, args.share = 1, 8, 4, 8, False
        args.flood_warmup, args.batch_streams, args.batch_tokens, args.probes = 0.3, 2, 48, 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
