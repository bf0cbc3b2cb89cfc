"""Text-to-image and image edits: a diffusers pipeline loaded from its folder, one denoising step
per work step. An edit runs the same modules through diffusers' inpainting pipeline for that
pipeline (a mask: only its white pixels are repainted, and the others are the source's, pixel for
pixel) or its image-to-image pipeline (no mask: the whole image, ``strength`` deciding how far).

The pipeline's modules (UNet, VAE, text encoder) are shared by all calls, but each call gets its
own pipeline object with a fresh scheduler: diffusers schedulers, and the pipeline object itself
(``_guidance_scale``, ``_num_timesteps``, ...), hold per-call state, so two calls on one object
from two threads would corrupt each other.

Adapter stacks. Because concurrent calls share the denoiser's weights, a call's adapter stack
(``ImageRequest.adapters``) is merged into them through a :class:`StackGate`: calls wanting the
stack that is merged run together; a call wanting another stack waits until those finish, then the
weights are switched (merge, or restore for the base model) before it starts.
"""

from __future__ import annotations

import copy
import inspect
import io
import itertools
import json
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from lora_kernels import AdapterStack
from workers.base import AdapterStackSpec, Cancelled, ModelSpec, StackKey, StepContext, stack_key
from workers.worker import ModelInfo, ThreadWorker

if TYPE_CHECKING:  # diffusers is imported where a pipeline loads: ~1 s a server without one skips
    from diffusers import DiffusionPipeline
    from PIL.Image import Image


@dataclass
class ImageRequest:
    """One ``/v1/images/generations`` or ``/v1/images/edits`` call. ``width``/``height`` None = the
    model's native size.

    An edit has ``image`` (RGB, already ``width`` x ``height``) and, to repaint part of it,
    ``mask`` (mode "L", the same size: 255 where to repaint, 0 where to keep); ``strength`` (0..1]
    is how much noise the source gets, None for diffusers' default (1.0 with a mask, 0.8 without).
    """

    prompt: str
    n: int = 1
    width: int | None = None
    height: int | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int = 25
    guidance_scale: float = 7.0
    adapters: AdapterStackSpec = ()  # merged into the denoiser for this call; () = the base model
    image: Image | None = None  # an edit's source image
    mask: Image | None = None  # an edit's mask (with image): what to repaint
    strength: float | None = None  # an edit's noise strength; None = diffusers' default
    partial_images: int = 0  # a streamed request's previews while it denoises (0..3)


