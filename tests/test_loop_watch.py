"""The event loop's watch (gateway/loop_watch.py): where a stack was, and a real server's loop
held by a function of this module, reported as a stall that names it (event, metric, log)."""

from __future__ import annotations

import logging
import re
import threading
import time
import traceback
from pathlib import Path

import httpx
import pytest

from gateway.loop_watch import ROOT, frame_label, loop_frames, waiting, where
from tests.helpers import start_server, write_config

VENV_LIB = "/work/x/.venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"


def frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_where_names_the_innermost_own_frame_and_the_library_frame_it_called():
    stack = [frame(f"{STDLIB}/asyncio/events.py", 80, "_run"),
             frame(str(ROOT / "batch/lines.py"), 88, "check_lines"),
             frame(str(ROOT / "gateway/schemas.py"), 12, "loads"),
             frame(f"{STDLIB}/json/decoder.py", 353, "raw_decode")]
    assert where(stack) == "gateway/schemas.py:12 loads > json/decoder.py:353 raw_decode"
    assert where(stack[:3]) == "gateway/schemas.py:12 loads"  # the own frame is the innermost
    # no frame of tiergate's: the innermost, a library's path from its package
    assert where([frame(f"{VENV_LIB}/starlette/routing.py", 5, "app")]) == "starlette/routing.py:5 app"
    assert where([]) is None


def test_a_library_installed_under_the_project_is_not_its_own_code():
    inside = frame(str(ROOT / ".venv/lib/python3.11/site-packages/torch/nn/module.py"), 1, "forward")
    assert frame_label(inside) == "torch/nn/module.py:1 forward"
    assert where([frame(str(ROOT / "workers/chat.py"), 9, "chat"), inside]) == \
        "workers/chat.py:9 chat > torch/nn/module.py:1 forward"


ASYNCIO = [frame("/x/threading.py", 1, "run"), frame(f"{STDLIB}/asyncio/base_events.py", 2, "run_forever"),
           frame(f"{STDLIB}/asyncio/base_events.py", 3, "_run_once")]
CALLBACK = [frame(str(ROOT / "gateway/http.py"), 9, "send")]


def test_a_sample_in_the_loops_own_frames_is_the_loop_waiting():
    # asyncio: the first timer's stack is the loop's frames, Handle._run, the timer; a sample in
    # the selector's wait after the loop's frames is waiting, one in a callback is code
    loop = loop_frames(ASYNCIO + [frame(f"{STDLIB}/asyncio/events.py", 4, "_run")])
    assert loop == [(f.filename, f.name) for f in ASYNCIO]
    assert waiting(ASYNCIO + [frame(f"{STDLIB}/selectors.py", 468, "select")], loop)
    assert waiting(ASYNCIO, loop)  # between two callbacks, in the loop's own turn
    assert not waiting(ASYNCIO + [frame(f"{STDLIB}/asyncio/events.py", 4, "_run")] + CALLBACK, loop)
    # uvloop runs callbacks from C: its frames are those that called it, and any more are a callback's
    uvloop = loop_frames(ASYNCIO[:1] + [frame(str(ROOT / "tests/helpers.py"), 137, "run")])
    assert waiting(ASYNCIO[:1] + [frame(str(ROOT / "tests/helpers.py"), 137, "run")], uvloop)
    assert not waiting(ASYNCIO[:1] + [frame(str(ROOT / "tests/helpers.py"), 137, "run")] + CALLBACK, uvloop)
    assert not waiting(CALLBACK, uvloop)  # another stack altogether


def test_each_cause_is_reported_as_such():
    from prometheus_client import CollectorRegistry

    from arbiter.events import EventLog
    from gateway.loop_watch import LoopWatch

    events = EventLog()
    watch = LoopWatch(0.1, events, CollectorRegistry())
    watch._loop_frames = [(f.filename, f.name) for f in ASYNCIO]
    select = frame(f"{STDLIB}/selectors.py", 468, "select")
    code = ASYNCIO + [frame(f"{STDLIB}/asyncio/events.py", 4, "_run")] + CALLBACK
    for stack, gc_s in ((ASYNCIO + [select], 0.0), (None, 0.0), (code, 0.1), (code, 0.125), (None, 0.2)):
        watch._report(0.25, traceback.StackSummary.from_list(stack) if stack else None, gc_s)
    assert [(e.data["cause"], e.data["where"], e.data["stack"][-1:]) for e in events.recent] == [
        ("waiting", None, []), ("not_sampled", None, []), ("code", "gateway/http.py:9 send", ["gateway/http.py:9 send"]),
        ("gc", None, []), ("gc", None, [])]  # full collections for half the lag or more: theirs
    assert watch.stalls == 5


