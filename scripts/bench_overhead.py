#!/usr/bin/env python
"""Gateway overhead: what tiergate adds per request over a bare Starlette endpoint that makes the
same engine call on the same model, over real HTTP on 127.0.0.1, at 1 and at 64 concurrent clients.

    python scripts/bench_overhead.py                 # 5 rounds, about 1.5 minutes on 2 cores
    python scripts/bench_overhead.py --rounds 9 --requests 400 --clients 1 64
    python scripts/bench_overhead.py --engine vllm   # chat on the vLLM engine (its core in its own process)
    python scripts/bench_overhead.py --smoke         # tiny counts, the real code path; no verdict

Two servers, each its own process, started and loaded before anything is timed:

  tiergate  as ``tiergate serve`` runs (``build_services``, ``create_app``, uvicorn with tiergate's
            HTTP protocol, the request log writing one line per request): auth, the gate, the
            arbiter's lease, metrics, the request log, accounts, OpenAI-shaped validation.
  bare      a Starlette app with one route per endpoint and nothing else: it parses the JSON body,
            calls the same worker class on the same model (the config's own ``ModelSpec``, built
            by ``workers.registry.make_worker``) and answers in OpenAI's shape; no auth, no
            limits, no metrics, no logging.

The endpoints: ``/v1/chat/completions`` on the demo tiny-chat with the transformers engine
(``max_tokens`` 1, greedy, not streamed: the prefill and one token, so the HTTP path dominates),
and ``/v1/embeddings`` on the demo tiny-embed (one short input). Both servers run with one torch
thread (``--server-threads``) and the same uvicorn protocol settings. The gate gets room for
every client (``gate.slots`` 64, paid ``max_inflight`` 64), so the engine sees the same
concurrency behind both servers.

With ``--engine vllm`` tiny-chat runs on the vLLM engine (``workers.chat_vllm``: one ``AsyncLLM``,
its engine core a child process of each server) with the config's engine defaults, the same
``ModelSpec`` and so the same engine arguments behind both servers; only chat is measured (the
embeddings endpoint does not touch the chat engine: its figures are the transformers run's).
On the transformers engine the engine's step thread shares the server's interpreter lock with
the event loop; on vLLM the engine core does not.

The client is this process: closed-loop keep-alive connections written on asyncio streams (a
minimal HTTP/1.1 client, so that the client's own cost, which lands on the same cores, stays
small and equal for both). Per round, per endpoint, per concurrency level, the two servers take
turns (the order reversed every other round); the figures are medians over ``--rounds`` rounds
(5 by default: with 3, the 1-client p50 added ranged -0.58 to +2.00 ms between the rounds of one
run on a quiet machine, so one slow round in three could decide a 1 ms target).

Judged, per endpoint: the p50 latency tiergate adds at 1 client <= 1 ms (the median over the
rounds of p50(tiergate) - p50(bare)), and tiergate's throughput >= 0.9x the bare endpoint's at 64
clients (the median of the per-round ratios). Both are ``n/a`` when processes outside this
benchmark (its two servers and its client are its own) used more than ``OTHER_LOAD_LIMIT`` cores
while it ran (``benchlib.OtherLoad``): the figures then measure the machine.

Printed beside them, the figure load distorts least: each server's CPU seconds per request
(its whole process tree, all threads, user + system, from ``/proc/<pid>/stat``), read before and
after each run, and apart: the server process itself (the API: uvicorn, the app, and on the
transformers engine the engine thread) and its children (vLLM's engine core); and the server
process's garbage collections (CPU per request, and how many were full collections), read from
``/bench/gc`` on both servers; and its threads' context switches per request (``cs``, the server
process's ``getrusage``, also from ``/bench/gc``): a thread that waits for the interpreter lock, or a helper thread
woken to do a little work, is a switch, and each costs the others turns at the lock (bare's
server has only its event loop and the engine thread). At 64 clients both servers are CPU-bound, so tiergate's throughput
ratio is about the inverse of its CPU ratio; the difference is tiergate's own work per request.

Diagnostics, set in both servers once their models are loaded (``/bench/tune``), judged the same
way: ``--switch-interval SECONDS`` (``sys.setswitchinterval``; the transformers engine lowers it
to 0.5 ms when it loads: how much of the 64-client gap is the loop and the engine thread handing
the interpreter lock back and forth), ``--gc-freeze`` (``gc.freeze()``) and ``--gc-threshold``
(``gc.set_threshold``): how much of it is the collector.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (OTHER_LOAD_LIMIT, OtherLoad, Target, http_head, judge, read_response,  # noqa: E402
                      spare_port, tree_cpu_s)

TIERS = ["paid", "subscriber", "free", "batch"]
CHAT, EMBED = "tiny-chat", "tiny-embed"
ADDED_P50_MS = 1.0
# After its first requests vLLM's engine core on CPU kept a core busy for ~1 s (not after later
# runs): a pause after the warm-up, so that the first run does not share the cores with it
SETTLE_S = 2.0
THROUGHPUT = 0.9
CHAT_BODY = {"model": CHAT, "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": 1,
             "temperature": 0}
EMBED_BODY = {"model": EMBED, "input": "the gateway's own overhead"}
ENDPOINTS = {"chat": ("/v1/chat/completions", CHAT_BODY), "embeddings": ("/v1/embeddings", EMBED_BODY)}


# -- the servers (each its own process) -------------------------------------------------------------


def write_config(folder: Path, models_dir: Path, engine: str, endpoints: list[str]) -> Path:
    lines = ["tiers:"]
    for name in TIERS:
        lines += [f"  - name: {name}", f"    keys_env: TIERGATE_BENCH_KEYS_{name.upper()}", "    max_inflight: 64",
                  "    max_queued: 256", "    latency_target_s: 600"] + (["    batch: true"] if name == "batch" else [])
    lines += ["models:", f"  - name: {CHAT}", "    kind: chat", f"    path: {models_dir / CHAT}", f"    engine: {engine}"]
    if "embeddings" in endpoints:
        lines += [f"  - name: {EMBED}", "    kind: embed", f"    path: {models_dir / EMBED}"]
    lines += ["gpu:", "  device: cpu", "  vram_budget: 4GiB",
              "gate:", "  slots: 64"]
    path = folder / "tiers.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def serve(kind: str, config_path: str, port: int) -> None:
    """Serve ``kind``'s app on ``port`` as ``tiergate serve`` does (gateway/cli.py's _serve)."""
    import uvicorn

    from gateway import request_log
    from gateway.cli import server_config

    if kind == "tiergate":
        request_log.configure(json_lines=False)
    gc.callbacks.append(GC_CLOCK)
    app = tiergate_app(config_path) if kind == "tiergate" else bare_app(config_path)
    uvicorn.Server(server_config(app, "127.0.0.1", port, log_config=None, access_log=False)).run()


class GcClock:
    """The server process's garbage collections: count and CPU seconds per generation
    (``gc.callbacks``; a collection runs in the thread that set it off, so its thread's CPU time
    is the collection's, whatever else shares the cores)."""

    def __init__(self) -> None:
        self.collections, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.collections[info["generation"]] += 1
            self.seconds[info["generation"]] += time.thread_time() - self._start


GC_CLOCK = GcClock()


def bench_routes() -> list:
    """Both servers' diagnostics, outside the timed runs: their garbage collections so far, and,
    once loaded, a switch interval, ``gc.freeze()`` and the collector's thresholds for the
    diagnostic flags."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def collections(request):
        usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread's, the ended ones' too
        return JSONResponse({"collections": GC_CLOCK.collections, "seconds": GC_CLOCK.seconds,
                             "switches": usage.ru_nvcsw + usage.ru_nivcsw})

    async def tune(request):
        settings = json.loads(await request.body())
        if settings.get("switch_interval") is not None:
            sys.setswitchinterval(settings["switch_interval"])
        if settings.get("gc_freeze"):
            gc.collect()
            gc.freeze()
        if settings.get("gc_threshold"):
            gc.set_threshold(*settings["gc_threshold"])
        return JSONResponse({"switch_interval": sys.getswitchinterval(), "frozen": gc.get_freeze_count(),
                             "threshold": gc.get_threshold()})

    return [Route("/bench/gc", collections, methods=["GET"]), Route("/bench/tune", tune, methods=["POST"])]


def tiergate_app(config_path: str):
    """The production app, its services built from the config with the keys in the environment,
    and the garbage collector's freezes (``gateway.collector``), as ``tiergate serve`` runs it."""
    from gateway import collector
    from gateway.app import build_services, create_app
    from gateway.cli import resolve_keys
    from gateway.config import load_config

    config = load_config(config_path)
    keyring, _ = resolve_keys(config, demo=False)
    services = build_services(config, keyring)
    collector.attach(services)
    return create_app(services, bench_routes())


def bare_app(config_path: str):
    """The same workers on the same specs behind a bare Starlette app, placed before it listens
    (the vLLM engine starts on the server's own event loop, as behind tiergate)."""
    import contextlib

    import anyio
    import torch
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from gateway.config import load_config
    from workers.base import ChatFinished, ChatParams, ChatRequest, StepContext, TextDelta
    from workers.registry import make_worker

    workers = {s.name: make_worker(s) for s in load_config(config_path).model_specs()}
    chat_worker, embed_worker = workers[CHAT], workers.get(EMBED)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for worker in workers.values():
            await worker.place(torch.device("cpu"))
        yield
        for worker in workers.values():
            await worker.release()

    async def chat(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        params = ChatParams(max_tokens=body.get("max_tokens", 256), temperature=body.get("temperature", 1.0))
        text, finished = [], None
        events = chat_worker.chat(ChatRequest(body["messages"], params, stream=bool(body.get("stream"))))
        async for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, ChatFinished):
                finished = event
        return JSONResponse({
            "id": "chatcmpl-bare", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                         "finish_reason": finished.finish_reason}],
            "usage": {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
                      "total_tokens": finished.prompt_tokens + finished.completion_tokens}})

    async def embeddings(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        inputs = [body["input"]] if isinstance(body["input"], str) else body["input"]
        ids = await anyio.to_thread.run_sync(embed_worker.tokenize, inputs)
        vectors = await anyio.to_thread.run_sync(lambda: embed_worker.embed(ids, None, StepContext()))
        tokens = sum(len(i) for i in ids)
        return JSONResponse({"object": "list", "model": body["model"],
                             "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             *([Route("/v1/embeddings", embeddings, methods=["POST"])] if embed_worker else []),
                             Route("/healthz", healthz, methods=["GET"]), *bench_routes()],
                     lifespan=lifespan)


@dataclass
class Server:
    kind: str
    proc: subprocess.Popen
    port: int
    key: str

    def cpu_s(self) -> tuple[float, float]:
        """The server's CPU seconds so far, every thread, user + system (Linux; else 0): (its own
        process, its descendants together: vLLM's engine core)."""
        tree = tree_cpu_s(self.proc.pid) if os.path.exists("/proc/stat") else {}
        own = sum(cpu for (pid, _), cpu in tree.items() if pid == self.proc.pid)
        return own, sum(tree.values()) - own

    def collections(self) -> dict:
        """The server process's garbage collections so far (``/bench/gc``)."""
        status, body = asyncio.run(_request(self.port, "GET", "/bench/gc", None, b""))
        if status != 200:
            raise RuntimeError(f"{self.kind} /bench/gc: {status} {body[:200]!r}")
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(kind: str, config: Path, folder: Path, threads: int, models: list[str],
                 tune: dict, timeout: float = 240) -> Server:
    keys = {t: f"tg-bench-{t}-{secrets.token_urlsafe(12)}" for t in [*TIERS, "admin"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERGATE_KEYS_")}
    env.update({f"TIERGATE_BENCH_KEYS_{t.upper()}": keys[t] for t in TIERS})
    env["TIERGATE_KEYS_ADMIN"] = keys["admin"]
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    port = spare_port()
    log = (folder / f"{kind}.log").open("w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", kind, str(config),
                             "--port", str(port), "--server-threads", str(threads)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(kind, proc, port, keys["paid"])
    deadline = time.monotonic() + timeout
    while not _healthy(port):
        if proc.poll() is not None:
            raise RuntimeError(f"the {kind} server exited ({proc.returncode}):\n{(folder / f'{kind}.log').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the {kind} server did not come up")
        time.sleep(0.2)
    if kind == "tiergate":  # the bare server loaded its models before it listened
        for model in models:
            status, body = asyncio.run(_request(port, "POST", f"/admin/models/{model}/load", keys["admin"], b""))
            if status != 200:
                server.stop()
                raise RuntimeError(f"loading {model} failed: {status} {body[:300]!r}")
    if any(tune.values()):
        status, body = asyncio.run(_request(port, "POST", "/bench/tune", None, json.dumps(tune).encode()))
        if status != 200:
            server.stop()
            raise RuntimeError(f"/bench/tune failed: {status} {body[:300]!r}")
    return server


def _healthy(port: int) -> bool:
    try:
        return asyncio.run(_request(port, "GET", "/healthz", None, b""))[0] == 200
    except OSError:
        return False


async def _request(port: int, method: str, path: str, key: str | None, body: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(http_head(method, path, key, body))
        return await read_response(reader)
    finally:
        writer.close()


@dataclass
class Load:
    latencies: list[float]  # seconds, per request
    seconds: float  # wall time of the whole run
    errors: list[str]
    api_cpu_s: float = 0.0  # the server process's CPU seconds over the run
    engine_cpu_s: float = 0.0  # its descendants' (vLLM's engine core)
    gc_s: float = 0.0  # the server process's garbage collections over the run: seconds
    full_gcs: int = 0  # and how many were of the oldest generation (every object tracked)
    switches: int = 0  # the server process's threads' context switches over the run

    @property
    def cpu_ms(self) -> float:
        """The server's CPU milliseconds per request, its whole process tree."""
        return (self.api_cpu_s + self.engine_cpu_s) / len(self.latencies) * 1e3

    @property
    def api_ms(self) -> float:
        return self.api_cpu_s / len(self.latencies) * 1e3

    @property
    def engine_ms(self) -> float:
        return self.engine_cpu_s / len(self.latencies) * 1e3

    @property
    def gc_ms(self) -> float:
        return self.gc_s / len(self.latencies) * 1e3

    @property
    def switches_per_request(self) -> float:
        return self.switches / len(self.latencies)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1e3


async def _drive(server: Server, endpoint: str, clients: int, requests: int) -> Load:
    path, payload = ENDPOINTS[endpoint]
    message = http_head("POST", path, server.key, json.dumps(payload).encode())
    latencies: list[float] = []
    errors: list[str] = []
    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]

    async def client(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            for _ in range(n):
                start = time.perf_counter()
                writer.write(message)
                status, body = await read_response(reader)
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    errors.append(f"{status} {body[:200]!r}")
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(n) for n in per_client if n))
    return Load(latencies, time.perf_counter() - start, errors)


def drive(server: Server, endpoint: str, clients: int, requests: int) -> Load:
    gcs = server.collections()
    api, engine = server.cpu_s()
    load = asyncio.run(_drive(server, endpoint, clients, requests))
    api_after, engine_after = server.cpu_s()
    gcs_after = server.collections()
    load.api_cpu_s, load.engine_cpu_s = api_after - api, engine_after - engine
    load.gc_s = sum(gcs_after["seconds"]) - sum(gcs["seconds"])
    load.full_gcs = gcs_after["collections"][2] - gcs["collections"][2]
    load.switches = gcs_after["switches"] - gcs["switches"]
    return load


# -- the run ---------------------------------------------------------------------------------------


def measure(servers: list[Server], args: argparse.Namespace) -> dict:
    """results[endpoint][server kind][clients]: one Load per round, the servers taking turns."""
    results = {e: {s.kind: {c: [] for c in args.clients} for s in servers} for e in args.endpoints}
    for r in range(args.rounds):
        for endpoint in args.endpoints:
            for clients in args.clients:
                for server in (servers if r % 2 == 0 else servers[::-1]):
                    load = drive(server, endpoint, clients, args.requests if clients > 1 else args.requests_alone)
                    if load.errors:
                        raise RuntimeError(f"{server.kind} {endpoint} at {clients} clients: {len(load.errors)} "
                                           f"errors, first: {load.errors[0]}")
                    results[endpoint][server.kind][clients].append(load)
    return results


def targets(results: dict, levels: list[int], loaded: str) -> list[Target]:
    """Per endpoint: the p50 tiergate adds at the lowest level (1 client), and its throughput over
    the bare endpoint's at the highest (64), each the median over the rounds."""
    low, high = min(levels), max(levels)
    out = []
    for endpoint, runs in results.items():
        added = statistics.median(t.p50_ms - b.p50_ms for t, b in zip(runs["tiergate"][low], runs["bare"][low]))
        ratio = statistics.median(t.throughput / b.throughput for t, b in zip(runs["tiergate"][high], runs["bare"][high]))
        claim = f"{endpoint}: p50 latency tiergate adds at {low} client{'s' if low > 1 else ''} <= {ADDED_P50_MS:g} ms"
        why = loaded or ("" if low == 1 else f"(the lowest level measured is {low} clients, not 1)")
        out.append(Target(claim, f"{added:.3f} ms", None if why else added <= ADDED_P50_MS, why))
        claim = f"{endpoint}: tiergate/bare throughput at {high} clients >= {THROUGHPUT:g}x"
        why = loaded or ("" if high >= 64 else f"(the highest level measured is {high} clients, not 64)")
        out.append(Target(claim, f"{ratio:.2f}x", None if why else ratio >= THROUGHPUT, why))
    return out


def run(args: argparse.Namespace) -> int:
    from demo import build_demo_models

    models = [CHAT] + ([EMBED] if "embeddings" in args.endpoints else [])
    build_demo_models(args.models_dir, names=models)
    cores = os.cpu_count() or 1
    other = OtherLoad()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        folder = Path(tmp)
        config = write_config(folder, args.models_dir.resolve(), args.engine, args.endpoints)
        servers = []
        try:
            for kind in ("tiergate", "bare"):
                servers.append(start_server(kind, config, folder, args.server_threads, models,
                                            {"switch_interval": args.switch_interval, "gc_freeze": args.gc_freeze,
                                             "gc_threshold": args.gc_threshold}))
            for server in servers:  # warm: every path once, the engines' first steps
                for endpoint in args.endpoints:
                    warm = drive(server, endpoint, min(4, max(args.clients)), args.warmup)
                    if warm.errors:
                        raise RuntimeError(f"{server.kind} {endpoint}: {warm.errors[0]}")
            time.sleep(SETTLE_S)
            with other:
                results = measure(servers, args)
        finally:
            for server in servers:
                server.stop()
    busy = "n/a" if other.cores is None else f"{other.cores:.2f}"
    interval = "" if args.switch_interval is None else f"; switch interval {args.switch_interval:g} s (diagnostic)"
    interval += "; gc.freeze() after loading (diagnostic)" if args.gc_freeze else ""
    interval += f"; gc thresholds {args.gc_threshold} (diagnostic)" if args.gc_threshold else ""
    print(f"tiergate (the production app) vs a bare Starlette endpoint on the same worker; chat engine "
          f"{args.engine}; {cores} CPUs; other processes used {busy} cores meanwhile (limit {OTHER_LOAD_LIMIT:g}); "
          f"torch threads {args.server_threads} per server; {args.rounds} rounds, medians over them{interval}; "
          f"cpu ms/req: the server's CPU per request, its process tree (api: the server process; "
          f"engine: its children, vLLM's engine core; gc: the server process's garbage collections, ms per "
          f"request; full: collections of the oldest generation, all rounds; cs: context switches per "
          f"request, the server process's threads)")
    print(f"{'endpoint':<11} {'clients':>7} {'server':<9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>10} "
          f"{'api':>6} {'engine':>6} {'gc':>6} {'full':>4} {'cs':>5}")
    for endpoint in args.endpoints:
        for clients in args.clients:
            for kind in ("tiergate", "bare"):
                runs = results[endpoint][kind][clients]
                p99 = statistics.median(statistics.quantiles(r.latencies, n=100)[98] if len(r.latencies) > 1
                                        else r.latencies[0] for r in runs) * 1e3
                print(f"{endpoint:<11} {clients:>7} {kind:<9} {statistics.median(r.throughput for r in runs):>8.1f} "
                      f"{statistics.median(r.p50_ms for r in runs):>8.2f} {p99:>8.2f} "
                      f"{statistics.median(r.cpu_ms for r in runs):>10.2f} "
                      f"{statistics.median(r.api_ms for r in runs):>6.2f} {statistics.median(r.engine_ms for r in runs):>6.2f} "
                      f"{statistics.median(r.gc_ms for r in runs):>6.3f} {sum(r.full_gcs for r in runs):>4} "
                      f"{statistics.median(r.switches_per_request for r in runs):>5.1f}")
    print()
    for endpoint in args.endpoints:
        for clients in args.clients:
            t, b = results[endpoint]["tiergate"][clients], results[endpoint]["bare"][clients]
            added = " ".join(f"{x.p50_ms - y.p50_ms:+.2f}" for x, y in zip(t, b))
            ratio = " ".join(f"{x.throughput / y.throughput:.2f}" for x, y in zip(t, b))
            cpu = " ".join(f"{x.cpu_ms - y.cpu_ms:+.2f}" for x, y in zip(t, b))
            gcs = " ".join(f"{x.gc_ms - y.gc_ms:+.2f}" for x, y in zip(t, b))
            print(f"{endpoint} at {clients:>2} clients, per round: p50 added ms {added}; throughput tiergate/bare "
                  f"{ratio}; cpu ms/req added {cpu}; of it gc {gcs}")
    return judge(targets(results, args.clients, other.why_not(OTHER_LOAD_LIMIT)), smoke=args.smoke,
                 note="issue 15 item 3: the gateway's own overhead")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "demo-models")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 64], help="concurrency levels")
    ap.add_argument("--requests", type=int, default=640, help="per run above 1 client")
    ap.add_argument("--requests-alone", type=int, default=200, help="per run at 1 client")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server-threads", type=int, default=1, help="torch intra-op threads per server")
    ap.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                    help="tiny-chat's engine behind both servers (vllm: its engine core in a child process)")
    ap.add_argument("--endpoints", nargs="+", choices=list(ENDPOINTS),
                    help="default: chat and embeddings on transformers, chat alone on vllm")
    ap.add_argument("--switch-interval", type=float, help="diagnostic: sys.setswitchinterval in both servers once "
                    "loaded (the transformers engine lowers it to 0.0005)")
    ap.add_argument("--gc-freeze", action="store_true", help="diagnostic: gc.freeze() in both servers once loaded "
                    "(the loaded libraries' objects out of every later collection)")
    ap.add_argument("--gc-threshold", type=int, nargs=3, metavar=("GEN0", "GEN1", "GEN2"),
                    help="diagnostic: gc.set_threshold in both servers once loaded (Python's default: 700 10 10)")
    ap.add_argument("--smoke", action="store_true", help="1 round of a few requests at 1 and 4 clients; no verdict")
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        import torch

        torch.set_num_threads(args.server_threads)
        serve(*args.serve, args.port)
        return 0
    if args.smoke:
        args.clients, args.requests, args.requests_alone, args.warmup, args.rounds = [1, 4], 8, 4, 2, 1
    args.clients = sorted(set(args.clients))
    if args.endpoints is None:
        args.endpoints = ["chat"] if args.engine == "vllm" else list(ENDPOINTS)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
