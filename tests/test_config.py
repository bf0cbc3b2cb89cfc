"""tiers.yaml validation: every problem is one line naming the file, the field and the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import resolve_keys
from gateway.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]

BASE = """
tiers:
  - {name: paid, keys_env: K_PAID}
  - {name: batch, keys_env: K_BATCH}
models:
  - {name: m, kind: chat, path: model, vram: 6GiB}
gpu: {device: cpu, vram_budget: 10GiB}
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    p = tmp_path / "tiers.yaml"
    p.write_text(text)
    return p


def test_good_config_loads(tmp_path):
    c = load_config(write(tmp_path, BASE))
    assert c.tier_names == ["paid", "batch"]
    spec = c.model_specs()[0]
    assert spec.vram == 6 * 2**30
    assert spec.path == tmp_path / "model"  # relative to the file
    assert c.gpu.vram_budget == 10 * 2**30


@pytest.mark.parametrize("text,field,problem", [
    (BASE.replace("gpu:", "gpux:"), "gpux", "unknown field"),
    (BASE.replace("vram: 6GiB", "vram: 6 gigs"), "models[0].vram", "not a size"),
    (BASE.replace("kind: chat", "kind: video"), "models[0].kind", "Input should be"),
    (BASE.replace("models:\n", "models:\n  - {name: m, kind: chat, path: model}\n"), "models", "duplicate name 'm'"),
    (BASE.replace("{name: batch", "{name: paid"), "tiers", "duplicate name 'paid'"),
    (BASE.replace("path: model", "path: nowhere"), "models[0].path", "no such folder"),
    (BASE.replace("keys_env: K_PAID}", "keys_env: K_PAID, max_inflight: 0}"), "tiers[0].max_inflight", "greater than"),
    ("tiers: []\n", "tiers", "at least 1"),
    ("tiers: [\n", "", "not valid YAML"),
])
def test_bad_config_is_one_line_naming_file_field_problem(tmp_path, text, field, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {field}")
    assert problem in msg


def test_no_keys_outside_demo_mode_stops_startup(tmp_path):
    c = load_config(write(tmp_path, BASE))
    with pytest.raises(ConfigError) as exc:
        resolve_keys(c, demo=False, environ={})
    assert "K_PAID" in str(exc.value) and "tiers" in str(exc.value)


def test_demo_mode_makes_fresh_keys_and_env_keys_win(tmp_path):
    c = load_config(write(tmp_path, BASE))
    ring1, made1 = resolve_keys(c, demo=True, environ={})
    ring2, made2 = resolve_keys(c, demo=True, environ={})
    assert made1["paid"] != made2["paid"]  # random every run, never shipped
    assert ring1.lookup(made1["paid"][0]).tier == "paid"
    assert ring1.lookup(made1["admin"][0]).admin
    ring, made = resolve_keys(c, demo=True, environ={"K_PAID": "a, b", "K_BATCH": "c"})
    assert made is None
    assert ring.lookup("b").tier == "paid" and ring.lookup("c").tier == "batch"
    assert ring.lookup("a, b") is None


def test_shipped_tiers_yaml_is_valid():
    c = load_config(ROOT / "tiers.yaml", check_paths=False)
    assert c.tier_names == ["paid", "subscriber", "free", "batch"]
    assert [t.keys_env for t in c.tiers] == [
        "TIERGATE_KEYS_PAID", "TIERGATE_KEYS_SUBSCRIBER", "TIERGATE_KEYS_FREE", "TIERGATE_KEYS_BATCH"]
    assert "tiny-chat" in [m.name for m in c.models]


def test_reading_a_config_imports_no_torch(tmp_path):
    """Sizes live in the torch-free arbiter.units: loading tiers.yaml pulls in no model library."""
    path = write(tmp_path, BASE)
    code = ("import sys; from gateway.config import load_config; "
            f"load_config({str(path)!r}); print(sorted(m for m in ('torch', 'transformers', 'diffusers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
