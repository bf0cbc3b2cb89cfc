"""The serving core's one hold path (gateway/serving.py) against a real server:

* out of memory inside a real image, speech and transcription step, and inside a real load, makes
  the arbiter evict the least valuable other model; the eviction has finished before the retry
  starts (the order of events is recorded), and the retry succeeds;
* the admission cost model learns only completed, unpaused service time: a batch request paused
  for a long time, and a stream cut by a disconnect, leave its prediction unchanged; the cut
  stream's usage is still written;
* the usage write is shielded from a cancel scope's cancellation exactly where one encloses it.

Out of memory is raised by torch forward pre-hooks on the worker's own modules (or by its own
``Module.to`` during a load), so the worker's real code runs up to that point."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from tests.helpers import RunningServer, start_server, write_config

T = TypeVar("T")
EXTRA = "eviction:\n  protect_window_s: 0\nlimits:\n  max_chat_tokens: 64\n  image_max_steps: 400\n"


@pytest.fixture(scope="module")
def server(tiny_chat: Path, tiny_image: Path, tiny_tts: Path, tiny_stt: Path, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("serving-core")
    models = {"low": ("chat", tiny_chat), "mid": ("chat", tiny_chat), "tiny-image": ("image", tiny_image),
              "tiny-tts": ("tts", tiny_tts), "tiny-stt": ("stt", tiny_stt)}
    cfg = write_config(folder, models, EXTRA)
    # no host cache: an evicted model goes cold, so loading it again is a real load from disk
    cfg.write_text(cfg.read_text().replace("vram_budget: 4GiB", "vram_budget: 64GiB\n  host_cache_budget: 0"))
    srv = start_server(cfg)
    yield srv
    srv.stop()


def sdk(server: RunningServer, tier: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def hello(server: RunningServer, model: str, tier: str) -> None:
    sdk(server, tier).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def places(server: RunningServer) -> dict[str, str]:
    return {name: s.place for name, s in server.services.arbiter.states.items()}


def settle(server: RunningServer) -> None:
    """Wait until nothing is admitted or moving."""
    deadline = time.time() + 30
    while server.services.gate.total_inflight or server.services.arbiter._loading:
        assert time.time() < deadline, "the server did not settle"
        time.sleep(0.02)


class Recorder:
    """The order of events: each out-of-memory raised, each eviction finished (the arbiter's own
    ``_evict``, wrapped to note its end), each step or load that ran after."""

    def __init__(self, server: RunningServer) -> None:
        self.events: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.fired = False
        arbiter = server.services.arbiter
        real = arbiter._evict

        async def evict(decision, *args):
            await real(decision, *args)
            self.note("evicted", decision.victims)

        self.undo = lambda: setattr(arbiter, "_evict", real)
        arbiter._evict = evict

    def note(self, what: str, detail: object = None) -> None:
        with self.lock:
            self.events.append((what, detail))

    def first(self, what: str, after: int = 0) -> int:
        return next(i for i, (w, _) in enumerate(self.events) if w == what and i >= after)

    def oom_once(self, module: torch.nn.Module, where: str) -> None:
        """Called as ``module`` runs: the first call raises torch.OutOfMemoryError (as the allocator
        would), every later one is noted as a step."""
        with self.lock:
            if not self.fired:
                self.fired = True
                self.events.append(("oom", type(module).__name__))
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected in {where})")
            if self.events[-1][0] != "step":
                self.events.append(("step", type(module).__name__))


def prepare(server: RunningServer, target: str, warm_up) -> Recorder:
    """``target`` resident (by one normal paid request), then "mid" served to the subscriber tier
    and "low" to the free tier: "low" is the least valuable model the paid tier may evict."""
    settle(server)
    warm_up()
    hello(server, "mid", "subscriber")
    hello(server, "low", "free")
    settle(server)
    assert places(server)[target] == "resident" and places(server)["low"] == places(server)["mid"] == "resident"
    return Recorder(server)


def through_an_oom(server: RunningServer, model: str, call: Callable[[RunningServer], T]) -> tuple[T, Recorder]:
    """``call`` once with ``model`` resident beside "mid" and "low" (``prepare``) and the first
    forward of any of its modules raising out of memory: what it returned, and the order of events."""
    rec = prepare(server, model, lambda: call(server))

    def hook(module, args):
        rec.oom_once(module, "a forward")

    modules = server.services.arbiter.workers[model].modules()
    hooks = [sub.register_forward_pre_hook(hook) for m in modules for sub in m.modules()]
    try:
        return call(server), rec
    finally:
        for h in hooks:
            h.remove()
        rec.undo()


def assert_relieved_then_retried(server: RunningServer, rec: Recorder) -> None:
    oom = rec.first("oom")
    evicted = rec.first("evicted", oom)
    retried = rec.first("step", oom)
    assert rec.events[evicted][1] == ("low",), rec.events
    assert evicted < retried, f"the retry started before the eviction finished: {rec.events}"
    assert places(server)["low"] in ("warm", "cold") and places(server)["mid"] == "resident"
    assert server.services.arbiter.counters.evictions.get(("low", "oom"), 0) >= 1


def image(server: RunningServer) -> bytes:
    r = sdk(server).images.generate(model="tiny-image", prompt="a red square", size="64x64",
                                    extra_body={"num_inference_steps": 2, "seed": 1})
    return base64.b64decode(r.data[0].b64_json)


def test_oom_in_an_image_step_evicts_the_least_valuable_then_retries(server):
    png, rec = through_an_oom(server, "tiny-image", image)
    assert png.startswith(b"\x89PNG")
    assert_relieved_then_retried(server, rec)


def speak(server: RunningServer) -> bytes:
    r = httpx.post(f"{server.base_url}/audio/speech", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   json={"model": "tiny-tts", "input": "Hello there. How are you?", "voice": "alloy",
                         "response_format": "wav"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def test_oom_in_a_speech_step_evicts_the_least_valuable_then_retries(server):
    audio, rec = through_an_oom(server, "tiny-tts", speak)
    samples, _ = sf.read(io.BytesIO(audio))
    assert len(samples) > 0
    assert_relieved_then_retried(server, rec)


def transcribe(server: RunningServer) -> dict:
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    r = httpx.post(f"{server.base_url}/audio/transcriptions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   data={"model": "tiny-stt"}, files={"file": ("tone.wav", buf.getvalue(), "audio/wav")}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_oom_in_a_transcription_step_evicts_the_least_valuable_then_retries(server):
    out, rec = through_an_oom(server, "tiny-stt", transcribe)
    assert isinstance(out["text"], str) and out["usage"]["seconds"] == 1
    assert_relieved_then_retried(server, rec)


def streamed_image(server: RunningServer) -> list[str]:
    events = list(sdk(server).images.generate(model="tiny-image", prompt="a red square", size="64x64", stream=True,
                                              partial_images=1, extra_body={"num_inference_steps": 4, "seed": 1}))
    return [e.type for e in events]


def streamed_transcript(server: RunningServer) -> list[str]:
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    events = sdk(server).audio.transcriptions.create(model="tiny-stt", file=("tone.wav", buf.getvalue(), "audio/wav"),
                                                      stream=True)
    return [e.type for e in events]


@pytest.mark.parametrize("model, call, last", [("tiny-image", streamed_image, "image_generation.completed"),
                                               ("tiny-stt", streamed_transcript, "transcript.text.done")])
def test_oom_before_a_streamed_answer_sends_anything_is_relieved_then_retried(server, model, call, last):
    """Streamed, out of memory at the first forward (nothing sent yet): the least valuable model
    is evicted and the work run once more, as unstreamed; the stream is whole."""
    kinds, rec = through_an_oom(server, model, call)
    assert kinds[-1] == last and len(kinds) >= 2
    assert_relieved_then_retried(server, rec)


def test_oom_in_a_load_evicts_the_least_valuable_then_loads_again(server, monkeypatch):
    rec = prepare(server, "tiny-image", lambda: image(server))
    unloaded = httpx.post(f"{server.url}/admin/models/tiny-image/unload",
                          headers={"Authorization": f"Bearer {server.keys['admin']}"})
    assert unloaded.status_code == 200 and places(server)["tiny-image"] == "cold"
    real_to = torch.nn.Module.to

    def to(module, *args, **kwargs):  # the pipeline's own move onto the device, during its load
        if type(module).__module__.startswith("diffusers"):
            rec.oom_once(module, "a load")
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    try:
        png = image(server)
    finally:
        monkeypatch.undo()
        rec.undo()
    assert png.startswith(b"\x89PNG") and rec.fired
    assert_relieved_then_retried(server, rec)
    assert server.services.arbiter.counters.evictions.get(("low", "make_room"), 0) >= 1


# -- what the cost model learns --------------------------------------------------------------------


def predict(server: RunningServer, model: str, units: float) -> float:
    return server.call(server.services.gate.costs.predict, model, units)


def test_a_long_paused_batch_request_leaves_the_prediction_unchanged(server):
    settle(server)
    units = float(64 * 64 * 3)
    for seed in (1, 2):  # completed paid requests: these are what the cost model learns from
        sdk(server).images.generate(model="tiny-image", prompt="warm", size="64x64",
                                    extra_body={"num_inference_steps": 3, "seed": seed})
    learned = predict(server, "tiny-image", units)
    assert learned != predict(server, "nonexistent-model", units)  # it did learn from them
    svc, pauses = server.services, server.services.arbiter.counters.batch_pauses
    line = {"custom_id": "slow", "method": "POST", "url": "/v1/images/generations",
            "body": {"model": "tiny-image", "prompt": "slow", "size": "64x64", "num_inference_steps": 300}}
    c = sdk(server, "free")
    f = c.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/images/generations", completion_window="24h")
    deadline = time.time() + 30
    while svc.arbiter.states["tiny-image"].running_batch == 0:
        assert time.time() < deadline, "the batch line never started"
        time.sleep(0.01)

    async def paid_in_flight(seconds: float) -> None:  # a paid request holds a slot: batch work pauses
        ticket = await svc.gate.acquire("paid", "mid", 1.0)
        await asyncio.sleep(seconds)
        svc.gate.release(ticket)

    asyncio.run_coroutine_threadsafe(paid_in_flight(2.0), server.loop).result(10)
    while (b := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.time() < deadline + 60, b
        time.sleep(0.05)
    assert b.status == "completed" and b.request_counts.completed == 1
    assert svc.arbiter.counters.batch_pauses > pauses
    assert predict(server, "tiny-image", units) == learned


def metered(server: RunningServer, model: str) -> int:
    """The paid key's requests on ``model`` in its usage (GET /v1/usage)."""
    r = httpx.get(f"{server.base_url}/usage", params={"group_by": "model"},
                  headers={"Authorization": f"Bearer {server.keys['paid']}"})
    return sum(row["requests"] for row in r.json()["data"] if row["model"] == model)


