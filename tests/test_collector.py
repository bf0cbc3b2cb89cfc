"""The garbage collector's freezes (gateway/collector.py): nothing that is garbage is frozen, a
frozen model is still freed when its worker drops it, and ``tiergate serve``'s collector freezes
once at startup and once after each worker class's first load, following the arbiter's events.

Every test here unfreezes what it froze, so the rest of the suite's process collects as usual."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from arbiter.events import EventLog
from gateway import collector


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_freeze_collects_first_so_no_garbage_is_frozen():
    gone = cycle()  # garbage only a collection can free
    kept = Node()
    assert gone() is not None
    assert any(o is kept for o in gc.get_objects())  # tracked: walked by every full collection
    assert collector.freeze() >= 1
    assert gone() is None
    assert not any(o is kept for o in gc.get_objects())  # alive, and out of the collections' walks
    gc.collect()
    # Still frozen after a full collection. (Not checked by gc.get_freeze_count(): a frozen
    # object that loses its last reference, in any thread of the suite's process, leaves the
    # count, as it dropped by 6 in one CI run.)
    assert not any(o is kept for o in gc.get_objects())


def test_a_freeze_waits_out_a_collection_another_thread_is_running():
    """Another thread's collection is held inside a finalizer: this thread's ``gc.collect()``
    returns at once without collecting (CPython runs one at a time), so a freeze then would
    freeze this thread's garbage for good. The freeze collects again once the other collection
    has ended. (Seen once in a full CI run, 2026-12-06: the first test here found its cycle
    frozen.)"""
    inside, release = threading.Event(), threading.Event()

    class Slow:
        def __del__(self) -> None:
            inside.set()
            release.wait(10)

    def other() -> None:
        slow = Slow()
        slow.me = slow  # a cycle: only a collection frees it, and its finalizer holds that collection
        del slow
        gc.collect()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert inside.wait(10)
    gone = cycle()
    timer = threading.Timer(0.3, release.set)
    timer.start()
    collector.freeze()
    assert gone() is None
    thread.join(10)
    timer.join(10)


def test_a_frozen_model_is_freed_when_its_worker_drops_it(tiny_chat):
    """The chat worker as the arbiter drives it: loaded (its engine thread running), frozen, then
    released as an eviction to cold releases it. Its weights go by reference count, although the
    collector no longer walks them."""
    import torch

    from workers.base import ModelSpec
    from workers.registry import make_worker

    worker = make_worker(ModelSpec(name="tiny-chat", kind="chat", path=tiny_chat))
    worker.load(torch.device("cpu"))
    weights = weakref.ref(next(iter(worker.modules()[0].parameters())))
    collector.freeze()
    assert weights() is not None
    worker.unload()
    assert weights() is None


def test_frozen_cyclic_garbage_is_the_price():
    """Why the collector freezes only a bounded number of times: a cycle alive at a freeze that
    becomes garbage afterwards is not reclaimed by later collections."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    collector.freeze()
    del a, b
    gc.collect()
    assert ref() is not None
    gc.unfreeze()
    gc.collect()
    assert ref() is None


class ChatLike:
    pass


class ImageLike:
    pass


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_freezes_at_start_and_after_each_worker_class_first_load():
    async def main() -> list[int]:
        events, workers = EventLog(), {}
        c = collector.Collector(events, workers)
        before = gc.get_threshold()
        await c.start()
        assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, *before[1:])  # young collections rarer
        seen = [c.freezes]
        for model, cls in [("chat-a", ChatLike), ("chat-b", ChatLike), ("image", ImageLike), ("chat-a", ChatLike)]:
            workers[model] = cls()
            events.emit("load_finished", model=model, from_place="cold", seconds=0.1, footprint_bytes=1)
            events.emit("eviction", model=model, from_place="resident", to_place="warm", reason="make_room",
                        by_model=None, by_tier=None)
            await settle()
            seen.append(c.freezes)
        await c.stop()
        assert gc.get_threshold() == before  # put back
        return seen

    assert asyncio.run(main()) == [1, 2, 2, 3, 3]


def test_a_lagged_subscription_still_freezes_for_what_loaded_meanwhile():
    async def main() -> int:
        events, workers = EventLog(queue_size=2), {}
        c = collector.Collector(events, workers)
        await c.start()
        await settle()  # subscribed
        workers["image"] = ImageLike()
        for _ in range(5):  # more than the queue holds before the collector runs: it is dropped
            events.emit("refusal", tier="free", reason="queue_full", model=None, retry_after_s=1)
        await settle()
        await c.stop()
        return c.freezes

    assert asyncio.run(main()) == 2


def test_tiergate_serve_freezes_at_startup_and_after_the_first_chat_load(tmp_path, tiny_chat):
    """The services as ``tiergate serve`` wires them (``collector.attach``): one freeze when the
    app has started, one more when the arbiter has loaded the first chat model, none for a
    second chat model of the same worker class."""
    from starlette.testclient import TestClient

    from gateway.app import build_services, create_app
    from gateway.auth import KeyRing
    from gateway.config import load_config
    from tests.helpers import write_config

    config = load_config(write_config(tmp_path, {"a": ("chat", tiny_chat), "b": ("chat", tiny_chat)}))
    services = build_services(config, KeyRing({"paid": ["key-paid"]}))
    c = collector.attach(services)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(create_app(services)) as client:
        assert c.freezes == 1
        frozen = gc.get_freeze_count()
        for model, freezes in (("a", 2), ("b", 2)):
            r = client.post("/v1/chat/completions", json={"model": model, **body},
                            headers={"authorization": "Bearer key-paid"})
            assert r.status_code == 200, r.text
            client.portal.call(settle)
            assert c.freezes == freezes
        assert gc.get_freeze_count() > frozen  # the first load's objects joined the frozen ones
