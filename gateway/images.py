"""POST /v1/images/generations (OpenAI images) and GET /v1/images/files/{id}.png, which serves
the images of ``response_format: "url"`` to the key that asked for them, for a limited time."""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.adapters import resolve_request
from gateway.auth import Caller
from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import MAX_STACK, AdapterChoice, _Body, parse, read_json
from gateway.service import ClientGone, Services, in_thread, unless_gone
from workers.base import Cancelled, ModelSpec
from workers.image import ImageRequest

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


class ImageStore:
    """PNGs behind ``response_format: "url"``: owner key id + bytes, expiring after ``ttl_s``,
    at most ``max_bytes`` in all (the oldest go first). Insertion order is expiry order."""

    def __init__(self, ttl_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_bytes, self.clock = ttl_s, max_bytes, clock
        self._items: OrderedDict[str, tuple[str, float, bytes]] = OrderedDict()  # id -> (owner, expires, png)
        self.bytes = 0

    def put(self, owner: str, png: bytes) -> str:
        self._expire()
        while self._items and self.bytes + len(png) > self.max_bytes:
            self._drop(next(iter(self._items)))
        image_id = f"img-{secrets.token_urlsafe(18)}"
        self._items[image_id] = (owner, self.clock() + self.ttl_s, png)
        self.bytes += len(png)
        return image_id

    def get(self, owner: str, image_id: str) -> bytes | None:
        """The image if it exists, has not expired, and belongs to ``owner``; else None."""
        self._expire()
        item = self._items.get(image_id)
        if item is None or not secrets.compare_digest(item[0], owner):
            return None
        return item[2]

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items and next(iter(self._items.values()))[1] <= now:
            self._drop(next(iter(self._items)))

    def _drop(self, image_id: str) -> None:
        self.bytes -= len(self._items.pop(image_id)[2])


@dataclass(frozen=True)
class Plan:
    """A validated request: what the worker gets and what the gate is told."""

    request: ImageRequest
    units: float


def native_size(path: Path) -> tuple[int, int] | None:
    """The pipeline's default image size, read from its folder as diffusers computes it:
    denoiser ``sample_size`` times the VAE's down-sampling factor. None when the folder does not say."""
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


async def generations(request: Request) -> Response:
    svc: Services = request.app.state.services
    caller = svc.admit_caller(request)
    data = await read_json(request, svc.config.limits.max_body)
    return await generate(svc, caller, data, request)


async def generate(svc: Services, caller: Caller, data: dict, request: Request | None) -> Response:
    """Serve one image generation body for ``caller`` (``request`` None: nobody to watch for)."""
    arrived = time.monotonic()
    body = parse(ImageGenerationRequest, data)
    spec, stack = resolve_request(svc, body.model, body.adapters, "image")
    job = plan(body, svc.config.limits, _native(svc, spec))
    job = Plan(replace(job.request, adapters=stack), job.units)
    if body.response_format == "url" and request is None:
        raise bad_request("response_format 'url' is only for live requests; use b64_json", "response_format")
    held = await unless_gone(request, svc.hold(caller.tier, spec.name, job.units))
    ok = False
    try:
        worker, ctx = held.lease.worker, held.lease.context()
        pngs = await unless_gone(request, in_thread(lambda: worker.generate(job.request, ctx), ctx))
        ok = True
    except Cancelled:
        raise ClientGone() from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except torch.OutOfMemoryError:
        raise APIError(503, f"out of memory generating images with {spec.name}", "out_of_memory") from None
    finally:
        held.release(ok=ok)
        svc.metrics.latency.labels(caller.tier, "images").observe(time.monotonic() - arrived)
    if body.response_format == "url":
        data_rows = [{"url": _url(request, _store(svc).put(caller.key_id, png)), "revised_prompt": None} for png in pngs]
    else:
        data_rows = [{"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": None} for png in pngs]
    return JSONResponse({"created": int(time.time()), "data": data_rows}, headers=svc.gate.rate_headers(caller.tier))


async def image_file(request: Request) -> Response:
    """GET /v1/images/files/{image_id}.png: only for the key that generated it, until it expires."""
    svc: Services = request.app.state.services
    caller = svc.authenticate(request)
    png = _store(svc).get(caller.key_id, request.path_params["image_id"])
    if png is None:
        raise not_found("no such image (it may have expired)", None, "image_not_found")
    return Response(png, media_type="image/png", headers={"cache-control": "private, no-store"})


def _url(request: Request, image_id: str) -> str:
    return str(request.url_for("image_file", image_id=image_id))


def _store(svc: Services) -> ImageStore:
    return svc.extras["image_store"]


def _native(svc: Services, spec: ModelSpec) -> tuple[int, int] | None:
    sizes: dict[str, tuple[int, int] | None] = svc.extras.setdefault("image_native_sizes", {})
    if spec.name not in sizes:
        sizes[spec.name] = native_size(Path(spec.path))
    return sizes[spec.name]


def routes(svc: Services) -> list[BaseRoute]:
    limits = svc.config.limits
    svc.extras["image_store"] = ImageStore(limits.image_url_ttl_s, limits.image_url_store)
    return [
        Route("/v1/images/generations", generations, methods=["POST"]),
        Route("/v1/images/files/{image_id}.png", image_file, methods=["GET"], name="image_file"),
    ]
