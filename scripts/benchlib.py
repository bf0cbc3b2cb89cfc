"""Verdicts for the benchmarks: every ``scripts/bench_*.py`` ends by listing its targets with
the figures measured against them, then ONE last line, its verdict:

    verdict: PASS (2 of 2 judged targets met)
    verdict: FAIL (1 of 3 judged targets missed)
    verdict: n/a on CPU (no device memory)
    verdict: n/a (smoke run: counts too small to judge)

and exits 1 on FAIL, 0 otherwise. A target is judged (PASS/FAIL), not judgeable in this run (n/a,
with the reason), or shown for information only: a target another issue owns, printed with the
figure it would get so nobody has to compute it, but not part of the verdict.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

SMOKE = "(smoke run: counts too small to judge)"
VERDICT_LINE = re.compile(r"^verdict: (?:(?P<judged>PASS|FAIL)(?: \(.+\))?|n/a \S.*)$")


def pct(xs: list[float], q: int) -> float:
    """The ``q``-th percentile (a whole number, 1-99) of ``xs``, interpolated between samples; nan
    for none. A fraction (0.5 for the median) is refused: read as a percentile, it would index the
    last quantile and report p99 as p50."""
    if not (isinstance(q, int) and 1 <= q <= 99):
        raise ValueError(f"a percentile is a whole number from 1 to 99, not {q!r}")
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def closed_loop(call: Callable[[int], object], clients: int, requests: int) -> tuple[float, list[float]]:
    """``call(0)`` .. ``call(requests - 1)`` by ``clients`` threads, each making its next call as
    soon as its last returned (a closed loop): the wall time, and each call's latency (seconds)."""
    latencies: list[float] = []
    lock = threading.Lock()
    left = iter(range(requests))

    def client() -> None:
        while True:
            with lock:
                i = next(left, None)
            if i is None:
                return
            start = time.perf_counter()
            call(i)
            took = time.perf_counter() - start
            with lock:
                latencies.append(took)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies


def demo_chat_model(model: Path) -> None:
    """Build the demo chat model when ``model`` is its folder (``demo-models/tiny-chat``), as the
    worker-level chat benchmarks' default; any other chat model folder is taken as it is."""
    root = Path(__file__).resolve().parents[1]
    if Path(model).resolve() == (root / "demo-models" / "tiny-chat").resolve():
        from demo import build_demo_models

        build_demo_models(root / "demo-models", names=["tiny-chat"])


@dataclass(frozen=True)
class Target:
    claim: str  # what must hold, e.g. "tiergate/broadcast throughput at 1000 waiters >= 10x"
    measured: str  # the figure it was judged on, e.g. "34.8x"
    ok: bool | None  # None: cannot be judged in this run (``why_not`` says why)
    why_not: str = ""  # an n/a reason, written to follow "n/a ": "on CPU (no device memory)"
    judged: bool = True  # False: printed for information (another issue's target), not in the verdict


def at_least(claim: str, value: float | None, target: float, unit: str = "x", why_not: str = "",
             judged: bool = True) -> Target:
    """The common case: ``value >= target``; ``value`` None means not measured (``why_not``)."""
    if value is None:
        return Target(f"{claim} >= {target:g}{unit}", "n/a", None, why_not or "(not measured in this run)", judged)
    return Target(f"{claim} >= {target:g}{unit}", f"{value:.2f}{unit}", value >= target, judged=judged)


