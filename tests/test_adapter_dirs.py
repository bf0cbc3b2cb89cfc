"""Adapters from ``adapter_dirs`` folders, against a real server with the openai SDK: a folder
dropped in while the server runs is an adapter at once (its replies the same as the same files
configured in tiers.yaml), its files replaced are read again, a folder removed is a 404, a broken
one a 400 until it is fixed; names cannot reach outside the folder; /v1/models lists them. And the
registry on its own: least recently used dropped past the budget, one read for many waiters,
models never looked for on disk; and the config's errors."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway import adapters as adapters_module
from gateway.adapters import SETTLE_S, AdapterDir, AdapterRegistry, served_names
from gateway.config import ConfigError, load_config
from gateway.errors import APIError
from gateway.schemas import AdapterChoice
from tests.helpers import start_server, write_config

PIRATE, POET, SKETCH = "tiny-chat-pirate", "tiny-chat-poet", "tiny-image-sketch"


@pytest.fixture(scope="module")
def demo_adapters(demo_dir: Path, tiny_chat: Path, tiny_image: Path) -> dict[str, Path]:
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=[PIRATE, POET, SKETCH])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-dirs")
    made = {"chat": root / "chat", "chat2": root / "chat2", "image": root / "image"}
    for folder in made.values():
        folder.mkdir()
    return made


@pytest.fixture(scope="module")
def server(demo_adapters, folders, tiny_chat, tiny_image, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter-dirs-server")
    models = {"tiny-chat": ("chat", tiny_chat), "tiny-image": ("image", tiny_image)}
    extra = (f"limits:\n  max_chat_tokens: 64\n"
             f"adapters:\n  - {{name: {PIRATE}, model: tiny-chat, path: {demo_adapters[PIRATE]}}}\n"
             f"  - {{name: {POET}, model: tiny-chat, path: {demo_adapters[POET]}}}\n"
             f"adapter_dirs:\n  - {{model: tiny-chat, path: {folders['chat']}}}\n"
             f"  - {{model: tiny-chat, path: {folders['chat2']}}}\n"
             f"  - {{model: tiny-image, path: {folders['image']}}}\n")
    running = start_server(write_config(folder, models, extra))
    yield running
    running.stop()


def client(server, tier="paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0, timeout=60)


def chat(server, model="tiny-chat", adapters=None) -> str:
    r = client(server).chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                               max_tokens=12, temperature=0,
                                               extra_body={"adapters": adapters} if adapters is not None else None)
    return r.choices[0].message.content


def put(source: Path, folder: Path, name: str) -> Path:
    """``source``'s files as the adapter ``name`` of ``folder``, written beside it and renamed into
    place (as an operator should: a reader never sees half the files)."""
    staged = folder.parent / f".staged-{folder.name}-{name}"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(source, staged)
    target = folder / name
    if target.exists():
        shutil.rmtree(target)
    staged.rename(target)
    return target


def quirk(source: Path, folder: Path, name: str, kind: str) -> Path:
    """``source``'s peft adapter put in ``folder`` as ``name``, with one thing that tiergate reads
    and vLLM's own loader refuses: ``rank_pattern`` (its v_proj modules of rank 128, zero padded),
    ``rank128`` (every module zero padded to rank 128, ``r: 128``), ``segkeys`` (keys
    ``lora_A.default.weight``), ``noalpha`` (no ``lora_alpha``) or ``pissa`` (``init_lora_weights:
    "pissa"``). Padding with zeros keeps the delta's direction (its scale alpha/r changes)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    work = folder.parent / f".quirk-{folder.name}-{name}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    config = json.loads((work / "adapter_config.json").read_text())
    weights = load_file(work / "adapter_model.safetensors")

    def padded(key: str, t):  # lora_A [r, in] gets rows, lora_B [out, r] columns
        if ".lora_A." in key:
            return torch.cat([t, t.new_zeros(128 - t.shape[0], *t.shape[1:])])
        return torch.cat([t, t.new_zeros(t.shape[0], 128 - t.shape[1])], dim=1)

    if kind == "rank_pattern":
        config["rank_pattern"] = {"v_proj": 128}
        weights = {k: padded(k, t) if ".v_proj." in k else t for k, t in weights.items()}
    elif kind == "rank128":
        config["r"] = 128
        weights = {k: padded(k, t) for k, t in weights.items()}
    elif kind == "segkeys":
        weights = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
                   for k, t in weights.items()}
    elif kind == "noalpha":
        del config["lora_alpha"]
    else:
        assert kind == "pissa", kind
        config["init_lora_weights"] = "pissa"
    save_file({k: t.contiguous() for k, t in weights.items()}, str(work / "adapter_model.safetensors"))
    (work / "adapter_config.json").write_text(json.dumps(config))
    try:
        return put(work, folder, name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def settled(path: Path) -> Path:
    """``path``'s files dated 10 s back: no longer young enough to be a copy under way, so a broken
    one reads as broken (a 400) rather than as being written (a 503)."""
    then = time.time() - 10
    for file in [path] if path.is_file() else path.iterdir():
        os.utime(file, (then, then))
    return path


def test_a_folder_dropped_in_is_an_adapter_at_once(server, folders, demo_adapters):
    base, pirate, poet = chat(server), chat(server, PIRATE), chat(server, POET)
    assert len({base, pirate, poet}) == 3  # the demo adapters change the reply
    with pytest.raises(openai.NotFoundError) as e:
        chat(server, "sailor")
    assert e.value.body["code"] == "model_not_found"

    put(demo_adapters[PIRATE], folders["chat"], "sailor")
    assert chat(server, "sailor") == pirate  # the same files as the configured adapter: the same reply
    assert chat(server, adapters=[{"name": "sailor", "weight": 1.0}]) == pirate
    assert chat(server, POET, adapters=[{"name": "sailor", "weight": 0.0}]) == poet  # a stack of both kinds
    listed = {m.id: m for m in client(server).models.list()}
    assert listed["sailor"].model_extra["source"] == "folder" and listed["sailor"].model_extra["parent"] == "tiny-chat"
    assert listed["sailor"].model_extra["rank"] == listed[PIRATE].model_extra["rank"]
    assert listed[PIRATE].model_extra["source"] == "config"

    # its files replaced (renamed into place): read again, and merged again though the engine still
    # holds the old files' merge (its stacks are keyed by the name the content is known by)
    assert chat(server, "sailor") == pirate
    put(demo_adapters[POET], folders["chat"], "sailor")
    assert chat(server, "sailor") == poet
    assert server.services.adapters.get("sailor").adapter.name == "sailor@2"  # the engines' key moved too
    # removed: gone
    shutil.rmtree(folders["chat"] / "sailor")
    with pytest.raises(openai.NotFoundError):
        chat(server, "sailor")
    assert "sailor" not in server.services.adapters.cached  # nor held in host memory any more
    assert "sailor" not in {m.id for m in client(server).models.list()}


def test_tokenize_names_a_folder_adapter_without_reading_it_on_the_loop(server, folders, demo_adapters):
    """/tokenize needs an adapter's base model's tokenizer, not its factors: a folder adapter not
    read yet is not read there (that read would be on the event loop, stalling every request)."""
    put(demo_adapters[PIRATE], folders["chat"], "counted")
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['paid']}"}, timeout=30)
    try:
        base = http.post("/tokenize", json={"model": "tiny-chat", "prompt": "Hello there"})
        counted = http.post("/tokenize", json={"model": "counted", "prompt": "Hello there"})
        assert counted.status_code == 200 and counted.json()["tokens"] == base.json()["tokens"]
        assert "counted" not in server.services.adapters.cached  # never read for it
    finally:
        shutil.rmtree(folders["chat"] / "counted")


