"""The LoRA merge kernels against the fp64 reference, with the bound stated in
tests/lora_cases.error_bound (elementwise, vs fp64):

    exact: |out - ref| <= u_out*|ref| + (K+2)*2^-24*(|W| + F)       F = sum_i |s_i||B_i||A_i|
    fast:  the exact bound + 2*u_in*F

u_out = 2^-24 / 2^-8 / 2^-11 for fp32 / bf16 / fp16 weights (doubled for bf16 under the Triton
interpreter, whose fp32->bf16 cast truncates); u_in = 2^-8 (bf16), 2^-11 (fp16, tf32).

Coverage: the torch path (production CPU path) on ALL shapes x {fp32, bf16, fp16} x {exact, fast}
(fast takes the exact path on a CPU without native bf16, as this one; its bf16 GEMM is checked
on the shapes below 3072, forced).
The Triton kernel under the interpreter (a subprocess, see tests/lora_interp_runner.py) on all
dtypes and modes for 1536x32x4 and the odd shapes, and on the three 3072 shapes for the two
production combinations (fp32 exact, bf16 fast) to keep the suite fast. Without a GPU the kernel
is also compiled for sm_90 (H200) and checked for register spills. On CUDA it runs natively on ALL
shapes x dtypes x modes (skipped without CUDA; scripts/gpu_check_lora.py runs them without pytest).

Any CPU: the bounds hold whatever order a BLAS sums in (K terms pass at most K-1 additions in any
order), so they do not depend on which kernels this CPU's MKL, oneDNN or numpy picks. Bit-for-bit
checks compare only what rounds nothing (test_bit_exact_when_every_sum_is_exact) or the same
operations on the same data. Checked with MKL, oneDNN and ATen held to SSE4.2, AVX2 and AVX-512.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_kernels import concat_factors, merge_into, merge_loop, merge_reference, ops
from tests.lora_cases import ALL_CASES, count_launches, grouped_check, make_case, run_triton_case, worst_ratio

BIG = {"3072x32x4", "3072x64x4", "3072x64x8"}
INTERP_CASES = [c for c in ALL_CASES if c[0] not in BIG or (c[1], c[2]) in {("fp32", "exact"), ("bf16", "fast")}]
RUNNER = Path(__file__).with_name("lora_interp_runner.py")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case_id(case: tuple[str, str, str]) -> str:
    return "/".join(case)


# ---------------------------------------------------------------- torch path (CPU production path)


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_torch_path_within_bound(case):
    shape, dtype, mode = case
    w, factors = make_case(shape, dtype)
    out = merge_into([w], [factors], out=[torch.empty_like(w)], mode=mode, backend="torch")[0]
    assert worst_ratio(out, shape, dtype, mode) <= 1.0


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c[0] not in BIG and c[1:] == ("bf16", "fast")], ids=_case_id)
def test_torch_bf16_gemm_within_bound_where_the_cpu_has_one(case, monkeypatch):
    """The one bf16 ``addmm`` that fast mode takes on a CPU that multiplies bf16 natively, forced
    here whatever this CPU has (an AVX2 CPU emulates it, ~50x slower than fp32: the smaller shapes
    only)."""
    shape, dtype, mode = case
    monkeypatch.setattr(ops, "native_bf16_cpu", lambda: True)
    w, factors = make_case(shape, dtype)
    out = merge_into([w], [factors], out=[torch.empty_like(w)], mode=mode, backend="torch")[0]
    b_cat, a_cat = concat_factors(factors, torch.bfloat16, w.device)
    assert torch.equal(out, torch.addmm(w, b_cat, a_cat))  # the bf16 GEMM itself, not the fp32 path
    assert worst_ratio(out, shape, dtype, mode) <= 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fast_mode_on_a_cpu_without_a_low_precision_gemm_is_the_exact_path(dtype, monkeypatch):
    monkeypatch.setattr(ops, "native_bf16_cpu", lambda: False)
    w, factors = make_case("1000x77_r3-8-16", {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype])
    fast, exact = (merge_into([w], [factors], out=[torch.empty_like(w)], mode=m, backend="torch")[0]
                   for m in ("fast", "exact"))
    assert torch.equal(fast, exact)


def test_in_place_equals_out_of_place():
    """Both write the result of the same fp32 ``addmm`` rounded once to bf16: the same bits on any CPU."""
    w, factors = make_case("1000x77_r3-8-16", "bf16")
    out = merge_into([w], [factors], out=[torch.empty_like(w)], backend="torch")[0]
    w2 = w.clone()
    merge_into([w2], [factors], backend="torch")
    assert torch.equal(out, w2)


def test_bit_exact_when_every_sum_is_exact():
    """The one bit-exactness claim, and it holds on any CPU: fp32 factors on a grid of 1/8 and
    scales that are dyadic make every product, every partial sum and the add of W exact in fp32
    (multiples of 2^-8 below 2^11: 19 bits), so the fused merge, the per-adapter loop and the fp64
    reference agree bit for bit whatever order the BLAS sums in. (On random data the two paths
    sum in different orders: they agree within the bound of test_torch_path_within_bound, and
    bit for bit only where this CPU's BLAS happens to sum alike, which no test relies on.)"""
    g = torch.Generator().manual_seed(3)

    def grid(*shape: int, steps: int) -> torch.Tensor:  # multiples of 1/8 in [-steps/8, steps/8]
        return torch.randint(-steps, steps + 1, shape, generator=g).float() / 8

    w = grid(1024, 768, steps=8192)
    factors = [(grid(1024, r, steps=8), grid(r, 768, steps=8), s) for r, s in ((64, 2.0), (16, -0.75), (7, 0.5))]
    fused = merge_into([w.clone()], [factors], backend="torch")[0]
    exact = merge_reference(w, factors)
    assert torch.equal(fused.double(), exact)
    assert torch.equal(merge_loop(w.clone(), factors).double(), exact)
    assert not torch.equal(fused, w)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_more_accurate_than_loop(dtype):
    """One rounding beats the loop's N+1 roundings into a low-precision weight."""
    for shape in ("1536x32x4", "1000x77_r3-8-16"):
        w, factors = make_case(shape, dtype)
        ref = merge_reference(w, factors)
        fused = merge_into([w], [factors], out=[torch.empty_like(w)], backend="torch")[0]
        loop = merge_loop(w.clone(), factors)
        assert (fused.double() - ref).abs().max() < (loop.double() - ref).abs().max()
        assert worst_ratio(loop, shape, dtype, "exact") > 1.0  # the loop misses the exact bound


def test_concat_factors_folds_scales():
    _, factors = make_case("1000x77_r3-8-16", "fp32")
    b_cat, a_cat = concat_factors(factors, torch.float64)
    assert b_cat.shape == (1000, 27) and a_cat.shape == (27, 77)
    delta = merge_reference(torch.zeros(1000, 77), factors)
    torch.testing.assert_close(b_cat @ a_cat, delta, rtol=0, atol=1e-6)


def test_bad_shapes_rejected():
    w = torch.zeros(8, 6)
    with pytest.raises(ValueError, match="do not fit"):
        merge_into([w], [[(torch.zeros(8, 2), torch.zeros(2, 5), 1.0)]], backend="torch")
    with pytest.raises(ValueError, match="mode"):
        merge_into([w], [[(torch.zeros(8, 2), torch.zeros(2, 6), 1.0)]], mode="sloppy", backend="torch")


# ---------------------------------------------------------------- Triton kernel, interpreter


@pytest.fixture(scope="module", autouse=True)
def _interp_process(request, tmp_path_factory):
    """Starts ONE subprocess for every interpreter case as soon as this module's tests begin, so it
    runs beside the torch-path tests (TRITON_INTERPRET=1 stays out of this process)."""
    wanted = any(item.module is request.module and "interp_results" in item.fixturenames for item in request.session.items)
    if not wanted:
        yield None
        return
    d = tmp_path_factory.mktemp("interp")
    cases = [{"shape": s, "dtype": dt, "mode": m} for s, dt, m in INTERP_CASES]
    (d / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(d / "cases.json"), str(d / "out.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc, d / "out.json"
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def interp_results(_interp_process):
    proc, out = _interp_process
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", INTERP_CASES, ids=_case_id)
def test_triton_interpreter_within_bound(interp_results, case):
    res = interp_results[_case_id(case)]
    assert res["launches"] == 1
    assert res["ratio"] <= 1.0


def test_triton_interpreter_grouped_launches(interp_results):
    res = interp_results["grouped"]
    assert res["launches"] == res["groups"] == 2  # 5 weights of 2 shapes
    assert res["max_rel_err"] < 1e-5


def test_triton_tuner_never_touches_the_weight(interp_results):
    assert interp_results["tuner"] == {"picked_fastest": True, "weight_untouched": True}


def test_interpreter_did_not_leak_into_this_process():
    import os

    assert os.environ.get("TRITON_INTERPRET") != "1"


# ---------------------------------------------------------------- Triton kernel, compiled for sm_90 without a GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernel is compiled and run for real")
@pytest.mark.parametrize("variant", [("fp32", "fp32", "ieee"), ("bf16", "bf16", "tf32")], ids=["fp32_exact", "bf16_fast"])
def test_kernel_compiles_for_h200_without_register_spills(variant):
    """The interpreter never compiles the kernel; ptxas (shipped in the triton wheel) does, for sm_90,
    with the specialisation the JIT applies to contiguous, 16-byte-aligned tensors."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from lora_kernels import triton_merge

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump in this triton wheel")
    w_dtype, f_dtype, precision = variant
    ints = ["M", "N", "K", "stride_sm", "stride_sn", "stride_dm", "stride_dn", "stride_bg", "stride_bm",
            "stride_bk", "stride_ag", "stride_ak", "stride_an"]
    sig = {"src_ptrs": "*i64", "dst_ptrs": "*i64", "like_ptr": f"*{w_dtype}", "b_ptr": f"*{f_dtype}",
           "a_ptr": f"*{f_dtype}", **dict.fromkeys(ints, "i32")}
    unit = {"stride_sn": 1, "stride_dn": 1, "stride_bk": 1, "stride_an": 1}  # the JIT specialises 1s
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n not in unit and n not in ("M", "N")}
    for cfg in triton_merge.CUDA_CONFIGS:
        consts = {**unit, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "PRECISION": precision, "UPCAST": False}
        src = triton.compiler.ASTSource(fn=triton_merge._merge_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                                        constexprs=consts, attrs=aligned)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                         "enable_fp_fusion": True})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        assert "STACK:0 " in usage, (cfg, usage)  # no spills to local memory
        assert kernel.metadata.shared <= 227 * 1024


# ---------------------------------------------------------------- Triton kernel, CUDA (scripts/gpu_check_lora.py)


@cuda
@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_triton_cuda_within_bound(case):
    res = run_triton_case(*case, device="cuda")  # backend triton, natively
    assert res["launches"] == 1
    assert res["ratio"] <= 1.0


@cuda
def test_triton_cuda_grouped_launches():
    res = grouped_check("cuda")
    assert res["launches"] == res["groups"] == 2
    assert res["max_rel_err"] < 1e-5


@cuda
def test_auto_backend_picks_triton_on_cuda():
    w, factors = make_case("1000x77_r3-8-16", "fp32")
    with count_launches() as counter:
        merge_into([w.cuda()], [[(b.cuda(), a.cuda(), s) for b, a, s in factors]])
    assert counter.launches >= 1