def ratio_at_most(claim: str, label: str, ours: list[float], theirs: list[float], target: float,
                  why_not: str = "") -> Target:
    """Each round's ``ours / theirs`` printed as ``label, per round: ...``, judged on their median
    (``<= target``; ``why_not``: n/a, the reason)."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(f"{label}, per round: " + " ".join(f"{x:.2f}x" for x in ratios))
    value = statistics.median(ratios)
    return Target(f"{claim} <= {target:g}x", f"{value:.2f}x", None if why_not else value <= target, why_not)


def verdict_of(targets: list[Target], smoke: bool = False) -> str:
    """The verdict line for ``targets`` (see the module docstring)."""
    if smoke:
        return f"verdict: n/a {SMOKE}"
    judged = [t for t in targets if t.judged]
    failed = [t for t in judged if t.ok is False]
    passed = [t for t in judged if t.ok is True]
    unknown = [t for t in judged if t.ok is None]
    rest = f", {len(unknown)} n/a" if unknown else ""
    if failed:
        return f"verdict: FAIL ({len(failed)} of {len(passed) + len(failed)} judged targets missed{rest})"
    if passed:
        return f"verdict: PASS ({len(passed)} of {len(passed)} judged targets met{rest})"
    reasons = list(dict.fromkeys(t.why_not for t in unknown)) or ["(no target judged)"]
    return "verdict: n/a " + "; ".join(reasons)


def judge(targets: list[Target], smoke: bool = False, note: str = "") -> int:
    """Print the targets, then the verdict as the last line; return the exit status."""
    print()
    print("targets judged here" + (f" ({note})" if note else "") + ":")
    for t in targets:
        state = "n/a" if t.ok is None or smoke else ("PASS" if t.ok else "FAIL")
        if not t.judged:
            if state == "n/a":
                print(f"  {'info':<5} {t.claim}: n/a" + ("" if smoke else f" {t.why_not}"))
            else:
                print(f"  {'info':<5} {t.claim}: {t.measured} (would {state}; not judged here)")
        elif t.ok is None and not smoke:
            shown = f"{t.measured}, not judged: " if t.measured != "n/a" else ""
            print(f"  {state:<5} {t.claim}: {shown}n/a {t.why_not}")
        else:
            print(f"  {state:<5} {t.claim}: {t.measured}")
    line = verdict_of(targets, smoke)
    print(line, flush=True)
    return 1 if line.startswith("verdict: FAIL") else 0


class OtherLoad:
    """The CPU that processes *outside* this benchmark's own process tree used while it ran.

    The load average counts the benchmark's own server and clients, so a benchmark that keeps two
    cores busy reads "load 2" on a 2-core machine however quiet the machine is. This counts instead
    the machine's busy CPU time (``/proc/stat``) minus what this process and its descendants used
    (sampled from ``/proc/<pid>/stat`` every ``period`` s by a thread, so children that exit midway
    still count), in cores:

        with OtherLoad() as other:
            ...run the benchmark...
        if other.cores > OTHER_LOAD_LIMIT: the ratios measure the machine: n/a

    Linux only; elsewhere ``cores`` is None (the caller falls back to the load average).
    """

    def __init__(self, period: float = 0.25) -> None:
        self.period = period
        self.cores: float | None = None
        self._first: dict[tuple[int, str], float] = {}
        self._last: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()

    def __enter__(self) -> OtherLoad:
        if not os.path.exists("/proc/stat"):
            return self
        self._t0, self._busy0 = time.monotonic(), _machine_busy_s()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="other-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not hasattr(self, "_thread"):
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        ours = sum(self._last[k] - self._first[k] for k in self._last)
        elapsed = max(1e-9, time.monotonic() - self._t0)
        self.cores = max(0.0, (_machine_busy_s() - self._busy0 - ours) / elapsed)

    def why_not(self, limit: float = 0.5) -> str:
        """An n/a reason when other processes used more than ``limit`` cores, else ""."""
        if self.cores is None or self.cores <= limit:
            return ""
        return f"(other processes used {self.cores:.1f} cores meanwhile: the figures measure the machine)"

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> None:
        initial = not self._last
        for key, cpu in tree_cpu_s(os.getpid()).items():
            self._first.setdefault(key, cpu if initial else 0.0)  # born after the start: all of it counts
            self._last[key] = max(cpu, self._last.get(key, 0.0))


OTHER_LOAD_LIMIT = 0.5  # cores other processes may use before a latency or throughput ratio is n/a
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def tree_cpu_s(root: int) -> dict[tuple[int, str], float]:
    """CPU seconds (own plus reaped children's) of ``root`` and every live descendant, by
    (pid, start time) so a reused pid is a new process."""
    parent: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(name)
        parent[pid], stats[pid] = int(rest[1]), rest
    ours, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in ours:
                ours.add(child)
                frontier.append(child)
    out = {}
    for pid in ours:
        if pid in stats:
            s = stats[pid]  # after the ")": state=0, ppid=1, ..., utime=11, stime=12, cutime=13, cstime=14, starttime=19
            out[(pid, s[19])] = sum(int(x) for x in s[11:15]) / _TICK
    return out


# -- a minimal HTTP/1.1 client: keep-alive connections on asyncio streams --------------------------
# The load generators' own CPU shares the machine's cores with the server they measure; httpx
# spends several times more per request than this.


def http_head(method: str, path: str, key: str | None, body: bytes) -> bytes:
    """A request's bytes: the head (JSON content type, the key as a bearer token) and ``body``."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{auth}\r\n").encode() + body


async def read_response(reader) -> tuple[int, bytes]:
    """(status, body) of one response on a keep-alive connection (content-length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    fields = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if "content-length" in fields:
        return status, await reader.readexactly(int(fields["content-length"]))
    chunks = []  # chunked
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunks.append(await reader.readexactly(size + 2))
        if size == 0:
            return status, b"".join(c[:-2] for c in chunks)


async def flood(port: int, message: bytes, clients: int, backoff: float, stop, ready, results) -> None:
    """A load generator's flood, run in a process of its own (``multiprocessing``'s spawn context;
    ``stop`` and ``ready`` its events, ``results`` its queue) so that its CPU is not the timing
    client's: ``clients`` keep-alive connections on 127.0.0.1:``port``, each sending ``message``
    (``http_head``'s bytes) again as soon as it is answered, and waiting ``backoff`` seconds after a
    refusal or a broken connection. Puts its outcomes (``ok``, ``<status> <error code>``), the
    latencies of the answered ones, its length in seconds and its process's CPU seconds."""
    import asyncio
    import json
    from collections import Counter

    outcomes: Counter = Counter()
    latencies: list[float] = []

    async def worker() -> None:
        conn = None
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                if conn is None:
                    conn = await asyncio.open_connection("127.0.0.1", port)
                conn[1].write(message)
                status, answer = await read_response(conn[0])
            except (OSError, asyncio.IncompleteReadError) as exc:
                outcomes[f"error {type(exc).__name__}"] += 1
                conn = None
                await asyncio.sleep(backoff)
                continue
            if status == 200:
                outcomes["ok"] += 1
                latencies.append(time.monotonic() - t0)
                continue
            try:
                code = json.loads(answer)["error"]["code"]
            except Exception:  # noqa: BLE001
                code = "?"
            outcomes[f"{status} {code}"] += 1
            await asyncio.sleep(backoff)
        if conn is not None:
            conn[1].close()

    start = time.monotonic()
    tasks = [asyncio.create_task(worker()) for _ in range(clients)]
    ready.set()
    while not stop.is_set():
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    results.put({"outcomes": dict(outcomes), "latencies": latencies, "seconds": time.monotonic() - start,
                 "cpu": time.process_time()})


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A folder for a benchmark's server config, log and built models, removed when the run ends
    cleanly; kept (its path printed) when the run raises, for its ``server.log``."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except BaseException:
        print(f"kept for its logs: {folder}", file=sys.stderr)
        raise
    shutil.rmtree(folder, ignore_errors=True)


def tiergate_serve(folder: Path, config: str, key: str) -> tuple[subprocess.Popen, str]:
    """``tiergate serve`` (its own process, as deployed, one torch thread) on the tiers.yaml text
    ``config`` written in ``folder``, the paid key ``key`` in ``TIERGATE_BENCH_KEYS_PAID``; returns
    once it answers /healthz: (the process, its URL). Its output goes to ``folder/server.log``."""
    import httpx

    root = Path(__file__).resolve().parents[1]
    (folder / "tiers.yaml").write_text(config)
    port = spare_port()
    env = {**os.environ, "TIERGATE_BENCH_KEYS_PAID": key, "OMP_NUM_THREADS": "1"}
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(folder / "tiers.yaml"),
                             "--host", "127.0.0.1", "--port", str(port)], cwd=root, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{(folder / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not come up")


def spare_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a server in a process of its own, chosen below the
    kernel's range for ephemeral ports (32768-60999 on Linux by default). A port from ``bind(0)``
    is in that range: between its release and the server's bind, another process's ``bind(0)``
    or outgoing connection can take it (CI lost a test server's port that way). A process that
    binds in-process should bind port 0 itself and hand the socket over instead."""
    import random

    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(low // 2, low)  # the upper half of the ports below it (16384-32767 by default)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