def test_count_tokens_reads_a_folder_adapter_off_the_loop(server, folders, demo_adapters, monkeypatch):
    """/v1/messages/count_tokens naming a folder adapter not read yet reads it in a worker thread
    first, as /v1/messages does: a read by get() itself would be on the event loop."""
    put(demo_adapters[PIRATE], folders["chat"], "counted-too")
    registry = server.services.adapters
    on_loop: list[str] = []
    real_get = registry.get

    def get(name):
        if name == "counted-too" and registry.cached.get(name) is None:
            on_loop.append(name)
        return real_get(name)

    monkeypatch.setattr(registry, "get", get)
    try:
        counted = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=30,
                             headers={"Authorization": f"Bearer {server.keys['paid']}"},
                             json={"model": "counted-too", "messages": [{"role": "user", "content": "Hello there"}]})
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text
        assert on_loop == []
    finally:
        shutil.rmtree(folders["chat"] / "counted-too")


def test_folders_resolve_in_order_after_models_and_configured_adapters(server, folders, demo_adapters):
    pirate, poet = chat(server, PIRATE), chat(server, POET)
    put(demo_adapters[POET], folders["chat"], "twice")
    put(demo_adapters[PIRATE], folders["chat2"], "twice")
    assert chat(server, "twice") == poet  # the first folder listed
    put(demo_adapters[POET], folders["chat"], PIRATE)  # a configured adapter's name: the configured one
    assert chat(server, PIRATE) == pirate
    put(demo_adapters[POET], folders["chat"], "tiny-chat")  # a model's name: the model
    assert chat(server) == chat(server, adapters=[])
    rows = [m.id for m in client(server).models.list()]
    assert rows.count("twice") == 1 and rows.count(PIRATE) == 1 and rows.count("tiny-chat") == 1
    assert client(server).models.retrieve("twice").model_extra["parent"] == "tiny-chat"


def test_a_broken_folder_is_a_400_until_it_is_fixed(server, folders, demo_adapters):
    target = put(demo_adapters[PIRATE], folders["chat"], "broken")
    (target / "adapter_config.json").write_text("{not json")
    # just written: it may be a copy under way, so a 503 to try again, not a 400 remembered
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"authorization": f"Bearer {server.keys['paid']}"},
                   json={"model": "broken", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "adapter_changing" and r.headers["retry-after"] == "1"
    settled(target)
    for _ in range(2):  # refused, and remembered as refused (not read again) while the files stay
        with pytest.raises(openai.BadRequestError) as e:
            chat(server, "broken")
        assert e.value.body["code"] == "adapter_invalid" and e.value.body["param"] == "model"
        message = e.value.body["message"]
        assert "broken" in message and "adapter_config.json is not valid JSON" in message
        assert str(folders["chat"]) not in message
    target = put(demo_adapters[PIRATE], folders["chat"], "broken")
    (target / "adapter_model.safetensors").write_bytes(b"not safetensors")  # safetensors' own error
    settled(target)
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "broken")
    assert e.value.body["code"] == "adapter_invalid" and "not a readable safetensors file" in e.value.body["message"]
    settled(put(demo_adapters[SKETCH], folders["chat"], "broken"))  # an image model's LoRA in the chat folder
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "broken")
    assert e.value.body["code"] == "adapter_invalid"
    put(demo_adapters[POET], folders["chat"], "broken")
    assert chat(server, "broken") == chat(server, POET)
    scraped = httpx.get(f"{server.url}/metrics").text
    refused = re.search(r'^tiergate_adapter_folder_reads_total\{outcome="refused"\} (\S+)$', scraped, re.M)
    assert refused and float(refused.group(1)) >= 3 and "tiergate_adapter_folder_held_bytes" in scraped


def loud(source: Path, folder: Path, name: str, fold: float = 1e37) -> Path:
    """``source``'s adapter as ``name`` of ``folder`` with a ``lora_alpha`` that makes its largest
    ``scale * B`` ``fold``: finite at weight 1, inf at weight 100 (fp32 ends at 3.4e38)."""
    import json

    from lora_kernels import load_peft_adapter

    peak = max(float(m.up.abs().max()) * m.scale for m in load_peft_adapter(source).modules.values())
    target = put(source, folder, name)
    config = json.loads((target / "adapter_config.json").read_text())
    config["lora_alpha"] *= fold / peak
    (target / "adapter_config.json").write_text(json.dumps(config))
    return settled(target)


