#!/usr/bin/env python
"""Benchmark: the stock per-adapter merge loop (what peft/diffusers do) vs the fused merge.

    python scripts/bench_lora_merge.py                  # CPU: torch loop vs fused torch addmm
    python scripts/bench_lora_merge.py --device cuda    # CUDA: + Triton kernel exact/fast, GB/s, roofline share
    python scripts/bench_lora_merge.py --smoke          # one small shape, one repetition: no verdict

Square fp32 weights d x d with N adapters of rank r (the shape table of docs/BENCHMARKS.md); on CUDA
also bf16. Every figure is a median after warm-ups, and every ratio compares timings of the same run.
Three ways to merge: "loop" is peft/diffusers' ``W += s_i * (B_i @ A_i)`` (a full delta per adapter);
"addmm" is the strongest simple baseline, in place without any delta, ``W.addmm_(B_i, A_i, alpha=s_i)``
per adapter; "fused" is ``merge_into`` (one addmm over the factors concatenated along the rank on
the torch path; one Triton launch on CUDA). fused/addmm is what fusing gains beyond not allocating.

Judged: the fused torch path >= 1.5x the loop at 3072x64x4 fp32 (the claim of docs/BENCHMARKS.md),
on whichever device runs. The Triton kernel has no target yet: on CUDA its figures are printed;
on CPU it runs only in the Triton interpreter, so it is n/a there.
The roofline counts the least bytes a merge must move: read W + write W + the factors once,
``d_out*d_in*2*elem + N*r*(d_out+d_in)*elem``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Target, at_least, judge  # noqa: E402
from lora_kernels import merge_into, merge_loop  # noqa: E402

SHAPES = [(1536, 32, 4), (3072, 32, 4), (3072, 64, 4), (3072, 64, 8)]  # dim, rank, adapters
SMOKE_SHAPES = [(256, 8, 2)]
JUDGED_SHAPE, TARGET = "3072x64x4", 1.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make(dim: int, rank: int, n: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(dim, dim, generator=g).to(device, dtype)
    factors = [
        ((0.1 * torch.randn(dim, rank, generator=g)).to(device, dtype),
         (0.1 * torch.randn(rank, dim, generator=g)).to(device, dtype), 0.7 - 0.3 * i)
        for i in range(n)
    ]
    return w, factors


def min_bytes(dim: int, rank: int, n: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return dim * dim * 2 * elem + n * rank * (dim + dim) * elem


def merge_addmm(w: torch.Tensor, factors) -> torch.Tensor:
    """The strongest simple baseline: in place, one ``addmm_`` per adapter, no delta allocated."""
    for b, a, scale in factors:
        w.addmm_(b, a, alpha=scale)
    return w


def time_cpu(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, float]:
    """Median ms per function; the functions take turns each rep so drift hits them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def time_cuda(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    from triton.testing import do_bench

    for fn in fns.values():  # compile, tune
        fn()
    torch.cuda.synchronize()
    return {k: do_bench(fn, warmup=25, rep=200, return_mode="median") for k, fn in fns.items()}


def bench_cpu(shapes: list[tuple[int, int, int]], reps: int, warmup: int) -> list[dict]:
    rows = []
    for dim, rank, n in shapes:
        w, factors = make(dim, rank, n, torch.float32, "cpu")
        ms = time_cpu(
            {
                "loop": lambda: merge_loop(w, factors),
                "addmm": lambda: merge_addmm(w, factors),
                "fused": lambda: merge_into([w], [factors], backend="torch"),
            },
            reps,
            warmup,
        )
        rows.append({"shape": f"{dim}x{rank}x{n}", "dtype": "fp32", **ms, "torch_fused": ms["fused"]})
    print(f"CPU ({torch.get_num_threads()} threads), in-place merges, median of {reps} after {warmup} warm-ups")
    print(f"{'shape':<12} {'dtype':<5} {'loop ms':>9} {'addmm ms':>9} {'fused ms':>9} {'loop/fused':>11} {'addmm/fused':>12}")
    for r in rows:
        print(f"{r['shape']:<12} {r['dtype']:<5} {r['loop']:>9.2f} {r['addmm']:>9.2f} {r['fused']:>9.2f} "
              f"{r['loop'] / r['fused']:>10.2f}x {r['addmm'] / r['fused']:>11.2f}x")
    return rows


def bench_cuda(shapes: list[tuple[int, int, int]], peak: float, dtypes: list[str]) -> list[dict]:
    from lora_kernels import triton_merge

    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for dim, rank, n in shapes:
            w, factors = make(dim, rank, n, dtype, "cuda")
            out = torch.empty_like(w)
            prepared = {m: triton_merge.prepare_group([w], [out], [factors], m) for m in ("exact", "fast")}
            ms = time_cuda(
                {
                    "loop": lambda: merge_loop(w, factors),
                    "addmm": lambda: merge_addmm(w, factors),
                    "torch_fused": lambda: merge_into([w], [factors], out=[out], backend="torch"),
                    "triton_exact_call": lambda: merge_into([w], [factors], out=[out], mode="exact"),
                    "triton_exact": prepared["exact"].launch,
                    "triton_fast": prepared["fast"].launch,
                }
            )
            nbytes = min_bytes(dim, rank, n, dtype)
            row = {"shape": f"{dim}x{rank}x{n}", "dtype": dtype_name, **ms, "min_bytes": nbytes}
            for k in ("triton_exact", "triton_fast"):
                row[f"{k}_GBps"] = nbytes / (ms[k] * 1e-3) / 1e9
                row[f"{k}_roofline"] = nbytes / (ms[k] * 1e-3) / peak
            rows.append(row)
    print(f"CUDA {torch.cuda.get_device_name()}, do_bench medians; roofline peak {peak / 1e12:.2f} TB/s")
    print("kernel = one prepared launch; call = merge_into end to end (factor stacking, pointer tables, launch)")
    head = (f"{'shape':<12} {'dtype':<5} {'loop ms':>8} {'addmm ms':>9} {'torch ms':>9} {'exact call':>10} {'exact ms':>9} "
            f"{'fast ms':>8} {'loop/exact':>10} {'addmm/exact':>11} {'addmm/fast':>10} {'exact GB/s':>10} {'roof':>6} "
            f"{'fast GB/s':>9} {'roof':>6}")
    print(head)
    for r in rows:
        print(
            f"{r['shape']:<12} {r['dtype']:<5} {r['loop']:>8.3f} {r['addmm']:>9.3f} {r['torch_fused']:>9.3f} "
            f"{r['triton_exact_call']:>10.3f} {r['triton_exact']:>9.4f} {r['triton_fast']:>8.4f} "
            f"{r['loop'] / r['triton_exact']:>9.1f}x {r['addmm'] / r['triton_exact']:>10.2f}x "
            f"{r['addmm'] / r['triton_fast']:>9.2f}x {r['triton_exact_GBps']:>10.0f} {r['triton_exact_roofline']:>6.1%} "
            f"{r['triton_fast_GBps']:>9.0f} {r['triton_fast_roofline']:>6.1%}"
        )
    return rows


def targets(rows: list[dict], device: str) -> list[Target]:
    row = next((r for r in rows if r["shape"] == JUDGED_SHAPE and r["dtype"] == "fp32"), None)
    fused = row["loop"] / row["torch_fused"] if row else None
    out = [at_least(f"fused torch merge / per-adapter loop at {JUDGED_SHAPE} fp32", fused, TARGET,
                    why_not=f"({JUDGED_SHAPE} not measured in this run)")]
    if device == "cuda":
        gain = row["addmm"] / row["triton_exact"] if row else None
        out.append(at_least(f"Triton exact / in-place addmm_ at {JUDGED_SHAPE} fp32 (no target set yet)", gain, 1.0,
                            judged=False))
    else:
        out.append(Target("the Triton kernel (no target set yet)", "n/a", None,
                          "on CPU (Triton runs only in its interpreter)", judged=False))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--peak-bw", type=float, default=4.8e12, help="memory bandwidth peak in B/s (H200: 4.8e12)")
    p.add_argument("--dtypes", default="fp32,bf16", help="CUDA weight dtypes (CPU runs fp32)")
    p.add_argument("--reps", type=int, default=7, help="CPU repetitions (median)")
    p.add_argument("--warmup", type=int, default=2, help="CPU warm-up rounds")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--smoke", action="store_true", help="one small shape, one repetition, no warm-up: no verdict")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.smoke:
        args.reps, args.warmup = 1, 0
    if device == "cuda":
        rows = bench_cuda(shapes, args.peak_bw, args.dtypes.split(","))
    else:
        rows = bench_cpu(shapes, args.reps, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return judge(targets(rows, device), smoke=args.smoke, note="the torch path's claim; the Triton kernel's shown")


if __name__ == "__main__":
    sys.exit(main())
