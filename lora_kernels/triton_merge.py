"""The fused Triton merge kernel: ``dst_g = src_g + B_g @ A_g`` for a group of same-shape weights in
ONE launch (grid = M tiles x N tiles x group), fp32 accumulation, the add of W in the epilogue.

The weights of a group live in separate tensors; the kernel reads their addresses from an int64
pointer table. The factors of the group are stacked and zero-padded along the rank to a common K.

Imported only when the Triton path is used. On a machine without CUDA it runs under the Triton
interpreter, which needs ``TRITON_INTERPRET=1`` in the environment before this module is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .factors import LOW_PRECISION, LoraFactor, Mode, check_factors, factor_dtype

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _merge_kernel(
    src_ptrs,
    dst_ptrs,
    like_ptr,
    b_ptr,
    a_ptr,
    M,
    N,
    K,
    stride_sm,
    stride_sn,
    stride_dm,
    stride_dn,
    stride_bg,
    stride_bm,
    stride_bk,
    stride_ag,
    stride_ak,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2)
    w_ty = tl.pointer_type(like_ptr.dtype.element_ty)
    # 64-bit scalar bases per tile, 32-bit offsets inside it (fewer registers than 64-bit index tiles)
    off_m = (pid_m * BLOCK_M).to(tl.int64)
    off_n = (pid_n * BLOCK_N).to(tl.int64)
    src = tl.load(src_ptrs + g).to(w_ty) + off_m * stride_sm + off_n * stride_sn
    dst = tl.load(dst_ptrs + g).to(w_ty) + off_m * stride_dm + off_n * stride_dn
    b_tile = b_ptr + g.to(tl.int64) * stride_bg + off_m * stride_bm
    a_tile = a_ptr + g.to(tl.int64) * stride_ag + off_n * stride_an

    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M - pid_m * BLOCK_M
    n_ok = rn < N - pid_n * BLOCK_N
    b_tile += rm[:, None] * stride_bm + rk[None, :] * stride_bk
    a_tile += rk[:, None] * stride_ak + rn[None, :] * stride_an

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is padded to a multiple of BLOCK_K with zeros
        b = tl.load(b_tile, mask=m_ok[:, None], other=0.0)
        a = tl.load(a_tile, mask=n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            b = b.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(b, a, input_precision=PRECISION)
        b_tile += BLOCK_K * stride_bk
        a_tile += BLOCK_K * stride_ak

    # epilogue: add W in fp32, one rounding into W's dtype
    mask = m_ok[:, None] & n_ok[None, :]
    w = tl.load(src + rm[:, None] * stride_sm + rn[None, :] * stride_sn, mask=mask, other=0.0)
    acc += w.to(tl.float32)
    tl.store(dst + rm[:, None] * stride_dm + rn[None, :] * stride_dn, acc.to(w_ty.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# CUDA candidates share block_k so the padded factor stack fits all of them.
CUDA_BLOCK_K = 32
CUDA_CONFIGS = (  # none of these spills registers on sm_90 for fp32/tf32/bf16 (checked with ptxas)
    Config(128, 128, CUDA_BLOCK_K, 8, 3),
    Config(128, 64, CUDA_BLOCK_K, 8, 3),
    Config(64, 128, CUDA_BLOCK_K, 8, 3),
    Config(64, 64, CUDA_BLOCK_K, 4, 4),
)
_tuned: dict[tuple, Config] = {}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def interpreter_config(m: int, n: int, k: int) -> Config:
    """Big blocks: the interpreter's cost is per program, numpy does the rest."""
    return Config(min(1024, _pow2(m)), min(1024, _pow2(n)), min(512, _pow2(max(16, k))))


