"""Chat serving benchmark, one run, one model, all over HTTP with the openai SDK:

  (a) sequential transformers ``generate`` behind a minimal streaming server (one request at a time)
  (b) tiergate with the transformers engine (continuous batching in workers/chat.py)
  (c) tiergate with the vLLM engine
  (d) vLLM's own OpenAI server (``vllm serve``), the peer, started with the same engine arguments:
      its flags are derived from the ``AsyncEngineArgs`` tiergate's engine builds for (c) (every
      field set away from vLLM's default, and every field vLLM's command line defaults otherwise),
      parsed back and compared field by field; the output lists the flags and every difference
      left (none, or the scheduling policy under ``--peer-policy fcfs``)

At 1, 8 and 32 concurrent streams: output tokens/s, TTFT and TPOT p50/p99. Ratios in the same run:
(c)/(d) is tiergate's overhead on top of the engine (target: within 10% at 8 and 32 streams),
(c)/(a) at 32 streams is what batching buys (target: >= 5x).

    python scripts/bench_chat.py --medium                   # the run the targets are judged on (5 runs)
    python scripts/bench_chat.py [--model demo-models/tiny-chat] [--tokens 64] [--rounds 3] [--repeat 5]
    python scripts/bench_chat.py --smoke                    # (a) and (b), 1 stream, 8 tokens: no verdict

Whole comparisons repeat ``--repeat`` times in alternating order; each target is judged on the
median of the runs' ratios, and only with at least 5 runs (fewer: n/a), with the spread printed,
and n/a when other processes than the benchmark's own used more than half a core meanwhile
(``benchlib.OtherLoad``).
On the demo tiny-chat (the default model) the verdict is n/a: its forward pass is so cheap that
the figures measure per-token Python overhead and swing 2-5x run to run; judge with ``--medium``
(or ``--model`` a real one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, Target, at_least, judge, pct, spare_port  # noqa: E402

KEY = "bench-key"
MIN_RUNS = 5
PEER_LEVELS = (8, 32)  # target: tiergate on vLLM within 10% of vllm serve at these stream counts
BATCHING_LEVEL = 32  # target: tiergate on vLLM >= 5x sequential generate at this stream count
KV_CACHE = "512MiB"
MAX_SEQS = 32


def build_medium(folder: Path) -> Path:
    """tiny-chat's tokenizer on a wider, deeper random Llama (hidden 512, 8 layers, head_dim 64)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from demo import build_demo_models

    tiny = build_demo_models(folder.parent, names=["tiny-chat"])["tiny-chat"]
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


# -- (a) the sequential baseline ------------------------------------------------------------------

SEQUENTIAL_SERVER = r'''
import asyncio, json, sys, threading, time, uuid
import torch, uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

path, port = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
lock = threading.Lock()  # one generate at a time: the plain way to serve a model

async def chat(request):
    body = await request.json()
    ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    n = {"tokens": 0}
    done = threading.Event()
    def work():
        with lock:
            out = model.generate(**ids, max_new_tokens=body.get("max_tokens", 64), do_sample=False, streamer=streamer)
            n["tokens"] = out.shape[1] - ids["input_ids"].shape[1]
        done.set()
    threading.Thread(target=work, daemon=True).start()
    cid = "chatcmpl-" + uuid.uuid4().hex
    loop = asyncio.get_running_loop()
    pieces = asyncio.Queue()
    def pump():  # a thread per request moves the streamer's text to the event loop
        for piece in streamer:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)
        loop.call_soon_threadsafe(pieces.put_nowait, None)
    threading.Thread(target=pump, daemon=True).start()
    async def events():
        while (piece := await pieces.get()) is not None:
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            yield "data: " + json.dumps(chunk) + "\n\n"
        await asyncio.to_thread(done.wait)
        usage = {"prompt_tokens": int(ids["input_ids"].shape[1]), "completion_tokens": n["tokens"],
                 "total_tokens": int(ids["input_ids"].shape[1]) + n["tokens"]}
        yield "data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": 0, "model": "m",
                                     "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

uvicorn.run(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]),
            host="127.0.0.1", port=port, log_level="warning")
'''


