"""``--loop-stalls FILE``: every event-loop stall the suite's servers report
(``gateway.loop_watch``), one JSON line each: the ``loop_stall`` event and the test that was
running. ``scripts/loop_stalls.py FILE`` sums them up by cause and place. The suite's own load
makes stalls of its own (``waiting``, ``not_sampled``); what a line names in tiergate's code is
what to read. Loaded by ``tests/conftest.py``; with pytest-xdist every process appends to FILE."""

from __future__ import annotations

import json
import logging
import os

import pytest


class _Lines(logging.Handler):
    def __init__(self, path: str) -> None:
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        stall = getattr(record, "loop_stall", None)
        if stall is None:
            return
        line = json.dumps({**stall, "test": os.environ.get("PYTEST_CURRENT_TEST")}) + "\n"
        with open(self.path, "a", encoding="utf-8") as out:  # one short append per line: whole across processes
            out.write(line)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--loop-stalls", metavar="FILE", default=None,
                     help="append every event-loop stall the servers report to FILE, one JSON line each")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--loop-stalls")
    if path:
        logging.getLogger("tiergate.loop").addHandler(_Lines(os.path.abspath(path)))
