"""Images in chat messages, for models that read them.

An ``image_url`` content part (chat completions; the Responses API's ``input_image`` becomes one)
carries its image inline as a ``data:`` URL, ``data:image/png;base64,...``. The gateway reads each
into the file's bytes and checks what its header says, before the request is admitted (a payload
over ``INLINE_DECODE`` is decoded on a thread, in :func:`resolve_images`: 10 MiB of base64 takes
~27 ms, which the event loop would otherwise not spend on anyone else): a PNG,
JPEG, WebP or single-frame GIF of at most ``MAX_SIDE`` pixels a side, at most ``limits.chat_max_images`` of
them, for a model whose folder has a vision tower (``ModelInfo.images``). Each refusal is a 400
naming the part (``messages[i].content[j].image_url.url``). :func:`resolve_images` then decodes
every image's pixels on a thread, one at a time, still before admission: a file cut short or
damaged past its header is that 400 too (``invalid_image``), not a failure in the engine after a
slot was taken and the request metered. The engine decodes them again for the model's processor
(``workers.chat_prompt.vision_inputs``), off the event loop.

The Responses API's ``input_image`` may name an uploaded file instead (``file_id``: the caller's
file of purpose ``vision`` or ``user_data``), read as that file's data: URL
(``gateway.responses.file_images``).

Remote ``http(s)`` URLs are fetched only from the hosts tiers.yaml names
(``server.image_url_hosts``: exact names, or ``*.example.com`` for its subdomains); any other is a
400 that says so. A gateway that fetched any URL would let every key make it request addresses on
its own network. A fetch (:func:`resolve_images`, before admission, so no slot or model waits on the
network) follows no redirect (it could leave the listed hosts), gives up after
``limits.image_fetch_timeout_s`` and past ``limits.image_fetch_max_bytes``, and its file is checked
as a data: URL's is; each failure is a 400 naming the part (``image_url_fetch_failed``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from dataclasses import dataclass

from gateway.config import Config, LimitsConfig
from gateway.errors import bad_request
from gateway.fetching import client, fetch, host_of, is_remote, listed
from gateway.images import read_image
from gateway.schemas import ChatCompletionRequest
from workers.base import ModelSpec
from workers.registry import describe

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # OpenAI's list for image inputs
MAX_SIDE = 4096  # either side of an image, from its header, before its pixels are decoded: the processor scales
# the short side to its size, so a long thin image within MAX_PIXELS (16777216 x 1) would grow to billions of pixels
MAX_PIXELS = MAX_SIDE * MAX_SIDE  # its width x height
_DATA_URL = re.compile(r"data:(?P<media>[^;,]*)(;[^;,]*)*?;base64,", re.IGNORECASE)
INLINE_DECODE = 64 * 1024  # base64 characters a data: URL may have to be decoded on the event loop


@dataclass(frozen=True)
class PendingImage:
    """An image part not read yet (:func:`resolve_images`): an http(s) URL on a listed host, a
    data: URL too long to decode on the event loop, or ``data``, a file whose header was read and
    whose pixels are still to decode."""

    url: str
    param: str  # the part, for a 400
    data: bytes | None = None

    @property
    def remote(self) -> bool:
        return is_remote(self.url)


def request_images(body: ChatCompletionRequest, spec: ModelSpec, config: Config) -> tuple[PendingImage, ...]:
    """The images of ``body``'s image parts, in order, to read (:func:`resolve_images`); () without
    any. 400 for a model that reads no images, too many images, or one that is not an image
    this server reads or fetches (from its header)."""
    for m in body.messages:
        if isinstance(m.content, list):
            break
    else:  # all text (nearly every request): nothing to look for
        return ()
    places = [(i, j, part) for i, m in enumerate(body.messages) for j, part in m.image_parts()]
    if not places:
        return ()
    i, j, _ = places[0]
    check_reads_images(spec, f"messages[{i}].content[{j}].type")
    limits = config.limits
    if len(places) > limits.chat_max_images:
        i, j, _ = places[limits.chat_max_images]
        raise bad_request(f"the prompt has {len(places)} images, above this server's limit of {limits.chat_max_images}",
                          f"messages[{i}].content[{j}]", "too_many_images")
    return tuple(_pending(part.image_url.url, f"messages[{i}].content[{j}].image_url.url",
                          config.server.image_url_hosts) for i, j, part in places)


def _pending(url: str, param: str, hosts: list[str]) -> PendingImage:
    read = read_image_url(url, param, hosts)
    return read if isinstance(read, PendingImage) else PendingImage(url, param, read)


async def resolve_images(images: tuple[bytes | PendingImage, ...], limits: LimitsConfig) -> tuple[bytes, ...]:
    """``images`` with every pending one read (fetched at the same time, long data: URLs decoded on
    a thread) and checked, then its pixels decoded on a thread, one image at a time (a decoded
    4096x4096 image is 64 MiB): a 400 naming the part for one that does not decode."""
    if not any(isinstance(image, PendingImage) for image in images):
        return images  # type: ignore[return-value]
    if any(isinstance(image, PendingImage) and image.remote for image in images):
        async with client(limits.image_fetch_timeout_s) as http:
            files = await asyncio.gather(*(_read(http, image, limits) for image in images))
    else:
        files = [await _read(None, image, limits) for image in images]
    pending = [(data, image.param) for data, image in zip(files, images) if isinstance(image, PendingImage)]
    await asyncio.to_thread(_check_pixels, pending)
    return tuple(files)


async def _read(http, image: bytes | PendingImage, limits: LimitsConfig) -> bytes:
    if not isinstance(image, PendingImage):
        return image
    if image.data is not None:
        return image.data
    if image.remote:
        return await _fetch(http, image, limits)
    return await asyncio.to_thread(_decode, image.url, _DATA_URL.match(image.url).end(), image.param)


def _check_pixels(images: list[tuple[bytes, str]]) -> None:
    """Each image's pixels decoded (then let go): one cut short or damaged past its header is a 400
    naming its part (``invalid_image``) here, before admission, not the engine's failure after it."""
    for data, param in images:
        read_image(data, param, FORMATS, MAX_PIXELS, lambda image: image.load())