class StackGate:
    """Which adapter stack the shared weights hold, and who is using them.

    ``key`` is the stack merged now, ``users`` the calls running on it, and one condition guards
    both plus the waiting calls (ticket -> key, in arrival order). A call may start when

    * nobody runs and it wants the stack of the oldest waiting call (the weights are switched
      first, under the lock, with nobody running on them); every call then waiting for that stack
      belongs to this turn and may start too; or
    * its stack is the running one and it belongs to the turn, or no call waiting for another
      stack is older than it (so a stream of same-stack calls cannot starve other stacks).
    """

    def __init__(self) -> None:
        self.key: StackKey = ()
        self.users = 0
        self.switches = 0
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: dict[int, StackKey] = {}
        self._turn: set[int] = set()

    @contextmanager
    def use(self, key: StackKey, switch: Callable[[StackKey], None], ctx: StepContext) -> Iterator[None]:
        """Hold the weights with stack ``key`` for one call; ``switch(key)`` changes the weights.
        Work that yields at its step boundaries (batch work: ``ctx.pause_gate``) lets go of the
        weights while it is paused and takes them again, with its stack, before its next step. Held
        through the pause, a paused call on one stack kept every call wanting another waiting for
        it, the very calls it had paused for: those waited until their clients gave up."""
        self._acquire(key, switch, ctx)
        held, gate = True, ctx.pause_gate

        def paused(c: StepContext) -> None:  # ctx's pause gate, the weights let go while it waits
            nonlocal held
            if c.pause_check is None:  # a gate that says nothing of pausing ahead: called as it is
                gate(c)
                return
            while c.must_pause() and not c.cancelled:
                self._release()
                held = False
                gate(c)
                if c.cancelled:  # (boundary raises Cancelled: nothing to take again)
                    return
                with torch.inference_mode(False):  # a switch here is the one before the call: outside it
                    self._acquire(key, switch, c)
                held = True

        if gate is not None:
            ctx.pause_gate = paused
        try:
            yield
        finally:
            ctx.pause_gate = gate
            if held:
                self._release()

    def _acquire(self, key: StackKey, switch: Callable[[StackKey], None], ctx: StepContext) -> None:
        with self._cond:
            ticket = next(self._tickets)
            self._waiting[ticket] = key
            try:
                while not self._may_start(ticket, key):
                    self._cond.wait(0.05)
                    if ctx.cancelled:
                        raise Cancelled()
                if self.users == 0:
                    if key != self.key:
                        self.key = ()  # what a failed switch leaves: the restored base weights
                        switch(key)
                        self.key = key
                        self.switches += 1
                    self._turn = {t for t, k in self._waiting.items() if k == key}
                self.users += 1
            finally:
                del self._waiting[ticket]
                self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self.users -= 1
            self._cond.notify_all()

    def _may_start(self, ticket: int, key: StackKey) -> bool:
        if self.users == 0:
            return key == self._waiting[min(self._waiting)]
        if key != self.key:
            return False
        return ticket in self._turn or all(k == key for t, k in self._waiting.items() if t < ticket)


