"""The prepared device check (scripts/gpu_check.sh, scripts/gpu_check_workers.py) on this CPU: the
worker comparison's code path against itself, and the driver's step selection and failure count.
What it finds on CUDA is recorded in docs/BENCHMARKS.md ("On a GPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.forked import run_script

ROOT = Path(__file__).resolve().parents[1]


def test_worker_check_runs_its_path_on_cpu(demo_dir, tmp_path):
    """``--device cpu`` compares each worker with itself: every check must hold exactly."""
    from demo import build_demo_models

    build_demo_models(demo_dir, names=["tiny-chat", "tiny-chat-pirate", "tiny-chat-poet", "tiny-embed",
                                       "tiny-moderation", "tiny-rerank", "tiny-vlm"])
    out = run_script(ROOT / "scripts" / "gpu_check_workers.py",  # forked with the stack imported (tests/forked.py)
                     ["--device", "cpu", "--models", str(demo_dir), "--out", str(tmp_path), "--kinds", "chat", "vision",
                      "embed", "moderation", "rerank", "train"], ROOT, tmp_path, 240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: PASS")
    results = json.loads((tmp_path / "workers.json").read_text())
    assert set(results) == {"chat", "vision", "embed", "moderation", "rerank", "train"}
    assert results["chat"]["logits_rel_err"] == 0.0 and results["chat"]["replies"]["stack"]["equal"]
    assert results["chat"]["together"] == {"rows": 3, "finite": True, "first_tokens_equal": 3}
    assert results["vision"]["logits_rel_err"] == 0.0 and results["vision"]["reply"]["equal"]
    assert results["embed"]["min_cosine"] > 0.99999 and results["moderation"]["max_abs_diff"] == 0.0
    assert results["rerank"]["max_abs_diff"] == 0.0
    assert results["train"]["losses"]["cpu"] == {**results["train"]["losses"]["device"],  # seeded: CPU twice, the same
                                                 "seconds": results["train"]["losses"]["cpu"]["seconds"]}
    dpo = results["train"]["dpo"]
    assert abs(dpo["first"] - 0.6931472) < 1e-6 and dpo["last"] < dpo["first"]


def test_driver_runs_only_the_steps_asked_and_counts_failures(tmp_path):
    """Without CUDA the workers step exits 2 ("no CUDA device"): the driver logs it, skips the
    steps not asked for, and exits with the number of failed steps."""
    env = {**os.environ, "PY": sys.executable, "STEPS": "workers", "WHEELS": str(tmp_path / "none")}
    out = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    log = (tmp_path / "out" / "all.log").read_text()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no CUDA device" in log and "=== workers: rc=2" in log
    assert "=== kernels" not in log and "=== lora" not in log and "sized chat model" not in log
    assert "=== serving" not in log and "=== decode" not in log
    assert log.strip().splitlines()[-1] == "gpu_check: 1 step(s) failed"