def start_sequential(model: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SEQUENTIAL_SERVER, str(model), str(port)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- (b), (c): tiergate ---------------------------------------------------------------------------

def tiergate_config(model: Path, engine: str, folder: Path) -> Path:
    cfg = folder / f"tiers-{engine}.yaml"
    cfg.write_text(f"""
tiers:
  - {{name: paid, keys_env: BENCH_KEYS, max_inflight: {MAX_SEQS}, max_queued: 1000, latency_target_s: 3600}}
models:
  - {{name: m, kind: chat, path: {model}, engine: {{name: {engine}, max_num_seqs: {MAX_SEQS}, kv_cache: {KV_CACHE}}}}}
gpu: {{device: auto, vram_budget: 8GiB}}
gate: {{slots: {MAX_SEQS}}}
""")
    return cfg


def start_tiergate(model: Path, port: int, engine: str, folder: Path) -> subprocess.Popen:
    cfg = tiergate_config(model, engine, folder)
    env = {**os.environ, "BENCH_KEYS": KEY}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
                            env=env, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- (d): vllm serve ------------------------------------------------------------------------------

def tiergate_engine_args(model: Path, folder: Path):
    """The ``AsyncEngineArgs`` tiergate's vLLM engine starts (c) with: its own config, spec and
    worker (workers/chat_vllm.py ``engine_args``), nothing restated here."""
    from gateway.config import load_config
    from workers.registry import make_worker

    (spec,) = load_config(tiergate_config(model, "vllm", folder)).model_specs()
    return make_worker(spec).engine_args()


def _flag(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if dataclasses.is_dataclass(value):
        return [flag, json.dumps(dataclasses.asdict(value))]
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def peer_engine_flags(model: Path, folder: Path, policy: str) -> tuple[list[str], list[str]]:
    """vllm serve's engine flags, derived from (c)'s engine arguments: every field tiergate's engine
    sets away from vLLM's default becomes a flag, and so does every field that vLLM's command line
    would otherwise leave unlike the Python default (its parser's own defaults), so both engines
    start with the same arguments; the scheduling policy is ``policy`` (``--peer-policy``). Returns
    the flags and every field that still differs when vLLM parses them back ('name: tiergate's /
    vllm serve's'; values equal in all but form do not count): none, or ``scheduling_policy``
    under ``--peer-policy fcfs``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ours = tiergate_engine_args(model, folder)
    fields = [f.name for f in dataclasses.fields(AsyncEngineArgs)
              if f.init and f.name not in ("model", "scheduling_policy")]

    def parsed(flags: list[str]):
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(ours.model), *flags])
        return AsyncEngineArgs.from_cli_args(args)

    def differ(theirs) -> list[str]:
        return [name for name in fields if not _same(getattr(ours, name), getattr(theirs, name))]

    default = AsyncEngineArgs(model=ours.model)
    flags = [flag for name in fields if not _same(getattr(ours, name), getattr(default, name))
             for flag in _flag(name, getattr(ours, name))]
    for name in differ(parsed(flags)):  # the command line's own defaults, where unlike the Python API's
        if getattr(ours, name) is not None:
            flags += _flag(name, getattr(ours, name))
    flags += ["--scheduling-policy", policy]  # --peer-policy: tiergate's own is priority
    theirs = parsed(flags)
    return flags, [f"{name}: {getattr(ours, name)!r} / {getattr(theirs, name)!r}"
                   for name in [*differ(theirs), "scheduling_policy"] if not _same(getattr(ours, name), getattr(theirs, name))]


def _same(a, b) -> bool:
    """Equal, or equal in all but form: a name as a string and as a one-element list; None and ''."""
    return (a == b or (isinstance(a, str) and b == [a]) or (isinstance(b, str) and a == [b])
            or (a is None and b == "") or (a == "" and b is None))


def start_vllm_serve(model: Path, port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--port", str(port), "--host", "127.0.0.1", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # as tiergate's engine runs its processes there (workers/chat_vllm.py)
        env["TORCHDYNAMO_DISABLE"] = "1"
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- the client -----------------------------------------------------------------------------------

async def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60) as client:
        end = time.time() + timeout
        while time.time() < end:
            if proc.poll() is not None:  # say so now, not after the timeout
                raise RuntimeError(f"the server for {base} exited with status {proc.returncode} before it answered")
            try:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm up"}],
                                                     max_tokens=4)
                return
            except (openai.APIConnectionError, openai.APIStatusError):
                await asyncio.sleep(0.5)
    raise RuntimeError(f"{base} did not come up")


async def one_stream(client, i: int, tokens: int) -> tuple[float, float | None, int]:
    t0 = time.perf_counter()
    first = last = None
    count = 0
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Tell me story number {i}."}],
        max_tokens=tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage:
            count = chunk.usage.completion_tokens
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (count - 1) if first and last and count > 1 else None
    return ttft, tpot, count


async def measure(base: str, streams: int, tokens: int, rounds: int) -> dict:
    results = []
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=600) as client:
        t0 = time.perf_counter()
        for r in range(rounds):
            results += await asyncio.gather(*[one_stream(client, r * streams + i, tokens) for i in range(streams)])
        wall = time.perf_counter() - t0
    ttfts = [x[0] for x in results]
    tpots = [x[1] for x in results if x[1] is not None]
    return {"tok_s": sum(x[2] for x in results) / wall, "ttft": ttfts, "tpot": tpots}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "demo-models" / "tiny-chat")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=MIN_RUNS, help="whole comparisons, alternating the order; "
                    f"targets are judged on >= {MIN_RUNS}")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--only", nargs="+", default=["a", "b", "c", "d"])
    ap.add_argument("--medium", action="store_true",
                    help="use (and build if missing) a 25M-parameter random Llama instead of tiny-chat, so the "
                         "forward pass, not per-token overhead, dominates")
    ap.add_argument("--peer-policy", choices=["priority", "fcfs"], default="priority",
                    help="vllm serve's scheduling policy (tiergate always runs vLLM with priority)")
    ap.add_argument("--smoke", action="store_true",
                    help="(a) and (b) only, 1 stream, 8 tokens, 1 round, 1 run: the code path, no verdict")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.rounds, args.repeat, args.streams, args.only = 8, 1, 1, [1], ["a", "b"]
    if args.medium:
        args.model = build_medium(ROOT / "demo-models" / "bench-chat-medium")
    args.model = args.model.resolve()  # the servers' configs live in a temporary folder
    if not args.model.exists():
        from demo import build_demo_models

        build_demo_models(args.model.parent, names=[args.model.name])
    systems = {
        "a": ("sequential generate", lambda p, d: start_sequential(args.model, p)),
        "b": ("tiergate transformers", lambda p, d: start_tiergate(args.model, p, "transformers", d)),
        "c": ("tiergate vllm", lambda p, d: start_tiergate(args.model, p, "vllm", d)),
        "d": ("vllm serve", lambda p, d: start_vllm_serve(args.model, p, peer_flags)),
    }
    runs: list[dict[tuple[str, int], dict]] = []
    other = OtherLoad().__enter__()  # the CPU other processes take meanwhile (left after the runs)
    with tempfile.TemporaryDirectory() as tmp:
        if "d" in args.only:
            peer_flags, differ = peer_engine_flags(args.model, Path(tmp), args.peer_policy)
            print("vllm serve's engine flags, derived from tiergate's engine arguments (c):", " ".join(peer_flags))
            print("engine arguments that differ between (c) and (d):", "; ".join(differ) if differ else "none")
        for rep in range(args.repeat):
            order = args.only if rep % 2 == 0 else list(reversed(args.only))  # drift hits every system
            table: dict[tuple[str, int], dict] = {}
            for key in order:
                name, start = systems[key]
                port = spare_port()
                proc = start(port, Path(tmp))
                base = f"http://127.0.0.1:{port}/v1"
                try:
                    asyncio.run(wait_ready(base, proc))
                    for n in args.streams:
                        table[(key, n)] = asyncio.run(measure(base, n, args.tokens, args.rounds))
                        print(f"  run {rep + 1} {name:<22} streams={n:<3} {table[(key, n)]['tok_s']:8.0f} tok/s", flush=True)
                finally:
                    stop(proc)
            runs.append(table)
    other.__exit__(None, None, None)

    print(f"\nmodel {args.model.name}, {args.tokens} max tokens per stream, {args.rounds} rounds per level, greedy; "
          f"{args.repeat} runs, the last one in full:")
    print(f"{'system':<24}{'streams':>8}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}  (ms)")
    for (key, n), m in sorted(runs[-1].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{systems[key][0]:<24}{n:>8}{m['tok_s']:>10.0f}{pct(m['ttft'], 50) * 1e3:>10.1f}"
              f"{pct(m['ttft'], 99) * 1e3:>10.1f}{pct(m['tpot'], 50) * 1e3:>10.2f}{pct(m['tpot'], 99) * 1e3:>10.2f}")
    print("\nratios of tok/s, each run, then the median [spread: min-max]:")
    targets: list[Target] = []
    why_not = ""
    if len(runs) < MIN_RUNS:
        why_not = f"({len(runs)} runs: targets are judged on the median of >= {MIN_RUNS})"
    elif args.model.name == "tiny-chat":
        why_not = "(tiny-chat measures per-token overhead, not the engines: judge with --medium)"
    elif other.why_not(OTHER_LOAD_LIMIT):
        why_not = other.why_not(OTHER_LOAD_LIMIT)
    print(f"(other processes than this benchmark's used {'n/a' if other.cores is None else f'{other.cores:.2f}'} "
          "cores meanwhile)")

    def ratio(x: str, y: str, n: int, target: float | None) -> None:
        rs = [t[(x, n)]["tok_s"] / t[(y, n)]["tok_s"] for t in runs if (x, n) in t and (y, n) in t]
        claim = f"{systems[x][0]} / {systems[y][0]} tok/s at {n} streams"
        if not rs:
            if target is not None:
                targets.append(at_least(claim, None, target, why_not="(not measured in this run)"))
            return
        med = statistics.median(rs)
        shown = "" if target is None else f"(target >= {target:g}) {'PASS' if med >= target else 'FAIL'}"
        print(f"  {systems[x][0]} / {systems[y][0]} at {n:>2} streams: "
              f"{' '.join(f'{r:.2f}' for r in rs)} -> {med:.2f} [{min(rs):.2f}-{max(rs):.2f}] {shown}")
        if target is not None:
            judged = at_least(claim, med, target)
            targets.append(Target(judged.claim, judged.measured, None, why_not) if why_not else judged)

    big = max(args.streams)
    for n in sorted(set(args.streams) | set(PEER_LEVELS)):
        ratio("c", "d", n, 0.9 if n in PEER_LEVELS else None)
    ratio("c", "a", BATCHING_LEVEL, 5.0)
    ratio("b", "a", big, None)
    ratio("b", "d", big, None)
    return judge(targets, smoke=args.smoke, note=f"median of {len(runs)} runs")

if __name__ == "__main__":
    sys.exit(main())
