"""semantic_vad's wait (``gateway.turn_end.turn_wait_ms``): a pure function of the judged
probability and the eagerness, over a table."""

from __future__ import annotations

import math

import pytest

from gateway.turn_end import EAGERNESS_MAX_MS, MIN_WAIT_MS, turn_wait_ms


@pytest.mark.parametrize("p, eagerness, wait", [
    (None, "low", 8000), (None, "medium", 4000), (None, "auto", 4000), (None, "high", 2000),  # not judged: the longest
    (math.nan, "high", 2000),
    (0.0, "low", 8000), (0.0, "high", 2000),
    (1.0, "low", MIN_WAIT_MS), (1.0, "medium", MIN_WAIT_MS), (1.0, "high", MIN_WAIT_MS),  # sure: the shortest
    (0.5, "low", 4250), (0.5, "medium", 2250), (0.5, "auto", 2250), (0.5, "high", 1250),
    (0.9, "medium", 850),
    (1.5, "low", MIN_WAIT_MS), (-0.2, "high", 2000),  # out of range: clipped
])
def test_turn_wait(p, eagerness, wait):
    assert turn_wait_ms(p, eagerness) == wait


def test_a_surer_judgement_never_waits_longer():
    for eagerness in EAGERNESS_MAX_MS:
        waits = [turn_wait_ms(i / 100, eagerness) for i in range(101)]
        assert waits == sorted(waits, reverse=True) and waits[0] == EAGERNESS_MAX_MS[eagerness]