def test_factors_that_are_not_finite_are_refused(server, folders, demo_adapters):
    """A folder whose factors hold NaN (a diverged training run) is a 400 ``adapter_invalid``, as
    any broken folder; a stack whose weight folds an adapter's factors to inf is a 400 naming
    ``adapters``, and the engine serves on as before. Both were a 200 with an empty reply (and a
    500 with logprobs); on vLLM the requests of other keys then came out wrong. Factors finite but
    so large that the model's logits overflow are a 400 too (they were a 500 sampled, and garbage at
    temperature 0: hunt EE, finding 6)."""
    import torch
    from safetensors.torch import load_file, save_file

    base = chat(server)
    target = put(demo_adapters[PIRATE], folders["chat"], "diverged")
    weights = target / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(weights).items()}, weights)
    settled(target)
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "diverged")
    assert e.value.body["code"] == "adapter_invalid" and "not finite" in e.value.body["message"]
    loud(demo_adapters[PIRATE], folders["chat"], "loud")
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, adapters=[{"name": "loud", "weight": 100}])
    assert e.value.body["param"] == "adapters" and "not finite" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # finite factors, too large: the model's logits overflow
        chat(server, "loud")
    assert e.value.body["code"] == "adapter_not_supported" and "non-finite" in e.value.body["message"]
    assert chat(server) == base


def test_deleted_folders_are_let_go_of(server, folders, demo_adapters):
    """A held folder adapter whose folder is deleted leaves host memory, and the ``held`` gauges,
    at the next scrape of /metrics (or listing of /v1/models), though no request names it again."""
    def held() -> tuple[float, float]:
        scraped = httpx.get(f"{server.url}/metrics").text
        found = dict(re.findall(r"^(tiergate_adapter_folder_held(?:_bytes)?) (\S+)$", scraped, re.M))
        return float(found["tiergate_adapter_folder_held"]), float(found["tiergate_adapter_folder_held_bytes"])

    names = ["gone-a", "gone-b"]
    for name in names:
        put(demo_adapters[PIRATE], folders["chat"], name)
        chat(server, name)
    count, size = held()
    assert {*names} <= set(server.services.adapters.cached) and size > 0
    one = server.services.adapters.cached["gone-a"].nbytes
    for name in names:
        shutil.rmtree(folders["chat"] / name)
    assert held() == (count - 2, size - 2 * one)
    assert not {*names} & set(server.services.adapters.cached)
    put(demo_adapters[PIRATE], folders["chat"], "gone-a")  # and by the listing too
    chat(server, "gone-a")
    shutil.rmtree(folders["chat"] / "gone-a")
    client(server).models.list()
    assert "gone-a" not in server.services.adapters.cached


@pytest.mark.parametrize("name", ["../chat2/reached", "chat2/../reached", ".hidden", "/etc", "a" * 129])
def test_names_cannot_reach_outside_their_folder(server, folders, demo_adapters, name):
    put(demo_adapters[PIRATE], folders["chat2"], "reached")
    put(demo_adapters[PIRATE], folders["chat"], ".hidden")
    with pytest.raises(openai.NotFoundError):
        chat(server, name)
    with pytest.raises(openai.NotFoundError):
        chat(server, adapters=[{"name": name, "weight": 1.0}])


def test_image_folders(server, folders, demo_adapters):
    def picture(model, adapters=None) -> bytes:
        extra = {"num_inference_steps": 2, "seed": 3, **({"adapters": adapters} if adapters is not None else {})}
        r = client(server).images.generate(model=model, prompt="a cat", size="32x32", extra_body=extra)
        return base64.b64decode(r.data[0].b64_json)

    put(demo_adapters[SKETCH], folders["image"], "inked")
    plain, inked = picture("tiny-image"), picture("inked")
    assert inked != plain and picture("tiny-image", [{"name": "inked", "weight": 1.0}]) == inked
    # an image LoRA as one file in the folder, named by its stem
    shutil.copy(demo_adapters[SKETCH] / "pytorch_lora_weights.safetensors", folders["image"] / "inked-file.safetensors")
    assert picture("inked-file") == inked
    listed = {m.id: m.model_extra for m in client(server).models.list()}
    assert listed["inked-file"]["parent"] == "tiny-image" and listed["inked-file"]["source"] == "folder"
    (folders["image"] / "inked-file.safetensors").write_bytes(b"not safetensors")  # changed: read again, refused
    settled(folders["image"] / "inked-file.safetensors")
    with pytest.raises(openai.BadRequestError):
        picture("inked-file")
    with pytest.raises(openai.BadRequestError) as e:  # an image adapter asked of a chat model
        chat(server, "inked")
    assert e.value.body["code"] == "model_not_supported"


# -- the registry on its own ---------------------------------------------------------------------------


def _registry(tiny_chat: Path, folder: Path, cache_bytes: int = 1 << 30) -> AdapterRegistry:
    return AdapterRegistry((), [AdapterDir("tiny-chat", "chat", folder, tiny_chat)], ["tiny-chat", "alias"], cache_bytes)


def test_the_least_recently_used_is_dropped_past_the_budget(tiny_chat, demo_adapters, tmp_path):
    for name in "abc":
        put(demo_adapters[PIRATE], tmp_path, name)
    one = _registry(tiny_chat, tmp_path).get("a").nbytes
    registry = _registry(tiny_chat, tmp_path, cache_bytes=2 * one)
    first = registry.get("a")
    registry.get("b")
    assert registry.get("a") is first  # held: not read again
    registry.get("c")  # past the budget: b, the least recently used, goes
    assert list(registry.cached) == ["a", "c"]
    metrics = {m.name: m.samples for m in registry.collect()}
    assert [(s.labels, s.value) for s in metrics["tiergate_adapter_folder_reads"]] == [
        ({"outcome": "read"}, 3), ({"outcome": "refused"}, 0), ({"outcome": "changing"}, 0)]
    assert metrics["tiergate_adapter_folder_dropped"][0].value == 1
    assert metrics["tiergate_adapter_folder_held"][0].value == 2
    assert metrics["tiergate_adapter_folder_held_bytes"][0].value == 2 * one
    tiny = _registry(tiny_chat, tmp_path, cache_bytes=1)
    assert tiny.get("a") is not None and tiny.get("b") is not None and list(tiny.cached) == ["b"]  # the latest stays


