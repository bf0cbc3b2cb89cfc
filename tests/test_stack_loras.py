"""The vLLM engine's stack LoRAs on disk (workers.chat_vllm.VllmChatEngine.stack_lora): a
request's adapter stack is written once as one peft LoRA, at most ``max_stack_loras`` of them are
kept (the least recently used idle one is deleted beyond that), and their folder goes with the
engine. Writing a stack's LoRA needs no engine start and no vLLM, so this runs everywhere;
tests/test_vllm_engine.py serves forgotten and re-written stacks on a real engine, and
tests/test_reaper.py checks the folder goes when the process is killed."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from lora_kernels import load_peft_adapter
from workers.base import ModelSpec
from workers.chat_vllm import VllmChatEngine


@pytest.fixture(scope="module")
def pirate_poet(demo_dir: Path):
    from demo import build_demo_models

    built = build_demo_models(demo_dir, names=["tiny-chat-pirate", "tiny-chat-poet"])
    return load_peft_adapter(built["tiny-chat-pirate"]), load_peft_adapter(built["tiny-chat-poet"])


def engine(tiny_chat: Path, **options) -> VllmChatEngine:
    return VllmChatEngine(ModelSpec("tiny-chat", "chat", str(tiny_chat), engine="vllm"), **options)


def test_a_stack_is_written_once_and_a_plain_adapter_too_never_its_own_folder(tiny_chat, pirate_poet):
    """One adapter at weight 1 is written too, from the factors tiergate read: vLLM reads a LoRA's
    files only when it first schedules it, when the adapter's own folder may be gone or changed, and
    its loader refuses some folders tiergate reads (hunt P, findings 1, 2 and 5). The folder is
    named by the stack: one written before is served again."""
    pirate, poet = pirate_poet
    eng = engine(tiny_chat)
    blend = eng.stack_lora(((pirate, 0.5), (poet, -0.7)))
    assert blend[0] == "tiny-chat-pirate*0.5+tiny-chat-poet*-0.7"
    assert eng.stack_lora(((pirate, 0.5), (poet, -0.7))) == blend  # same stack: same LoRA, same id
    other = eng.stack_lora(((pirate, 0.25),))
    assert other[1] != blend[1] and Path(other[2]).parent == Path(blend[2]).parent
    plain = eng.stack_lora(((poet, 1.0),))
    assert Path(plain[2]) != Path(poet.source) and Path(plain[2]).parent == Path(blend[2]).parent
    written = load_peft_adapter(plain[2])
    for name, lm in poet.modules.items():
        got = written.modules[name]
        assert torch.allclose(got.scale * got.up @ got.down, lm.scale * lm.up @ lm.down, atol=1e-6)
    stamp = (Path(plain[2]) / "adapter_model.safetensors").stat().st_mtime_ns
    assert eng._write_stack(((poet, 1.0),), 99, Path(plain[2]).parent)[2] == plain[2]
    assert (Path(plain[2]) / "adapter_model.safetensors").stat().st_mtime_ns == stamp  # there: not written again


def test_beyond_the_limit_the_least_recently_used_stack_is_deleted(tiny_chat, pirate_poet):
    pirate, poet = pirate_poet
    eng = engine(tiny_chat, max_stack_loras=2)
    s1, s2, s3 = ((pirate, 0.5),), ((poet, 0.5),), ((pirate, 0.5), (poet, 0.5))
    first, second = eng.stack_lora(s1), eng.stack_lora(s2)
    assert eng.stack_lora(s1) == first  # s1 used again: s2 is now the least recently used
    third = eng.stack_lora(s3)
    assert Path(first[2]).is_dir() and Path(third[2]).is_dir()
    assert not Path(second[2]).exists()
    again = eng.stack_lora(s2)  # written again, under a new id (vLLM may still hold the old one)
    assert again[0] == second[0] and again[1] not in (first[1], second[1], third[1]) and Path(again[2]).is_dir()
    assert not Path(first[2]).exists()  # s1 was the least recently used then
    assert sorted(p.name for p in Path(third[2]).parent.iterdir()) == sorted(
        Path(r[2]).name for r in (third, again))


def test_a_stack_a_request_holds_is_kept_beyond_the_limit(tiny_chat, pirate_poet):
    """A request holds its stack's LoRA from its start to its end (across a pause too): that one
    is not deleted, even when the limit is passed; it goes once it is idle and room is needed."""
    pirate, poet = pirate_poet
    eng = engine(tiny_chat, max_stack_loras=1)
    s1, s2, s3 = ((pirate, 0.5),), ((poet, 0.5),), ((pirate, 0.25),)
    held = asyncio.run(eng._hold_stack(s1))  # what chat() does for a request's stack
    second = eng.stack_lora(s2)
    assert Path(held.ref[2]).is_dir() and Path(second[2]).is_dir()  # two kept, while s1 is held
    held.users -= 1  # the request ended
    eng.stack_lora(s3)
    assert not Path(held.ref[2]).exists() and not Path(second[2]).exists()


def test_a_new_stack_is_written_once_off_the_event_loop_for_all_who_want_it(tiny_chat, pirate_poet, monkeypatch):
    """Writing a stack's LoRA is hundreds of MB for a large model: it runs in a worker thread, not
    on the event loop that serves every tier, and requests that want the same new stack meanwhile
    wait for that one write. A request cancelled while it waits does not stop it for the others."""
    import lora_kernels

    pirate, poet = pirate_poet
    eng = engine(tiny_chat)
    writes = []

    def save(stack, folder, **kw):
        writes.append(threading.current_thread())
        time.sleep(0.2)
        return real(stack, folder, **kw)

    real = lora_kernels.save_stack_as_peft
    monkeypatch.setattr(lora_kernels, "save_stack_as_peft", save)
    blend = ((pirate, 0.5), (poet, -0.7))

    async def main():
        beats = 0

        async def heartbeat():
            nonlocal beats
            while True:
                await asyncio.sleep(0.01)
                beats += 1

        ticking = asyncio.create_task(heartbeat())
        quitter = asyncio.create_task(eng._hold_stack(blend))
        await asyncio.sleep(0.05)
        quitter.cancel()
        held = await asyncio.gather(*(eng._hold_stack(blend) for _ in range(3)))
        ticking.cancel()
        return held, beats

    held, beats = asyncio.run(main())
    assert len(writes) == 1 and writes[0] is not threading.main_thread()
    assert beats >= 10  # the loop ran on while the stack was written (0.2 s)
    assert len({id(h) for h in held}) == 1 and held[0].users == 3  # the cancelled one is not counted
    assert Path(held[0].ref[2]).is_dir()


def test_a_stack_above_the_rank_limit_is_refused_and_not_kept(tiny_chat, pirate_poet):
    pirate, poet = pirate_poet  # ranks 4 and 8
    eng = engine(tiny_chat, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 12, above this engine's max_lora_rank of 8"):
        eng.stack_lora(((pirate, 0.5), (poet, 0.5)))
    kept = eng.stack_lora(((poet, 0.5),))
    assert [p.name for p in Path(kept[2]).parent.iterdir()] == [Path(kept[2]).name]


def test_an_engines_stack_folder_goes_with_the_engine(tiny_chat, pirate_poet):
    """The folder is the engine object's: removed when it is collected (and at exit; by the
    reaper when the process is killed). Every engine that served a stack used to leave one in
    the temp folder."""
    pirate, poet = pirate_poet
    eng = engine(tiny_chat)
    folder = Path(eng.stack_lora(((pirate, 0.5), (poet, -0.7)))[2]).parent
    assert folder.name.startswith("tiergate-tiny-chat-stacks-") and any(folder.iterdir())
    del eng
    gc.collect()
    assert not folder.exists()


def test_max_stack_loras_must_be_positive(tiny_chat):
    with pytest.raises(ValueError, match="max_stack_loras must be >= 1"):
        engine(tiny_chat, max_stack_loras=0)