def test_a_runs_stalls_kept_as_lines_and_summed_up(tmp_path):
    # tests/loop_stalls.py's handler (pytest --loop-stalls FILE) and scripts/loop_stalls.py's summary
    import json
    import subprocess
    import sys

    from prometheus_client import CollectorRegistry

    from arbiter.events import EventLog
    from gateway.loop_watch import LoopWatch
    from tests.loop_stalls import _Lines

    watch = LoopWatch(0.1, EventLog(), CollectorRegistry())
    watch._loop_frames = [(f.filename, f.name) for f in ASYNCIO]
    handler = _Lines(str(tmp_path / "stalls.jsonl"))
    logging.getLogger("tiergate.loop").addHandler(handler)
    try:
        for lag, stack in ((0.25, ASYNCIO + CALLBACK), (0.5, ASYNCIO + CALLBACK), (0.3, None)):
            watch._report(lag, traceback.StackSummary.from_list(stack) if stack else None)
    finally:
        logging.getLogger("tiergate.loop").removeHandler(handler)
    lines = [json.loads(line) for line in (tmp_path / "stalls.jsonl").read_text().splitlines()]
    assert [(s["cause"], s["lag_s"], s["where"]) for s in lines] == [
        ("code", 0.25, "gateway/http.py:9 send"), ("code", 0.5, "gateway/http.py:9 send"), ("not_sampled", 0.3, None)]
    assert all("test_a_runs_stalls_kept_as_lines_and_summed_up" in s["test"] for s in lines)
    summary = subprocess.run([sys.executable, str(ROOT / "scripts/loop_stalls.py"), str(tmp_path / "stalls.jsonl")],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert summary[1].split()[:5] == ["2", "0.75", "0.50", "code", "gateway/http.py:9"]  # the longest total first
    assert summary[2].split()[:4] == ["1", "0.30", "0.30", "not_sampled"]
    assert summary[-1] == "3 stalls in 2 places"


def test_full_collections_are_timed_and_young_ones_are_not():
    import gc

    from prometheus_client import CollectorRegistry

    from arbiter.events import EventLog
    from gateway.loop_watch import LoopWatch

    watch = LoopWatch(0.1, EventLog(), CollectorRegistry())
    gc.callbacks.append(watch._collected)
    try:
        gc.collect(0)
        gc.collect(1)
        assert watch._gc_s == 0.0
        gc.collect(2)
        assert watch._gc_s > 0.0
    finally:
        gc.callbacks.remove(watch._collected)


# -- a real server -----------------------------------------------------------------------------------


def _sleep_on_the_loop() -> None:
    time.sleep(0.5)


def _spin_on_the_loop() -> None:  # Python that never waits: the watchdog samples it between bytecodes
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_embed):
    folder = tmp_path_factory.mktemp("loop-watch")
    srv = start_server(write_config(folder, {"tiny-embed": ("embed", tiny_embed)}))
    yield srv
    srv.stop()


def stalls(srv) -> list[dict]:
    return srv.call(lambda: [e.public() for e in srv.services.arbiter.events.recent if e.kind == "loop_stall"])


def metric(srv, name: str, text: str | None = None) -> float:
    text = text or httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} is not in /metrics"
    return float(found.group(1))


@pytest.mark.parametrize("hold", [_sleep_on_the_loop, _spin_on_the_loop])
def test_a_held_loop_is_reported_with_the_function_that_held_it(server, hold, caplog):
    before = {e["id"] for e in stalls(server)}
    count = metric(server, "tiergate_event_loop_stalls_total")
    with caplog.at_level(logging.WARNING, logger="tiergate.loop"):
        server.loop.call_soon_threadsafe(hold)
        deadline = time.monotonic() + 10
        while not [e for e in stalls(server) if e["id"] not in before and hold.__name__ in (e["where"] or "")]:
            assert time.monotonic() < deadline, f"no stall naming {hold.__name__}: {stalls(server)}"
            time.sleep(0.05)
    (stall,) = [e for e in stalls(server) if e["id"] not in before and hold.__name__ in (e["where"] or "")]
    here = Path(__file__).relative_to(ROOT)
    assert stall["where"].startswith(f"{here}:") and stall["where"].endswith(hold.__name__), stall
    assert stall["cause"] == "code" and stall["stack"][-1] == stall["where"]  # innermost: this module's
    assert 0.5 - 0.1 <= stall["lag_s"] < 5  # at least the hold less one period (0.05 s), and a margin
    assert metric(server, "tiergate_event_loop_stalls_total") >= count + 1
    # the lag histogram saw a timer that late, and many on time
    text = httpx.get(f"{server.url}/metrics", timeout=10).text  # one scrape: the timer runs on
    late = metric(server, "tiergate_event_loop_lag_seconds_count", text) - \
        metric(server, 'tiergate_event_loop_lag_seconds_bucket{le="0.25"}', text)
    assert late >= 1
    assert any(hold.__name__ in r.getMessage() and "ran 0." in r.getMessage() for r in caplog.records)


