"""Load generator: open-loop (Poisson) arrivals per tier against a running tiergate, over a mix of
modalities, swept over the offered load; a table per tier and PNG plots.

    python scripts/loadgen.py --config tiers.yaml --rate paid=2 --rate free=8 --rate batch=1 \\
        --sweep 0.5,1,2,4 --duration 20 --out loadgen-out

Each tier's requests arrive as a Poisson process at its rate times the sweep point's multiplier,
whether or not earlier ones have finished (open loop: a slow server is not given a slower client).
Each arrival picks a modality by the ``--mix`` weights (chat streamed with a small ``max_tokens``,
images, speech, transcriptions) and a model of that kind found on ``/v1/models``. Refusals (429s)
are counted by their error code and never retried. Per tier and sweep point it prints p50/p99
latency of the answered requests, time to first token (chat), goodput (answered within the tier's
``latency_target_s`` per second of arrivals), refusals and errors. While it runs it polls
``/v1/models`` every ``--poll`` seconds for each model's place (resident, loading, warm, cold).

It writes to ``--out``: ``latency.png`` (p50/p99 against offered load per tier), ``goodput.png``
(goodput against offered load per tier, with the offered rate for reference: the knee is where
they part), ``residency.png`` (which model was where, when; evictions marked) and ``results.json``.

Keys: ``--key tier=KEY``, else the first key in the tier's ``keys_env`` from ``--config``, else
``TIERGATE_KEYS_<TIER>``. Every loop is bounded: arrivals stop after ``--duration`` seconds or
``--max-requests`` per tier and point, stragglers are cancelled ``--drain`` seconds later.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import random
import sys
import time
import wave
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
import yaml

MODALITY_KIND = {"chat": "chat", "image": "image", "speech": "tts", "transcription": "stt"}
PLACE_COLOURS = {"resident": "#2e7d32", "loading": "#f9a825", "warm": "#64b5f6", "cold": "#e0e0e0"}
PROMPT = "Tell me about the weather on a quiet afternoon."


# -- what to run --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierLoad:
    name: str
    rate: float  # requests/s at multiplier 1
    key: str = field(repr=False)
    target_s: float | None  # latency target for goodput; None: every answer counts


@dataclass(frozen=True)
class Plan:
    url: str
    tiers: list[TierLoad]
    mix: dict[str, float]
    sweep: list[float]
    duration_s: float
    max_requests: int
    drain_s: float
    request_timeout_s: float
    poll_s: float
    max_tokens: int
    image_size: str
    image_steps: int
    seed: int
    warmup: bool
    out: Path


def pairs(items: list[str], what: str) -> dict[str, str]:
    """``["paid=2", "free=8"]`` -> ``{"paid": "2", "free": "8"}``."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise SystemExit(f"loadgen: {what} must be NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def numbers(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"loadgen: {what} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise SystemExit(f"loadgen: {what} must be finite numbers >= 0, got {text!r}")
    return values


def tiers_from_config(path: str | None) -> list[dict[str, Any]]:
    if not path:
        return []
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"loadgen: cannot read {path}: {exc}") from None
    return [t for t in data.get("tiers") or [] if isinstance(t, dict) and "name" in t]


def tier_loads(args: argparse.Namespace, environ=os.environ) -> list[TierLoad]:
    rates = {k: numbers(v, f"--rate {k}")[0] for k, v in pairs(args.rate, "--rate").items()}
    keys = pairs(args.key, "--key")
    targets = {k: numbers(v, f"--target {k}")[0] for k, v in pairs(args.target, "--target").items()}
    configured = {t["name"]: t for t in tiers_from_config(args.config)}
    unknown = [t for t in rates if configured and t not in configured]
    if unknown:
        raise SystemExit(f"loadgen: --rate names tiers not in {args.config}: {', '.join(unknown)}")
    order = [t for t in configured if t in rates] or list(rates)
    loads = []
    for name in order:
        conf = configured.get(name, {})
        env = conf.get("keys_env") or f"TIERGATE_KEYS_{name.upper()}"
        key = keys.get(name) or next((k.strip() for k in environ.get(env, "").split(",") if k.strip()), "")
        if not key:
            raise SystemExit(f"loadgen: no API key for tier {name}: give --key {name}=KEY or set {env}")
        target = targets.get(name, conf.get("latency_target_s"))
        loads.append(TierLoad(name, rates[name], key, float(target) if target is not None else None))
    return loads


