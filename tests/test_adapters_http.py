"""LoRA adapters chosen per request, over HTTP with the openai SDK against a real server: selection by
model name and by a weighted ``adapters`` stack, exact restore of the base model, no mixing of stacks
inside one chat batch, the image worker's stack gate, /v1/models, and start-up config errors."""

from __future__ import annotations

import base64
import io
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from gateway.app import build_services
from gateway.auth import KeyRing
from gateway.cli import main
from gateway.config import ConfigError, load_config
from tests.helpers import start_server, write_config
from workers.base import StepContext
from workers.image import StackGate

PIRATE, POET, SKETCH = "tiny-chat-pirate", "tiny-chat-poet", "tiny-image-sketch"
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def demo_adapters(demo_dir: Path, tiny_chat: Path, tiny_image: Path) -> dict[str, Path]:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=[PIRATE, POET, SKETCH])


def adapters_yaml(adapters: dict[str, tuple[str, Path]]) -> str:
    return "adapters:\n" + "".join(f"  - {{name: {n}, model: {m}, path: {p}}}\n" for n, (m, p) in adapters.items())


@pytest.fixture(scope="module")
def server(demo_adapters, tiny_chat, tiny_image, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter-server")
    models = {"tiny-chat": ("chat", tiny_chat), "other-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image)}
    extra = "limits:\n  max_chat_tokens: 64\n" + adapters_yaml(
        {PIRATE: ("tiny-chat", demo_adapters[PIRATE]), POET: ("tiny-chat", demo_adapters[POET]),
         SKETCH: ("tiny-image", demo_adapters[SKETCH])})
    running = start_server(write_config(folder, models, extra))
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=60)


def chat(server, model="tiny-chat", adapters=None, tier="paid", content="Hello there", **kw) -> str:
    extra = {"adapters": adapters} if adapters is not None else None
    kw = {"max_tokens": 12, "temperature": 0, **kw}
    r = client(server, tier).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], extra_body=extra, **kw)
    return r.choices[0].message.content


def image(server, model="tiny-image", adapters=None, prompt="a cat") -> bytes:
    extra = {"num_inference_steps": 2, "seed": 3, **({"adapters": adapters} if adapters is not None else {})}
    r = client(server).images.generate(model=model, prompt=prompt, size="32x32", extra_body=extra)
    return base64.b64decode(r.data[0].b64_json)


def chat_worker(server):
    return server.services.arbiter.workers["tiny-chat"]


# -- chat --------------------------------------------------------------------------------------------


def test_adapters_change_the_reply_and_the_base_model_comes_back_exactly(server):
    base = chat(server)
    pirate, poet = chat(server, PIRATE), chat(server, POET)
    assert len({base, pirate, poet}) == 3
    assert chat(server) == base  # restored bit for bit: the same greedy tokens
    # the two ways to select one adapter are the same request
    assert chat(server, "tiny-chat", [{"name": PIRATE}]) == pirate
    assert chat(server, "tiny-chat", [{"name": POET, "weight": 1.0}]) == poet
    assert chat_worker(server).stack_key == ((POET, 1.0),)  # a stack stays merged until another is wanted


def test_same_adapter_and_seed_give_the_same_sample(server):
    a = chat(server, PIRATE, temperature=1.0, seed=5)
    b = chat(server, PIRATE, temperature=1.0, seed=5)
    other = chat(server, PIRATE, temperature=1.0, seed=6)
    assert a == b
    assert a != other


def test_weighted_stack_differs_from_each_adapter(server):
    pirate, poet, base = chat(server, PIRATE), chat(server, POET), chat(server)
    mixed = chat(server, adapters=[{"name": PIRATE, "weight": 0.5}, {"name": POET, "weight": 0.5}])
    assert mixed not in (pirate, poet, base)
    # the model's own adapter comes first, the listed ones are stacked on it
    assert chat(server, PIRATE, [{"name": POET, "weight": 0.5}]) == chat(
        server, adapters=[{"name": PIRATE}, {"name": POET, "weight": 0.5}])
    # weight 0 adds an exact zero: the base model's reply
    assert chat(server, adapters=[{"name": PIRATE, "weight": 0.0}]) == base
    assert chat(server, adapters=[{"name": PIRATE, "weight": -1.0}]) not in (pirate, base)


