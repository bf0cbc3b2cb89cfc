"""Merging W' = W + sum_i s_i * B_i @ A_i: the grouped entry point, the fused torch path and the
reference paths.

Layout: every weight is seen as a 2-D matrix ``[d_out, d_in]`` (a Conv2d weight flattened to
``[out, in*kh*kw]``); a factor is ``(B [d_out, r], A [r, d_in], scale)``.

Numerics (see docs/LORA.md):

* ``exact``: factors in fp32 with the scale folded into B, one fp32 GEMM over the concatenated rank
  (IEEE products in the Triton kernel), the add of W in fp32, ONE rounding into W's dtype.
* ``fast``: factors in W's dtype when W is bf16/fp16 (tf32 products for fp32 W in the Triton kernel),
  fp32 accumulation on GPU; on CPU one bf16 ``addmm`` for bf16 weights (fp16 and fp32 weights take
  the exact path there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Mode = Literal["exact", "fast"]
Backend = Literal["auto", "torch", "triton"]
LoraFactor = tuple[Tensor, Tensor, float]  # (B [d_out, r], A [r, d_in], scale)

LOW_PRECISION = (torch.bfloat16, torch.float16)


def factor_dtype(weight_dtype: torch.dtype, mode: Mode) -> torch.dtype:
    """The dtype the concatenated factors are fed to the GEMM in."""
    if mode not in ("exact", "fast"):
        raise ValueError(f"mode must be 'exact' or 'fast', not {mode!r}")
    if mode == "fast" and weight_dtype in LOW_PRECISION:
        return weight_dtype
    return torch.float32


def check_factors(weight: Tensor, factors: Sequence[LoraFactor]) -> int:
    """Validate shapes against a 2-D weight; return K = sum of ranks."""
    if weight.dim() != 2:
        raise ValueError(f"weights must be 2-D views, got shape {tuple(weight.shape)}")
    d_out, d_in = weight.shape
    k = 0
    for b, a, _ in factors:
        r = b.shape[1]
        if b.shape != (d_out, r) or a.shape != (r, d_in):
            raise ValueError(
                f"factor shapes B{tuple(b.shape)} A{tuple(a.shape)} do not fit weight {tuple(weight.shape)}"
            )
        k += r
    return k


def concat_factors(
    factors: Sequence[LoraFactor], dtype: torch.dtype, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """(B_cat [d_out, K], A_cat [K, d_in]) with each scale folded into its B block (in fp32).

    ``B_cat @ A_cat == sum_i s_i * B_i @ A_i`` up to the rounding of the fold.
    """
    if not factors:
        raise ValueError("concat_factors needs at least one factor")
    device = device or factors[0][0].device
    b_cat = torch.cat([b.to(device, torch.float32) * float(s) for b, _, s in factors], dim=1)
    a_cat = torch.cat([a.to(device, torch.float32) for _, a, _ in factors], dim=0)
    return b_cat.to(dtype), a_cat.to(dtype)


def merge_torch(src: Tensor, dst: Tensor, factors: Sequence[LoraFactor], mode: Mode = "exact") -> Tensor:
    """Fused torch path: ``dst = src + B_cat @ A_cat`` as ONE ``addmm`` (dst may be src)."""
    check_factors(src, factors)
    if mode == "fast" and src.dtype == torch.float16 and src.device.type == "cpu":
        mode = "exact"  # CPUs lack a fast fp16 GEMM: the fp32 path is both faster and exact
    fdtype = factor_dtype(src.dtype, mode)
    b_cat, a_cat = concat_factors(factors, fdtype, src.device)
    if src.dtype == fdtype:  # fp32 weight, or fast mode on a low-precision weight
        if _same_memory(src, dst):
            return dst.addmm_(b_cat, a_cat)
        return torch.addmm(src, b_cat, a_cat, out=dst)
    # exact mode on a bf16/fp16 weight: fp32 accumulation, one final rounding
    return dst.copy_(torch.addmm(src.to(torch.float32), b_cat, a_cat))


def _same_memory(x: Tensor, y: Tensor) -> bool:
    return x.data_ptr() == y.data_ptr() and x.stride() == y.stride()


def merge_loop(weight: Tensor, factors: Sequence[LoraFactor]) -> Tensor:
    """Stock reference, as peft/diffusers merge: ``W += s_i * (B_i @ A_i)`` one adapter at a time, in place.

    Like peft, the delta is computed in fp32 on CPU for bf16/fp16 weights, then cast to W's dtype.
    """
    check_factors(weight, factors)
    upcast = weight.device.type == "cpu" and weight.dtype in LOW_PRECISION
    for b, a, s in factors:
        if upcast:
            delta = (b.float() @ a.float()) * s
        else:
            delta = (b.to(weight.dtype) @ a.to(weight.dtype)) * s
        weight += delta.to(weight.dtype)
    return weight


def merge_reference(weight: Tensor, factors: Sequence[LoraFactor]) -> Tensor:
    """fp64 reference ``W + sum_i s_i B_i A_i`` (a new fp64 tensor)."""
    check_factors(weight, factors)
    out = weight.to(torch.float64).clone()
    for b, a, s in factors:
        out.addmm_(b.to(torch.float64), a.to(torch.float64), alpha=float(s))
    return out


def _use_triton(weights: Sequence[Tensor], backend: Backend) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")
    if not all(w.is_cuda for w in weights):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _group_key(src: Tensor, dst: Tensor) -> tuple:
    """Weights that share this key are merged in one launch."""
    return (tuple(src.shape), src.dtype, src.device, src.stride(), dst.dtype, dst.stride())


def merge_into(
    weights: Sequence[Tensor],
    factors: Sequence[Sequence[LoraFactor]],
    *,
    out: Sequence[Tensor] | None = None,
    mode: Mode = "exact",
    backend: Backend = "auto",
) -> list[Tensor]:
    """Merge ``out[j] = weights[j] + sum_i s_ij B_ij @ A_ij`` for every j (in place when ``out`` is None).

    Weights that share shape, dtype, device and strides are merged as one group: one Triton launch per
    group on CUDA (``backend="auto"``), one ``addmm`` per weight on the torch path. Returns the outputs.
    """
    factor_dtype(torch.float32, mode)  # validates mode
    if len(weights) != len(factors):
        raise ValueError("one factor list per weight")
    dsts = list(weights) if out is None else list(out)
    if len(dsts) != len(weights):
        raise ValueError("one output per weight")
    for w, d, fs in zip(weights, dsts, factors):
        check_factors(w, fs)
        if d.shape != w.shape or d.dtype != w.dtype:
            raise ValueError("an output must have its weight's shape and dtype")
    todo = [j for j, fs in enumerate(factors) if fs]
    for j in (j for j, fs in enumerate(factors) if not fs):
        if not _same_memory(weights[j], dsts[j]):
            dsts[j].copy_(weights[j])
    if not todo:
        return dsts
    if _use_triton([weights[j] for j in todo], backend):
        from . import triton_merge

        groups: dict[tuple, list[int]] = {}
        for j in todo:
            groups.setdefault(_group_key(weights[j], dsts[j]), []).append(j)
        for idx in groups.values():
            triton_merge.merge_group(
                [weights[j] for j in idx], [dsts[j] for j in idx], [factors[j] for j in idx], mode=mode
            )
    else:
        for j in todo:
            merge_torch(weights[j], dsts[j], factors[j], mode)
    return dsts