class ImageWorker(ThreadWorker):
    """Runs one diffusers text-to-image pipeline."""

    kind = "image"

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.pipe: DiffusionPipeline | None = None
        self._local = threading.local()  # per-thread tokenizer copies (see _own_tokenizers)
        self.adapter_stack: AdapterStack | None = None  # merges adapter stacks into the denoiser
        self.stack_gate = StackGate()
        self.stack_merges = 0  # stack switches that merged adapters (AdapterStack.apply calls)

    @classmethod
    def describe(cls, spec: ModelSpec) -> ModelInfo:
        return ModelInfo(native_size=native_size(Path(spec.path)))

    def load(self, device: torch.device) -> None:
        """Load the pipeline from ``spec.path`` onto ``device`` (fp16 on CUDA, fp32 elsewhere)."""
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(self.spec.path, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(device)
        denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
        self.adapter_stack = AdapterStack(denoiser, offload=device.type == "cuda") if denoiser is not None else None

    def unload(self) -> None:
        self.pipe = None
        self.adapter_stack = None

    def modules(self) -> list[torch.nn.Module]:
        if self.pipe is None:
            return []
        return [c for c in self.pipe.components.values() if isinstance(c, torch.nn.Module)]

    def generate(self, req: ImageRequest, ctx: StepContext,
                 on_partial: Callable[[list[bytes]], None] | None = None) -> list[bytes]:
        """Generate ``req.n`` PNG images; ``ctx.boundary()`` runs after every denoising step.

        ``on_partial`` (a streamed request) is called, on this thread, with previews of the
        images (PNGs of the latents decoded by the VAE) after ``req.partial_images`` of the
        denoising steps spread evenly before the last (``partial_steps``); packed latents (Flux's)
        are unpacked first, and none are sent for latents of another shape.

        Image ``i`` has its own generator seeded ``req.seed + i`` (diffusers draws each image's
        noise from its own generator), so image ``i`` starts from the noise of the ``n=1`` request
        with seed ``req.seed + i``. Its pixels equal that image's within the rounding of the batch
        kernels, not bit for bit: a batch of ``n`` may run other kernels than a batch of one.
        """
        if self.pipe is None:
            raise RuntimeError(f"model {self.spec.name!r} is not loaded")
        if req.n < 1:
            raise ValueError("n must be at least 1")
        if req.mask is not None and (req.image is None or req.mask.size != req.image.size):
            raise ValueError("a mask needs an image of its size")
        for side in (req.width, req.height):
            if side is not None and (side <= 0 or side % 8):
                raise ValueError(f"image sides must be positive multiples of 8, got {side}")
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)  # leaves torch's global RNG alone
        generators = [torch.Generator("cpu").manual_seed(seed + i) for i in range(req.n)]

        size = req.image.size if req.image is not None else (req.width, req.height) if req.width and req.height else None

        def on_step_end(pipe: DiffusionPipeline, step: int, timestep: int, kwargs: dict) -> dict:
            ctx.boundary()
            if on_partial is not None and step in partial_steps(pipe.num_timesteps, req.partial_images):
                previews = _previews(pipe, kwargs["latents"], size)
                if previews is not None:
                    on_partial([_png(self._kept(req, img)) for img in previews])
            return kwargs

        task, kwargs = _task(req)
        switch = lambda key: self._switch_stack(req.adapters)  # noqa: E731
        with self.stack_gate.use(stack_key(req.adapters), switch, ctx), torch.inference_mode():
            pipe = self._call_pipeline(task)
            if task == "image2image" and "width" in inspect.signature(pipe.__call__).parameters:
                width, height = req.image.size  # Flux's takes its default size (1024) otherwise, not the image's
                kwargs.update(width=width, height=height)
            out = pipe(
                prompt=[req.prompt] * req.n,
                negative_prompt=[req.negative_prompt] * req.n if req.negative_prompt else None,
                num_inference_steps=req.num_inference_steps,
                guidance_scale=req.guidance_scale,
                generator=generators,
                callback_on_step_end=on_step_end,
                output_type="pil",
                **kwargs,
            )
        return [_png(self._kept(req, img)) for img in out.images]

    @staticmethod
    def _kept(req: ImageRequest, image: Image) -> Image:
        """An edit with a mask: outside it, the source itself (not its trip through the VAE)."""
        if req.mask is None:
            return image
        from PIL import Image as PILImage

        return PILImage.composite(image.convert("RGB"), req.image, req.mask)

    def _switch_stack(self, stack: AdapterStackSpec) -> None:
        """(under the stack gate, nobody running) Merge ``stack`` into the denoiser, or restore it;
        a failed merge leaves the pristine weights (``AdapterStack.switch``) and raises."""
        if self.adapter_stack is None:
            if stack:
                raise ValueError(f"model {self.spec.name!r} has no unet or transformer to merge adapters into")
            return
        self.adapter_stack.switch(stack)
        self.stack_merges += bool(stack)

    def _own_tokenizers(self) -> dict:
        """This thread's copies of the pipeline's tokenizers. A fast (Rust) tokenizer is not safe
        to share between threads: each call sets its padding and truncation on it, and concurrent
        calls were seen to encode a prompt with another call's settings (a different image for
        the same seed). Copied once per thread, kept for the worker's life."""
        local = self._local.__dict__
        if local.get("pipe") is not self.pipe:
            local["pipe"] = self.pipe
            local["tokenizers"] = {k: copy.deepcopy(v) for k, v in self.pipe.components.items()
                                   if k.startswith("tokenizer") and v is not None}
        return local["tokenizers"]

    def _call_pipeline(self, task: str = "text2image") -> DiffusionPipeline:
        """A pipeline object for one call: the shared modules and a fresh scheduler. ``task``
        "inpaint" or "image2image" gets diffusers' pipeline for that task on the same modules
        (``AutoPipelineFor*.from_pipe``); a ValueError when diffusers has none for this pipeline."""
        pipe = self.pipe
        if task != "text2image":
            from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

            auto = AutoPipelineForInpainting if task == "inpaint" else AutoPipelineForImage2Image
            scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
            try:
                fresh = auto.from_pipe(pipe, scheduler=scheduler, **self._own_tokenizers())
            except ValueError:
                raise ValueError(f"model {self.spec.name!r} ({type(pipe).__name__}) cannot edit images: diffusers "
                                 f"has no {task} pipeline for it") from None
            fresh.set_progress_bar_config(disable=True)
            return fresh
        _, optional = pipe._get_signature_keys(pipe)
        options = {k: pipe.config[k] for k in optional if k in pipe.config}
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        fresh = type(pipe)(**{**pipe.components, "scheduler": scheduler, **self._own_tokenizers()}, **options)
        fresh.set_progress_bar_config(disable=True)
        return fresh


