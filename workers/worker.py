"""The worker interface: what the arbiter calls to move a model's weights, and what the gateway
may know of a model before its weights are loaded.

Every worker runs one model of one kind and implements :class:`Worker`. The arbiter calls its four
residency methods on the event loop, one at a time per worker, and never asks what kind of worker
it holds:

* ``place(device)`` loads the weights from disk onto the device (again after ``release``);
* ``to_host(pin)`` moves them into host RAM (pinned, for a fast way back) and returns True, or
  returns False when this worker cannot keep a host copy, having released its memory instead;
* ``to_device(device)`` brings a host copy back;
* ``release()`` frees the weights (device and host); the object may be placed again.

A worker whose engine dies under it (vLLM's engine core process) says so: ``failure`` names why,
and its requests raise :class:`WorkerFailed`; the arbiter then releases it and places the model
again for the next request.

Where a worker's memory lives decides how the arbiter counts it: ``modules()`` lists the torch
modules holding its weights in this process, which the arbiter measures after a load; a worker
whose memory lives in other processes (``reserves_memory``) is counted at its reservation.

:class:`ThreadWorker` is the base of workers that load and compute on threads in this process
(transformers and diffusers models): it runs their synchronous ``load``/``unload`` in a worker
thread and moves their modules with ``module.to``. An engine that owns its processes (vLLM)
implements the four calls itself, on the loop.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from workers.base import ModelKind, ModelSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway may know of a model without loading it, read from its folder."""

    context_length: int | None = None  # chat: prompt plus completion tokens
    native_size: tuple[int, int] | None = None  # image: (width, height) when the folder says
    voices: tuple[str, ...] = ()  # tts: the model's own voice names, in order
    images: bool = False  # chat: the model reads images in its messages (a vision-language model)


class WorkerFailed(RuntimeError):
    """The worker can serve no more requests: its engine died (the message says which and why)."""


class Worker(ABC):
    """One model of one kind, placed and evicted by the arbiter (see the module docstring)."""

    kind: ClassVar[ModelKind]
    engine: ClassVar[str] = "transformers"
    reserves_memory: ClassVar[bool] = False  # its memory lives in other processes: count the reservation
    spec: ModelSpec

    @classmethod
    @abstractmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        """What the gateway needs to know of ``spec``'s model, without loading its weights."""

    @abstractmethod
    async def place(self, device: torch.device) -> None:
        """Load the weights from disk onto ``device``."""

    @abstractmethod
    async def to_host(self, pin: bool) -> bool:
        """Move the weights to host RAM (pinned if ``pin``); False: released instead (no host copy)."""

    @abstractmethod
    async def to_device(self, device: torch.device) -> None:
        """Bring the host copy back onto ``device``."""

    @abstractmethod
    async def release(self) -> None:
        """Free the weights, on the device and in host RAM. ``place`` may be called again."""

    def modules(self) -> list[torch.nn.Module]:
        """The torch modules holding its weights in this process (measured after a load)."""
        return []

    @property
    def failure(self) -> str | None:
        """Why this placed worker can serve no more requests (its engine died), or None."""
        return None


def keep_cudnn_out_of_attention() -> None:
    """Take cuDNN out of torch's attention kernels (``scaled_dot_product_attention``), for the
    whole process, before a model is placed on CUDA.

    torch (2.11 here) tries cuDNN first for attention with a mask on Hopper and newer GPUs, and
    cuDNN builds an execution plan for every new shape (tens of ms each, then cached). A chat
    engine's key length grows by one every decode step, so every step paid a build: on an H200
    the transformers engine took 27.8 ms a step for 8 rows of tiny-chat with cuDNN and 2.85 ms
    without (docs/BENCHMARKS.md, "On a GPU"; the same finding: pytorch's order on sm_100 in
    modelscope/FunASR#3704). Without it torch picks flash, memory-efficient or math kernels, which
    need no plan. The switch is process-wide (torch keeps one flag, not one per thread), so it is
    set here, once, and never set back."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


class ThreadWorker(Worker):
    """A worker whose model lives in this process: ``load(device)`` and ``unload()`` are
    synchronous (they run in a worker thread, off the loop), ``modules()`` lists the weights."""

    device: torch.device | None = None  # where its modules are now

    @abstractmethod
    def load(self, device: torch.device) -> None:
        """(thread) Load the weights from ``spec.path`` onto ``device``."""

    @abstractmethod
    def unload(self) -> None:
        """(thread) Drop the weights and stop any thread the worker runs."""

    @abstractmethod
    def modules(self) -> list[torch.nn.Module]: ...

    async def place(self, device: torch.device) -> None:
        if device.type == "cuda":
            keep_cudnn_out_of_attention()
        await asyncio.to_thread(self.load, device)

    async def to_host(self, pin: bool) -> bool:
        import torch

        await asyncio.to_thread(self._move, torch.device("cpu"), pin)
        return True

    async def to_device(self, device: torch.device) -> None:
        await asyncio.to_thread(self._move, device, False)

    async def release(self) -> None:
        await asyncio.to_thread(self.unload)

    def _move(self, device: torch.device, pin: bool) -> None:
        """(thread) Move every module to ``device``; pinned host memory makes the way back a fast copy."""
        for module in self.modules():
            module.to(device)
            if pin:
                for t in (*module.parameters(), *module.buffers()):
                    t.data = t.data.pin_memory()
        self.device = device