def parse_args(argv: list[str] | None) -> Plan:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (its /v1 is appended)")
    p.add_argument("--config", help="tiers.yaml: tier order, latency targets, keys_env")
    p.add_argument("--rate", action="append", default=[], metavar="TIER=R", help="requests/s at multiplier 1")
    p.add_argument("--key", action="append", default=[], metavar="TIER=KEY", help="API key for a tier")
    p.add_argument("--target", action="append", default=[], metavar="TIER=S", help="latency target (s), over the config")
    p.add_argument("--mix", default="chat=4,image=1,speech=1,transcription=1",
                   help="modality weights (chat, image, speech, transcription)")
    p.add_argument("--sweep", default="0.5,1,2,4", help="multipliers of the rates, one point each")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per sweep point")
    p.add_argument("--max-requests", type=int, default=10_000, help="most arrivals per tier and point")
    p.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers after a point")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--poll", type=float, default=0.25, help="seconds between /v1/models polls")
    p.add_argument("--max-tokens", type=int, default=16, help="chat max_tokens")
    p.add_argument("--image-size", default="32x32")
    p.add_argument("--image-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the one untimed request per model (first tier) before the sweep")
    p.add_argument("--out", default="loadgen-out", help="folder for the PNGs and results.json")
    args = p.parse_args(argv)
    if not args.rate:
        p.error("give at least one --rate TIER=R")
    mix = {k: numbers(v, f"--mix {k}")[0] for k, v in pairs(args.mix.split(","), "--mix").items()}
    bad = [m for m in mix if m not in MODALITY_KIND]
    if bad or not any(mix.values()):
        p.error(f"--mix: modalities are {', '.join(MODALITY_KIND)} with a positive weight somewhere")
    if args.duration <= 0 or args.max_requests < 1 or args.drain < 0 or args.poll <= 0:
        p.error("--duration and --poll must be > 0, --max-requests >= 1, --drain >= 0")
    return Plan(args.url.rstrip("/"), tier_loads(args), mix, numbers(args.sweep, "--sweep"), args.duration,
                args.max_requests, args.drain, args.request_timeout, args.poll, args.max_tokens,
                args.image_size, args.image_steps, args.seed, args.warmup, Path(args.out))


# -- one request ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    tier: str
    modality: str
    model: str
    point: int
    sent_at: float  # seconds since the run started
    latency_s: float | None = None  # answered requests only
    ttft_s: float | None = None  # streamed chat only
    refused: str | None = None  # the 429's error code
    error: str | None = None  # anything else that was not an answer


def tone_wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """A short 440 Hz tone, 16-bit mono WAV: the transcription upload."""
    n = int(seconds * rate)
    samples = bytearray()
    for i in range(n):
        samples += int(8000 * math.sin(2 * math.pi * 440 * i / rate)).to_bytes(2, "little", signed=True)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(samples))
    return buf.getvalue()


class Requests:
    """The modalities' calls on one tier's client. Each returns the time to first token or None."""

    def __init__(self, plan: Plan, client: openai.AsyncOpenAI, audio: bytes) -> None:
        self.plan, self.client, self.audio = plan, client, audio

    async def chat(self, model: str, t0: float) -> float | None:
        stream = await self.client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=self.plan.max_tokens, stream=True)
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
        return first

    async def image(self, model: str, t0: float) -> None:
        await self.client.images.generate(model=model, prompt=PROMPT, size=self.plan.image_size,  # type: ignore[arg-type]
                                          extra_body={"num_inference_steps": self.plan.image_steps})

    async def speech(self, model: str, t0: float) -> None:
        async with self.client.audio.speech.with_streaming_response.create(
                model=model, input=PROMPT, voice="alloy", response_format="wav") as response:
            async for _ in response.iter_bytes():
                pass

    async def transcription(self, model: str, t0: float) -> None:
        await self.client.audio.transcriptions.create(model=model, file=("tone.wav", self.audio, "audio/wav"))