def partial_steps(steps: int, partial_images: int) -> frozenset[int]:
    """The denoising steps (0-based, of ``steps``) after which a streamed request's
    ``partial_images`` previews are made: spread evenly, never the last (the finished image is),
    fewer when there are not enough steps."""
    return frozenset((j + 1) * steps // (partial_images + 1) - 1 for j in range(partial_images)) - {-1, steps - 1}


def _previews(pipe: DiffusionPipeline, latents: torch.Tensor, size: tuple[int, int] | None) -> list[Image] | None:
    """The images ``latents`` (mid-denoising) decode to, as the pipeline decodes its last ones:
    packed ones (Flux's: a sequence of 2x2 patches) unpacked to the image's latents for ``size``
    (width, height; None: the pipeline's default), unscaled (and unshifted) for the VAE, then its
    image processor; None for latents of any other shape."""
    vae = getattr(pipe, "vae", None)
    if vae is None or getattr(pipe, "image_processor", None) is None:
        return None
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):
        latents = _unpacked(pipe, latents, size)
    if latents is None or latents.ndim != 4:
        return None
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    pixels = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor + shift, return_dict=False)[0]
    return pipe.image_processor.postprocess(pixels, output_type="pil")


def _unpacked(pipe: DiffusionPipeline, latents: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor | None:
    """Packed latents (batch, patches, channels x 4) as the pipeline unpacks them before decoding,
    for an image of ``size``; None when the patches are not that size's (a size the pipeline
    rounded otherwise)."""
    scale = pipe.vae_scale_factor
    if size is None:
        default = getattr(pipe, "default_sample_size", None)
        if default is None:
            return None
        size = (default * scale, default * scale)
    width, height = size
    if (height // (scale * 2)) * (width // (scale * 2)) != latents.shape[1]:
        return None
    return pipe._unpack_latents(latents, height, width, scale)


def _task(req: ImageRequest) -> tuple[str, dict]:
    """The diffusers task of ``req`` and the call's arguments for it beyond the shared ones."""
    if req.image is None:
        return "text2image", {"width": req.width, "height": req.height}
    strength = {} if req.strength is None else {"strength": req.strength}
    if req.mask is None:  # image-to-image takes its size from the image (or is told it: generate)
        return "image2image", {"image": req.image, **strength}
    width, height = req.image.size
    return "inpaint", {"image": req.image, "mask_image": req.mask, "width": width, "height": height, **strength}


def native_size(path: Path) -> tuple[int, int] | None:
    """The pipeline's default image size (width, height), read from its folder as diffusers
    computes it: denoiser ``sample_size`` times the VAE's down-sampling factor. None when the
    folder does not say."""
    try:
        vae = json.loads((path / "vae" / "config.json").read_text())
        scale = 2 ** (len(vae["block_out_channels"]) - 1)
        for denoiser in ("unet", "transformer"):
            cfg = path / denoiser / "config.json"
            if cfg.exists():
                sample = json.loads(cfg.read_text()).get("sample_size")
                if isinstance(sample, int):
                    return sample * scale, sample * scale
                if isinstance(sample, list) and len(sample) == 2:
                    return sample[1] * scale, sample[0] * scale
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
