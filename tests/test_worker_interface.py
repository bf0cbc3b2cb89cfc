"""Every worker class the registry names satisfies the worker interface the arbiter calls, and
tells the gateway what it needs before loading (context length, native size, voices)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from workers.base import ModelSpec
from workers.registry import WORKERS, describe, make_worker, worker_class
from workers.worker import ModelInfo, ThreadWorker, Worker

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind, engine", sorted(WORKERS))
def test_every_registered_class_implements_the_interface(kind, engine):
    cls = worker_class(ModelSpec("m", kind, "unused", engine=engine))
    assert issubclass(cls, Worker) and not inspect.isabstract(cls)
    assert (cls.kind, cls.engine) == (kind, engine)
    for call in ("place", "to_host", "to_device", "release"):
        assert inspect.iscoroutinefunction(getattr(cls, call)), call
    assert cls.reserves_memory == (not issubclass(cls, ThreadWorker))  # in-process workers are measured


def test_an_unknown_kind_or_engine_is_a_clear_error():
    with pytest.raises(ValueError, match="no worker runs a image model on 'vllm'"):
        worker_class(ModelSpec("m", "image", "unused", engine="vllm"))


def test_describe_reads_what_the_gateway_needs_from_the_folder(tiny_chat, tiny_image, tiny_tts, tiny_stt, tiny_embed):
    assert describe(ModelSpec("c", "chat", tiny_chat)) == ModelInfo(context_length=512)
    vllm = ModelSpec("c", "chat", tiny_chat, engine="vllm", options={"max_model_len": 256})
    assert describe(vllm).context_length == 256
    assert describe(ModelSpec("c", "chat", tiny_chat, engine="vllm")).context_length == 512
    assert describe(ModelSpec("i", "image", tiny_image)) == ModelInfo(native_size=(64, 64))
    assert describe(ModelSpec("t", "tts", tiny_tts)) == ModelInfo(voices=("amy", "ben", "cleo"))
    assert describe(ModelSpec("s", "stt", tiny_stt)) == ModelInfo()
    assert describe(ModelSpec("e", "embed", tiny_embed)) == ModelInfo(context_length=128)


def test_a_thread_worker_moves_through_every_place(tiny_chat):
    """place -> to_host -> to_device -> release, through the interface alone, then placed again."""
    worker = make_worker(ModelSpec("c", "chat", tiny_chat, options={"max_num_seqs": 2}))

    def devices() -> set[str]:
        return {p.device.type for m in worker.modules() for p in m.parameters()}

    async def cycle() -> None:
        await worker.place(CPU)
        assert devices() == {"cpu"} and worker.device == CPU
        assert await worker.to_host(pin=False) is True
        assert devices() == {"cpu"}
        await worker.to_device(CPU)
        assert devices() == {"cpu"}
        await worker.release()
        assert worker.modules() == []
        await worker.place(CPU)  # a released worker may be placed again
        assert devices() == {"cpu"}
        await worker.release()

    asyncio.run(cycle())


class _Recording(ThreadWorker):
    """A thread worker whose load only records what torch's attention flag said when it ran."""

    kind = "chat"

    def __init__(self) -> None:
        self.cudnn_at_load: list[bool] = []

    @classmethod
    def describe(cls, spec):
        return ModelInfo()

    def load(self, device):
        self.cudnn_at_load.append(torch.backends.cuda.cudnn_sdp_enabled())
        self.device = device

    def unload(self) -> None:
        pass

    def modules(self):
        return []


def test_placing_on_cuda_takes_cudnn_out_of_attention_first():
    """cuDNN builds an attention plan per shape, so a decode step whose key length grows paid one
    every step on a Hopper GPU (docs/BENCHMARKS.md): a worker placed on CUDA finds it switched
    off for the process before its load; placing on the CPU leaves torch's order alone."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        worker = _Recording()
        asyncio.run(worker.place(CPU))
        assert worker.cudnn_at_load == [True] and torch.backends.cuda.cudnn_sdp_enabled()
        asyncio.run(worker.place(torch.device("cuda", 0)))  # the recording load touches no device
        assert worker.cudnn_at_load == [True, False] and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
