"""The suite's scheduling units (``tests/conftest.py``, ``ONE_PROCESS``): a module that uses the
session's vLLM server must run in the process that started it, or its own process starts a
second vLLM engine (~45 s of CPU; ``test_fine_tuning`` did until 2026-12-06)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ONE_PROCESS

TESTS = Path(__file__).resolve().parent


def test_every_module_on_the_shared_vllm_server_is_in_its_unit():
    users = sorted(f"tests/{p.name}" for p in TESTS.glob("test_*.py")
                   if p.name != Path(__file__).name and "vllm_chat_server" in p.read_text())
    unit = sorted(module for module, group in ONE_PROCESS.items() if group == "vllm-chat-server")
    assert users == unit