def test_many_waiters_read_a_folder_once_off_the_loop(tiny_chat, demo_adapters, tmp_path, monkeypatch):
    put(demo_adapters[PIRATE], tmp_path, "a")
    registry = _registry(tiny_chat, tmp_path)
    reads: list[str] = []
    real = registry._read

    def counted(name, *args):
        reads.append(name)
        return real(name, *args)

    monkeypatch.setattr(registry, "_read", counted)

    async def run() -> None:
        await asyncio.gather(*(registry.ready("tiny-chat", [AdapterChoice(name="a", weight=1.0)]) for _ in range(8)))
        await registry.ready("a", None)

    asyncio.run(run())
    assert reads == ["a"] and registry.get("a") is not None and reads == ["a"]


def test_a_stack_larger_than_the_budget_is_read_once_off_the_loop(tiny_chat, demo_adapters, tmp_path, monkeypatch):
    """Two folder adapters that the budget cannot hold together: ``ready`` reads both in worker
    threads (the second dropping the first), and the request's stack is made of those reads, not of
    reads by ``get`` on the event loop."""
    import threading

    put(demo_adapters[PIRATE], tmp_path, "a")
    put(demo_adapters[POET], tmp_path, "b")
    registry = _registry(tiny_chat, tmp_path, cache_bytes=1)  # holds one adapter at a time
    reads: list[tuple[str, bool]] = []  # (name, on the event loop's thread)
    real = registry._read
    monkeypatch.setattr(registry, "_read", lambda name, *args: (
        reads.append((name, threading.current_thread() is threading.main_thread())), real(name, *args))[1])
    choices = [AdapterChoice(name="a", weight=0.5), AdapterChoice(name="b", weight=0.5)]

    async def request():
        await registry.ready("tiny-chat", choices)
        return registry.stack("tiny-chat", choices, "chat")

    stack = asyncio.run(request())
    assert served_names(stack) == ("a", "b") and list(registry.cached) == ["b"]
    assert reads == [("a", False), ("b", False)]


def test_files_changed_are_read_again(tiny_chat, demo_adapters, tmp_path):
    put(demo_adapters[PIRATE], tmp_path, "a")
    registry = _registry(tiny_chat, tmp_path)
    first = registry.get("a")
    assert registry.get("a") is first and first.adapter.name == "a"
    put(demo_adapters[PIRATE], tmp_path, "a")  # the same bytes, new files
    second = registry.get("a")
    assert second is not first and second.adapter.name == "a@2" and registry.get("a") is second
    (tmp_path / "a" / "adapter_config.json").touch()
    assert registry.get("a").adapter.name == "a@3"
    assert served_names(registry.stack("tiny-chat", [AdapterChoice(name="a", weight=0.5)], "chat")) == ("a",)


def test_models_and_aliases_are_never_looked_for_on_disk(tiny_chat, demo_adapters, tmp_path, monkeypatch):
    put(demo_adapters[PIRATE], tmp_path, "a")
    registry = _registry(tiny_chat, tmp_path)
    looked: list[str] = []
    monkeypatch.setattr("gateway.adapters.signature", lambda folder: looked.append(folder.name))
    for name in ("tiny-chat", "alias"):
        assert registry.get(name) is None and registry.base_model(name) == name
        assert registry.stack(name, None, "chat") == ()
    asyncio.run(registry.ready("tiny-chat", None))
    assert looked == []
    registry.get("other")
    assert looked == ["other"]


def test_a_refused_folder_is_not_read_again_until_its_files_change(tiny_chat, demo_adapters, tmp_path, monkeypatch):
    target = put(demo_adapters[PIRATE], tmp_path, "a")
    (target / "adapter_config.json").write_text("[]")
    settled(target)
    registry = _registry(tiny_chat, tmp_path)
    reads: list[str] = []
    real = registry._read
    monkeypatch.setattr(registry, "_read", lambda name, *args: reads.append(name) or real(name, *args))
    for _ in range(3):
        with pytest.raises(APIError) as e:
            registry.get("a")
        assert e.value.status == 400 and e.value.code == "adapter_invalid"
    assert reads == ["a"]
    put(demo_adapters[PIRATE], tmp_path, "a")
    assert registry.get("a").adapter.name == "a@2" and reads == ["a", "a"]


