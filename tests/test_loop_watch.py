"""The event loop's watch (gateway/loop_watch.py): where a stack was, and a real server's loop
held by a function of this module, reported as a stall that names it (event, metric, log)."""

from __future__ import annotations

import logging
import re
import time
import traceback
from pathlib import Path

import httpx
import pytest

from gateway.loop_watch import ROOT, frame_label, where
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
    assert stall["stack"][-1] == stall["where"]  # the innermost frame is this module's (time.sleep is C)
    assert 0.5 - 0.1 <= stall["lag_s"] < 5  # at least the hold less one period (0.05 s), and a margin
    assert metric(server, "tiergate_event_loop_stalls_total") >= count + 1
    # the lag histogram saw a timer that late, and many on time
    text = httpx.get(f"{server.url}/metrics", timeout=10).text  # one scrape: the timer runs on
    late = metric(server, "tiergate_event_loop_lag_seconds_count", text) - \
        metric(server, 'tiergate_event_loop_lag_seconds_bucket{le="0.25"}', text)
    assert late >= 1
    assert any(hold.__name__ in r.getMessage() and "ran 0." in r.getMessage() for r in caplog.records)


def test_the_watch_can_be_turned_off(tmp_path, tiny_embed):
    srv = start_server(write_config(tmp_path, {"tiny-embed": ("embed", tiny_embed)}, "server:\n  loop_stall_s: 0\n"))
    try:
        srv.loop.call_soon_threadsafe(_sleep_on_the_loop)
        time.sleep(0.8)
        assert stalls(srv) == []
        assert "tiergate_event_loop" not in httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.stop()
