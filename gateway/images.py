"""Images: ``plan_images`` checks a request, ``serve_images`` (the serving core, shared with batch
lines) makes the PNGs, and the HTTP handlers render them: POST /v1/images/generations (OpenAI
images), POST /v1/images/edits (a multipart upload: an image, and a mask whose fully transparent
pixels are what to repaint, OpenAI's rule), POST /v1/images/variations (an upload made again, no
prompt) and GET /v1/images/files/{id}.{png,jpeg,webp}, which serves the
images of ``response_format: "url"`` to the key that asked for them, for a limited time. The
workers make PNGs; ``output_format`` jpeg or webp is encoded from them here, as the answer goes
out (``encoded``)."""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal, TypeVar

import anyio
from pydantic import Field
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from accounts.rates import Ask
from gateway.adapters import names_own, resolve_request, served_names
from gateway.auth import Caller
from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request, not_found
from gateway.http import Streamed, disconnect_signal
from gateway.multipart import Multipart, text_fields
from gateway.schemas import MAX_STACK, AdapterChoice, _Body, _Form, loads, parse, read_json
from gateway.service import Services
from gateway.serving import Finished, Gone, Serving, in_thread, relayed
from workers.base import ModelSpec
from workers.image import ImageRequest
from workers.registry import describe

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger("tiergate")

DEFAULT_STEPS = 25
# OpenAI's quality, as denoising steps when num_inference_steps is not given: a share of the default
# (gpt-image-1's low/medium/high, dall-e-3's standard/hd; auto: the default)
QUALITY_STEPS = {"low": 0.4, "medium": 0.7, "auto": 1.0, "standard": 1.0, "high": 1.5, "hd": 1.5}
Quality = Literal["auto", "low", "medium", "high", "standard", "hd"]
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SOURCE_PIXELS = 4096 * 4096  # an edit's uploaded image (and mask), checked before it is decoded
SOURCE_FORMATS = ("PNG", "JPEG", "WEBP")
IMG2IMG_STRENGTH = 0.8  # diffusers' image-to-image default: an edit without a mask, strength not given
# an edit without a mask at ``input_fidelity: high`` (gpt-image-1's "match the input image more closely"), strength
# not given: half the noise, so more of the source's shapes and colours survive (a choice of this server's)
HIGH_FIDELITY_STRENGTH = 0.5
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
DEFAULT_COMPRESSION = 100  # OpenAI's default output_compression for jpeg and webp


class ImageGenerationRequest(_Body):
    model: str = Field(min_length=1)
    prompt: str
    n: int = Field(default=1, ge=1)
    size: str | None = None  # "WxH" or "auto"; None and "auto" = the model's native size
    response_format: Literal["b64_json", "url"] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**62)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float = Field(default=7.0, ge=0, le=50)
    quality: Quality | None = None  # the denoising steps, when num_inference_steps is not given (QUALITY_STEPS)
    output_format: Literal["png", "jpeg", "webp"] | None = None  # the pipelines' PNG, or encoded from it (``encoded``)
    output_compression: int | None = Field(default=None, ge=0, le=100)  # jpeg and webp: 0-100 (quality)
    background: Literal["auto", "opaque", "transparent"] | None = None  # transparent: a 400 (opaque images only)
    # gpt-image-1's filter strictness: accepted, and both values are the same here (no filter runs on image prompts)
    moderation: Literal["auto", "low"] | None = None
    stream: bool = False  # previews while it denoises (partial_images of them), then the image: SSE events
    partial_images: int | None = Field(default=None, ge=0, le=3)
    user: str | None = None
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack


class ImageVariationForm(_Form):
    """``/v1/images/variations``'s text fields (the image is a file part)."""

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    size: str | None = None  # "WxH" or "auto"; None and "auto" = the image's own size
    response_format: Literal["b64_json", "url"] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**62)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float = Field(default=7.0, ge=0, le=50)
    strength: float | None = Field(default=None, gt=0, le=1)  # extension: how far from the source
    user: str | None = None
    adapters: str | None = None  # extension: the LoRA stack as JSON text, as the JSON endpoints take it


