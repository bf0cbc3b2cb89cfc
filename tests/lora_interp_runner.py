"""Runs the Triton merge kernel under the Triton interpreter, in its own process.

``TRITON_INTERPRET=1`` must be set before triton / the kernel module is imported, and it must not
leak into the pytest process (the rest of the suite imports lora_kernels without the interpreter),
so tests/test_lora_kernels.py starts this script as a subprocess:

    python tests/lora_interp_runner.py CASES_JSON OUT_JSON

CASES_JSON lists ``{"shape": id, "dtype": name, "mode": mode}``; OUT_JSON receives, per case id
``shape/dtype/mode``, the worst error/bound ratio (``tests/lora_cases.error_bound``), the number of
kernel launches and seconds; plus the grouped-launch and tuner checks under ``"grouped"`` and
``"tuner"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lora_kernels import merge_into, merge_reference, triton_merge  # noqa: E402
from tests.lora_cases import make_case, worst_ratio  # noqa: E402


class LaunchCounter:
    """Stands in for the jitted kernel and counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def run_case(shape: str, dtype: str, mode: str, counter: LaunchCounter) -> dict:
    w, factors = make_case(shape, dtype)
    out = torch.empty_like(w)
    counter.launches = 0
    t = time.perf_counter()
    merge_into([w], [factors], out=[out], mode=mode, backend="triton")
    seconds = time.perf_counter() - t
    truncating = True  # the interpreter's fp32->bf16 cast truncates
    return {"ratio": worst_ratio(out, shape, dtype, mode, truncating), "launches": counter.launches, "seconds": seconds}


def grouped_check(counter: LaunchCounter) -> dict:
    """5 weights of 2 shapes (and mixed ranks within a group), merged in place: 2 launches expected."""
    g = torch.Generator().manual_seed(1)
    shapes = [(96, 80), (80, 96), (96, 80), (96, 80), (80, 96)]
    ranks = [(3, 8), (4,), (16,), (1, 2, 5), (7, 9)]
    weights = [torch.randn(s, generator=g) for s in shapes]
    factors = [
        [(torch.randn(s[0], r, generator=g), torch.randn(r, s[1], generator=g), 0.5 - i) for i, r in enumerate(rs)]
        for s, rs in zip(shapes, ranks)
    ]
    refs = [merge_reference(w, f) for w, f in zip(weights, factors)]
    counter.launches = 0
    merge_into(weights, factors, mode="exact", backend="triton")
    err = max(((w.double() - r).abs() / (r.abs() + 1)).max().item() for w, r in zip(weights, refs))
    return {"launches": counter.launches, "groups": len(set(shapes)), "max_rel_err": err}


def tuner_check() -> dict:
    """The CUDA tuner times candidates on a scratch output: the weight must stay untouched."""
    w, factors = make_case("1000x77_r3-8-16", "fp32")
    w = w.clone()
    before = w.clone()
    b_all, a_all = triton_merge.stack_factors([factors], *w.shape, torch.float32, 32, w.device)
    candidates = [triton_merge.Config(64, 64, 32), triton_merge.Config(128, 32, 32)]
    fake_times = iter([2.0, 1.0])
    cfg = triton_merge.pick_config([w], b_all, a_all, "exact", bench=lambda fn: (fn(), next(fake_times))[1],
                                   candidates=candidates)
    return {"picked_fastest": cfg == candidates[1], "weight_untouched": torch.equal(w, before)}


def main(cases_path: str, out_path: str) -> None:
    counter = LaunchCounter(triton_merge._merge_kernel)
    triton_merge._merge_kernel = counter
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        results[f"{case['shape']}/{case['dtype']}/{case['mode']}"] = run_case(**case, counter=counter)
    results["grouped"] = grouped_check(counter)
    results["tuner"] = tuner_check()
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