def test_files_being_written_are_neither_served_half_read_nor_remembered_as_broken(tiny_chat, demo_adapters,
                                                                                  tmp_path, monkeypatch):
    """A copy under way: files that change while they are read give a 503 ``adapter_changing``
    (what was read may be half of them), and a read that fails on files younger than SETTLE_S
    is not remembered as broken; the next request reads again and gets the adapter, or, once
    the files have settled, the 400."""
    target = put(demo_adapters[PIRATE], tmp_path, "a")
    registry = _registry(tiny_chat, tmp_path)
    real = adapters_module.read_adapter
    writes = iter([True])

    def read_while_written(*args, **kwargs):
        served = real(*args, **kwargs)
        if next(writes, False):  # the copy writes the file again while it is being read
            (target / "adapter_model.safetensors").write_bytes((target / "adapter_model.safetensors").read_bytes())
        return served

    monkeypatch.setattr(adapters_module, "read_adapter", read_while_written)
    with pytest.raises(APIError) as e:
        registry.get("a")
    assert (e.value.status, e.value.code, e.value.headers) == (503, "adapter_changing", {"retry-after": "1"})
    assert "a" not in registry.cached and registry.reads["changing"] == 1
    assert registry.get("a").signature == adapters_module.signature(target)  # settled: read, and held

    (target / "adapter_config.json").write_text("{")  # the config written first, the rest still to come
    for _ in range(2):  # young: a 503 each time, read each time (not remembered)
        with pytest.raises(APIError) as e:
            registry.get("a")
        assert e.value.code == "adapter_changing"
    assert registry.reads["refused"] == 0 and registry.reads["changing"] == 3
    settled(target)
    with pytest.raises(APIError) as e:  # settled and still broken: the 400, remembered
        registry.get("a")
    assert e.value.code == "adapter_invalid" and registry.reads["refused"] == 1

    async def off_the_loop() -> None:  # the same rules where requests read, in a worker thread
        put(demo_adapters[POET], tmp_path, "b")
        (tmp_path / "b" / "adapter_config.json").write_text("[]")
        with pytest.raises(APIError) as e:
            await registry.ready("b", None)
        assert e.value.code == "adapter_changing" and not registry._refused.get((tmp_path / "b", registry._find("b")[2]))
        settled(tmp_path / "b")
        await registry.ready("b", None)  # refused now, and remembered: get() answers without reading
        with pytest.raises(APIError) as e:
            registry.get("b")
        assert e.value.code == "adapter_invalid"

    asyncio.run(off_the_loop())
    assert SETTLE_S <= 5  # the test dates files 10 s back


@pytest.mark.parametrize("entry, error", [
    ("{model: nope, path: .}", "adapter_dirs[0].model: no model named 'nope'"),
    ("{model: tiny-embed, path: .}", "'tiny-embed' is an embed model; adapters are for chat and image models"),
    ("{model: tiny-chat, path: missing}", "adapter_dirs[0].path: no such folder"),
])
def test_config_errors(tiny_chat, tmp_path, entry, error):
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat), "tiny-embed": ("embed", tiny_chat)},
                        f"adapter_dirs:\n  - {entry}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert error in str(e.value)


# -- which keys may use which adapters -------------------------------------------------------------------


def _error(call) -> dict:
    with pytest.raises(openai.NotFoundError) as e:
        call()
    return e.value.body


def test_a_keys_adapter_allow_list(server, folders, demo_adapters):
    put(demo_adapters[PIRATE], folders["chat"], "acme-support")
    put(demo_adapters[POET], folders["chat"], "globex-sales")
    put(demo_adapters[SKETCH], folders["image"], "globex-logo")
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    made = admin.post("/admin/keys", json={"name": "acme", "tier": "paid", "adapters": ["acme-*"]})
    assert made.status_code == 201, made.text
    assert made.json()["adapters"] == ["acme-*"]
    acme = openai.OpenAI(base_url=server.base_url, api_key=made.json()["value"], max_retries=0, timeout=60)

    def ask(model="tiny-chat", adapters=None) -> str:
        return acme.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                            max_tokens=12, temperature=0, extra_body={"adapters": adapters} if adapters else None
                                            ).choices[0].message.content

    pirate = chat(server, PIRATE)
    assert ask("acme-support") == pirate and ask(adapters=[{"name": "acme-support"}]) == pirate
    assert ask() == chat(server)  # the base model itself
    # another's adapter, folder or configured, is as if it did not exist: the same error as a name nobody has
    for name in ("globex-sales", PIRATE):
        assert _error(lambda: ask(name)) == _error(lambda: ask("nobody-x")) | {"message": f"the model '{name}' does not exist"}
        assert _error(lambda: ask(adapters=[{"name": name}])) == \
            _error(lambda: ask(adapters=[{"name": "nobody-x"}])) | {"message": f"the adapter '{name}' does not exist"}
    assert _error(lambda: ask("acme-support", adapters=[{"name": "globex-sales"}]))["code"] == "adapter_not_found"
    assert _error(lambda: acme.images.generate(model="globex-logo", prompt="a cat", size="32x32",
                                               extra_body={"num_inference_steps": 2}))["code"] == "model_not_found"
    listed = {m.id: m.model_extra.get("kind") for m in acme.models.list()}
    assert sorted(i for i, kind in listed.items() if kind == "adapter") == ["acme-support"]
    assert "tiny-chat" in listed and "globex-sales" in {m.id for m in client(server).models.list()}

    key_id = made.json()["id"]
    assert admin.patch(f"/admin/keys/{key_id}", json={"adapters": []}).json()["adapters"] == []  # none at all
    assert _error(lambda: ask("acme-support"))["code"] == "model_not_found" and ask() == chat(server)
    assert admin.patch(f"/admin/keys/{key_id}", json={"adapters": None}).json()["adapters"] is None  # the tier's: all
    assert ask("globex-sales") == chat(server, POET)
    assert admin.patch(f"/admin/keys/{key_id}", json={"adapters": [""]}).status_code == 400


