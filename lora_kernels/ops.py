"""Merging W' = W + sum_i s_i * B_i @ A_i: the grouped entry point, the fused torch path and the
reference paths.

Layout: every weight is seen as a 2-D matrix ``[d_out, d_in]`` (a Conv2d weight flattened to
``[out, in*kh*kw]``); a factor is ``(B [d_out, r], A [r, d_in], scale)``.

Numerics (see docs/LORA.md):

* ``exact``: factors in fp32 with the scale folded into B, one fp32 GEMM over the concatenated rank
  (IEEE products in the Triton kernel), the add of W in fp32, ONE rounding into W's dtype.
* ``fast``: factors in W's dtype when W is bf16/fp16 (tf32 products for fp32 W in the Triton kernel),
  fp32 accumulation on GPU. On CPU only a bf16 weight on a CPU with native bf16 dot products
  (AVX512-BF16 or AMX) takes one bf16 ``addmm``; every other CPU case takes the exact path, which
  is faster there (an AVX2 CPU has no bf16 GEMM: 9.6 s against 0.21 s exact for a 3072x3072
  weight and a rank-512 stack, one thread).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .factors import LOW_PRECISION, Backend, LoraFactor, Mode, check_factors, concat_factors, factor_dtype

__all__ = ["Backend", "LoraFactor", "Mode", "concat_factors", "merge_into", "merge_loop", "merge_reference", "merge_torch"]


def merge_torch(src: Tensor, dst: Tensor, factors: Sequence[LoraFactor], mode: Mode = "exact") -> Tensor:
    """Fused torch path: ``dst = src + B_cat @ A_cat`` as ONE ``addmm`` (dst may be src)."""
    check_factors(src, factors)
    if mode == "fast" and src.device.type == "cpu" and not (src.dtype == torch.bfloat16 and native_bf16_cpu()):
        mode = "exact"  # no fast low-precision GEMM on this CPU: the fp32 path is both faster and exact
    fdtype = factor_dtype(src.dtype, mode)
    b_cat, a_cat = concat_factors(factors, fdtype, src.device)
    if src.dtype == fdtype:  # fp32 weight, or fast mode on a low-precision weight
        if _same_memory(src, dst):
            return dst.addmm_(b_cat, a_cat)
        return torch.addmm(src, b_cat, a_cat, out=dst)
    # exact mode on a bf16/fp16 weight: fp32 accumulation, one final rounding
    return dst.copy_(torch.addmm(src.to(torch.float32), b_cat, a_cat))


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where a bf16 GEMM is faster
    than fp32; elsewhere torch emulates it, ~50x slower than fp32."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


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