def test_a_stream_cut_by_a_disconnect_leaves_the_prediction_unchanged(server):
    settle(server)
    body = {"model": "mid", "messages": [{"role": "user", "content": "count"}], "max_tokens": 64,
            "temperature": 0, "stream": True}
    done = sdk(server).chat.completions.create(**{**body, "stream": False})
    assert done.usage.completion_tokens > 8  # the request we cut would run long
    learned = predict(server, "mid", 64)
    before = metered(server, "mid")
    slow = [m.register_forward_pre_hook(lambda m, a: time.sleep(0.05)) for m in server.services.arbiter.workers["mid"].modules()]
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            payload = json.dumps(body).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      + f"authorization: Bearer {server.keys['paid']}\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
                      + payload)
            got = b""
            while got.count(b"data: ") < 2:  # the role chunk, then the first token
                got += s.recv(65536)
        settle(server)
    finally:
        for h in slow:
            h.remove()
    assert predict(server, "mid", 64) == learned
    deadline = time.time() + 10  # the slot is given back before the usage write ends
    while metered(server, "mid") != before + 1:
        assert time.time() < deadline, f"the cut stream was not metered: {metered(server, 'mid')} != {before + 1}"
        time.sleep(0.05)


def test_the_usage_write_is_shielded_only_inside_a_cancel_scope():
    import anyio

    from gateway.serving import in_cancel_scope

    async def main() -> list[bool]:
        seen = [in_cancel_scope()]  # a plain task: nothing re-cancels it, so no shield
        async with anyio.create_task_group() as group:  # a streamed response's task group
            async def child() -> None:
                seen.append(in_cancel_scope())
            group.start_soon(child)
            seen.append(in_cancel_scope())
        with anyio.CancelScope():
            seen.append(in_cancel_scope())
        seen.append(in_cancel_scope())  # the scopes were left
        return seen

    assert asyncio.run(main()) == [False, True, True, True, False]