class ImageEditForm(ImageVariationForm):
    """``/v1/images/edits``'s text fields (the image and the mask are file parts)."""

    prompt: str
    quality: Quality | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(default=None, ge=0, le=100)
    background: Literal["auto", "opaque", "transparent"] | None = None
    input_fidelity: Literal["high", "low"] | None = None  # without a mask, strength not given: high keeps more
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=3)


@dataclass(frozen=True)
class Plan:
    """A validated request: what the worker gets and what the gate is told."""

    request: ImageRequest
    units: float
    model: str = ""  # the base model (set by plan_images)
    own_adapter: bool = False  # ``model`` named the stack's first adapter (whose refusal names ``model``)


def plan(body: ImageGenerationRequest, limits: LimitsConfig, native: tuple[int, int] | None) -> Plan:
    """Check ``body`` against the limits; every refusal is a 400 naming its field."""
    steps = _checked_steps(body, limits)
    size = _size(body.size, limits.image_max_side, native)
    width, height = size or (None, None)
    pixels = width * height if size else limits.image_max_side**2  # unknown native size: count the largest
    req = ImageRequest(body.prompt, body.n, width, height, body.seed, body.negative_prompt or None, steps,
                       body.guidance_scale)
    return Plan(req, units=float(body.n * pixels * steps))


def _checked_steps(body: ImageGenerationRequest | ImageVariationForm, limits: LimitsConfig) -> int:
    """The fields generations, edits and variations share checked against the limits (the prompt
    where there is one); the denoising steps."""
    if "prompt" in type(body).model_fields:
        _text(body.prompt, "prompt", limits.prompt_max_chars, required=True)
    if body.negative_prompt is not None:
        _text(body.negative_prompt, "negative_prompt", limits.prompt_max_chars, required=False)
    if body.n > limits.image_max_n:
        raise bad_request(f"n is {body.n}, above this server's limit of {limits.image_max_n}", "n")
    share = QUALITY_STEPS[getattr(body, "quality", None) or "auto"]
    steps = body.num_inference_steps or min(max(1, round(DEFAULT_STEPS * share)), limits.image_max_steps)
    if steps > limits.image_max_steps:
        raise bad_request(f"num_inference_steps is {steps}, above this server's limit of {limits.image_max_steps}",
                          "num_inference_steps")
    if getattr(body, "background", None) == "transparent":
        raise bad_request("background transparent is not served: this server's image models make opaque images "
                          "(auto or opaque)", "background")
    if getattr(body, "output_compression", None) is not None and (body.output_format or "png") == "png":
        raise bad_request("output_compression applies to output_format jpeg or webp; a png is lossless",
                          "output_compression")
    return steps


def _text(value: str, param: str, max_chars: int, required: bool) -> None:
    if required and not value.strip():
        raise bad_request(f"{param} must not be empty", param)
    if len(value) > max_chars:
        raise bad_request(f"{param} is {len(value)} characters, above this server's limit of {max_chars}", param)


def _size(size: str | None, max_side: int, native: tuple[int, int] | None) -> tuple[int, int] | None:
    """(width, height) from "WxH"; the native size for None or "auto" (None if unknown)."""
    if size is None or size == "auto":
        if native is not None and max(native) > max_side:
            raise bad_request(f"the model's native size {native[0]}x{native[1]} is above this server's limit of "
                              f"{max_side} pixels a side; ask for a smaller size", "size")
        return native
    m = _SIZE.match(size)
    if m is None:
        raise bad_request(f"size must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto', got {size!r}", "size")
    width, height = int(m[1]), int(m[2])
    if min(width, height) < 8 or width % 8 or height % 8:
        raise bad_request(f"size {size}: both sides must be positive multiples of 8", "size")
    if max(width, height) > max_side:
        raise bad_request(f"size {size} is above this server's limit of {max_side} pixels a side", "size")
    return width, height