def test_concurrent_requests_with_two_stacks_never_share_a_batch(server):
    """Eight requests (four per stack, two tiers, distinct prompts) sent at once each return exactly
    what they return alone, so no row ran on the other stack's weights; and the stacks were merged
    fewer times than there were requests (queued rows with the same stack share one merge)."""
    jobs = [(PIRATE if i % 2 else POET, ("paid", "subscriber")[i % 4 // 2], f"Count to {i}") for i in range(8)]
    alone = {job: chat(server, job[0], tier=job[1], content=job[2], max_tokens=16) for job in jobs}
    chat(server)  # back to the base model, so the wave needs merges
    worker = chat_worker(server)
    merges, steps = worker.stack_merges, worker.steps
    start = threading.Barrier(len(jobs))

    def run(job):
        start.wait()
        return job, chat(server, job[0], tier=job[1], content=job[2], max_tokens=16)

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = dict(pool.map(run, jobs))
    assert together == alone
    assert len(set(alone.values())) > 2  # the prompts and stacks give different replies
    merged = worker.stack_merges - merges
    assert 2 <= merged < len(jobs), merged
    assert worker.steps - steps < 15 * len(jobs)  # rows shared decode steps


def test_unknown_adapter_is_404(server):
    with pytest.raises(openai.NotFoundError) as exc:
        chat(server, adapters=[{"name": "tiny-chat-nobody"}])
    assert exc.value.body["param"] == "adapters" and exc.value.body["code"] == "adapter_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        chat(server, "tiny-chat-nobody")
    assert exc.value.body["param"] == "model"


def test_adapter_of_another_base_model_is_400(server):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server, "other-chat", [{"name": PIRATE}])
    assert exc.value.body["param"] == "adapters" and exc.value.body["code"] == "adapter_model_mismatch"
    with pytest.raises(openai.BadRequestError) as exc:
        chat(server, SKETCH)
    assert exc.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as exc:
        image(server, PIRATE)
    assert exc.value.body["param"] == "model"


@pytest.mark.parametrize("weight", [float("inf"), float("nan")])
def test_non_finite_weights_are_400(server, weight):
    """JSON has no Infinity or NaN: a body that writes them (as Python's json does) is not JSON."""
    body = {"model": "tiny-chat", "messages": HELLO, "max_tokens": 2, "adapters": [{"name": PIRATE, "weight": weight}]}
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   content=json.dumps(body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("weight", [1e300, 100.5, -101])
def test_weights_beyond_100_are_400(server, weight):
    """A stack's weight is at most 100 either way: far past any blend in use, and small enough that
    no adapter's factors fold to inf (1e300 did, and on vLLM then changed other keys' replies)."""
    body = {"model": "tiny-chat", "messages": HELLO, "max_tokens": 2, "adapters": [{"name": PIRATE, "weight": weight}]}
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "adapters[0].weight" and "100" in r.json()["error"]["message"]
    assert chat(server, "tiny-chat", adapters=[{"name": PIRATE, "weight": -100}]) is not None  # the bound itself serves


@pytest.mark.parametrize("adapters,param", [
    ([{"name": PIRATE, "weight": "heavy"}], "adapters[0].weight"),
    ([{"name": PIRATE, "path": "/etc"}], "adapters[0].path"),  # no request names a folder
    ([{"name": PIRATE}] * 9, "adapters"),
    ([{"name": PIRATE}, {"name": PIRATE}], "adapters"),
])
def test_bad_adapter_lists_are_400(server, adapters, param):
    body = {"model": "tiny-chat", "messages": HELLO, "max_tokens": 2, "adapters": adapters}
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Authorization": f"Bearer {server.keys['paid']}"},
                   content=json.dumps(body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_models_lists_adapters(server):
    rows = {m.id: m.model_extra for m in client(server).models.list().data}
    assert rows[PIRATE]["kind"] == "adapter" and rows[PIRATE]["parent"] == "tiny-chat"
    assert (rows[PIRATE]["rank"], rows[POET]["rank"]) == (4, 8)
    assert rows[SKETCH]["parent"] == "tiny-image" and rows[SKETCH]["format"] == "diffusers"
    assert rows["tiny-chat"]["kind"] == "chat"
    assert client(server).models.retrieve(POET).model_extra["format"] == "peft"


def test_an_adapter_on_an_endpoint_of_another_kind_is_refused_as_its_base_is(server):
    """An adapter (listed by /v1/models) named as the model of embeddings, rerank, moderations,
    /classify or speech is a 400 ``model_not_supported`` naming it an adapter of its base's kind,
    as its base model gets one there: not a 404 "does not exist"."""
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=30)
    asks = {"/v1/embeddings": {"input": "x"}, "/v1/rerank": {"query": "x", "documents": ["y"]},
            "/v1/moderations": {"input": "x"}, "/classify": {"input": "x"},
            "/v1/audio/speech": {"input": "x", "voice": "alloy"}}
    for path, body in asks.items():
        for base, adapter in (("tiny-chat", PIRATE), ("tiny-image", SKETCH)):
            for model in (base, adapter):
                r = http.post(path, json={"model": model, **body})
                assert r.status_code == 400, (path, model, r.text)
                assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("model_not_supported", "model")
            kind = "a chat model" if base == "tiny-chat" else "an image model"
            assert f"adapter of {kind} ('{base}')" in r.json()["error"]["message"], (path, r.text)
        assert http.post(path, json={"model": "tiny-chat-nobody", **body}).status_code == 404


# -- images ------------------------------------------------------------------------------------------


def test_image_adapter_changes_the_image_and_base_comes_back(server):
    base = image(server)
    sketch = image(server, SKETCH)
    assert sketch != base
    assert image(server, adapters=[{"name": SKETCH}]) == sketch
    assert image(server) == base


def test_image_edit_takes_the_adapter_stack_by_name_or_in_the_form(server):
    """An edit is multipart: the stack comes as the adapter's model name, or as the ``adapters``
    field holding the JSON endpoints' list as JSON text."""
    source = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(source, "PNG")

    def edit(model="tiny-image", **extra) -> bytes:
        r = client(server).images.edit(model=model, prompt="a cat", image=("a.png", source.getvalue()),
                                       extra_body={"num_inference_steps": 2, "strength": 1.0, "seed": 3, **extra})
        return base64.b64decode(r.data[0].b64_json)

    base, sketch = edit(), edit(SKETCH)
    assert sketch != base
    assert edit(adapters=json.dumps([{"name": SKETCH}])) == sketch
    assert edit(adapters=json.dumps([{"name": SKETCH, "weight": 0.0}])) == base
    assert edit() == base


def test_concurrent_image_calls_with_two_stacks_each_get_their_own(server):
    alone = {(m, p): image(server, m, prompt=p) for m in ("tiny-image", SKETCH) for p in ("a cat", "a dog")}
    worker = server.services.arbiter.workers["tiny-image"]
    switches = worker.stack_gate.switches
    jobs = list(alone) * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: image(server, job[0], prompt=job[1]), jobs))
    assert results == [alone[job] for job in jobs]
    assert worker.stack_gate.switches - switches < len(jobs)


def test_stack_gate_runs_one_stack_at_a_time_and_same_stacks_together():
    gate = StackGate()
    switched, active, log = [], {}, []
    lock = threading.Lock()

    def call(key, hold):
        with gate.use(key, switched.append, StepContext()):
            with lock:
                active[key] = active.get(key, 0) + 1
                log.append(dict(active))
            time.sleep(hold)
            with lock:
                active[key] -= 1

    a, b = (("a", 1.0),), (("b", 1.0),)
    threads = [threading.Thread(target=call, args=(k, 0.05)) for k in (a, a, b, a, b)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert all(sum(1 for v in snap.values() if v) == 1 for snap in log)  # never two stacks at once
    assert max(snap.get(a, 0) for snap in log) >= 2  # the same stack does run concurrently
    assert switched[0] == a and len(switched) <= 4


def test_stack_gate_lets_go_of_the_weights_while_batch_work_is_paused():
    """Batch work paused at a step boundary (a higher tier's request came) on one stack must not
    keep a call wanting another stack out: that call is what the pause is for. It used to wait
    until its client gave up. Resumed, the batch call gets its own stack back before its next step."""
    gate = StackGate()
    switched: list = []
    run = threading.Event()
    run.set()

    def pause_gate(ctx: StepContext) -> None:
        while not run.wait(0.01) and not ctx.cancelled:
            pass

    a, b = (("a", 1.0),), (("b", 1.0),)
    batch_ctx = StepContext(pause_gate=pause_gate, pause_check=lambda: not run.is_set())
    stepping, seen = threading.Event(), []

    def batch_call():
        with gate.use(a, switched.append, batch_ctx):
            for _ in range(6):
                seen.append(gate.key)
                stepping.set()
                batch_ctx.boundary()
                time.sleep(0.01)

    batch = threading.Thread(target=batch_call, daemon=True)
    batch.start()
    assert stepping.wait(5)
    run.clear()  # a paid request arrived: the batch call pauses at its next boundary
    served = threading.Event()

    def paid_call():
        with gate.use(b, switched.append, StepContext()):
            seen.append(gate.key)
            served.set()

    paid = threading.Thread(target=paid_call, daemon=True)
    paid.start()
    try:
        assert served.wait(5), "the call on another stack waited for the paused batch call"
    finally:
        run.set()
    batch.join(5)
    paid.join(5)
    assert not batch.is_alive()
    assert switched == [a, b, a] and seen[-1] == a and gate.users == 0
    assert batch_ctx.paused and batch_ctx.pause_gate is pause_gate


# -- configuration -------------------------------------------------------------------------------------


def config_with(tmp_path: Path, tiny_chat: Path, tiny_image: Path, adapters: str) -> Path:
    return write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image)}, adapters)


