"""Shared fixtures: the tiny demo models (built once per session, offline) and a real server."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers import RunningServer, start_server, write_config


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs ``tiergate serve``'s main() installs its one log handler on the root
    logger; give the next tests the logging they had (pytest's own capture)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo-models")


@pytest.fixture(scope="session")
def tiny_chat(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-chat"])["tiny-chat"]


@pytest.fixture(scope="session")
def tiny_image(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-image"])["tiny-image"]


@pytest.fixture(scope="session")
def tiny_tts(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-tts"])["tiny-tts"]


@pytest.fixture(scope="session")
def tiny_stt(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-stt"])["tiny-stt"]


@pytest.fixture(scope="session")
def tiny_embed(demo_dir: Path) -> Path:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=["tiny-embed"])["tiny-embed"]


@pytest.fixture(scope="module")
def chat_server(tiny_chat: Path, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("chat-server")
    extra = "limits:\n  max_body: 64KiB\n  max_chat_tokens: 64\n"
    server = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat)}, extra))
    yield server
    server.stop()