# -- edits: the upload decoded and its mask read --------------------------------------------------


def decode_edit(image: bytes, mask: bytes | None, size: str | None, max_side: int,
                whole: bool = False) -> tuple[Image, Image | None]:
    """An edit's source image (RGB) and what to repaint (mode "L": 255 repaint, 0 keep; None = the
    whole image), both at the output size. The mask's fully transparent pixels are what to repaint;
    without a mask, the image's own fully transparent pixels are (OpenAI's rule), and an image with
    none, or any image when ``whole`` (a variation), is edited whole. Runs in a thread: decoding
    is CPU work."""
    source = _open_image(image, "image")
    width, height = _edit_size(size, source.size, max_side)
    if mask is not None:
        held = _open_image(mask, "mask")
        if held.size != source.size:
            raise bad_request(f"the mask is {held.width}x{held.height} and the image {source.width}x{source.height}: "
                              "they must be the same size", "mask", "invalid_mask")
        repaint = _transparent(held)
        if repaint is None:
            raise bad_request("the mask has no alpha channel: its fully transparent pixels say where to edit",
                              "mask", "invalid_mask")
        if repaint.getextrema()[1] == 0:
            raise bad_request("the mask has no fully transparent pixel: nothing to edit", "mask", "invalid_mask")
    else:
        repaint = None if whole else _transparent(source)
        if repaint is not None and repaint.getextrema()[1] == 0:
            repaint = None  # an alpha channel, but nothing transparent: the whole image
    from PIL import Image as PILImage

    rgb = source.convert("RGB")
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), PILImage.Resampling.LANCZOS)
        repaint = repaint.resize((width, height), PILImage.Resampling.NEAREST) if repaint is not None else None
    return rgb, repaint


def _open_image(data: bytes, param: str) -> Image:
    """``data`` decoded by Pillow, as RGBA when it has an alpha channel (a palette or colour-key
    transparency counts as one) and RGB otherwise; a 400 naming ``param`` for anything else than a
    PNG, JPEG or WebP image of at most MAX_SOURCE_PIXELS (:func:`read_image`)."""
    return read_image(data, param, SOURCE_FORMATS, MAX_SOURCE_PIXELS,
                      lambda img: img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info else "RGB"))


T = TypeVar("T")


def read_image(data: bytes, param: str, formats: tuple[str, ...], max_pixels: int, use: Callable[[Image], T]) -> T:
    """``use(image)`` of ``data`` opened by Pillow; a 400 naming ``param`` when it is not one of
    ``formats`` (Pillow's names) of at most ``max_pixels``, both read from its header before any
    pixel is decoded, or when Pillow cannot read it (then or in ``use``)."""
    from PIL import Image as PILImage

    shown = [{"WEBP": "WebP"}.get(f, f) for f in formats]
    names = ", ".join(shown[:-1]) + " or " + shown[-1]
    try:
        with PILImage.open(io.BytesIO(data)) as img:
            if img.format not in formats:
                raise bad_request(f"{param} is a {img.format} image; this endpoint takes {names}", param,
                                  "invalid_image_format")
            if img.width * img.height > max_pixels:
                raise bad_request(f"{param} is {img.width}x{img.height}, above this server's limit of "
                                  f"{max_pixels} pixels", param, "image_too_large")
            return use(img)
    except APIError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):  # (the warning where made an error)
        # Pillow's own guard, in open, above MAX_IMAGE_PIXELS (89M): before the header is ours to read
        raise bad_request(f"{param} has more than {PILImage.MAX_IMAGE_PIXELS} pixels (its header says), above this "
                          f"server's limit of {max_pixels} pixels", param, "image_too_large") from None
    except Exception:  # Pillow's decoders raise many kinds on a damaged or hostile file (OSError, ValueError,
        # SyntaxError, EOFError, zlib's error...), and their messages may quote our buffer's repr
        raise bad_request(f"{param} is not a {names} image this server can read (empty, cut short, damaged "
                          "or an unsupported pixel format)", param, "invalid_image") from None


