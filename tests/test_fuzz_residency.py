"""Generated sequences of admin actions (load, unload, pin, unpin) and requests of every kind
(chat, embeddings, image, speech, transcription) at every tier, one after another on a real
server whose budget holds two of its five models, so nearly every step loads or evicts something.

After each step the arbiter's table must hold what a user and an operator rely on:
- the resident models fit the budget;
- no lease is left behind: once an answer is read, nothing runs and the gate holds no slot;
- a pinned model that is resident stays resident until it is unpinned or unloaded by hand;
- an admin load that answers 200 leaves the model resident, an unload that answers 200 leaves it
  out of the device, and a 409 unload means it was not resident;
- a paid request for a model that was resident is served;
- every answer is a success or a 429/503 in OpenAI's error shape, never a 500.

``TIERGATE_FUZZ_EXAMPLES`` and ``TIERGATE_FUZZ_RANDOM`` work as in tests/test_fuzz_api.py.
"""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import TIERS, start_server, write_config
from tests.test_fuzz_api import FUZZ, check_error, sound_file

GiB = 1024**3
KINDS = {"tiny-chat": "chat", "tiny-embed": "embed", "tiny-image": "image", "tiny-tts": "tts", "tiny-stt": "stt"}
WAV = sound_file(16000, 1, 1600, "WAV", "PCM_16", "plain")


@pytest.fixture(scope="module")
def server(tiny_chat, tiny_embed, tiny_image, tiny_tts, tiny_stt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-residency")
    paths = {"tiny-chat": tiny_chat, "tiny-embed": tiny_embed, "tiny-image": tiny_image, "tiny-tts": tiny_tts,
             "tiny-stt": tiny_stt}
    config = write_config(folder, {name: (KINDS[name], path) for name, path in paths.items()},
                          "eviction:\n  protect_window_s: 0.3\n")
    text = config.read_text().replace("    path: ", "    vram: 1GiB\n    path: ")  # two fit in the budget
    config.write_text(text.replace("vram_budget: 4GiB", "vram_budget: 2GiB"))
    running = start_server(config)
    yield running
    running.stop()


def table(server) -> dict[str, dict]:
    return {row["id"]: row for row in server.call(server.services.arbiter.table)}


def call(server, model: str, tier: str) -> httpx.Response:
    """The request a client of that kind sends."""
    url, headers = server.base_url, {"Authorization": f"Bearer {server.keys[tier]}"}
    kind = KINDS[model]
    if kind == "stt":
        return httpx.post(f"{url}/audio/transcriptions", headers=headers, timeout=120,
                          files={"file": ("a.wav", WAV, "audio/wav")}, data={"model": model})
    path, body = {
        "chat": ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        "embed": ("/embeddings", {"input": "hi"}),
        "image": ("/images/generations", {"prompt": "a cat", "size": "32x32", "num_inference_steps": 1}),
        "tts": ("/audio/speech", {"input": "hi", "voice": "alloy"}),
    }[kind]
    return httpx.post(f"{url}{path}", headers=headers, json={"model": model, **body}, timeout=120)


def admin(server, model: str, action: str) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/models/{model}/{action}", timeout=120,
                      headers={"Authorization": f"Bearer {server.keys['admin']}"})


def settled(server) -> dict[str, dict]:
    """The table once every lease of the answered request is back (a response's last bytes may
    leave just before its lease is released)."""
    deadline = time.monotonic() + 5
    while True:
        rows = table(server)
        inflight = server.call(lambda: dict(server.services.gate.inflight))
        if all(r["running"] == 0 for r in rows.values()) and not any(inflight.values()):
            return rows
        if time.monotonic() > deadline:
            pytest.fail(f"a lease was left behind: running {[(m, r['running']) for m, r in rows.items()]}, "
                        f"gate in flight {inflight}")
        time.sleep(0.01)


STEP = st.one_of(
    st.tuples(st.sampled_from(["load", "unload", "pin", "unpin"]), st.sampled_from(sorted(KINDS))),
    st.tuples(st.just("call"), st.sampled_from(sorted(KINDS)), st.sampled_from(TIERS)),
    st.tuples(st.just("wait"), st.sampled_from([0.1, 0.35])),  # past the protection window, or not
)


@FUZZ
@given(steps=st.lists(STEP, min_size=1, max_size=8))
def _sequence(server, steps):
    for step in steps:
        before = settled(server)
        if step[0] == "wait":
            time.sleep(step[1])
            continue
        if step[0] == "call":
            _, model, tier = step
            r = call(server, model, tier)
        else:
            action, model = step
            r = admin(server, model, action)
        assert r.status_code in (200, 409, 429, 503), (step, r.status_code, r.text[:300])
        if r.status_code != 200:
            check_error(r.status_code, r.content, step)
        after = settled(server)
        resident = [m for m, row in after.items() if row["place"] == "resident"]
        assert sum(after[m]["footprint_bytes"] for m in resident) <= 2 * GiB, (step, resident)
        for m, row in before.items():  # pinned and resident stays so, unless this step undid it
            if row["pinned"] and row["place"] == "resident" and step[:2] not in (("unpin", m), ("unload", m)):
                assert after[m]["place"] == "resident", (step, m, after[m])
        if step[0] == "call":
            assert r.status_code != 409, (step, r.text)
            if tier == "paid" and before[model]["place"] == "resident":
                assert r.status_code == 200, (step, r.text)  # nothing outranks paid on its own model
            if r.status_code == 200:
                assert after[model]["last_tier"] is not None
        elif action == "load" and r.status_code == 200:
            assert after[model]["place"] == "resident", (step, after[model])
        elif action == "unload":
            assert r.status_code in (200, 409), (step, r.text)
            if r.status_code == 200:
                assert after[model]["place"] != "resident", (step, after[model])
            else:
                assert before[model]["place"] != "resident", (step, before[model])
        elif action in ("pin", "unpin"):
            assert r.status_code == 200 and after[model]["pinned"] == (action == "pin"), (step, r.text)


def test_generated_sequences_keep_the_residency_table_true(server):
    _sequence(server)
    # and at the end: unpinned, every model serves a paid request in turn
    for model in KINDS:
        admin(server, model, "unpin")
    for model in KINDS:
        time.sleep(0.35)  # past the protection the last paid request gave its model (paid protects against paid)
        r = call(server, model, "paid")
        assert r.status_code == 200, (model, r.text)
