"""Admission gate benchmark: tiergate's per-waiter gate vs a broadcast baseline
(asyncio.Condition + notify_all, same tier ordering) vs anyio.CapacityLimiter (FIFO, no tiers:
the cost floor), at 10, 100 and 1,000 concurrent waiters. Prints admissions/s and p50/p99 wait.

    python scripts/bench_admission.py [--slots 8] [--admissions 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import statistics
import time

import anyio

from gateway.admission import Gate, TierPolicy

TIERS = ["paid", "subscriber", "free"]


class BroadcastGate:
    """The thundering-herd design: one Condition; every release wakes every waiter, and each
    checks whether it is now the best one (tier, then arrival)."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.cond = asyncio.Condition()
        self.heap: list[tuple[int, int]] = []
        self.seq = itertools.count()

    async def acquire(self, tier: int) -> None:
        async with self.cond:
            me = (tier, next(self.seq))
            heapq.heappush(self.heap, me)
            await self.cond.wait_for(lambda: self.free > 0 and self.heap[0] == me)
            heapq.heappop(self.heap)
            self.free -= 1

    async def release(self) -> None:
        async with self.cond:
            self.free += 1
            self.cond.notify_all()


async def drive(n_waiters: int, admissions: int, acquire, release) -> tuple[float, list[float]]:
    """``n_waiters`` tasks loop acquire -> yield -> release until ``admissions`` are done."""
    waits: list[float] = []
    left = admissions
    rng = random.Random(0)

    async def waiter(tier: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            ticket = await acquire(tier)
            waits.append(time.perf_counter() - t0)
            await asyncio.sleep(0)  # the "work": one trip through the loop
            await release(ticket)

    start = time.perf_counter()
    await asyncio.gather(*[waiter(rng.randrange(len(TIERS))) for _ in range(n_waiters)])
    return time.perf_counter() - start, waits


def run_tiergate(n: int, admissions: int, slots: int):
    big = 10**9
    gate = Gate([TierPolicy(t, i, big, big, 1e9) for i, t in enumerate(TIERS)], slots)

    async def acquire(tier):
        return await gate.acquire(TIERS[tier], "m")

    async def release(ticket):
        gate.release(ticket)

    return asyncio.run(drive(n, admissions, acquire, release))


def run_broadcast(n: int, admissions: int, slots: int):
    async def main():
        gate = BroadcastGate(slots)

        async def acquire(tier):
            await gate.acquire(tier)

        async def release(_):
            await gate.release()

        return await drive(n, admissions, acquire, release)

    return asyncio.run(main())


def run_anyio(n: int, admissions: int, slots: int):
    async def main():
        limiter = anyio.CapacityLimiter(slots)

        async def acquire(_tier):
            token = object()
            await limiter.acquire_on_behalf_of(token)
            return token

        async def release(token):
            limiter.release_on_behalf_of(token)

        return await drive(n, admissions, acquire, release)

    return asyncio.run(main())


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--admissions", type=int, default=3000)
    ap.add_argument("--waiters", type=int, nargs="+", default=[10, 100, 1000])
    args = ap.parse_args()
    impls = [("tiergate", run_tiergate), ("broadcast", run_broadcast), ("anyio", run_anyio)]
    print(f"slots={args.slots} admissions per run={args.admissions}")
    print(f"{'waiters':>7} {'gate':<10} {'adm/s':>10} {'p50 wait ms':>12} {'p99 wait ms':>12}")
    summary = []
    for n in args.waiters:
        row = {}
        for name, fn in impls:
            secs, waits = fn(n, args.admissions, args.slots)
            rate = len(waits) / secs
            p50, p99 = pct(waits, 50) * 1e3, pct(waits, 99) * 1e3
            row[name] = (rate, p99)
            print(f"{n:>7} {name:<10} {rate:>10,.0f} {p50:>12.3f} {p99:>12.3f}")
        summary.append((n, row))
    print()
    print(f"{'waiters':>7} {'throughput vs broadcast':>24} {'p99 broadcast/tiergate':>23} {'throughput vs anyio':>20}")
    for n, row in summary:
        t, b, a = row["tiergate"], row["broadcast"], row["anyio"]
        print(f"{n:>7} {t[0] / b[0]:>23.1f}x {b[1] / t[1]:>22.1f}x {t[0] / a[0]:>19.2f}x")


if __name__ == "__main__":
    main()
