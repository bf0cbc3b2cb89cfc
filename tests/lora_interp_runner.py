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
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lora_kernels import triton_merge  # noqa: E402
from tests.lora_cases import grouped_check, make_case, run_triton_case  # noqa: E402


def fix_interpreter_index() -> bool:
    """Triton's interpreter before 3.7 turns a runtime scalar (the kernel's K in ``range``) into
    an int with ``int()`` of a one-element array, which numpy 2.4 and later refuse ("only
    0-dimensional arrays can be converted to Python scalars"). Seen with triton 3.6 (torch 2.11's)
    and numpy 2.4. This applies upstream's fix (triton-lang/triton#9171: squeeze first) where the
    interpreter lacks it; True when it did."""
    import inspect

    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "int(self.handle.data))" not in inspect.getsource(original):
        return False

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    return True


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
    fix_interpreter_index()
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        results[f"{case['shape']}/{case['dtype']}/{case['mode']}"] = run_triton_case(**case, device="cpu")
    results["grouped"] = grouped_check("cpu")
    results["tuner"] = tuner_check()
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