def test_another_keys_adapter_is_missing_on_every_endpoint(server, folders, demo_adapters):
    """An adapter outside a key's allow-list gets, on every endpoint that takes a model or adapters,
    the answer a name nobody has gets: not a count of its tokens, not a 400 naming its kind or base
    model (which would tell the key that another customer has it)."""
    put(demo_adapters[POET], folders["chat"], "globex-chat")
    put(demo_adapters[SKETCH], folders["image"], "globex-art")
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    made = admin.post("/admin/keys", json={"name": "acme-probe", "tier": "paid", "adapters": ["acme-*"]})
    assert made.status_code == 201, made.text
    key = made.json()["value"]
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    say = [{"role": "user", "content": "hi"}]
    asks = {  # (path, body) with {name} where a name goes
        "chat as model": ("/v1/chat/completions", {"model": "{name}", "messages": say, "max_tokens": 2}),
        "chat stack": ("/v1/chat/completions", {"model": "tiny-chat", "messages": say, "max_tokens": 2,
                                                "adapters": [{"name": "{name}"}]}),
        "chat, too many tokens": ("/v1/chat/completions", {"model": "{name}", "messages": say, "max_tokens": 10 ** 6}),
        "completions": ("/v1/completions", {"model": "{name}", "prompt": "hi", "max_tokens": 2}),
        "responses": ("/v1/responses", {"model": "{name}", "input": "hi", "max_output_tokens": 16}),
        "input_tokens": ("/v1/responses/input_tokens", {"model": "{name}", "input": "hi"}),
        "count_tokens": ("/v1/messages/count_tokens", {"model": "{name}", "messages": say}),
        "messages": ("/v1/messages", {"model": "{name}", "messages": say, "max_tokens": 2}),
        "images": ("/v1/images/generations", {"model": "{name}", "prompt": "a cat", "size": "32x32"}),
        "images stack": ("/v1/images/generations", {"model": "tiny-image", "prompt": "a cat", "size": "32x32",
                                                    "adapters": [{"name": "{name}"}]}),
        # where a chat or image adapter is of the wrong kind: a 400 only for an adapter the key may use
        "embeddings": ("/v1/embeddings", {"model": "{name}", "input": "hi"}),
        "rerank": ("/v1/rerank", {"model": "{name}", "query": "hi", "documents": ["there"]}),
        "moderations": ("/v1/moderations", {"model": "{name}", "input": "hi"}),
    }

    def answer(path: str, body: dict, name: str) -> tuple[int, str | None]:
        filled = httpx.Request("POST", "/", json=body).content.decode().replace("{name}", name)
        r = http.post(path, content=filled, headers={"content-type": "application/json"})
        error = r.json().get("error", {})
        return r.status_code, error.get("code") if isinstance(error, dict) else error

    for what, (path, body) in asks.items():
        missing = answer(path, body, "nobody-x")
        assert missing[0] == 404, (what, missing)
        for name in ("globex-chat", "globex-art", PIRATE, SKETCH):  # folder and configured, of either kind
            assert answer(path, body, name) == missing, (what, name)


@pytest.mark.parametrize("patterns, name, allowed", [
    (None, "anything", True),
    ((), "acme-a", False),
    (("acme-*",), "acme-a", True),
    (("acme-*",), "ACME-a", False),  # case matters, as in names
    (("acme-*",), "globex-a", False),
    (("acme-?", "globex-sales"), "acme-b", True),
    (("acme-?", "globex-sales"), "acme-bb", False),
    (("acme-?", "globex-sales"), "globex-sales", True),
    (("[ab]-x",), "b-x", True),
])
def test_adapter_patterns(patterns, name, allowed):
    from accounts.config import Limits

    assert Limits(adapters=patterns).allows_adapter(name) is allowed


def test_a_tiers_default_adapter_allow_list(tiny_chat, tmp_path):
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                        "accounts:\n  limits:\n    free: {adapters: ['shared-*']}\n")
    config = load_config(path)
    limits = config.accounts.limits
    assert limits["free"].allows_adapter("shared-a") and not limits["free"].allows_adapter("acme-a")

    # enforced at admission for the tier's keys (an environment key here), the rest untouched
    from accounts.rates import Ask
    from gateway.accounts import Accounts
    from gateway.auth import Caller

    accounts = Accounts.from_config(config)
    free, paid = Caller("free", "key-free"), Caller("paid", "key-paid")

    async def admit(caller, adapters, own=False):
        return await accounts.admit(caller, "tiny-chat", Ask(), adapters, own)

    assert asyncio.run(admit(free, ("shared-a",))) is None
    for own, code in ((True, "model_not_found"), (False, "adapter_not_found")):
        with pytest.raises(APIError) as e:
            asyncio.run(admit(free, ("acme-a",), own))
        assert (e.value.status, e.value.code) == (404, code)
    with pytest.raises(APIError):
        asyncio.run(admit(free, ("shared-a", "acme-a")))  # every adapter of the stack, not only the first
    assert asyncio.run(admit(paid, ("acme-a",))) is None


def test_the_keys_command_sets_an_adapter_allow_list(tiny_chat, tmp_path, capsys):
    import json

    from gateway.cli import main

    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)})
    for given, want in (("acme-*, globex-sales", ["acme-*", "globex-sales"]), ("", []), (None, None)):
        extra = ["--adapters", given] if given is not None else []
        assert main(["keys", "--config", str(path), "create", "--tier", "free", *extra]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["adapters"] == want


def test_tiergate_check_reads_every_folder_adapter(tiny_chat, demo_adapters, tmp_path, capsys):
    from gateway.cli import main

    folder = tmp_path / "dir"
    folder.mkdir()
    put(demo_adapters[PIRATE], folder, "good")
    (put(demo_adapters[PIRATE], folder, "broken") / "adapter_config.json").write_text("{")
    put(demo_adapters[SKETCH], folder, "misfit")  # an image model's LoRA for the chat model
    put(demo_adapters[PIRATE], folder, "tiny-chat")  # a model's name
    put(demo_adapters[PIRATE], folder, "bad name")
    put(demo_adapters[PIRATE], folder, ".staged")  # being copied in: not listed
    path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                        f"adapter_dirs:\n  - {{model: tiny-chat, path: {folder}}}\n")
    code = main(["check", "--config", str(path)])
    out, err = capsys.readouterr()
    assert code == 1 and "4 adapter(s) in adapter_dirs cannot be served" in err
    lines = out[out.index(f"adapter folder {folder}"):].splitlines()
    assert lines[0] == f"adapter folder {folder} (tiny-chat): 1 adapters serve, 4 cannot"
    problems = {line.split()[0]: line for line in lines[1:]}
    assert set(problems) == {"broken", "misfit", "tiny-chat", "bad"}
    assert "adapter_config.json is not valid JSON" in problems["broken"]
    assert "does not fit model 'tiny-chat'" in problems["misfit"] and "a model" in problems["tiny-chat"]
    assert "no request can name it" in problems["bad"] and ".staged" not in out

    for name in ("broken", "misfit", "tiny-chat", "bad name"):
        shutil.rmtree(folder / name)
    assert main(["check", "--config", str(path)]) == 0
    assert f"adapter folder {folder} (tiny-chat): 1 adapters serve, 0 cannot" in capsys.readouterr()[0]


