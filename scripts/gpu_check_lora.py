#!/usr/bin/env python
"""ONE prepared GPU check for lora_kernels, for a machine with CUDA (no pytest, diffusers or network
needed; torch, triton and safetensors are):

    python scripts/gpu_check_lora.py [--out DIR] [--peak-bw 4.8e12]

1. parity: the Triton kernel natively on CUDA for every shape x {fp32, bf16, fp16} x {exact, fast}
   against the fp64 reference under the bound of tests/lora_cases.error_bound, one launch per case,
   and one launch per same-shape group (the same functions the CUDA tests of
   tests/test_lora_kernels.py call);
2. the benchmark: scripts/bench_lora_merge.py --device cuda (loop vs torch vs Triton exact/fast,
   GB/s, share of the bandwidth roofline).

Prints every figure; writes parity.json and bench.json to --out; exits 1 if a parity check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def parity() -> tuple[list[dict], bool]:
    from tests.lora_cases import ALL_CASES, grouped_check, run_triton_case

    rows, ok = [], True
    print(f"{'case':<32} {'err/bound':>10} {'launches':>8} {'ms':>8}  result")
    for shape, dtype, mode in ALL_CASES:
        res = run_triton_case(shape, dtype, mode, device="cuda")
        passed = res["launches"] == 1 and res["ratio"] <= 1.0
        ok &= passed
        rows.append({"case": f"{shape}/{dtype}/{mode}", **res, "passed": passed})
        print(f"{rows[-1]['case']:<32} {res['ratio']:>10.3f} {res['launches']:>8} {res['seconds'] * 1e3:>8.2f}  "
              f"{'ok' if passed else 'FAIL'}")
    grouped = grouped_check("cuda")
    passed = grouped["launches"] == grouped["groups"] and grouped["max_rel_err"] < 1e-5
    ok &= passed
    rows.append({"case": "grouped", **grouped, "passed": passed})
    print(f"grouped: {grouped['launches']} launches for {grouped['groups']} shape groups, "
          f"max rel err {grouped['max_rel_err']:.2e}  {'ok' if passed else 'FAIL'}")
    return rows, ok


def main() -> int:
    p = argparse.ArgumentParser(description="LoRA merge: CUDA parity checks and benchmark")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results")
    p.add_argument("--peak-bw", default="4.8e12")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, ok = parity()
    (args.out / "parity.json").write_text(json.dumps(rows, indent=1))
    spec = importlib.util.spec_from_file_location("bench_lora_merge", ROOT / "scripts" / "bench_lora_merge.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cuda", "--peak-bw", args.peak_bw, "--json", str(args.out / "bench.json")])
    print("parity:", "all passed" if ok else "FAILURES above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
