"""demo.build_demo_models: what a caller that finds the demo models built pays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_models_found_current_import_no_builder(tiny_chat: Path, demo_dir: Path) -> None:
    """Every benchmark and ``scripts/serve`` call it before they start; with the folders current
    it must not import the builders' libraries (torch, transformers, diffusers: ~8 s of CPU here,
    for nothing)."""
    from demo import build_demo_models

    build_demo_models(demo_dir, names=["tiny-chat", "tiny-chat-pirate"])  # both current from here on
    code = ("import sys; from demo import build_demo_models; "
            f"built = build_demo_models({str(demo_dir)!r}, names=['tiny-chat', 'tiny-chat-pirate']); "
            "print(sorted(built), sorted(m for m in ('torch', 'transformers', 'diffusers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['tiny-chat', 'tiny-chat-pirate'] []"


def test_the_embedders_tokenizer_is_the_same_in_every_process() -> None:
    """One seed builds one model: tiny-embed's (and the classifiers') WordPiece vocabulary is made
    the same in a fresh process as here (the trainer it replaced broke ties in hash order, which
    Rust seeds per process: two builds differed nearly every time)."""
    from demo.embed import wordpiece_tokenizer

    code = "from demo.embed import wordpiece_tokenizer; print(sorted(wordpiece_tokenizer().get_vocab().items()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(wordpiece_tokenizer().get_vocab().items()))


def test_tiergate_demo_models_writes_no_progress_bar_outside_a_terminal(tmp_path: Path) -> None:
    """``tiergate demo-models`` into a log or a pipe writes no progress bar (README, "Progress
    bars": a terminal only): transformers' "Writing model shards" bars came through while tiergate's
    own was off (hunt report L, finding 12)."""
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "demo-models", "--out", str(tmp_path / "models")],
                          cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tiny-chat: " in done.stdout
    bars = [ln for ln in done.stderr.replace("\r", "\n").splitlines() if "%|" in ln or "it/s]" in ln]
    assert bars == []


def test_tiergate_demo_models_names_an_out_folder_it_cannot_make(tmp_path: Path, capsys) -> None:
    """``tiergate demo-models --out`` naming a file, or a folder below one, is one line and exit 2,
    before any model is built: it was pathlib's FileExistsError traceback (hunt report QQ,
    finding 4)."""
    from gateway.cli import main

    (tmp_path / "afile").write_text("not a folder")
    for out, why in (("afile", "File exists"), ("afile/below", "Not a directory")):
        assert main(["demo-models", "--out", str(tmp_path / out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == f"tiergate: --out {tmp_path / out}: cannot make the folder: {why}\n"