def test_tiergate_check_refuses_what_the_vllm_engine_would(tiny_chat, demo_adapters, tmp_path, capsys):
    """For a model on vLLM, ``tiergate check`` applies its engine's limit too, as a request would
    meet it (a 400): a rank above ``engine.max_lora_rank`` (64 by default), a ``rank_pattern``'s
    rank counted as well as ``r``. On the transformers engine, which has no such limit, they serve."""
    from gateway.cli import main

    folder = tmp_path / "dir"
    folder.mkdir()
    put(demo_adapters[PIRATE], folder, "good")
    quirk(demo_adapters[PIRATE], folder, "wide", "rank128")
    quirk(demo_adapters[PIRATE], folder, "patterned", "rank_pattern")
    for engine, refused in (("vllm", {"wide", "patterned"}), ("transformers", set())):
        path = write_config(tmp_path, {"tiny-chat": ("chat", tiny_chat)},
                            f"adapter_dirs:\n  - {{model: tiny-chat, path: {folder}}}\n", engine=engine)
        code = main(["check", "--config", str(path)])
        out = capsys.readouterr()[0]
        lines = out[out.index(f"adapter folder {folder}"):].splitlines()
        problems = {line.split()[0]: line for line in lines[1:]}
        assert (code, set(problems)) == (1 if refused else 0, refused), out
        for name in refused:
            assert "rank 128 is above tiny-chat's engine.max_lora_rank 64" in problems[name]


# -- vLLM's runtime LoRA endpoints ----------------------------------------------------------------------


def test_load_and_unload_lora_adapter_as_vllm_does(server, folders, demo_adapters, tmp_path):
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['admin']}"}, timeout=30)
    source = put(demo_adapters[PIRATE], tmp_path, "pirate-copy")
    loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "hotswap", "lora_path": str(source)})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'hotswap' added successfully.")
    pirate, poet = chat(server, PIRATE), chat(server, POET)
    assert chat(server, adapters=[{"name": "hotswap", "weight": 1.0}]) == pirate
    assert chat(server, "hotswap") == pirate  # the engine holds this merge now
    row = client(server).models.retrieve("hotswap").model_extra
    assert row["source"] == "runtime" and row["parent"] == "tiny-chat"

    def refused(path: str, body: dict, status: int = 400) -> dict:
        r = admin.post(path, json=body)
        assert r.status_code == status, r.text
        return r.json()["error"]

    again = {"lora_name": "hotswap", "lora_path": str(put(demo_adapters[POET], tmp_path, "poet-copy"))}
    assert "load_inplace" in refused("/v1/load_lora_adapter", again)["message"]
    assert admin.post("/v1/load_lora_adapter", json={**again, "load_inplace": True}).status_code == 200
    assert chat(server, "hotswap") == poet  # read again: merged again, though the engine held the old merge
    assert refused("/v1/load_lora_adapter", {"lora_name": "tiny-chat", "lora_path": str(source)})["param"] == "lora_name"
    assert "already served" in refused("/v1/load_lora_adapter", {"lora_name": PIRATE, "lora_path": str(source)})["message"]
    for nowhere in (str(tmp_path / "nowhere"), "/" + "a" * 5000, "\x00"):
        assert refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": nowhere}, 404)["code"] == \
            "adapter_not_found"
    broken = put(demo_adapters[PIRATE], tmp_path, "broken-copy")
    (broken / "adapter_config.json").write_text("[]")
    assert refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(broken)})["code"] == "adapter_invalid"
    sketch = {"lora_name": "y", "lora_path": str(demo_adapters[SKETCH])}
    assert "does not fit" in refused("/v1/load_lora_adapter", sketch)["message"]  # the only chat model by default
    assert admin.post("/v1/load_lora_adapter", json={**sketch, "base_model": "tiny-image"}).status_code == 200
    held = server.services.adapters.get("y")
    assert held.source == "runtime" and held.adapter.name.startswith("y")
    file = put(demo_adapters[SKETCH], tmp_path, "sketch-copy") / "pytorch_lora_weights.safetensors"
    as_file = {"lora_name": "y", "lora_path": str(file), "base_model": "tiny-image", "load_inplace": True}
    assert admin.post("/v1/load_lora_adapter", json=as_file).status_code == 200  # a diffusers LoRA as its file
    file.write_bytes(file.read_bytes())  # the same bytes, written again: a new content name all the same
    first = server.services.adapters.get("y").adapter.name
    assert admin.post("/v1/load_lora_adapter", json=as_file).status_code == 200
    assert server.services.adapters.get("y").adapter.name != first
    assert refused("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": str(source), "base_model": "nope"},
                   404)["param"] == "base_model"
    not_admin = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(source)},
                           headers={"Authorization": f"Bearer {server.keys['paid']}"})
    assert not_admin.status_code in (401, 403) and not_admin.json()["error"]

    unloaded = admin.post("/v1/unload_lora_adapter", json={"lora_name": "hotswap"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'hotswap' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        chat(server, "hotswap")
    assert refused("/v1/unload_lora_adapter", {"lora_name": "hotswap"}, 404)["code"] == "adapter_not_found"
    assert "not loaded at run time" in refused("/v1/unload_lora_adapter", {"lora_name": PIRATE})["message"]
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "y"}).status_code == 200