def _transparent(img: Image) -> Image | None:
    """Mode "L", 255 where ``img`` (from ``_open_image``) is fully transparent and 0 elsewhere;
    None when it has no alpha channel."""
    if img.mode != "RGBA":
        return None
    return img.getchannel("A").point(lambda a: 255 if a == 0 else 0)


def _edit_size(size: str | None, source: tuple[int, int], max_side: int) -> tuple[int, int]:
    """The edit's output size: ``size``, or for None and "auto" the image's own, each side rounded
    down to a multiple of 8."""
    if size is not None and size != "auto":
        return _size(size, max_side, None)
    width, height = source[0] // 8 * 8, source[1] // 8 * 8
    if min(width, height) < 8:
        raise bad_request(f"the image is {source[0]}x{source[1]}; an edit needs both sides at least 8 pixels", "image",
                          "invalid_image")
    if max(width, height) > max_side:
        raise bad_request(f"the image is {source[0]}x{source[1]}, above this server's limit of {max_side} pixels a "
                          "side; ask for a smaller size", "size")
    return width, height


def plan_edit(body: ImageVariationForm, steps: int, image: Image, mask: Image | None) -> Plan:
    """An edit's or a variation's job (a variation: an edit without a prompt): its checked fields
    (``steps`` from ``_checked_steps``), the decoded image and mask; its cost counts the steps
    diffusers runs (``strength`` of them)."""
    width, height = image.size
    strength = body.strength if body.strength is not None else _default_strength(body, mask)
    runs = int(steps * strength)  # diffusers denoises the last int(steps x strength) of the steps
    if runs < 1:
        raise bad_request(f"num_inference_steps {steps} at strength {strength:g} runs no denoising step (an edit runs "
                          "int(steps x strength) of them): ask for more steps or a higher strength",
                          "strength" if body.strength is not None else "num_inference_steps")
    req = ImageRequest(getattr(body, "prompt", ""), body.n, width, height, body.seed, body.negative_prompt or None,
                       steps, body.guidance_scale, image=image, mask=mask, strength=strength)
    return Plan(req, units=float(body.n * width * height * runs))


def _default_strength(body: ImageVariationForm, mask: Image | None) -> float:
    """An edit's strength when the request does not set one: a masked edit repaints the mask's
    pixels from noise (and keeps the rest as they are); the whole image is repainted at diffusers'
    default, or at half the noise for ``input_fidelity: high``."""
    if mask is not None:
        return 1.0
    return HIGH_FIDELITY_STRENGTH if getattr(body, "input_fidelity", None) == "high" else IMG2IMG_STRENGTH


async def serve_images(svc: Services, caller: Caller, job: Plan, gone: Gone | None) -> list[bytes]:
    """The serving core: one generation's PNGs."""
    async with Serving(svc, caller, job.model, job.units, "images", gone, Ask(images=job.request.n),
                       served_names(job.request.adapters), job.own_adapter) as serving:
        worker = serving.worker
        try:
            pngs = await serving.step(lambda ctx: in_thread(lambda: worker.generate(job.request, ctx), ctx),
                                      "generating images with")
        except ValueError as exc:  # what the worker refuses before denoising: not metered
            raise serving.refused(str(exc), None) from None
        _metered(serving, pngs)
        return pngs


