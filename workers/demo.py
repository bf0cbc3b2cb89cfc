"""Builds the tiny random-weight demo models offline, one folder per model, in the libraries' own
formats. A folder is built in a temporary sibling and renamed when complete, so an interrupted
build is never mistaken for a model."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

DEMO_MODELS = {
    "tiny-chat": "workers.chat",
    "tiny-image": "workers.image",
    "tiny-tts": "workers.tts",
    "tiny-stt": "workers.stt",
}


def build_demo_models(out: Path, seed: int = 0, names: list[str] | None = None, force: bool = False) -> dict[str, Path]:
    """Build the demo models missing under ``out`` (all of them with ``force``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name in names or list(DEMO_MODELS):
        folder = out / name
        if folder.is_dir() and not force:
            built[name] = folder
            continue
        tmp = out / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        importlib.import_module(DEMO_MODELS[name]).build_demo(tmp, seed)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        built[name] = folder
    return built
