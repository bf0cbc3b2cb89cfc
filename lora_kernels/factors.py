"""What every merge path shares: the factor type, the numerics modes and the dtype rule, and the
checks and concatenation of factors. Both ``ops`` (the entry point and torch paths) and
``triton_merge`` (the kernel) import this module; neither imports the other at module level."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Mode = Literal["exact", "fast"]
Backend = Literal["auto", "torch", "triton"]
LoraFactor = tuple[Tensor, Tensor, float]  # (B [d_out, r], A [r, d_in], scale)

LOW_PRECISION = (torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max


class NonFiniteFactors(ValueError):
    """Factors that are not finite, or not once the scale (and a stack's weight) is folded into
    B: served, every reply of the stack was empty and, on vLLM, other requests' rows went wrong."""


def folds_finite(b: Tensor, scale: float) -> bool:
    """Whether ``scale * b``, the fold every merge path (and a stack written for vLLM) makes in
    fp32, is finite; False for a NaN or inf in ``b`` or ``scale``. One reduction over ``b``."""
    if b.is_meta:  # no values to check (a merge of it fails on its own)
        return True
    if not b.numel():
        return math.isfinite(scale)
    return float(b.abs().amax()) * abs(scale) <= FP32_MAX  # (NaN compares False)


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