def dora_copy(demo_adapters, tmp_path: Path) -> Path:
    folder = shutil.copytree(demo_adapters[PIRATE], tmp_path / "dora")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    return folder


@pytest.mark.parametrize("case,field,problem", [
    ("unknown base", "adapters[0].model", "no model named 'tiny-nothing'"),
    ("missing folder", "adapters[0].path", "no such folder"),
    ("name of a model", "adapters[0].name", "also a model's name"),
    ("duplicate", "adapters", "duplicate name"),
])
def test_bad_adapter_config_is_one_line(tmp_path, demo_adapters, tiny_chat, tiny_image, case, field, problem):
    good = demo_adapters[PIRATE]
    entries = {
        "unknown base": f"  - {{name: x, model: tiny-nothing, path: {good}}}\n",
        "missing folder": f"  - {{name: x, model: tiny-chat, path: {tmp_path / 'nowhere'}}}\n",
        "name of a model": f"  - {{name: tiny-image, model: tiny-chat, path: {good}}}\n",
        "duplicate": f"  - {{name: x, model: tiny-chat, path: {good}}}\n" * 2,
    }
    path = config_with(tmp_path, tiny_chat, tiny_image, "adapters:\n" + entries[case])
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {field}") and problem in msg, msg


def test_refused_or_unfitting_adapters_stop_start_up(tmp_path, demo_adapters, tiny_chat, tiny_image, capsys):
    dora = dora_copy(demo_adapters, tmp_path)
    corrupt = shutil.copytree(demo_adapters[PIRATE], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = {
        "corrupt weights": (f"  - {{name: shiny, model: tiny-chat, path: {corrupt}}}\n", "adapter_model.safetensors"),
        "DoRA": (f"  - {{name: shiny, model: tiny-chat, path: {dora}}}\n", "use_dora"),
        "chat LoRA on the image model": (f"  - {{name: shiny, model: tiny-image, path: {demo_adapters[POET]}}}\n",
                                         "does not fit model 'tiny-image'"),
        "image LoRA on the chat model": (f"  - {{name: shiny, model: tiny-chat, path: {demo_adapters[SKETCH]}}}\n",
                                         "does not fit model 'tiny-chat'"),
    }
    for case, (entry, problem) in cases.items():
        folder = tmp_path / case.replace(" ", "-")
        folder.mkdir()
        path = config_with(folder, tiny_chat, tiny_image, "adapters:\n" + entry)
        with pytest.raises(ConfigError) as exc:
            build_services(load_config(path), KeyRing({"paid": ["k"]}, []))
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith(f"{path}: adapters[0] (shiny): ") and problem in msg, (case, msg)
    # the command line says it in one line and exits 2 before serving
    assert main(["serve", "--demo", "--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # start-up log lines (engine chosen) come first
    assert lines[-1].startswith(f"tiergate: {path}: adapters[0] (shiny)")
    assert not any("Traceback" in line for line in lines)


def test_shipped_config_serves_the_demo_adapters():
    from demo import DEMO_ADAPTERS

    shipped = load_config(Path(__file__).resolve().parents[1] / "tiers.yaml", check_paths=False)
    assert {a.name: a.model for a in shipped.adapters} == {n: base for n, (base, _, _) in DEMO_ADAPTERS.items()}
    chat = next(s for s in shipped.model_specs() if s.name == "tiny-chat")
    # the transformers engine merges stacks; vLLM serves each stack as one unmerged LoRA
    assert chat.engine == "transformers" or chat.options["enable_lora"]


def test_demo_chat_adapter_is_a_peft_adapter(demo_adapters, tiny_chat):
    """peft reads the demo folder and its merge gives our merged weights."""
    import peft
    from transformers import AutoModelForCausalLM

    from lora_kernels import AdapterStack, load_peft_adapter

    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chat),
                                            str(demo_adapters[PIRATE])).merge_and_unload()
    ours = AutoModelForCausalLM.from_pretrained(tiny_chat)
    AdapterStack(ours).apply([(load_peft_adapter(demo_adapters[PIRATE]), 1.0)])
    expected, actual = theirs.state_dict(), ours.state_dict()
    assert set(expected) == set(actual)
    assert max((expected[k] - actual[k]).abs().max().item() for k in expected) <= 1e-6
