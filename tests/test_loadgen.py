"""The load generator (scripts/loadgen.py) end to end: a real server on the four demo models, a
short sweep of two points at tiny rates, the table with a row per tier and point, valid PNGs and
a residency timeline; plus its eviction finding and its refusal to run without keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import start_server, write_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import loadgen  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIERS = ["paid", "free", "batch"]


@pytest.fixture(scope="module")
def demo_server(tiny_chat: Path, tiny_image: Path, tiny_tts: Path, tiny_stt: Path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loadgen-server")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image),
              "tiny-tts": ("tts", tiny_tts), "tiny-stt": ("stt", tiny_stt)}
    config = write_config(folder, models)
    server = start_server(config)
    yield server, config
    server.stop()


def test_smoke_run_writes_table_and_pngs(demo_server, tmp_path: Path) -> None:
    server, config = demo_server
    out = tmp_path / "out"
    args = [sys.executable, str(ROOT / "scripts" / "loadgen.py"), "--url", server.url, "--config", str(config),
            "--sweep", "1,2", "--duration", "2", "--drain", "20", "--max-tokens", "4", "--out", str(out)]
    for tier, rate in zip(TIERS, ["2", "2", "1"]):
        args += ["--rate", f"{tier}={rate}", "--key", f"{tier}={server.keys[tier]}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for key in server.keys.values():
        assert key not in proc.stdout + proc.stderr

    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("load "))
    rows = [line.split() for line in lines[header + 1:header + 1 + 2 * len(TIERS)]]
    assert [(r[0], r[1]) for r in rows] == [(p, t) for p in ("x1", "x2") for t in TIERS], proc.stdout

    for name in ("latency.png", "goodput.png", "residency.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name

    results = json.loads((out / "results.json").read_text())
    points = results["points"]
    assert sum(p["sent"] for p in points) > 0
    assert sum(p["ok"] for p in points) > 0, proc.stdout
    assert all(p["ok"] + sum(p["refused"].values()) + sum(p["errors"].values()) == p["sent"] for p in points)
    seen = {m for sample in results["residency"] for m in sample["places"]}
    assert seen == {"tiny-chat", "tiny-image", "tiny-tts", "tiny-stt"}
    assert any(sample["places"]["tiny-chat"] == "resident" for sample in results["residency"])


def test_evictions_are_resident_to_warm_or_cold() -> None:
    samples = [(0.0, {"a": "cold", "b": "resident"}), (0.25, {"a": "loading", "b": "resident"}),
               (0.5, {"a": "resident", "b": "warm"}), (0.75, {"a": "cold", "b": "loading"}),
               (1.0, {"a": "cold", "b": "resident"})]
    assert loadgen.evictions(samples) == [(0.5, "b"), (0.75, "a")]


def test_missing_key_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.delenv("TIERGATE_KEYS_PAID", raising=False)
    with pytest.raises(SystemExit) as exc:
        loadgen.main(["--rate", "paid=1"])
    assert "no API key for tier paid" in str(exc.value)
