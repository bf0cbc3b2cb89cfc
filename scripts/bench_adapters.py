"""Adapter folders: what reading an adapter, the first time a request names it, costs the event loop.

    python scripts/bench_adapters.py            # 16 adapters of 38 MiB (rank 128, bf16), 5 rounds (~10 s)
    python scripts/bench_adapters.py --smoke    # 2 tiny adapters: the code path, no verdict

An ``adapter_dirs`` adapter is read and checked against its model when a request first names it
(README, "Adapter folders"). tiergate reads it in a worker thread (``AdapterRegistry.ready``,
awaited by every endpoint before it resolves the model), so the event loop, which serves every
tier's requests, goes on meanwhile. The baseline is the same registry reading the adapter on the
event loop (``get`` without ``ready``: what the server did without the thread).

Measured, per round and for both, with the adapters read one after another: the event loop's lag
(a task that sleeps 1 ms at a time records how late it wakes), its maximum and p99, and the time
per read. The rounds alternate the two and start from a fresh registry each (the files stay in the
page cache: a read from disk would stall the loop longer still; safetensors maps a file, so its
bytes are touched later, when an engine merges the adapter, on the engine's thread). Printed beside: what a lookup of a
held folder adapter costs (the check of its files every request makes) against a configured one.

Target: the worst lag with the thread at most 0.5x the baseline's (median of the rounds' ratios);
n/a while other processes use more than half a core (``benchlib.OtherLoad``).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchlib import OTHER_LOAD_LIMIT, OtherLoad, Target, judge  # noqa: E402
from gateway.adapters import AdapterDir, AdapterRegistry  # noqa: E402

TICK_S = 0.001


def build(root: Path, width: int, layers: int, rank: int, count: int) -> tuple[Path, Path]:
    """A random Llama-shaped chat model (bf16) and ``count`` LoRA adapters on all its linear layers,
    saved as transformers and peft save them."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, width // 64), num_key_value_heads=max(1, width // 64),
                         vocab_size=1000)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "base")
    folder = root / "adapters"
    folder.mkdir()
    lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", init_lora_weights=False))
    for i in range(count):
        lora.save_pretrained(folder / f"a{i}")
    return root / "base", folder


def registry(base: Path, folder: Path) -> AdapterRegistry:
    return AdapterRegistry((), [AdapterDir("base", "chat", folder, base)], ["base"])


async def read_all(reg: AdapterRegistry, names: list[str], threaded: bool) -> tuple[float, float, float]:
    """Read every adapter once, as requests naming each in turn would; (max lag, p99 lag, s per read)."""
    lags: list[float] = []
    done = asyncio.Event()

    async def beat() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - t - TICK_S)

    beating = asyncio.create_task(beat())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    for name in names:
        if threaded:
            await reg.ready(name, None)
        assert reg.get(name) is not None
        await asyncio.sleep(0)  # the next request's turn
    took = time.perf_counter() - start
    done.set()
    await beating
    lags.sort()
    return lags[-1], lags[min(len(lags) - 1, int(0.99 * len(lags)))], took / len(names)


def lookup_us(reg: AdapterRegistry, name: str, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        reg.get(name)
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="2 tiny adapters, 1 round: the code path, no verdict")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--adapters", type=int, default=16)
    args = ap.parse_args()
    width, layers, rank, count, rounds = (64, 2, 8, 2, 1) if args.smoke else (1024, 4, 128, args.adapters, args.rounds)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    try:
        base, folder = build(root, width, layers, rank, count)
        size = sum(f.stat().st_size for f in (folder / "a0").iterdir())
        names = [f"a{i}" for i in range(count)]
        warm = registry(base, folder)
        warm.get("a0")  # the files into the page cache once, before anything is timed
        print(f"bench_adapters: {count} adapters of {size / 2**20:.1f} MiB (rank {rank}, every linear layer of a "
              f"{layers}-layer {width}-wide model, bf16), read one after another, {rounds} rounds alternating")
        print(f"{'round':>5} {'read on':<12} {'max lag ms':>10} {'p99 lag ms':>10} {'ms per read':>11}")
        ratios = []
        with OtherLoad() as other:
            for r in range(rounds):
                figures = {}
                for threaded in (False, True):
                    figures[threaded] = asyncio.run(read_all(registry(base, folder), names, threaded))
                    worst, p99, per = figures[threaded]
                    print(f"{r + 1:>5} {'a thread' if threaded else 'the loop':<12} {worst * 1e3:>10.2f} {p99 * 1e3:>10.2f} "
                          f"{per * 1e3:>11.2f}")
                ratios.append(figures[True][0] / max(figures[False][0], 1e-9))
        held = lookup_us(warm, "a0", 200 if args.smoke else 20000)
        configured = AdapterRegistry([warm.get("a0")], [], ["base"])
        print(f"\nlookup of a held folder adapter (its files checked): {held:.1f} us; of a configured one: "
              f"{lookup_us(configured, 'a0', 200 if args.smoke else 20000):.2f} us")
        ratio = statistics.median(ratios)
        print(f"worst loop lag, thread / loop, per round: {' '.join(f'{x:.2f}' for x in ratios)}")
        why = other.why_not(OTHER_LOAD_LIMIT)
        claim = "worst event-loop lag while adapters are read, in a thread / on the loop <= 0.5x"
        target = Target(claim, f"{ratio:.2f}x", None if why else ratio <= 0.5, why)
        return judge([target], smoke=args.smoke, note="adapter_dirs: reads off the event loop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