async def stream_images(svc: Services, caller: Caller, job: Plan,
                        gone: Gone | None) -> AsyncGenerator[list[bytes] | Finished[list[bytes]], None]:
    """The serving core, streamed: the previews as the model denoises (``job.request.partial_images``
    of them, each a list of PNGs), then ``Finished`` with the PNGs, after the usage is written.
    What goes wrong before the first preview is raised by the first ``__anext__``; closing the
    iterator early stops the model at its next denoising step."""
    done: Finished[list[bytes]] | None = None
    async with Serving(svc, caller, job.model, job.units, "images", gone, Ask(images=job.request.n),
                       served_names(job.request.adapters), job.own_adapter) as serving:
        worker = serving.worker
        pieces = relayed(serving, lambda ctx, send: worker.generate(job.request, ctx, send), "generating images with")
        try:
            async for piece in pieces:
                if isinstance(piece, Finished):
                    done = piece
                else:
                    yield piece
        except ValueError as exc:  # what the worker refuses before denoising: not metered
            raise serving.refused(str(exc), None) from None
        finally:
            await pieces.aclose()
        _metered(serving, done.result)
    yield done  # after the block: its usage is written before the image goes out


def _metered(serving: Serving, pngs: list[bytes]) -> None:
    serving.usage.images = len(pngs)
    serving.usage.pixels = sum(_pixels(png) for png in pngs)


def _pixels(png: bytes) -> int:
    width, height = _png_size(png)
    return width * height


def plan_images(svc: Services, body: ImageGenerationRequest) -> Plan:
    """The job of ``body``: its model and adapter stack resolved, its size and limits checked."""
    spec, stack = resolve_request(svc, body.model, body.adapters, "image")
    job = plan(body, svc.config.limits, _native(svc, spec))
    return replace(job, model=spec.name, request=replace(job.request, adapters=stack), own_adapter=names_own(body.model, stack))


def b64_rows(images: list[bytes]) -> list[dict]:
    return [{"b64_json": base64.b64encode(image).decode("ascii"), "revised_prompt": None} for image in images]


async def encoded(pngs: list[bytes], body: ImageGenerationRequest | ImageVariationForm) -> list[bytes]:
    """The worker's PNGs in the request's ``output_format``: PNG as made; JPEG or WebP encoded
    from them (in a thread) at ``output_compression`` read as the encoder's quality (100 when not
    given): JPEG without chroma subsampling from 90 up, WebP lossless at 100, so the default keeps
    the pixels (within JPEG's rounding)."""
    fmt = getattr(body, "output_format", None) or "png"
    if fmt == "png":
        return pngs
    quality = body.output_compression if body.output_compression is not None else DEFAULT_COMPRESSION
    return await anyio.to_thread.run_sync(lambda: [_transcoded(png, fmt, quality) for png in pngs])