def test_batch_work_waiting_at_a_pause_takes_no_thread_the_others_need():
    """Batch work (a pause gate) runs on threads apart from the model threads: with 64 batch jobs
    holding their threads (waiting at a pause, as a paused batch lane does), work of another tier
    still gets a thread at once; the paused jobs then go on."""
    from gateway.serving import in_thread
    from workers.base import StepContext

    may_run = threading.Event()

    async def main() -> tuple[str, list[str]]:
        paused = [asyncio.ensure_future(in_thread(lambda: (may_run.wait(30), threading.current_thread().name)[1],
                                                  StepContext(pause_gate=lambda c: None))) for _ in range(64)]
        await asyncio.sleep(0.1)
        try:
            name = await asyncio.wait_for(in_thread(lambda: threading.current_thread().name, StepContext()), 10)
        finally:
            may_run.set()
        return name, await asyncio.gather(*paused)

    name, batch = asyncio.run(main())
    assert name.startswith("tiergate-model") and all(n.startswith("tiergate-batch") for n in batch)


def test_a_stop_iteration_in_thread_work_is_an_error_not_a_wait_forever():
    """asyncio (3.11) cannot set a StopIteration on a future: thread work raising one (a stray
    ``next()`` in library code) left the request awaiting it waiting forever. Model threads,
    batch threads and the default executor the server's lifespan sets (``use_threads``) raise it
    as a RuntimeError."""
    from gateway.serving import in_thread, use_threads
    from workers.base import StepContext

    def stray_next() -> int:
        return next(iter(()))

    async def main() -> None:
        use_threads(asyncio.get_running_loop())
        for call in (lambda: in_thread(stray_next, StepContext()),
                     lambda: in_thread(stray_next, StepContext(pause_gate=lambda c: None)),
                     lambda: asyncio.to_thread(stray_next)):
            with pytest.raises(RuntimeError, match="StopIteration"):
                await asyncio.wait_for(call(), 10)

    asyncio.run(main())