def stack_factors(
    factors: Sequence[Sequence[LoraFactor]], m: int, n: int, dtype: torch.dtype, block_k: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Zero-padded stacks B [G, M, Kpad] (scales folded, in fp32 then cast) and A [G, Kpad, N]."""
    k_max = max(sum(b.shape[1] for b, _, _ in fs) for fs in factors)
    k_pad = -(-k_max // block_k) * block_k
    b_all = torch.zeros(len(factors), m, k_pad, dtype=dtype, device=device)
    a_all = torch.zeros(len(factors), k_pad, n, dtype=dtype, device=device)
    for g, fs in enumerate(factors):
        off = 0
        for b, a, s in fs:
            r = b.shape[1]
            b_all[g, :, off : off + r] = (b.to(device, torch.float32) * float(s)).to(dtype)
            a_all[g, off : off + r, :] = a.to(device, dtype)
            off += r
    return b_all, a_all


def _pointers(tensors: Sequence[Tensor]) -> Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=tensors[0].device)


@dataclass
class PreparedMerge:
    """A group merge with its factors stacked, pointer tables built and config chosen: ``launch()``
    is exactly one kernel launch (the benchmark times it alone)."""

    srcs: Sequence[Tensor]
    dsts: Sequence[Tensor]
    b_all: Tensor
    a_all: Tensor
    cfg: Config
    mode: Mode

    def __post_init__(self) -> None:
        self.src_ptrs, self.dst_ptrs = _pointers(self.srcs), _pointers(self.dsts)

    def launch(self) -> None:
        m, n = self.srcs[0].shape
        cfg = self.cfg
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), len(self.srcs))
        extra = {} if INTERPRET else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": True}
        _merge_kernel[grid](
            self.src_ptrs,
            self.dst_ptrs,
            self.srcs[0],
            self.b_all,
            self.a_all,
            m,
            n,
            self.b_all.shape[2],
            *self.srcs[0].stride(),
            *self.dsts[0].stride(),
            *self.b_all.stride(),
            *self.a_all.stride(),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            PRECISION="ieee" if self.mode == "exact" else "tf32",
            UPCAST=INTERPRET and self.b_all.dtype in LOW_PRECISION,
            **extra,
        )


def pick_config(
    srcs: Sequence[Tensor],
    b_all: Tensor,
    a_all: Tensor,
    mode: Mode,
    bench: Callable[[Callable[[], None]], float] | None = None,
    candidates: Sequence[Config] = CUDA_CONFIGS,
) -> Config:
    """Fastest candidate for this shape, timed once per (shape, K, dtype, mode) on a scratch output
    (the merge itself may be in place, so it is never re-run for timing)."""
    key = (tuple(srcs[0].shape), b_all.shape[2], srcs[0].dtype, mode, srcs[0].device)
    if key not in _tuned:
        if bench is None:
            from triton.testing import do_bench

            def bench(fn):
                return do_bench(fn, warmup=5, rep=20)

        scratch = [torch.empty_like(srcs[0])]
        trials = {cfg: PreparedMerge(srcs[:1], scratch, b_all[:1], a_all[:1], cfg, mode) for cfg in candidates}
        times = {cfg: bench(trial.launch) for cfg, trial in trials.items()}
        _tuned[key] = min(times, key=times.get)
    return _tuned[key]


def prepare_group(
    srcs: Sequence[Tensor], dsts: Sequence[Tensor], factors: Sequence[Sequence[LoraFactor]], mode: Mode = "exact"
) -> PreparedMerge:
    """Validate a group of same-shape weights, stack its factors and choose the launch config."""
    if not srcs or not (len(srcs) == len(dsts) == len(factors)):
        raise ValueError("a non-empty group with one output and one factor list per weight")
    first, first_dst = srcs[0], dsts[0]
    for s, d, fs in zip(srcs, dsts, factors):
        check_factors(s, fs)
        if not fs:
            raise ValueError("every weight of a group needs at least one factor")
        if (s.shape, s.dtype, s.device, s.stride()) != (first.shape, first.dtype, first.device, first.stride()):
            raise ValueError("a group's weights must share shape, dtype, device and strides")
        if (d.shape, d.dtype, d.device, d.stride()) != (first.shape, first.dtype, first.device, first_dst.stride()):
            raise ValueError("a group's outputs must share shape, strides and the weights' dtype and device")
    if not INTERPRET and not first.is_cuda:
        raise RuntimeError("the Triton merge needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    m, n = first.shape
    fdtype = factor_dtype(first.dtype, mode)
    if INTERPRET:
        cfg = interpreter_config(m, n, max(sum(b.shape[1] for b, _, _ in fs) for fs in factors))
        b_all, a_all = stack_factors(factors, m, n, fdtype, cfg.block_k, first.device)
    else:
        b_all, a_all = stack_factors(factors, m, n, fdtype, CUDA_BLOCK_K, first.device)
        cfg = pick_config(srcs, b_all, a_all, mode)
    return PreparedMerge(srcs, dsts, b_all, a_all, cfg, mode)


def merge_group(
    srcs: Sequence[Tensor], dsts: Sequence[Tensor], factors: Sequence[Sequence[LoraFactor]], mode: Mode = "exact"
) -> None:
    """``dsts[g] = srcs[g] + sum_i s_gi B_gi A_gi`` for a group of same-shape weights, in ONE launch.

    ``dsts[g]`` may be ``srcs[g]`` (in place). All srcs share shape, dtype, device and strides, and so do
    all dsts.
    """
    prepare_group(srcs, dsts, factors, mode).launch()
