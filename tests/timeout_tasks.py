"""On a test's timeout, print every unfinished asyncio task's stack beside pytest-timeout's thread
stacks. A hung ``asyncio.run`` shows only its selector in a thread stack; the task that waits, and
the task that never ended, are what tell why (the 300 s CI hang in ``Runner.stop`` took a
reproduction to find). Loaded by ``tests/conftest.py``."""

from __future__ import annotations

import asyncio
import gc
import io
import signal
import threading

import pytest

MAX_TASKS = 40


def unfinished_tasks() -> list[asyncio.Task]:
    """Every pending task of every event loop in the process (found through the collector, so
    loops in other threads and loops that are not running count too)."""
    return [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]


def task_stacks() -> str:
    tasks = unfinished_tasks()
    out = io.StringIO()
    for task in tasks[:MAX_TASKS]:
        out.write(f"--- task {task.get_name()}: {task.get_coro()!r}\n")
        task.print_stack(file=out)
    if len(tasks) > MAX_TASKS:
        out.write(f"... and {len(tasks) - MAX_TASKS} more tasks\n")
    return out.getvalue()


@pytest.hookimpl(hookwrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """After pytest-timeout armed its alarm: in front of its handler (the signal method, the one
    that keeps the run going) put one that prints the tasks first."""
    yield
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return
    timed_out = signal.getsignal(signal.SIGALRM)
    if not callable(timed_out):
        return

    def handler(signum, frame):
        __tracebackhide__ = True
        try:  # whatever the dump meets, the test still times out
            terminal = item.config.get_terminal_writer()
            terminal.sep("+", title="Unfinished asyncio tasks")
            terminal.write(task_stacks())
        finally:
            timed_out(signum, frame)

    signal.signal(signal.SIGALRM, handler)
