"""A test that hangs in ``asyncio.run`` reports, at its timeout, the tasks that wait and why
(``tests/timeout_tasks.py``), in a real pytest run of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANGS = '''
import asyncio

async def never_ends_its_loop():
    while True:
        await asyncio.sleep(0.05)

async def stop_waits_for_it(task):
    await asyncio.gather(task)

def test_hangs():
    async def go():
        await stop_waits_for_it(asyncio.create_task(never_ends_its_loop(), name="claim-loop"))
    asyncio.run(go())
'''


def test_a_timed_out_test_prints_its_unfinished_tasks(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.timeout_tasks", "--timeout", "2",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "Timeout" in out, out[-3000:]
    assert "Unfinished asyncio tasks" in out, out[-3000:]
    tasks = out.split("Unfinished asyncio tasks", 1)[1]
    assert "task claim-loop" in tasks and "never_ends_its_loop" in tasks  # the loop that did not end
    assert "stop_waits_for_it" in tasks and "gather" in tasks  # and what waits for it
