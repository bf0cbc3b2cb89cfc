"""Shared cases and the stated error bound for the LoRA merge tests (tests/test_lora_kernels.py and
the Triton-interpreter runner tests/lora_interp_runner.py). Not a test module itself."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from lora_kernels.ops import LoraFactor, merge_into, merge_reference


@dataclass(frozen=True)
class Shape:
    """A weight [d_out, d_in] and the ranks of the adapters merged into it."""

    id: str
    d_out: int
    d_in: int
    ranks: tuple[int, ...]


# dim x rank x adapters (square weights), then odd shapes with mixed ranks
SHAPES = [
    Shape("1536x32x4", 1536, 1536, (32,) * 4),
    Shape("3072x32x4", 3072, 3072, (32,) * 4),
    Shape("3072x64x4", 3072, 3072, (64,) * 4),
    Shape("3072x64x8", 3072, 3072, (64,) * 8),
    Shape("1000x77_r3-8-16", 1000, 77, (3, 8, 16)),
    Shape("77x1000_r1-5-33", 77, 1000, (1, 5, 33)),
]
SHAPE_BY_ID = {s.id: s for s in SHAPES}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("exact", "fast")
ALL_CASES = [(s.id, d, m) for s in SHAPES for d in DTYPES for m in MODES]
# per-adapter scales (weight * alpha / r): not powers of two, one negative
SCALES = (0.7, -1.3, 0.45, 1.9, -0.8, 1.1, 0.35, -2.2)

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Triton's tf32 dot on NVIDIA tensor cores truncates each fp32 operand to tf32 (drops the low 13
# mantissa bits; no round to nearest, triton-lang/triton#4574): a relative error below 2^-10, not
# the 2^-11 of rounding. Seen on an H200: 1.03x the 2^-11 bound at 1000x77_r3-8-16/fp32/fast.
TF32_ROUNDOFF = 2.0**-10


@functools.lru_cache(maxsize=2)
def make_case(shape_id: str, dtype_name: str, seed: int = 0) -> tuple[Tensor, list[LoraFactor]]:
    """W ~ N(0, 1) and factors ~ N(0, 0.1^2) in the weight's dtype (adapters stored like the model)."""
    shape, dtype = SHAPE_BY_ID[shape_id], DTYPES[dtype_name]
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape.d_out, shape.d_in, generator=g).to(dtype)
    factors = [
        (
            (0.1 * torch.randn(shape.d_out, r, generator=g)).to(dtype),
            (0.1 * torch.randn(r, shape.d_in, generator=g)).to(dtype),
            SCALES[i % len(SCALES)],
        )
        for i, r in enumerate(shape.ranks)
    ]
    return w, factors


@functools.lru_cache(maxsize=2)
def reference(shape_id: str, dtype_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """fp64 (W + sum s B A, |W|, sum |s| |B| |A|) for a case."""
    w, factors = make_case(shape_id, dtype_name)
    fac = torch.zeros(w.shape, dtype=torch.float32)  # a magnitude for the bound: fp32 is plenty
    for b, a, s in factors:
        fac.addmm_(b.abs().float(), a.abs().float(), alpha=abs(s))
    return merge_reference(w, factors), w.abs().to(torch.float64), fac.to(torch.float64)


def error_bound(
    ref: Tensor, w_abs: Tensor, fac: Tensor, k: int, dtype: torch.dtype, mode: str, truncating: bool = False
) -> Tensor:
    """The bound we guarantee, elementwise, for a merged weight vs the fp64 reference:

    ``|out - ref| <= u_out * |ref| + (K + 2) * 2^-24 * (|W| + F)``   with F = sum_i |s_i| |B_i| |A_i|  (exact)
    ``             + 2 * u_in * F``                                  (fast mode adds this)

    u_out is the unit roundoff of W's dtype (2^-24 fp32, 2^-8 bf16, 2^-11 fp16), doubled where the
    final cast truncates (the Triton interpreter's fp32->bf16); (K + 2) * 2^-24 covers the fp32
    accumulation of K products, the scale fold and the add of W; u_in is the roundoff of the fast
    mode's factor inputs (bf16/fp16 factors; tf32 products, 2^-10 truncated, for fp32 weights).
    """
    u_out = UNIT_ROUNDOFF[dtype] * (2 if truncating and dtype == torch.bfloat16 else 1)
    bound = u_out * ref.abs() + (k + 2) * 2.0**-24 * (w_abs + fac)
    if mode == "fast":
        u_in = TF32_ROUNDOFF if dtype == torch.float32 else UNIT_ROUNDOFF[dtype]
        bound = bound + 2 * u_in * fac
    return bound


def worst_ratio(out: Tensor, shape_id: str, dtype_name: str, mode: str, truncating: bool = False) -> float:
    """max |out - ref| / bound over the weight: the test passes when this is <= 1."""
    ref, w_abs, fac = reference(shape_id, dtype_name)
    k = sum(SHAPE_BY_ID[shape_id].ranks)
    bound = error_bound(ref, w_abs, fac, k, DTYPES[dtype_name], mode, truncating)
    return ((out.to(torch.float64) - ref).abs() / bound).max().item()


class LaunchCounter:
    """Stands in for the jitted kernel and counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@contextmanager
def count_launches() -> Iterator[LaunchCounter]:
    from lora_kernels import triton_merge

    counter = LaunchCounter(triton_merge._merge_kernel)
    triton_merge._merge_kernel = counter
    try:
        yield counter
    finally:
        triton_merge._merge_kernel = counter.kernel


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_triton_case(shape: str, dtype: str, mode: str, device: str) -> dict:
    """One kernel case on ``device`` ("cpu" = the interpreter): error/bound ratio, launches, seconds."""
    w, factors = make_case(shape, dtype)
    w = w.to(device)
    factors = [(b.to(device), a.to(device), s) for b, a, s in factors]
    out = torch.empty_like(w)
    if device == "cuda":  # compile and tune outside the counted call
        merge_into([w], [factors], out=[out], mode=mode, backend="triton")
    with count_launches() as counter:
        t = time.perf_counter()
        merge_into([w], [factors], out=[out], mode=mode, backend="triton")
        _sync(device)
        seconds = time.perf_counter() - t
    truncating = device == "cpu"  # the interpreter's fp32->bf16 cast truncates
    ratio = worst_ratio(out.cpu(), shape, dtype, mode, truncating)
    return {"ratio": ratio, "launches": counter.launches, "seconds": seconds}


def grouped_check(device: str) -> dict:
    """5 weights of 2 shapes (mixed ranks within a group) merged in place: 2 launches expected."""
    g = torch.Generator().manual_seed(1)
    shapes = [(96, 80), (80, 96), (96, 80), (96, 80), (80, 96)]
    ranks = [(3, 8), (4,), (16,), (1, 2, 5), (7, 9)]
    weights = [torch.randn(s, generator=g).to(device) for s in shapes]
    factors = [
        [(torch.randn(s[0], r, generator=g).to(device), torch.randn(r, s[1], generator=g).to(device), 0.5 - i)
         for i, r in enumerate(rs)]
        for s, rs in zip(shapes, ranks)
    ]
    refs = [merge_reference(w, f) for w, f in zip(weights, factors)]
    if device == "cuda":
        merge_into([w.clone() for w in weights], factors, backend="triton")
    with count_launches() as counter:
        merge_into(weights, factors, mode="exact", backend="triton")
    err = max(((w.double() - r).abs() / (r.abs() + 1)).max().item() for w, r in zip(weights, refs))
    return {"launches": counter.launches, "groups": len(set(shapes)), "max_rel_err": err}