async def send(calls: Requests, out: Outcome, t_run: float) -> Outcome:
    t0 = time.monotonic()
    out.sent_at = t0 - t_run
    try:
        out.ttft_s = await getattr(calls, out.modality)(out.model, t0)
        out.latency_s = time.monotonic() - t0
    except openai.APIStatusError as exc:
        if exc.status_code == 429:
            out.refused = exc.code or "429"
        else:
            out.error = f"{exc.status_code} {exc.code or ''}".strip()
    except openai.APITimeoutError:
        out.error = "timeout"
    except openai.APIConnectionError as exc:  # the cause says which (e.g. RemoteProtocolError)
        out.error = f"connection/{type(exc.__cause__).__name__}" if exc.__cause__ else "connection"
    except asyncio.CancelledError:
        out.error = "unfinished"
        raise
    except Exception as exc:  # a malformed answer: count it, keep the run going
        out.error = type(exc).__name__
    return out


# -- the run --------------------------------------------------------------------------------------


class Progress:
    """tqdm where installed, else one carriage-return line on a terminal (nothing otherwise)."""

    def __init__(self, total: float) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar, self.total, self.tty = None, total, sys.stderr.isatty()
        else:
            self.bar = tqdm(total=round(total, 1), unit="s", desc="loadgen", file=sys.stderr, leave=True, mininterval=0.5,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")

    def show(self, done_s: float, note: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(min(round(done_s, 1), self.bar.total) - self.bar.n)
        elif self.tty:
            sys.stderr.write(f"\rloadgen {100 * done_s / self.total:3.0f}% {note}\033[K")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


@dataclass
class Run:
    plan: Plan
    models: dict[str, list[str]]  # kind -> model ids
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[tuple[float, dict[str, str]]] = field(default_factory=list)  # (t, model -> place)
    points: list[tuple[float, float, float]] = field(default_factory=list)  # (multiplier, start, end of arrivals)

    def now(self) -> float:
        return time.monotonic() - self.t0


async def discover(http: httpx.AsyncClient) -> dict[str, str]:
    """model id -> its place, for every model with one (adapters have none)."""
    r = await http.get("/v1/models")
    r.raise_for_status()
    return {row["id"]: row["place"] for row in r.json()["data"] if "place" in row}


async def model_kinds(http: httpx.AsyncClient) -> dict[str, list[str]]:
    r = await http.get("/v1/models")
    r.raise_for_status()
    kinds: dict[str, list[str]] = {}
    for row in r.json()["data"]:
        if "place" in row:
            kinds.setdefault(row.get("kind", ""), []).append(row["id"])
    return kinds


async def poll_residency(run: Run, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            run.samples.append((run.now(), await discover(http)))
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # a missed sample is a gap in the timeline, not a failed run
        try:  # not asyncio.wait_for: on 3.11 it can swallow a cancel (gh-86296)
            async with asyncio.timeout(run.plan.poll_s):
                await stop.wait()
        except TimeoutError:
            pass


async def arrivals(run: Run, tier: TierLoad, calls: Requests, point: int, rate: float,
                   rng: random.Random, tasks: set[asyncio.Task]) -> None:
    """Poisson arrivals for one tier until the point's duration or request cap is reached."""
    plan = run.plan
    if rate <= 0:
        return
    start = time.monotonic()
    modalities = [m for m in plan.mix if plan.mix[m] > 0 and run.models.get(MODALITY_KIND[m])]
    weights = [plan.mix[m] for m in modalities]
    next_at = rng.expovariate(rate)
    for _ in range(plan.max_requests):
        delay = start + next_at - time.monotonic()
        if next_at >= plan.duration_s:
            return
        if delay > 0:
            await asyncio.sleep(delay)
        modality = rng.choices(modalities, weights)[0]
        model = rng.choice(run.models[MODALITY_KIND[modality]])
        out = Outcome(tier.name, modality, model, point, 0.0)
        run.outcomes.append(out)
        task = asyncio.create_task(send(calls, out, run.t0))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)


async def warm_up(run: Run, tier: str, calls: Requests) -> None:
    """One request per model in the mix, in turn, not counted: the first point then measures
    serving, not first loads (a model evicted later still loads cold in the sweep)."""
    for modality, weight in run.plan.mix.items():
        for model in run.models.get(MODALITY_KIND[modality], []) if weight > 0 else []:
            out = await send(calls, Outcome(tier, modality, model, -1, 0.0), run.t0)
            if out.error or out.refused:
                print(f"loadgen: warm-up {modality} on {model}: {out.error or out.refused}", file=sys.stderr)


def tally(outcomes: list[Outcome]) -> str:
    ok = sum(o.latency_s is not None for o in outcomes)
    refused = sum(o.refused is not None for o in outcomes)
    errors = sum(o.error is not None for o in outcomes)
    return f"sent {len(outcomes)} ok {ok} 429 {refused} err {errors}"


async def run_point(run: Run, point: int, mult: float, callers: dict[str, Requests], progress: Progress) -> None:
    plan = run.plan
    rng = random.Random(plan.seed * 1000 + point)
    tasks: set[asyncio.Task] = set()
    start = run.now()
    senders = [asyncio.create_task(arrivals(run, t, callers[t.name], point, t.rate * mult,
                                            random.Random(rng.random()), tasks)) for t in plan.tiers]
    done_before = point * plan.duration_s
    label = f"x{mult:g}"
    while not all(s.done() for s in senders):
        await asyncio.wait(senders, timeout=0.2)
        mine = [o for o in run.outcomes if o.point == point]
        progress.show(done_before + min(run.now() - start, plan.duration_s), f"{label}: {tally(mine)} in flight {len(tasks)}")
    for s in senders:
        s.result()  # an arrival loop's bug surfaces here
    run.points.append((mult, start, run.now()))
    deadline = time.monotonic() + plan.drain_s
    while tasks and time.monotonic() < deadline:
        await asyncio.wait(set(tasks), timeout=0.2)
        mine = [o for o in run.outcomes if o.point == point]
        progress.show(done_before + plan.duration_s, f"{label}: {tally(mine)} draining {len(tasks)}")
    for task in list(tasks):
        task.cancel()
    if tasks:
        await asyncio.wait(set(tasks))


async def execute(plan: Plan) -> Run:
    headers = {"Authorization": f"Bearer {plan.tiers[0].key}"}
    async with httpx.AsyncClient(base_url=plan.url, headers=headers, timeout=10) as http:
        kinds = await model_kinds(http)
        run = Run(plan, kinds)
        missing = [m for m in plan.mix if plan.mix[m] > 0 and not kinds.get(MODALITY_KIND[m])]
        if missing:
            print(f"loadgen: no {', '.join(missing)} model on {plan.url}/v1/models; sending none of those", file=sys.stderr)
        if all(m in missing for m in plan.mix if plan.mix[m] > 0):
            raise SystemExit("loadgen: the server has no model for any modality in --mix")
        audio = tone_wav()
        clients = {t.name: openai.AsyncOpenAI(base_url=f"{plan.url}/v1", api_key=t.key, max_retries=0,
                                              timeout=plan.request_timeout_s) for t in plan.tiers}
        callers = {name: Requests(plan, c, audio) for name, c in clients.items()}
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_residency(run, http, stop))
        if plan.warmup:
            await warm_up(run, plan.tiers[0].name, callers[plan.tiers[0].name])
        progress = Progress(len(plan.sweep) * plan.duration_s)
        try:
            for i, mult in enumerate(plan.sweep):
                await run_point(run, i, mult, callers, progress)
        finally:
            progress.close()
            stop.set()
            await poller
            for c in clients.values():
                await c.close()
        run.samples.append((run.now(), await discover(http)))
    return run


# -- the report -----------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class TierPoint:
    multiplier: float
    tier: str
    offered: float  # requests/s asked for
    sent: int
    ok: int
    p50_s: float | None
    p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    goodput: float  # answered within target, per second of arrivals
    target_s: float | None
    refused: dict[str, int]
    errors: dict[str, int]


def summarize(run: Run) -> list[TierPoint]:
    rows = []
    for i, (mult, start, end) in enumerate(run.points):
        window = run.plan.duration_s
        for tier in run.plan.tiers:
            mine = [o for o in run.outcomes if o.point == i and o.tier == tier.name]
            lat = [o.latency_s for o in mine if o.latency_s is not None]
            ttft = [o.ttft_s for o in mine if o.ttft_s is not None]
            good = sum(1 for x in lat if tier.target_s is None or x <= tier.target_s)
            rows.append(TierPoint(mult, tier.name, tier.rate * mult, len(mine), len(lat), quantile(lat, 0.5),
                                  quantile(lat, 0.99), quantile(ttft, 0.5), quantile(ttft, 0.99), good / window,
                                  tier.target_s, dict(Counter(o.refused for o in mine if o.refused)),
                                  dict(Counter(o.error for o in mine if o.error))))
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _counts(c: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items())) or "-"