def _transcoded(png: bytes, fmt: str, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    with Image.open(io.BytesIO(png)) as image:
        options = {"subsampling": 0 if quality >= 90 else 2} if fmt == "jpeg" else {"lossless": quality == 100}
        image.convert("RGB").save(buf, format=fmt.upper(), quality=quality, **options)
    return buf.getvalue()


# -- HTTP -------------------------------------------------------------------------------------------


async def generations(request: Request) -> Response:
    """POST /v1/images/generations."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ImageGenerationRequest, await read_json(request, svc.config.limits.max_body))
    await svc.adapters.ready(body.model, body.adapters)
    job = plan_images(svc, body)
    if body.stream:
        return await _streamed(request, svc, caller, job, body, "image_generation")
    async with disconnect_signal(request) as gone:
        pngs = await serve_images(svc, caller, job, gone)
    return await _answer(request, svc, caller, pngs, body)


async def _streamed(request: Request, svc: Services, caller: Caller, job: Plan,
                    body: ImageGenerationRequest | ImageEditForm, kind: str) -> Response:
    """``stream: true``: OpenAI's ``{kind}.partial_image`` events (the previews) and then
    ``{kind}.completed`` (the image), each with its image in ``b64_json`` (in ``output_format``)."""
    if body.n != 1:
        raise bad_request(f"a streamed request makes one image: n must be 1, not {body.n}", "n")
    if body.response_format == "url":
        raise bad_request("a streamed image comes in its events (b64_json): response_format url is not streamed",
                          "response_format")
    job = replace(job, request=replace(job.request, partial_images=body.partial_images or 0))
    async with disconnect_signal(request) as gone:
        pieces = stream_images(svc, caller, job, gone)
        first = await pieces.__anext__()  # errors before any event are HTTP errors
    width, height = _png_size(first.result[0] if isinstance(first, Finished) else first[0])
    shown = {"size": f"{width}x{height}", "quality": body.quality or "auto", "background": "opaque",
             "output_format": body.output_format or "png"}
    return Streamed(_image_events(first, pieces, kind, shown, _prompt_tokens(svc, job), body), "text/event-stream",
                    svc.gate.rate_headers(caller.tier))


async def _image_events(first, pieces, kind: str, shown: dict, prompt_tokens: int,
                        body: ImageGenerationRequest | ImageEditForm) -> AsyncIterator[bytes]:
    """The events of ``_streamed``. A failure after the first event ends the stream with an
    ``error`` event and no completed event."""
    try:
        piece, index = first, 0
        while True:
            image = (await encoded(piece.result if isinstance(piece, Finished) else piece, body))[0]
            b64 = base64.b64encode(image).decode("ascii")
            if isinstance(piece, Finished):
                usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"image_tokens": 0, "text_tokens": prompt_tokens},
                         "output_tokens": 0, "total_tokens": prompt_tokens}
                yield _event(f"{kind}.completed", {"b64_json": b64, **shown, "usage": usage})
                return
            yield _event(f"{kind}.partial_image", {"b64_json": b64, **shown, "partial_image_index": index})
            piece, index = await pieces.__anext__(), index + 1
    except APIError as exc:
        yield _event("error", {"error": exc.body()["error"]})
    except Exception:  # noqa: BLE001 - the response has started: it ends short, and the gateway lives on
        log.exception("image stream failed")
        yield _event("error", {"error": {"message": "the image generation failed", "type": "server_error",
                                         "param": None, "code": "server_error"}})
    finally:
        await pieces.aclose()


def _event(kind: str, data: dict) -> bytes:
    body = json.dumps({"type": kind, **data, "created_at": int(time.time())} if kind != "error" else {"type": kind, **data},
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from the PNG's header (IHDR: big-endian, at bytes 16-24)."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _prompt_tokens(svc: Services, job: Plan) -> int:
    """The prompt's tokens as the pipeline's (first) tokenizer counts them, uncut; 0 when the
    model is gone or has none."""
    worker = svc.arbiter.workers.get(job.model)
    tokenizer = getattr(getattr(worker, "pipe", None), "tokenizer", None)
    return len(tokenizer(job.request.prompt)["input_ids"]) if tokenizer is not None and job.request.prompt else 0


async def edits(request: Request) -> Response:
    """POST /v1/images/edits: multipart ``image`` (one), optional ``mask``, and the text fields."""
    return await _from_image(request, ImageEditForm, ("image", "image[]", "mask"))


async def variations(request: Request) -> Response:
    """POST /v1/images/variations: multipart ``image`` (one) made again, the whole of it, with no
    prompt: image to image at ``strength``."""
    return await _from_image(request, ImageVariationForm, ("image", "image[]"))


async def _from_image(request: Request, form_type: type[ImageVariationForm], files: tuple[str, ...]) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    limits = svc.config.limits
    async with Multipart(request, limits.image_edit_max_bytes, "the image in an 'image' part", "image",
                         max_files=3) as form:
        body = parse(form_type, text_fields(form, files))
        image, mask = await _uploads(form, limits.image_edit_max_bytes)
    await svc.adapters.ready(body.model, _adapters(body.adapters))
    spec, stack = resolve_request(svc, body.model, _adapters(body.adapters), "image")
    steps = _checked_steps(body, limits)  # the fields' 400s before the pixels are decoded
    source, repaint = await anyio.to_thread.run_sync(decode_edit, image, mask, body.size, limits.image_max_side,
                                                     form_type is ImageVariationForm)
    job = plan_edit(body, steps, source, repaint)
    job = replace(job, model=spec.name, request=replace(job.request, adapters=stack), own_adapter=names_own(body.model, stack))
    if getattr(body, "stream", False):
        return await _streamed(request, svc, caller, job, body, "image_edit")
    async with disconnect_signal(request) as gone:
        pngs = await serve_images(svc, caller, job, gone)
    return await _answer(request, svc, caller, pngs, body)


async def _answer(request: Request, svc: Services, caller: Caller, pngs: list[bytes],
                  body: ImageGenerationRequest | ImageVariationForm) -> Response:
    """Generations' answer: the images (in ``output_format``) inline, or as urls of the image
    store for ``url``; ``output_format`` is said when the request named one."""
    images = await encoded(pngs, body)
    fmt = getattr(body, "output_format", None)
    if body.response_format == "url":
        rows = [{"url": _url(request, svc.images.put(caller.key_id, image, fmt or "png"), fmt or "png"),
                 "revised_prompt": None} for image in images]
    else:
        rows = b64_rows(images)
    return JSONResponse({"created": int(time.time()), "data": rows, **({"output_format": fmt} if fmt else {})},
                        headers=svc.gate.rate_headers(caller.tier))


async def _uploads(form: FormData, max_bytes: int) -> tuple[bytes, bytes | None]:
    """The bytes of the one ``image`` (``image[]`` as the SDK sends a list) and of the ``mask``;
    413 when they are more than ``max_bytes`` together."""
    images = form.getlist("image") + form.getlist("image[]")
    masks = form.getlist("mask")
    if not images:
        raise bad_request("missing required parameter: image", "image", "missing_required_parameter")
    for param, parts in (("image", images), ("mask", masks)):
        if len(parts) > 1:
            raise bad_request(f"{len(parts)} {param} parts: this server edits one image (with at most one mask)",
                              param)
        if parts and not isinstance(parts[0], UploadFile):
            raise bad_request(f"{param} must be an uploaded image (a multipart file part), not a text field", param)
    image, mask = await images[0].read(), (await masks[0].read() if masks else None)
    if len(image) + len(mask or b"") > max_bytes:
        raise APIError(413, f"the image and mask are larger than this server's limit of {max_bytes} bytes",
                       "request_too_large", "image")
    return image, mask


def _adapters(text: str | None) -> list[AdapterChoice] | None:
    """The ``adapters`` form field: JSON text of the JSON endpoints' list (a 400 naming it otherwise)."""
    if text is None:
        return None
    try:
        value = loads(text)  # strict, as a body: no depth raises RecursionError
    except ValueError:
        raise bad_request("adapters must be JSON text: a list of {\"name\", \"weight\"} objects", "adapters") from None
    return parse(_EditAdapters, {"adapters": value}).adapters


class _EditAdapters(_Body):
    adapters: list[AdapterChoice] = Field(max_length=MAX_STACK)


async def image_file(request: Request) -> Response:
    """GET /v1/images/files/{image_id}.{png,jpeg,webp}: only for the key that generated it, in
    the format it was made in, until it expires."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    fmt = request.path_params["fmt"]
    image = svc.images.get(caller.key_id, request.path_params["image_id"], fmt) if fmt in MEDIA_TYPES else None
    if image is None:
        raise not_found("no such image (it may have expired)", None, "image_not_found")
    return Response(image, media_type=MEDIA_TYPES[fmt], headers={"cache-control": "private, no-store"})


def _url(request: Request, image_id: str, fmt: str) -> str:
    return str(request.url_for("image_file", image_id=image_id, fmt=fmt))


def _native(svc: Services, spec: ModelSpec) -> tuple[int, int] | None:
    if spec.name not in svc.native_sizes:
        svc.native_sizes[spec.name] = describe(spec).native_size
    return svc.native_sizes[spec.name]