def test_load_lora_adapter_without_base_model_takes_the_model_its_config_names(demo_adapters, tiny_chat, tiny_vlm,
                                                                               tmp_path):
    """On a server of two chat models, vLLM's own body (no ``base_model``) loads an adapter whose
    ``adapter_config.json`` names one of them in ``base_model_name_or_path``: by name (the demo
    adapters'), or by folder (fine-tuned adapters', relative to tiers.yaml); one that names neither
    model is still the 400 asking for ``base_model``."""
    import json

    folder = tmp_path / "server"
    folder.mkdir()
    running = start_server(write_config(folder, {"tiny-chat": ("chat", tiny_chat), "tiny-vlm": ("chat", tiny_vlm)}))
    try:
        admin = httpx.Client(base_url=running.url, headers={"Authorization": f"Bearer {running.keys['admin']}"},
                             timeout=30)

        def naming(base: str, name: str) -> Path:
            copy = put(demo_adapters[PIRATE], tmp_path, name)
            config = json.loads((copy / "adapter_config.json").read_text())
            (copy / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
            return copy

        by_name = admin.post("/v1/load_lora_adapter", json={"lora_name": "by-name",
                                                             "lora_path": str(demo_adapters[PIRATE])})
        assert (by_name.status_code, by_name.text) == (200, "Success: LoRA adapter 'by-name' added successfully.")
        by_folder = {"lora_name": "by-folder", "lora_path": str(naming(os.path.relpath(tiny_chat, folder), "f"))}
        assert admin.post("/v1/load_lora_adapter", json=by_folder).status_code == 200
        for name in ("by-name", "by-folder"):
            assert client(running).models.retrieve(name).model_extra["parent"] == "tiny-chat"
        other = admin.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(naming("elsewhere", "e"))})
        assert other.status_code == 400 and other.json()["error"]["param"] == "base_model"
        assert "2 chat models" in other.json()["error"]["message"]
    finally:
        running.stop()


def test_a_batch_naming_folder_adapters_reads_each_once_before_its_lines_run(server, folders, demo_adapters,
                                                                               monkeypatch):
    import json

    put(demo_adapters[PIRATE], folders["chat"], "batch-sailor")
    registry = server.services.adapters
    on_loop: list[str] = []
    real_get = registry.get

    def get(name):  # a folder adapter read by get() itself would be read on the event loop
        if name == "batch-sailor" and registry.cached.get(name) is None:
            on_loop.append(name)
        return real_get(name)

    monkeypatch.setattr(registry, "get", get)
    c = client(server)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
                       "temperature": 0, **({"adapters": [{"name": "batch-sailor"}]} if i % 2 else {})}}
             for i in range(4)]
    lines[0]["body"]["model"] = "batch-sailor"
    file = c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.time() + 120
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed") and time.time() < deadline:
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 4, batch
    out = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]["choices"][0]["message"]["content"]
           for x in c.files.content(batch.output_file_id).text.splitlines()}
    pirate, base = chat(server, PIRATE), chat(server)
    assert out == {"r0": pirate, "r1": pirate, "r2": base, "r3": pirate}
    assert on_loop == []


def test_a_batch_whose_adapter_is_being_written_still_validates(server, monkeypatch):
    """Reading a batch's adapters before its lines are shaped: one being written (a 503
    ``adapter_changing``) is left for its lines to read when they run (where a 503 is retried),
    and the rest are read; any other error is not swallowed."""
    from batch.store import Line

    asked: list[str] = []

    async def ready(name, choices):
        asked.append(name)
        if name == "copying":
            raise APIError(503, "being written", "adapter_changing", "model")
        if name == "broken-store":
            raise APIError(503, "the store is down", "store_unavailable")

    monkeypatch.setattr(server.batches.svc.adapters, "ready", ready)
    lines = [Line(0, "a", {"model": "copying"}), Line(1, "b", {"model": "tiny-chat", "adapters": [{"name": "x"}]})]
    asyncio.run(server.batches._ready_adapters(lines))
    assert asked == ["copying", "tiny-chat", "x"]
    with pytest.raises(APIError):
        asyncio.run(server.batches._ready_adapters([Line(0, "a", {"model": "broken-store"})]))


def test_an_image_folder_lists_its_lora_files_and_a_subfolder_comes_first(tiny_image, demo_adapters, tmp_path):
    weights = demo_adapters[SKETCH] / "pytorch_lora_weights.safetensors"
    shutil.copy(weights, tmp_path / "a.safetensors")
    shutil.copy(weights, tmp_path / ".staged.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"broken")
    put(demo_adapters[SKETCH], tmp_path, "a")  # a subfolder and a file named alike: the subfolder
    (tmp_path / "notes.txt").write_text("not an adapter")
    registry = AdapterRegistry((), [AdapterDir("tiny-image", "image", tmp_path, tiny_image)], ["tiny-image"])
    assert [(name, problem.split(":")[0]) for _, name, problem in registry.survey()] == [("a", ""), ("b", "refused")]
    assert registry.get("a").path == tmp_path / "a"
    shutil.rmtree(tmp_path / "a")
    assert registry.get("a").path == tmp_path / "a.safetensors"
    assert [r["id"] for r in registry.rows()] == ["a", "b"]
    chat_dir = AdapterRegistry((), [AdapterDir("tiny-chat", "chat", tmp_path, tiny_image)], ["tiny-chat"])
    assert chat_dir.get("a") is None and chat_dir.rows() == []  # a chat model's adapters are folders only


def test_two_loads_of_one_name_at_once_serve_one_and_refuse_the_other(tiny_chat, demo_adapters, tmp_path):
    """``/v1/load_lora_adapter`` twice at once for one name (each read on a thread): the first
    read to end is served, the other is the 400 a second load gets, where both said "Success" and
    only one was served."""
    from gateway.adapters import AdapterDir
    from gateway.errors import APIError

    registry = _registry(tiny_chat, tmp_path)
    base = AdapterDir("tiny-chat", "chat", tmp_path, tiny_chat)
    sources = [put(demo_adapters[PIRATE], tmp_path, "p"), put(demo_adapters[POET], tmp_path, "q")]

    async def run() -> list:
        return await asyncio.gather(*(registry.load("twice", path, base, False) for path in sources),
                                    return_exceptions=True)

    results = asyncio.run(run())
    served = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, APIError)]
    assert len(served) == 1 and len(refused) == 1 and "already been loaded" in refused[0].message
    assert registry.loaded["twice"] is served[0]
