"""Images in chat messages, for models that read them.

An ``image_url`` content part (chat completions; the Responses API's ``input_image`` becomes one)
carries its image inline as a ``data:`` URL, ``data:image/png;base64,...``. The gateway reads each
into the file's bytes and checks what its header says, before the request is admitted: a PNG,
JPEG, WebP or single-frame GIF of at most ``MAX_PIXELS``, at most ``limits.chat_max_images`` of
them, for a model whose folder has a vision tower (``ModelInfo.images``). Each refusal is a 400
naming the part (``messages[i].content[j].image_url.url``). The pixels are decoded later, off the
event loop, by the engine (``workers.chat_prompt.vision_inputs``).

Remote ``http(s)`` URLs are refused with a 400 that says so: this server does not fetch from the
network on a caller's behalf (a gateway that did would let any key make it request internal
addresses); the client sends the bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import re

from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request
from gateway.schemas import ChatCompletionRequest
from workers.base import ModelSpec
from workers.registry import describe

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # OpenAI's list for image inputs
MAX_PIXELS = 4096 * 4096  # an image's width x height, from its header, before its pixels are decoded
_DATA_URL = re.compile(r"data:(?P<media>[^;,]*)(;[^;,]*)*?;base64,", re.IGNORECASE)


def request_images(body: ChatCompletionRequest, spec: ModelSpec, limits: LimitsConfig) -> tuple[bytes, ...]:
    """The images of ``body``'s image parts, in order, as encoded files; () without any. 400 for a
    model that reads no images, too many images, or one that is not an image this server reads."""
    places = [(i, j, part) for i, m in enumerate(body.messages) for j, part in m.image_parts()]
    if not places:
        return ()
    i, j, _ = places[0]
    check_reads_images(spec, f"messages[{i}].content[{j}].type")
    if len(places) > limits.chat_max_images:
        i, j, _ = places[limits.chat_max_images]
        raise bad_request(f"the request has {len(places)} images, above this server's limit of {limits.chat_max_images}",
                          f"messages[{i}].content[{j}]", "too_many_images")
    return tuple(read_image_url(part.image_url.url, f"messages[{i}].content[{j}].image_url.url") for i, j, part in places)


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


def read_image_url(url: str, param: str) -> bytes:
    """The bytes of an image given as a ``data:`` URL, checked from its header; 400 naming
    ``param`` otherwise."""
    if url.startswith(("http://", "https://")):
        raise bad_request("this server does not fetch images from URLs: send the image inline as a data: URL "
                          "(data:image/png;base64,...)", param, "image_url_not_fetched")
    found = _DATA_URL.match(url)
    if found is None:
        raise bad_request("an image_url must be a data: URL with base64 data (data:image/png;base64,...)", param,
                          "invalid_image_url")
    if not found["media"].lower().startswith("image/"):
        raise bad_request(f"the data: URL holds {found['media'] or 'no media type'!r}, not an image", param,
                          "invalid_image_url")
    try:
        data = base64.b64decode(url[found.end():], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data: URL's base64 data is not valid base64", param, "invalid_image_url") from None
    _check_header(data, param)
    return data


def _check_header(data: bytes, param: str) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise bad_request(f"the image is a {image.format} file; images are PNG, JPEG, WebP or GIF", param,
                                  "invalid_image_format")
            if image.width * image.height > MAX_PIXELS:
                raise bad_request(f"the image is {image.width}x{image.height}, above this server's limit of "
                                  f"{MAX_PIXELS} pixels", param, "image_too_large")
            if getattr(image, "n_frames", 1) > 1:
                raise bad_request("the image is an animated GIF: send one frame", param, "invalid_image_format")
    except APIError:
        raise
    except Exception:  # Pillow raises many kinds on a damaged or hostile header; their messages may quote the buffer
        raise bad_request("the data: URL does not hold an image this server can read (PNG, JPEG, WebP or GIF)", param,
                          "invalid_image") from None
