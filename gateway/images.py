"""Images: ``plan_images`` checks a request, ``serve_images`` (the serving core, shared with batch
lines) makes the PNGs, and the HTTP handlers render them: POST /v1/images/generations (OpenAI
images) and GET /v1/images/files/{id}.png, which serves the images of ``response_format: "url"``
to the key that asked for them, for a limited time."""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from accounts.rates import Ask
from gateway.adapters import resolve_request
from gateway.auth import Caller
from gateway.config import LimitsConfig
from gateway.errors import bad_request, not_found
from gateway.http import disconnect_signal
from gateway.schemas import MAX_STACK, AdapterChoice, _Body, parse, read_json
from gateway.service import Services
from gateway.serving import Gone, Serving, in_thread
from workers.base import ModelSpec
from workers.image import ImageRequest
from workers.registry import describe

DEFAULT_STEPS = 25
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


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
    # OpenAI fields accepted with the only values this server has
    quality: Literal["auto", "standard"] | None = None
    output_format: Literal["png"] | None = None
    stream: Literal[False] | None = None
    user: str | None = None
    adapters: list[AdapterChoice] | None = Field(default=None, max_length=MAX_STACK)  # extension: LoRA stack


@dataclass(frozen=True)
class Plan:
    """A validated request: what the worker gets and what the gate is told."""

    request: ImageRequest
    units: float
    model: str = ""  # the base model (set by plan_images)


def plan(body: ImageGenerationRequest, limits: LimitsConfig, native: tuple[int, int] | None) -> Plan:
    """Check ``body`` against the limits; every refusal is a 400 naming its field."""
    _text(body.prompt, "prompt", limits.prompt_max_chars, required=True)
    if body.negative_prompt is not None:
        _text(body.negative_prompt, "negative_prompt", limits.prompt_max_chars, required=False)
    if body.n > limits.image_max_n:
        raise bad_request(f"n is {body.n}, above this server's limit of {limits.image_max_n}", "n")
    steps = body.num_inference_steps or min(DEFAULT_STEPS, limits.image_max_steps)
    if steps > limits.image_max_steps:
        raise bad_request(f"num_inference_steps is {steps}, above this server's limit of {limits.image_max_steps}",
                          "num_inference_steps")
    size = _size(body.size, limits.image_max_side, native)
    width, height = size or (None, None)
    pixels = width * height if size else limits.image_max_side**2  # unknown native size: count the largest
    req = ImageRequest(body.prompt, body.n, width, height, body.seed, body.negative_prompt or None, steps,
                       body.guidance_scale)
    return Plan(req, units=float(body.n * pixels * steps))


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


async def serve_images(svc: Services, caller: Caller, job: Plan, gone: Gone | None) -> list[bytes]:
    """The serving core: one generation's PNGs."""
    async with Serving(svc, caller, job.model, job.units, "images", gone, Ask(images=job.request.n)) as serving:
        worker = serving.worker
        try:
            pngs = await serving.step(lambda ctx: in_thread(lambda: worker.generate(job.request, ctx), ctx),
                                      "generating images with")
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        serving.usage.images = len(pngs)
        serving.usage.pixels = sum(_pixels(png) for png in pngs)
        return pngs


def _pixels(png: bytes) -> int:
    """Width times height, from the PNG's header (IHDR: big-endian, at bytes 16-24)."""
    return int.from_bytes(png[16:20], "big") * int.from_bytes(png[20:24], "big")


def plan_images(svc: Services, body: ImageGenerationRequest) -> Plan:
    """The job of ``body``: its model and adapter stack resolved, its size and limits checked."""
    spec, stack = resolve_request(svc, body.model, body.adapters, "image")
    job = plan(body, svc.config.limits, _native(svc, spec))
    return replace(job, model=spec.name, request=replace(job.request, adapters=stack))


def b64_rows(pngs: list[bytes]) -> list[dict]:
    return [{"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": None} for png in pngs]


# -- HTTP -------------------------------------------------------------------------------------------


async def generations(request: Request) -> Response:
    """POST /v1/images/generations."""
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    body = parse(ImageGenerationRequest, await read_json(request, svc.config.limits.max_body))
    job = plan_images(svc, body)
    async with disconnect_signal(request) as gone:
        pngs = await serve_images(svc, caller, job, gone)
    if body.response_format == "url":
        rows = [{"url": _url(request, svc.images.put(caller.key_id, png)), "revised_prompt": None} for png in pngs]
    else:
        rows = b64_rows(pngs)
    return JSONResponse({"created": int(time.time()), "data": rows}, headers=svc.gate.rate_headers(caller.tier))


async def image_file(request: Request) -> Response:
    """GET /v1/images/files/{image_id}.png: only for the key that generated it, until it expires."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    png = svc.images.get(caller.key_id, request.path_params["image_id"])
    if png is None:
        raise not_found("no such image (it may have expired)", None, "image_not_found")
    return Response(png, media_type="image/png", headers={"cache-control": "private, no-store"})


def _url(request: Request, image_id: str) -> str:
    return str(request.url_for("image_file", image_id=image_id))


def _native(svc: Services, spec: ModelSpec) -> tuple[int, int] | None:
    if spec.name not in svc.native_sizes:
        svc.native_sizes[spec.name] = describe(spec).native_size
    return svc.native_sizes[spec.name]
