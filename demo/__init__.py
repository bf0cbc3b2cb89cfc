"""Builds the tiny random-weight demo models offline, one folder per model, in the libraries' own
formats, and a few demo LoRA adapters on them (under ``adapters/``, each after its base model). A
folder is built in a temporary sibling and renamed when complete, so an interrupted build is never
mistaken for a model.

The builders live beside this module, one per kind (``demo.chat``, ``demo.image``, ``demo.tts``,
``demo.stt``, ``demo.embed``, ``demo.moderation``, ``demo.rerank``,
``demo.vision``); demo imports workers and lora_kernels, never the reverse."""

from __future__ import annotations

import importlib
import shutil
import zlib
from pathlib import Path
from typing import Callable

DEMO_MODELS = {
    "tiny-chat": "demo.chat",
    "tiny-image": "demo.image",
    "tiny-tts": "demo.tts",
    "tiny-stt": "demo.stt",
    "tiny-embed": "demo.embed",
    "tiny-moderation": "demo.moderation",
    "tiny-rerank": "demo.rerank",
    "tiny-vlm": "demo.vision",
}

# name -> (base model, module with build_demo_adapter, rank). Random non-zero factors, so each
# adapter changes its model's outputs; deterministic from the seed and the name.
DEMO_ADAPTERS = {
    "tiny-chat-pirate": ("tiny-chat", "demo.chat", 4),
    "tiny-chat-poet": ("tiny-chat", "demo.chat", 8),
    "tiny-image-sketch": ("tiny-image", "demo.image", 4),
}
ADAPTERS_DIR = "adapters"
TRAINED_DIR = "trained"  # tiers.yaml's adapter folder for tiny-chat: where fine-tuning jobs write theirs
# Bumped whenever a builder changes what it makes (e.g. tiny-chat's head_dim for vLLM, its tool-calling
# chat template; 5: tiny-embed's tokenizer made, not trained): folders built by an older version are
# rebuilt, with the adapters on them.
DEMO_VERSION = "5"
STAMP = ".tiergate-demo"


def build_demo_models(out: Path, seed: int = 0, names: list[str] | None = None, force: bool = False) -> dict[str, Path]:
    """Build the demo models and adapters missing under ``out`` (all of them with ``force``).
    ``names`` may name models and adapters; an adapter brings its base model along."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = names or [*DEMO_MODELS, *DEMO_ADAPTERS]
    adapters = [n for n in names if n in DEMO_ADAPTERS]
    models = list(dict.fromkeys([n for n in names if n not in DEMO_ADAPTERS] + [DEMO_ADAPTERS[a][0] for a in adapters]))
    built: dict[str, Path] = {}
    rebuilt: set[str] = set()
    # a builder's module (torch, transformers, diffusers: seconds of imports) is imported only
    # when something is built: a caller that finds every folder current imports none of them
    for name in models:
        module = DEMO_MODELS[name]
        built[name], fresh = _build(out / name, lambda tmp: importlib.import_module(module).build_demo(tmp, seed), force)
        if fresh:
            rebuilt.add(name)
    for name in adapters:
        base, module, rank = DEMO_ADAPTERS[name]
        adapter_seed = seed * 1_000_003 + zlib.crc32(name.encode())
        built[name], _ = _build(out / ADAPTERS_DIR / name,
                                lambda tmp: importlib.import_module(module).build_demo_adapter(built[base], tmp,
                                                                                               adapter_seed, rank),
                                force or base in rebuilt)
    if "tiny-chat" in built:  # empty until a fine-tuning job writes an adapter; kept when tiny-chat is rebuilt
        (out / TRAINED_DIR / "tiny-chat").mkdir(parents=True, exist_ok=True)
    return built


def _build(folder: Path, build: Callable[[Path], object], force: bool) -> tuple[Path, bool]:
    """Build ``folder`` unless a current one is there; True when it was (re)built."""
    stamp = folder / STAMP
    if folder.is_dir() and not force and stamp.is_file() and stamp.read_text() == DEMO_VERSION:
        return folder, False
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / STAMP).write_text(DEMO_VERSION)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder, True