async def _fetch(http, image: PendingImage, limits: LimitsConfig) -> bytes:
    data = await fetch(http, image.url, image.param, limits.image_fetch_timeout_s, limits.image_fetch_max_bytes,
                       "image", "image_url_fetch_failed", "image_too_large")
    _check_header(data, image.param)
    return data


def check_reads_images(spec: ModelSpec, param: str) -> None:
    """A 400 naming ``param`` (the first image part) unless ``spec``'s model reads images."""
    if describe(spec).images:
        return
    if spec.engine == "vllm":
        message = (f"the model {spec.name} runs on the vllm engine, which takes no image parts here: serve a vision "
                   "model with engine: transformers")
    else:
        message = f"the model {spec.name} reads text only: image parts need a vision-language model"
    raise bad_request(message, param, "image_input_not_supported")


def read_image_url(url: str, param: str, hosts: list[str] = ()) -> bytes | PendingImage:
    """The bytes of an image given as a ``data:`` URL, checked from its header (pending when its
    data is longer than INLINE_DECODE), or an http(s) URL on one of ``hosts``, pending; 400 naming
    ``param`` otherwise."""
    if is_remote(url):
        if listed(url, hosts):
            return PendingImage(url, param)
        raise bad_request(f"this server does not fetch images from {host_of(url) or 'that URL'}: send the image inline as a "
                          "data: URL (data:image/png;base64,...)", param, "image_url_not_fetched")
    found = _DATA_URL.match(url)
    if found is None:
        raise bad_request("an image_url must be a data: URL with base64 data (data:image/png;base64,...)", param,
                          "invalid_image_url")
    if not found["media"].lower().startswith("image/"):
        raise bad_request(f"the data: URL holds {found['media'] or 'no media type'!r}, not an image", param,
                          "invalid_image_url")
    if len(url) - found.end() > INLINE_DECODE:
        return PendingImage(url, param)
    return _decode(url, found.end(), param)


def image_type(data: bytes) -> str | None:
    """The media type of an image file in one of ``FORMATS`` (``image/png``...), from its header;
    None for anything else."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # an image, of too many pixels to open:
        kind = _sniffed(data)  # its type all the same (refused as image_too_large where it is read)
    except (UnidentifiedImageError, OSError, ValueError):
        return None
    return f"image/{kind.lower()}" if kind in FORMATS else None


def _sniffed(data: bytes) -> str | None:
    """The format of ``FORMATS`` that ``data``'s magic bytes name, where Pillow will not open it."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    magic = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF"}
    return next((kind for head, kind in magic.items() if data.startswith(head)), None)


def _decode(url: str, start: int, param: str) -> bytes:
    """A data: URL's file from its base64 data at ``start``, checked from its header."""
    try:
        data = base64.b64decode(url[start:], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data: URL's base64 data is not valid base64", param, "invalid_image_url") from None
    _check_header(data, param)
    return data


def _check_header(data: bytes, param: str) -> None:
    def one_frame(image) -> None:
        if max(image.size) > MAX_SIDE:
            raise bad_request(f"{param} is {image.width}x{image.height}, above this server's limit of {MAX_SIDE} "
                              "pixels a side", param, "image_too_large")
        if getattr(image, "n_frames", 1) > 1:
            raise bad_request(f"{param} is an animated {image.format} ({image.n_frames} frames): send one frame", param,
                              "invalid_image_format")  # (an animated PNG or WebP too, not only a GIF)

    read_image(data, param, FORMATS, MAX_PIXELS, one_frame)