def test_full_collections_on_the_loop_are_reported_as_theirs(server):
    import gc
    import math

    keep = [[] for _ in range(1_000_000)]  # objects the collector walks: ~0.1 s a collection here
    start = time.perf_counter()
    gc.collect()
    rounds = math.ceil(0.5 / (time.perf_counter() - start))

    def _collect_on_the_loop() -> None:
        for _ in range(rounds):
            gc.collect()

    before = {e["id"] for e in stalls(server)}
    server.loop.call_soon_threadsafe(_collect_on_the_loop)
    deadline = time.monotonic() + 20
    while not (new := [e for e in stalls(server) if e["id"] not in before and e["lag_s"] >= 0.3]):
        assert time.monotonic() < deadline, "the collections were not reported as a stall"
        time.sleep(0.05)
    assert [(e["cause"], e["gc_s"] >= e["lag_s"] / 2) for e in new] == [("gc", True)], new
    del keep


def test_a_stall_another_thread_causes_is_not_blamed_on_the_loops_code(server):
    # another thread holds the interpreter lock in one C call for ~0.5 s: the loop cannot run, nor
    # can the watchdog until it returns; then the loop is found waiting, or was not sampled
    start = time.perf_counter()
    sum(range(10**6))
    n = int(10**6 * 0.5 / (time.perf_counter() - start))
    before = {e["id"] for e in stalls(server)}
    holder = threading.Thread(target=lambda: sum(range(n)))
    holder.start()
    holder.join()
    deadline = time.monotonic() + 10
    while not (new := [e for e in stalls(server) if e["id"] not in before and e["lag_s"] >= 0.2]):
        assert time.monotonic() < deadline, "the held lock was not reported as a stall"
        time.sleep(0.05)
    assert all(e["cause"] in ("waiting", "not_sampled") and e["where"] is None and e["stack"] == [] for e in new), new


def test_the_watch_can_be_turned_off(tmp_path, tiny_embed):
    srv = start_server(write_config(tmp_path, {"tiny-embed": ("embed", tiny_embed)}, "server:\n  loop_stall_s: 0\n"))
    try:
        srv.loop.call_soon_threadsafe(_sleep_on_the_loop)
        time.sleep(0.8)
        assert stalls(srv) == []
        assert "tiergate_event_loop" not in httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.stop()


# -- what the watch found: imports that held the loop, made on threads now ---------------------------

IMPORTS_OFF_THE_LOOP = r"""
import asyncio, importlib.abc, sys, threading
from pathlib import Path

on_loop, watching = [], threading.Event()


class Imports(importlib.abc.MetaPathFinder):  # records the imports made on the loop's thread once it runs
    def find_spec(self, name, path, target=None):
        if watching.is_set() and threading.get_ident() == loop_thread and name.split(".")[0] in ("vllm", "xgrammar"):
            on_loop.append(name)
        return None


sys.meta_path.insert(0, Imports())
loop_thread = threading.get_ident()  # asyncio.run's loop runs on this thread

from gateway.app import build_services, create_app
from gateway.auth import KeyRing
from gateway.config import load_config
from workers.base import ModelSpec
from workers.chat_vllm import VllmChatEngine

app = create_app(build_services(load_config(sys.argv[1]), KeyRing({}, [])))


async def main():
    watching.set()
    async with app.router.lifespan_context(app):  # the server's start, with a chat model configured
        assert "xgrammar" in sys.modules, "the server started without xgrammar"
    engine = VllmChatEngine(ModelSpec("gone", "chat", Path(sys.argv[2]), engine="vllm"))
    try:
        await engine.start()  # fails at the model's folder, after vLLM's import
    except Exception:
        pass

asyncio.run(main())
assert not on_loop, f"imported on the event loop: {on_loop[:20]}"
assert "vllm.v1.engine.async_llm" in sys.modules, "vLLM was not imported at all"
print("off the loop")
"""


def test_the_imports_that_held_the_loop_are_made_on_threads(tmp_path, tiny_chat):
    # at the server's start, xgrammar (a first structured request imported it on the loop); as a
    # vLLM engine starts, vLLM (2-5 s on the loop here)
    import subprocess
    import sys

    config = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    done = subprocess.run([sys.executable, "-c", IMPORTS_OFF_THE_LOOP, str(config), str(tmp_path / "no-model")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "off the loop" in done.stdout, done.stderr[-3000:]