def table(rows: list[TierPoint]) -> str:
    refused = [_counts(r.refused) for r in rows]
    width = max([len("refused (429)"), *map(len, refused)]) + 2
    head = (f"{'load':<6}{'tier':<12}{'offered/s':>10}{'sent':>6}{'ok':>6}{'p50 ms':>9}{'p99 ms':>9}"
            f"{'ttft p50':>10}{'ttft p99':>10}{'goodput/s':>11}{'target s':>10}  {'refused (429)':<{width}}errors")
    lines = [head]
    for r, refusals in zip(rows, refused):
        target = "-" if r.target_s is None else f"{r.target_s:g}"
        lines.append(f"{'x' + format(r.multiplier, 'g'):<6}{r.tier:<12}{r.offered:>10.2f}{r.sent:>6}{r.ok:>6}"
                     f"{_ms(r.p50_s):>9}{_ms(r.p99_s):>9}{_ms(r.ttft_p50_s):>10}{_ms(r.ttft_p99_s):>10}"
                     f"{r.goodput:>11.2f}{target:>10}  {refusals:<{width}}{_counts(r.errors)}")
    return "\n".join(lines)


def evictions(samples: list[tuple[float, dict[str, str]]]) -> list[tuple[float, str]]:
    """(time, model) wherever a model's place went from resident to warm or cold between polls."""
    found = []
    for (_, before), (t, after) in zip(samples, samples[1:]):
        for model, place in after.items():
            if before.get(model) == "resident" and place in ("warm", "cold"):
                found.append((t, model))
    return found


