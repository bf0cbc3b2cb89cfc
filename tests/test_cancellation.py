"""A cancel is never lost. On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that
arrives after the awaited thing finished and before the waiting task resumed (gh-86296, fixed in
3.12): a loop waiting that way ignored ``Runner.stop`` and hung a CI run for 300 s. The code uses
``async with asyncio.timeout(...)`` instead, which passes the cancel on; this keeps it that way.
The runner's own case is ``test_batches.test_a_runner_stops_when_its_wake_up_lands_just_before_the_stop``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layering import PACKAGES, ROOT


def wait_for_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call ``asyncio.wait_for`` (``Condition.wait_for`` is another thing)."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "asyncio"
                for a in n.names if a.name == "wait_for"}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "wait_for" and isinstance(f.value, ast.Name)
                and f.value.id == "asyncio") or (isinstance(f, ast.Name) and f.id in imported):
            out.append(node.lineno)
    return out


def test_the_finder_finds_both_spellings(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import asyncio\nfrom asyncio import wait_for as wf\n"
                      "async def f(c):\n    await asyncio.wait_for(c.wait(), 1)\n    await wf(c.wait(), 1)\n"
                      "    await c.wait_for(lambda: True)\n")
    assert wait_for_calls(sample) == [4, 5]


def test_no_code_waits_with_asyncio_wait_for():
    found = [f"{path.relative_to(ROOT)}:{line}" for package in (*PACKAGES, "scripts")
             for path in sorted((ROOT / package).rglob("*.py")) for line in wait_for_calls(path)]
    assert found == [], f"use 'async with asyncio.timeout(s)' instead of asyncio.wait_for at {found}"
