"""arbiter/residency.py's ``_leased``: a lease change is ``policy.served`` plus one more (or
fewer) lease of its kind, every other field of the model's state kept."""

import dataclasses

import pytest

from arbiter import policy
from arbiter.policy import ModelState
from arbiter.residency import _leased

STATE = ModelState(name="m", kind="chat", footprint=123, place="resident", served_at={0: 1.0, 2: 3.0},
                   running_nonbatch=4, running_batch=5, pinned=True, host_bytes=77)


def test_every_field_of_the_sample_state_differs_from_its_default():
    # so that the next test would notice a field that _leased dropped back to its default
    for f in dataclasses.fields(ModelState):
        if f.default is not dataclasses.MISSING:
            assert getattr(STATE, f.name) != f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(STATE, f.name) != f.default_factory(), f.name


@pytest.mark.parametrize("is_batch, delta", [(False, 1), (False, -1), (True, 1), (True, -1)])
def test_a_lease_change_is_served_plus_one_lease_more_or_less(is_batch, delta):
    kind = "running_batch" if is_batch else "running_nonbatch"
    expected = dataclasses.replace(policy.served(STATE, 1, 9.0), **{kind: getattr(STATE, kind) + delta})
    assert _leased(STATE, 1, 9.0, is_batch, delta) == expected
    assert STATE.served_at == {0: 1.0, 2: 3.0}  # the old state is untouched
