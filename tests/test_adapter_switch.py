"""Switching adapter stacks with restore on failure (lora_kernels.AdapterStack.switch), which the
chat engine and the image worker share: a merge that fails half way through the weights leaves
the pristine weights, bit for bit, and the worker serves on.

The failure is real and midway: a copy of a demo adapter whose LAST module's factors are meta
tensors. They have the right shapes, so every check before the merge passes, and the merge fails
only when it reaches that module (copying out of a meta tensor), after the earlier modules'
weights were written."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lora_kernels import AdapterStack, LoraAdapter, LoraModule, load_diffusers_lora, load_peft_adapter
from workers.base import ChatFinished, ChatParams, ChatRequest, ModelSpec, StepContext, TextDelta

PIRATE, SKETCH = "tiny-chat-pirate", "tiny-image-sketch"


@pytest.fixture(scope="module")
def demo_adapters(demo_dir, tiny_chat, tiny_image):
    from demo import build_demo_models

    return build_demo_models(demo_dir, names=[PIRATE, SKETCH])


def broken(adapter: LoraAdapter) -> LoraAdapter:
    """``adapter`` with its last module's factors replaced by meta tensors of the same shapes."""
    modules = dict(adapter.modules)
    last = list(modules)[-1]
    lm = modules[last]
    modules[last] = LoraModule(torch.empty_like(lm.down, device="meta"), torch.empty_like(lm.up, device="meta"), lm.scale)
    return LoraAdapter("broken", modules, adapter.config, adapter.source)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_pristine(module: torch.nn.Module, pristine: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert set(now) == set(pristine)
    changed = [k for k in pristine if not torch.equal(now[k], pristine[k])]
    assert not changed, changed[:5]


@pytest.fixture
def llama(tiny_chat):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()


@pytest.mark.parametrize("offload", [False, True], ids=["copies-beside", "copies-offloaded"])
def test_the_failure_is_midway_and_switch_restores_exactly(llama, demo_adapters, offload):
    pirate = load_peft_adapter(demo_adapters[PIRATE], PIRATE)
    pristine = snapshot(llama)
    bare = AdapterStack(llama, offload=offload)
    with pytest.raises(NotImplementedError, match="meta"):
        bare.apply([(broken(pirate), 1.0)])  # apply alone leaves the weights half merged
    now = llama.state_dict()
    assert any(not torch.equal(now[k], pristine[k]) for k in pristine)
    bare.restore()
    assert_pristine(llama, pristine)

    stack = AdapterStack(llama, offload=offload)
    stack.switch([(pirate, 1.0)])  # another stack merged first: its copies are kept too
    with pytest.raises(NotImplementedError, match="meta"):
        stack.switch([(pirate, 0.5), (broken(pirate), 1.0)])
    assert_pristine(llama, pristine)
    assert stack.merged is None
    stack.switch([(pirate, 1.0)]).switch([])  # and it switches on as before
    assert_pristine(llama, pristine)


def test_chat_engine_fails_the_rows_of_a_broken_stack_and_serves_on(tiny_chat, demo_adapters):
    from workers.chat import AdapterStackFailed, ChatWorker

    pirate = load_peft_adapter(demo_adapters[PIRATE], PIRATE)
    worker = ChatWorker(ModelSpec("tiny-chat", "chat", tiny_chat))
    worker.load(torch.device("cpu"))
    pristine = snapshot(worker.model)

    async def reply(adapters=()) -> str:
        req = ChatRequest([{"role": "user", "content": "Hello there"}], ChatParams(max_tokens=8, temperature=0),
                          ctx=StepContext(), adapters=tuple(adapters))
        text = ""
        async for ev in worker.chat(req):
            text += ev.text if isinstance(ev, TextDelta) else ""
            assert isinstance(ev, (TextDelta, ChatFinished))
        return text

    try:
        base = asyncio.run(reply())
        with_pirate = asyncio.run(reply([(pirate, 1.0)]))
        assert with_pirate != base
        with pytest.raises(AdapterStackFailed, match="meta"):
            asyncio.run(reply([(broken(pirate), 1.0)]))
        assert worker.stack_key == ()
        assert_pristine(worker.model, pristine)
        assert asyncio.run(reply()) == base
        assert asyncio.run(reply([(pirate, 1.0)])) == with_pirate
    finally:
        worker.unload()


def test_image_worker_raises_on_a_broken_stack_and_serves_on(tiny_image, demo_adapters):
    from workers.image import ImageRequest, ImageWorker

    sketch = load_diffusers_lora(demo_adapters[SKETCH], component="unet", name=SKETCH)
    worker = ImageWorker(ModelSpec("tiny-image", "image", tiny_image))
    worker.load(torch.device("cpu"))
    unet = worker.pipe.unet
    pristine = snapshot(unet)

    def image(adapters=()) -> bytes:
        req = ImageRequest("a cat", width=32, height=32, seed=3, num_inference_steps=2, adapters=tuple(adapters))
        return worker.generate(req, StepContext())[0]

    try:
        base = image()
        with_sketch = image([(sketch, 1.0)])
        assert with_sketch != base
        with pytest.raises(NotImplementedError, match="meta"):
            image([(broken(sketch), 1.0)])
        assert worker.stack_gate.key == ()
        assert_pristine(unet, pristine)
        assert image() == base
        assert image([(sketch, 1.0)]) == with_sketch
    finally:
        worker.unload()