# -- the plots ------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_tier(rows: list[TierPoint]) -> dict[str, list[TierPoint]]:
    out: dict[str, list[TierPoint]] = {}
    for r in rows:
        out.setdefault(r.tier, []).append(r)
    return out


def _total_offered(rows: list[TierPoint]) -> dict[float, float]:
    totals: dict[float, float] = {}
    for r in rows:
        totals[r.multiplier] = totals.get(r.multiplier, 0.0) + r.offered
    return totals


def _load_axis(ax, totals: dict[float, float]) -> None:
    """Offered load on a log axis (the sweep is usually geometric), ticks at the points."""
    values = sorted(v for v in totals.values() if v > 0)
    if values and values[-1] > values[0]:
        ax.set_xscale("log")
        ax.set_xticks(values, [f"{v:g}" for v in values])
        ax.minorticks_off()
    ax.set_xlabel("offered load, all tiers (requests/s)")


def plot_latency(rows: list[TierPoint], path: Path) -> None:
    plt = _pyplot()
    totals = _total_offered(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (tier, pts) in enumerate(_by_tier(rows).items()):
        colour = f"C{n}"
        for attr, style, label in (("p50_s", "o-", "p50"), ("p99_s", "s--", "p99")):
            xy = [(totals[p.multiplier], 1000 * getattr(p, attr)) for p in pts if getattr(p, attr) is not None]
            if xy:
                ax.plot(*zip(*xy), style, color=colour, label=f"{tier} {label}")
    ax.set_yscale("log")
    _load_axis(ax, totals)
    ax.set_ylabel("latency of answered requests (ms)")
    ax.set_title("Latency against offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_goodput(rows: list[TierPoint], path: Path) -> None:
    plt = _pyplot()
    totals = _total_offered(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (tier, pts) in enumerate(_by_tier(rows).items()):
        x = [totals[p.multiplier] for p in pts]
        ax.plot(x, [p.goodput for p in pts], "o-", color=f"C{n}", label=f"{tier} goodput")
        ax.plot(x, [p.offered for p in pts], ":", color=f"C{n}", alpha=0.6, label=f"{tier} offered")
    _load_axis(ax, totals)
    ax.set_ylabel("requests/s answered within target")
    ax.set_title("Goodput against offered load (dotted: offered)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_residency(run: Run, path: Path) -> None:
    plt = _pyplot()
    from matplotlib.patches import Patch

    models = sorted({m for _, places in run.samples for m in places})
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(models) + 1.8))
    for row, model in enumerate(models):
        for (t, places), (t_next, _) in zip(run.samples, run.samples[1:]):
            place = places.get(model)
            if place in PLACE_COLOURS:
                ax.broken_barh([(t, t_next - t)], (row - 0.35, 0.7), color=PLACE_COLOURS[place], linewidth=0)
    marks = evictions(run.samples)
    if marks:
        ax.plot([t for t, _ in marks], [models.index(m) for _, m in marks], "v", color="#c62828",
                markersize=7, label="eviction")
    for mult, start, end in run.points:
        ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        ax.text(start, len(models) - 0.4, f" x{mult:g}", fontsize=8, va="bottom")
    ax.set_yticks(range(len(models)), models)
    ax.set_ylim(-0.6, len(models) + 0.2)
    ax.set_xlabel("seconds since the run started (dotted: a sweep point's arrivals begin; before: warm-up)")
    ax.set_title(f"Residency (polled every {run.plan.poll_s:g} s); evictions: {len(marks)}")
    handles = [Patch(color=c, label=p) for p, c in PLACE_COLOURS.items()]
    if marks:
        handles.append(ax.lines[0])
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(run: Run, rows: list[TierPoint]) -> list[Path]:
    out = run.plan.out
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "latency.png", out / "goodput.png", out / "residency.png"]
    plot_latency(rows, paths[0])
    plot_goodput(rows, paths[1])
    plot_residency(run, paths[2])
    results = {"url": run.plan.url, "mix": run.plan.mix, "duration_s": run.plan.duration_s,
               "tiers": [{"name": t.name, "rate": t.rate, "target_s": t.target_s} for t in run.plan.tiers],
               "points": [asdict(r) for r in rows],
               "evictions": [{"t": t, "model": m} for t, m in evictions(run.samples)],
               "residency": [{"t": t, "places": p} for t, p in run.samples]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return paths + [out / "results.json"]


def main(argv: list[str] | None = None, announce: Callable[[str], None] = print) -> int:
    plan = parse_args(argv)
    try:
        _pyplot()
    except ImportError:
        print("loadgen: the plots need matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    offered = ", ".join(f"{t.name} {t.rate:g}/s" for t in plan.tiers)
    announce(f"loadgen: {plan.url}; rates at x1: {offered}; sweep {', '.join(f'x{m:g}' for m in plan.sweep)}, "
             f"{plan.duration_s:g} s each; mix {', '.join(f'{k} {v:g}' for k, v in plan.mix.items())}")
    try:
        run = asyncio.run(execute(plan))
    except httpx.HTTPError as exc:
        print(f"loadgen: cannot read {plan.url}/v1/models: {exc}", file=sys.stderr)
        return 1
    rows = summarize(run)
    announce(table(rows))
    marks = evictions(run.samples)
    announce(f"evictions seen: {len(marks)}" + (" (" + ", ".join(f"{m} at {t:.1f}s" for t, m in marks[:8]) + ")" if marks else ""))
    for path in write_outputs(run, rows):
        announce(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
