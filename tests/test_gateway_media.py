"""Images, speech and transcriptions through the official openai SDK and raw HTTP against a real
uvicorn serving the tiny demo models; bad input; and a client leaving mid-generation."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import struct
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai.types.audio import TranscriptionVerbose
import soundfile as sf
from PIL import Image

from gateway.image_store import ImageStore
from tests.helpers import RunningServer, png_claiming, recorded, spoken, start_server, write_config
from workers.audio import decode_audio, supported_speech_formats
from workers.base import ModelSpec
from workers.tts import TTSWorker

LIMITS = """limits:
  prompt_max_chars: 200
  image_max_n: 2
  image_max_side: 128
  image_max_steps: 400
  image_url_ttl_s: 60
  image_edit_max_bytes: 128KiB
  speech_max_chars: 20000
  transcription_max_bytes: 1MiB
  transcription_max_seconds: 20
"""


@pytest.fixture(scope="module")
def media(tiny_image: Path, tiny_tts: Path, tiny_stt: Path, tmp_path_factory) -> RunningServer:
    folder = tmp_path_factory.mktemp("media-server")
    models = {"tiny-image": ("image", tiny_image), "tiny-tts": ("tts", tiny_tts), "tiny-stt": ("stt", tiny_stt)}
    server = start_server(write_config(folder, models, LIMITS))
    yield server
    server.stop()


def client(server: RunningServer, tier: str = "paid") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.keys[tier], max_retries=0)


def auth(server: RunningServer, tier: str = "paid") -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[tier]}"}


def error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["message"]
    assert err["param"] == param, err
    if code:
        assert err["code"] == code, err
    return err


def png_size(data: bytes) -> tuple[int, int]:
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG"
    return img.size


def sample_rate_of(path: Path) -> int:
    return TTSWorker(ModelSpec("tts", "tts", path)).sample_rate


def tone_file(seconds: float, rate: int, channels: int, fmt: str) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) * (1 + np.sin(2 * np.pi * 0.5 * t)) / 2
    buf = io.BytesIO()
    sf.write(buf, np.stack([x] * channels, axis=1).astype(np.float32), rate, format=fmt)
    return buf.getvalue()


# ---------------------------------------------------------------- images


def test_image_b64_pngs_have_the_asked_size(media):
    c = client(media)
    r = c.images.generate(model="tiny-image", prompt="a cat", n=2, size="32x48",
                          extra_body={"num_inference_steps": 2, "seed": 3})
    assert len(r.data) == 2 and r.created > 0
    pngs = [base64.b64decode(d.b64_json) for d in r.data]
    assert [png_size(p) for p in pngs] == [(32, 48), (32, 48)]
    assert pngs[0] != pngs[1] and r.data[0].revised_prompt is None
    for size in (None, "auto"):  # the model's native size
        kw = {"size": size} if size else {}
        r = c.images.generate(model="tiny-image", prompt="a dog", extra_body={"num_inference_steps": 1}, **kw)
        assert png_size(base64.b64decode(r.data[0].b64_json)) == (64, 64)


def test_image_seed_and_extensions_decide_the_pixels(media):
    c = client(media)

    def one(**extra) -> bytes:
        body = {"num_inference_steps": 2, "guidance_scale": 3.0, **extra}
        return base64.b64decode(c.images.generate(model="tiny-image", prompt="a cat", size="32x32",
                                                  extra_body=body).data[0].b64_json)

    a, b, other = one(seed=5), one(seed=5), one(seed=6)
    assert a == b and a != other
    assert one(seed=5, negative_prompt="blurry") != a


def test_image_url_is_served_to_the_same_key_only(media):
    c = client(media)
    body = {"num_inference_steps": 2, "seed": 11}
    urls = c.images.generate(model="tiny-image", prompt="a cat", size="32x32", response_format="url",
                             extra_body=body)
    inline = c.images.generate(model="tiny-image", prompt="a cat", size="32x32", extra_body=body)
    url = urls.data[0].url
    assert url.startswith(media.url + "/v1/images/files/") and url.endswith(".png")
    assert urls.data[0].b64_json is None
    r = httpx.get(url, headers=auth(media))
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == base64.b64decode(inline.data[0].b64_json)  # same seed, same pixels
    error(httpx.get(url, headers=auth(media, "free")), 404, None, "image_not_found")
    error(httpx.get(url), 401, None, "missing_api_key")
    error(httpx.get(url.replace("/files/img-", "/files/img-x"), headers=auth(media)), 404, None)


def test_image_output_formats_are_the_same_pixels_encoded_as_asked(media):
    """``output_format`` jpeg and webp (gpt-image-1's fields) through the SDK: the same seed's
    pixels as the png, in that format (decoded from its own bytes: at the default
    ``output_compression`` of 100, JPEG within its rounding (no chroma subsampling) and WebP
    lossless; the demo's images are noise, which subsampling would blur by ~47 levels a channel);
    a lower ``output_compression`` makes a smaller file; a ``url``
    ends in the format and serves it with its media type, and not under another extension. A
    streamed generation's events are in the format too, and say so."""
    c = client(media)
    body = {"num_inference_steps": 2, "seed": 11}
    ask = dict(model="tiny-image", prompt="a cat", size="64x64", extra_body=body)
    png = base64.b64decode(c.images.generate(**ask).data[0].b64_json)
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)
    for fmt, pil in (("jpeg", "JPEG"), ("webp", "WEBP")):
        r = c.images.generate(**ask, output_format=fmt)
        assert r.output_format == fmt
        data = base64.b64decode(r.data[0].b64_json)
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == pil and img.size == (64, 64)
            assert np.abs(np.asarray(img.convert("RGB"), dtype=np.float64) - pixels).mean() < (2 if fmt == "jpeg" else 1e-9)
        small = base64.b64decode(c.images.generate(**ask, output_format=fmt, output_compression=5).data[0].b64_json)
        assert Image.open(io.BytesIO(small)).format == pil and len(small) < len(data)
        url = c.images.generate(**ask, output_format=fmt, response_format="url").data[0].url
        assert url.endswith(f".{fmt}")
        got = httpx.get(url, headers=auth(media))
        assert got.status_code == 200 and got.headers["content-type"] == f"image/{fmt}" and got.content == data
        error(httpx.get(url.rsplit(".", 1)[0] + ".png", headers=auth(media)), 404, None, "image_not_found")
    events = list(c.images.generate(model="tiny-image", prompt="a cat", size="64x64", extra_body=body,
                                    output_format="webp", stream=True, partial_images=1))
    assert [e.output_format for e in events] == ["webp", "webp"]
    assert all(Image.open(io.BytesIO(base64.b64decode(e.b64_json))).format == "WEBP" for e in events)
    assert c.images.generate(**ask, background="opaque").data[0].b64_json == base64.b64encode(png).decode()
    for moderation in ("auto", "low"):  # gpt-image-1's filter strictness: no filter runs here, the same image
        assert c.images.generate(**ask, moderation=moderation).data[0].b64_json == base64.b64encode(png).decode()


def test_quality_sets_the_denoising_steps(media):
    """OpenAI's ``quality`` (gpt-image-1's low/medium/high, dall-e-3's standard/hd) as a share of the
    default 25 denoising steps (UNet calls counted: one a step, the guidance batched in it), and
    ``num_inference_steps`` over it when given."""
    c = client(media)
    worker = media.services.arbiter.workers.get("tiny-image")
    if worker is None or getattr(worker, "pipe", None) is None:
        c.images.generate(model="tiny-image", prompt="warm up", size="32x32", extra_body={"num_inference_steps": 1})
        worker = media.services.arbiter.workers["tiny-image"]
    counts = {}
    for quality in ("low", "medium", "standard", "hd"):
        with _Counter(worker.pipe.unet) as steps:
            c.images.generate(model="tiny-image", prompt="a cat", size="32x32", quality=quality)
        counts[quality] = steps.n
    assert counts == {"low": 10, "medium": 18, "standard": 25, "hd": 38}
    with _Counter(worker.pipe.unet) as steps:
        c.images.generate(model="tiny-image", prompt="a cat", size="32x32", quality="high",
                          extra_body={"num_inference_steps": 3})
    assert steps.n == 3


def test_image_store_expires_and_stays_bounded():
    now = [0.0]
    store = ImageStore(ttl_s=10, max_bytes=100, clock=lambda: now[0])
    a = store.put("k1", b"a" * 40)
    now[0] = 5
    b = store.put("k1", b"b" * 40)
    assert store.get("k1", a) == b"a" * 40 and store.get("k2", a) is None
    c = store.put("k2", b"c" * 40)  # 120 bytes > 100: the oldest goes
    assert store.get("k1", a) is None and store.get("k1", b) == b"b" * 40 and store.get("k2", c) == b"c" * 40
    assert store.bytes == 80
    now[0] = 15.5  # b (put at 5) expired, c (put at 5) too
    assert store.get("k1", b) is None and store.get("k2", c) is None
    assert len(store) == 0 and store.bytes == 0


IMAGE = {"model": "tiny-image", "prompt": "a cat", "size": "32x32", "num_inference_steps": 1}


@pytest.mark.parametrize("change,param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x" * 201}, "prompt"),
    ({"negative_prompt": "x" * 201}, "negative_prompt"),
    ({"size": "36x32"}, "size"),
    ({"size": "256x256"}, "size"),
    ({"size": "0x64"}, "size"),
    ({"size": "large"}, "size"),
    ({"n": 3}, "n"),
    ({"n": 0}, "n"),
    ({"num_inference_steps": 401}, "num_inference_steps"),
    ({"response_format": "png"}, "response_format"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"style": "vivid"}, "style"),
    ({"output_format": "gif"}, "output_format"),
    ({"output_compression": 50}, "output_compression"),  # png is lossless
    ({"output_format": "png", "output_compression": 50}, "output_compression"),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"background": "transparent"}, "background"),
    ({"moderation": "strict"}, "moderation"),
    ({"model": "tiny-tts"}, "model"),
    ({"prompt": None}, "prompt"),
])
def test_bad_image_requests_are_400_naming_the_param(media, change, param):
    body = {k: v for k, v in {**IMAGE, **change}.items() if v is not None}
    error(httpx.post(f"{media.base_url}/images/generations", headers=auth(media), json=body), 400, param)


def test_sdk_sees_bad_image_input_as_bad_request(media):
    with pytest.raises(openai.BadRequestError) as e:
        client(media).images.generate(model="tiny-image", prompt="a cat", size="1024x1024")
    assert e.value.body["param"] == "size" and "128" in e.value.body["message"]


# ---------------------------------------------------------------- image edits


def png_of(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def hole_mask(width: int, height: int, box: tuple[int, int, int, int], mode: str = "RGBA") -> Image.Image:
    """OpenAI's mask: opaque, fully transparent (alpha 0) inside ``box``: where to edit."""
    mask = Image.new(mode, (width, height), (0, 0, 0, 255) if mode == "RGBA" else 0)
    if mode == "RGBA":
        mask.paste((0, 0, 0, 0), box)
    return mask


def pixels_of(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


EDIT = {"num_inference_steps": 2, "seed": 4}


def test_image_edit_repaints_only_the_transparent_pixels_of_the_mask(media):
    source, box = noise_image(48, 40), (8, 8, 32, 24)
    r = client(media).images.edit(model="tiny-image", image=("src.png", png_of(source), "image/png"),
                                  mask=("mask.png", png_of(hole_mask(48, 40, box)), "image/png"),
                                  prompt="a cat", n=2, extra_body=EDIT)
    got = [pixels_of(base64.b64decode(d.b64_json)) for d in r.data]
    assert len(got) == 2 and r.created > 0
    edited = np.zeros((40, 48), bool)
    edited[8:24, 8:32] = True
    src = np.asarray(source, dtype=np.int16)
    for pixels in got:
        assert pixels.shape == (40, 48, 3)
        assert (pixels[~edited] == src[~edited]).all()  # the source itself outside the hole
        assert np.abs(pixels[edited] - src[edited]).mean() > 20  # repainted inside it
    assert (got[0] != got[1]).any()


def test_image_edit_without_a_mask_uses_the_image_transparency(media):
    """OpenAI's rule: no mask, and the image's own fully transparent pixels are what to edit."""
    rgba = noise_image(32, 32, seed=2).convert("RGBA")
    rgba.paste((0, 0, 0, 0), (0, 16, 32, 32))
    c = client(media)

    def edit(**files) -> bytes:
        return base64.b64decode(c.images.edit(model="tiny-image", prompt="a dog", extra_body=EDIT,
                                              **files).data[0].b64_json)

    alone = edit(image=("a.png", png_of(rgba)))
    assert alone == edit(image=("a.png", png_of(rgba)), mask=("m.png", png_of(hole_mask(32, 32, (0, 16, 32, 32)))))
    assert alone == edit(image=("a.png", png_of(rgba)), input_fidelity="high")  # a masked edit keeps the rest exactly
    top = pixels_of(alone)[:16]
    assert (top == np.asarray(rgba.convert("RGB"), dtype=np.int16)[:16]).all()


def test_image_edit_of_an_opaque_image_is_image_to_image(media):
    """No transparency anywhere: the whole image is edited, ``strength`` (an extension) deciding
    how far; a JPEG is taken too, and ``size`` resizes the source."""
    c = client(media)
    jpeg = png_of(noise_image(40, 24, seed=3), "JPEG")

    def edit(**extra) -> bytes:
        r = c.images.edit(model="tiny-image", image=("a.jpg", jpeg, "image/jpeg"), prompt="a tree",
                          extra_body={**EDIT, **extra})
        return base64.b64decode(r.data[0].b64_json)

    weak, again, strong = edit(strength=0.5), edit(strength=0.5), edit(strength=1.0)
    assert weak == again and weak != strong
    # gpt-image-1's input_fidelity: high keeps more of the source (strength 0.5), low is the default 0.8 (at
    # 10 steps these run 5 and 8 of them; at 2 both would run the last one and make the same image)
    ten = {"num_inference_steps": 10}
    high, low, default = edit(input_fidelity="high", **ten), edit(input_fidelity="low", **ten), edit(**ten)
    assert high == edit(strength=0.5, **ten) and low == default != high
    assert png_size(weak) == (40, 24)
    assert png_size(edit(size="32x16")) == (32, 16)


def test_image_edit_url_and_adapters_field(media):
    c = client(media)
    r = c.images.edit(model="tiny-image", image=("a.png", png_of(noise_image(16, 16))), prompt="a cat",
                      response_format="url", extra_body=EDIT)
    got = httpx.get(r.data[0].url, headers=auth(media))
    assert got.status_code == 200 and png_size(got.content) == (16, 16)
    r = httpx.post(f"{media.base_url}/images/edits", headers=auth(media), files={"image": ("a.png", png_of(noise_image(16, 16)))},
                   data={"model": "tiny-image", "prompt": "a cat", "adapters": '[{"name": "nope"}]'})
    error(r, 404, "adapters", "adapter_not_found")  # read as the JSON endpoints read the field


def _edit(server, files=None, data=None) -> httpx.Response:
    fields = {"model": "tiny-image", "prompt": "a cat", "num_inference_steps": "1", **(data or {})}
    return httpx.post(f"{server.base_url}/images/edits", headers=auth(server), files=files, data=fields)


SRC = png_of(noise_image(32, 32))


@pytest.mark.parametrize("files,data,status,param,code", [
    ({"image": ("a.png", SRC), "mask": ("m.png", png_of(hole_mask(16, 32, (0, 0, 8, 8))))}, {}, 400, "mask",
     "invalid_mask"),  # not the image's size
    ({"image": ("a.png", SRC), "mask": ("m.png", png_of(Image.new("RGB", (32, 32))))}, {}, 400, "mask",
     "invalid_mask"),  # no alpha channel
    ({"image": ("a.png", SRC), "mask": ("m.png", png_of(Image.new("RGBA", (32, 32), (9, 9, 9, 255))))}, {}, 400,
     "mask", "invalid_mask"),  # nothing transparent: nothing to edit
    ({"image": ("a.png", b"not an image")}, {}, 400, "image", "invalid_image"),
    ({"image": ("a.png", SRC[:60])}, {}, 400, "image", "invalid_image"),  # cut short
    ({"image": ("a.png", b"")}, {}, 400, "image", "invalid_image"),
    ({"image": ("a.gif", png_of(noise_image(16, 16), "GIF"))}, {}, 400, "image", "invalid_image_format"),
    ({"image": ("a.png", png_of(noise_image(4, 4)))}, {}, 400, "image", "invalid_image"),  # under 8 pixels a side
    ({"image": ("a.png", png_of(noise_image(200, 16)))}, {}, 400, "size", None),  # over image_max_side
    ({"image": ("a.png", png_of(Image.new("L", (5000, 4000))))}, {}, 400, "image", "image_too_large"),
    ({"image": ("a.png", SRC), "mask": ("m.png", b"junk")}, {}, 400, "mask", "invalid_image"),
    ([("image", ("a.png", SRC)), ("image", ("b.png", SRC))], {}, 400, "image", None),
    ({"mask": ("m.png", SRC)}, {}, 400, "image", "missing_required_parameter"),
    ({"image": (None, "a text field")}, {}, 400, "image", "invalid_value"),
    ({"image": ("a.png", SRC), "mask": (None, "a text field")}, {}, 400, "mask", "invalid_value"),
    ({"image": ("big.png", b"x" * 140_000)}, {}, 413, "image", "request_too_large"),
    ({"image": ("a.png", SRC)}, {"prompt": ""}, 400, "prompt", None),
    ({"image": ("a.png", SRC)}, {"n": "3"}, 400, "n", None),
    ({"image": ("a.png", SRC)}, {"strength": "0"}, 400, "strength", None),
    ({"image": ("a.png", SRC)}, {"strength": "1.5"}, 400, "strength", None),
    ({"image": ("a.png", SRC)}, {"strength": "0.4", "num_inference_steps": "2"}, 400, "strength", None),  # 0 steps
    ({"image": ("a.png", SRC)}, {}, 400, "num_inference_steps", None),  # 1 step at the default 0.8: 0 steps
    ({"image": ("a.png", SRC)}, {"size": "36x32"}, 400, "size", None),
    ({"image": ("a.png", SRC)}, {"num_inference_steps": "401"}, 400, "num_inference_steps", None),
    ({"image": ("a.png", SRC)}, {"adapters": "not json"}, 400, "adapters", None),
    ({"image": ("a.png", SRC)}, {"style": "vivid"}, 400, "style", "unknown_parameter"),
    ({"image": ("a.png", SRC)}, {"input_fidelity": "medium"}, 400, "input_fidelity", None),
    ({"image": ("a.png", SRC)}, {"model": "tiny-tts"}, 400, "model", "model_not_supported"),
    ({"image": ("a.png", SRC)}, {"model": "nope"}, 404, "model", None),
])
def test_bad_image_edits_name_the_param(media, files, data, status, param, code):
    err = error(_edit(media, files, data), status, param, code)
    assert " at 0x" not in err["message"]  # no repr of our buffers


@pytest.mark.parametrize("side", [4097, 20_000, 50_000])
@pytest.mark.parametrize("endpoint", ["edits", "variations"])
def test_an_image_whose_header_claims_too_many_pixels_is_image_too_large(media, endpoint, side):
    """A source (or mask) whose header says more than 4096x4096 is ``image_too_large``, however
    large: past Pillow's own bomb guard (over 2 x 89.5M pixels, raised in ``Image.open`` before our
    check reads the header) it was ``invalid_image``, telling the client its file was damaged."""
    data = {"model": "tiny-image", "num_inference_steps": "2", **({"prompt": "a cat"} if endpoint == "edits" else {})}
    r = httpx.post(f"{media.base_url}/images/{endpoint}", headers=auth(media), data=data,
                   files={"image": ("big.png", png_claiming(side, side))})
    assert "pixels" in error(r, 400, "image", "image_too_large")["message"]
    if endpoint == "edits":
        r = httpx.post(f"{media.base_url}/images/edits", headers=auth(media), data=data,
                       files={"image": ("a.png", SRC), "mask": ("m.png", png_claiming(side, side))})
        error(r, 400, "mask", "image_too_large")


def test_pillows_bomb_warning_made_an_error_is_image_too_large_too():
    """Where warnings are errors (``python -W error``), Pillow's DecompressionBombWarning (over
    89.5M pixels), raised in ``Image.open``, is ``image_too_large`` as its error is, not ``invalid_image``."""
    from gateway.errors import APIError
    from gateway.images import read_image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(APIError) as caught:
            read_image(png_claiming(10_000, 10_000), "image", ("PNG",), 4096 * 4096, lambda img: img)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "image_too_large", "image")


def test_image_variation_remakes_the_whole_image(media):
    """``client.images.create_variation``: the image made again, no prompt, transparency and all
    (image to image at ``strength``, 0.8 by default); the seed decides it, as everywhere."""
    c = client(media)
    rgba = noise_image(32, 24, seed=5).convert("RGBA")
    rgba.paste((0, 0, 0, 0), (0, 0, 16, 24))  # transparent pixels mark nothing here: all of it is remade

    def vary(**extra) -> list[bytes]:
        r = c.images.create_variation(model="tiny-image", image=("a.png", png_of(rgba)), n=2, extra_body={**EDIT, **extra})
        return [base64.b64decode(d.b64_json) for d in r.data]

    first, again = vary(), vary()
    assert first == again and first[0] != first[1]
    assert [png_size(p) for p in first] == [(32, 24), (32, 24)]
    src = np.asarray(rgba.convert("RGB"), dtype=np.int16)
    assert np.abs(pixels_of(first[0])[:, 16:] - src[:, 16:]).mean() > 20  # the opaque half is remade too
    assert vary(strength=1.0) != first
    r = httpx.post(f"{media.base_url}/images/variations", headers=auth(media), data={"model": "tiny-image"},
                   files={"image": ("a.png", SRC), "mask": ("m.png", SRC)})
    assert "image, image[]" in error(r, 400, "mask")["message"]
    r = httpx.post(f"{media.base_url}/images/variations", headers=auth(media), files={"image": ("a.png", SRC)},
                   data={"model": "tiny-image", "prompt": "a cat"})
    error(r, 400, "prompt", "unknown_parameter")


def test_uploads_take_the_sdks_stream_false(media):
    """The SDK sends a given ``stream=False`` as the form text "false": answered whole, as without
    it (it was a 400 "Input should be False"); variations have no ``stream`` (OpenAI's neither)."""
    c = client(media)
    r = c.images.edit(model="tiny-image", prompt="a cat", image=("a.png", SRC), stream=False, extra_body=EDIT)
    assert png_size(base64.b64decode(r.data[0].b64_json)) == (32, 32)
    t = c.audio.transcriptions.create(model="tiny-stt", file=("a.wav", WAV), stream=False)
    assert isinstance(t.text, str)
    r = httpx.post(f"{media.base_url}/images/variations", headers=auth(media), files={"image": ("a.png", SRC)},
                   data={"model": "tiny-image", "stream": "true"})
    error(r, 400, "stream", "unknown_parameter")


def test_a_streamed_generation_sends_previews_then_the_image(media):
    """``stream: true`` through the SDK: ``partial_images`` previews, nearer the image each, then
    the image itself, byte for byte the unstreamed one of the same seed."""
    c = client(media)
    ask = dict(model="tiny-image", prompt="a cat", size="32x32", extra_body={"num_inference_steps": 8, "seed": 3})
    whole = base64.b64decode(c.images.generate(**ask).data[0].b64_json)
    events = list(c.images.generate(**ask, stream=True, partial_images=3))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 3 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:3]] == [0, 1, 2]
    done = events[-1]
    assert base64.b64decode(done.b64_json) == whole
    assert (done.size, done.output_format, done.quality) == ("32x32", "png", "auto") and done.created_at > 0
    assert done.usage.input_tokens == done.usage.total_tokens > 0
    final = pixels_of(whole)
    distances = [np.abs(pixels_of(base64.b64decode(e.b64_json)) - final).mean() for e in events[:3]]
    assert distances[0] > distances[-1] > 0  # previews of the denoising, not the image sent early
    assert [e.type for e in c.images.generate(**ask, stream=True)] == ["image_generation.completed"]  # no previews asked
    for bad, param in ((dict(n=2), "n"), (dict(response_format="url"), "response_format"), (dict(partial_images=4), "partial_images")):
        with pytest.raises(openai.BadRequestError) as e:
            c.images.generate(**{**ask, **bad}, stream=True)
        assert e.value.body["param"] == param, e.value.body


def test_a_streamed_edit_keeps_the_source_outside_its_mask_in_every_preview(media):
    source, box = noise_image(48, 40), (8, 8, 32, 24)
    ask = dict(model="tiny-image", image=("src.png", png_of(source), "image/png"), prompt="a cat",
               mask=("mask.png", png_of(hole_mask(48, 40, box)), "image/png"), extra_body={"num_inference_steps": 6, "seed": 4})
    c = client(media)
    whole = base64.b64decode(c.images.edit(**ask).data[0].b64_json)
    events = list(c.images.edit(**ask, stream=True, partial_images=2))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert base64.b64decode(events[-1].b64_json) == whole and events[-1].size == "48x40"
    edited = np.zeros((40, 48), bool)
    edited[8:24, 8:32] = True
    src = np.asarray(source, dtype=np.int16)
    for e in events:
        assert (pixels_of(base64.b64decode(e.b64_json))[~edited] == src[~edited]).all()


def test_leaving_a_streamed_generation_stops_the_denoising(media):
    c = client(media)
    c.images.generate(model="tiny-image", prompt="warm up", size="32x32", extra_body={"num_inference_steps": 1})
    worker = media.services.arbiter.workers["tiny-image"]
    asked = 400
    with _Counter(worker.pipe.unet) as steps:
        at_release, after = _leave_at_first_event(
            media, "/images/generations", "image_generation.partial_image", steps,
            json={**IMAGE, "size": "64x64", "num_inference_steps": asked, "stream": True, "partial_images": 3})
    assert after == at_release and at_release < asked // 2  # the first preview comes at step 100 of 400


def _leave_at_first_event(media, path: str, kind: str, counter: "_Counter", **request) -> tuple[int, int]:
    """POST a streamed request (``request``: httpx's body arguments), read its first event (of
    type ``kind``) and leave; ``counter``'s count once the model's slot is free, and 0.3 s later."""
    model = "tiny-image" if path.startswith("/images") else "tiny-stt"
    with httpx.stream("POST", f"{media.base_url}{path}", headers=auth(media), timeout=60, **request) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["type"] == kind
    _wait(lambda: _idle(media, model), timeout=10)
    at_release = counter.n
    time.sleep(0.3)
    return at_release, counter.n


def test_image_edit_needs_multipart(media):
    r = httpx.post(f"{media.base_url}/images/edits", headers=auth(media),
                   json={"model": "tiny-image", "prompt": "a cat", "image": base64.b64encode(SRC).decode()})
    assert "an 'image' part" in error(r, 415, None, "unsupported_media_type")["message"]


# ---------------------------------------------------------------- speech

TEXT = "Hello there. This is a test of speech; it has three sentences!"


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_speech_decodes_at_the_model_rate(media, tiny_tts, fmt):
    out = client(media).audio.speech.create(model="tiny-tts", input=TEXT, voice="alloy", response_format=fmt)
    assert out.response.headers["content-type"] == f"audio/{fmt}"
    x, rate = sf.read(io.BytesIO(out.content), dtype="float32")
    assert rate == sample_rate_of(tiny_tts)
    assert x.ndim == 1 and len(x) / rate > 0.1 and np.abs(x).max() > 0


def test_speech_as_aac_is_adts_frames_streamed_as_they_are_encoded(media, tiny_tts):
    """``response_format: "aac"`` through the SDK's streaming response: AAC-LC in ADTS frames
    (each frame's sync word), ``audio/aac``; it decodes (FFmpeg) at the model's rate to about the
    wav's length (AAC adds its encoder delay: ~0.13 s at 16 kHz). That the frames go out as the
    sentences are made is the worker's test (``test_aac_is_encoded_as_the_chunks_come``)."""
    c = client(media)
    pieces = []
    with c.audio.speech.with_streaming_response.create(model="tiny-tts", input=TEXT, voice="alloy",
                                                       response_format="aac") as out:
        assert out.headers["content-type"] == "audio/aac"
        pieces = [piece for piece in out.iter_bytes(chunk_size=None) if piece]
    data = b"".join(pieces)
    assert data[:2] == b"\xff\xf1"  # an ADTS header: MPEG-4, no CRC
    x, rate = decode_audio(data)
    wav, wav_rate = sf.read(io.BytesIO(c.audio.speech.create(model="tiny-tts", input=TEXT, voice="alloy",
                                                             response_format="wav").content), dtype="float32")
    assert rate == wav_rate == sample_rate_of(tiny_tts)
    assert 0 <= len(x) / rate - len(wav) / wav_rate < 0.2


def test_speech_pcm_is_raw_16_bit_at_the_announced_rate(media, tiny_tts):
    c = client(media)
    pcm = c.audio.speech.create(model="tiny-tts", input=TEXT, voice="ben", response_format="pcm")
    wav = c.audio.speech.create(model="tiny-tts", input=TEXT, voice="ben", response_format="wav")
    assert pcm.response.headers["content-type"] == "audio/pcm"
    assert int(pcm.response.headers["x-sample-rate"]) == sample_rate_of(tiny_tts)
    samples = np.frombuffer(pcm.content, "<i2")
    assert len(pcm.content) % 2 == 0 and np.abs(samples).max() > 0
    assert len(samples) == len(sf.read(io.BytesIO(wav.content))[0])  # durations are deterministic


def test_speech_as_server_sent_events(media, tiny_tts):
    """``stream_format: sse``: the audio as base64 ``speech.audio.delta`` events as it is made (a
    sentence at a time for pcm, each in deltas of at most ``AUDIO_DELTA_BYTES``), which decoded and
    joined are the audio of the plain answer, then ``speech.audio.done`` with the tokens the model
    read."""
    from transformers import AutoTokenizer

    from gateway.audio import AUDIO_DELTA_BYTES

    c = client(media)
    plain = c.audio.speech.create(model="tiny-tts", input=TEXT, voice="ben", response_format="pcm").content
    with c.audio.speech.with_streaming_response.create(model="tiny-tts", input=TEXT, voice="ben", response_format="pcm",
                                                       stream_format="sse") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 3 and {e["type"] for e in deltas} == {"speech.audio.delta"}  # three sentences, or more
    assert len(plain) > AUDIO_DELTA_BYTES  # the premise: more than one delta's worth
    assert all(len(base64.b64decode(e["audio"])) <= AUDIO_DELTA_BYTES for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(audio) == len(plain) and np.abs(np.frombuffer(audio, "<i2")).max() > 0  # (VITS samples noise: the
    # same duration, not the same samples)
    with c.audio.speech.with_streaming_response.create(model="tiny-tts", input=TEXT, voice="ben", response_format="wav",
                                                       stream_format="sse") as r:
        wav = b"".join(base64.b64decode(json.loads(line[6:])["audio"]) for line in r.iter_lines()
                       if line.startswith("data: ") and '"speech.audio.delta"' in line)
    x, rate = sf.read(io.BytesIO(wav), dtype="int16")  # joined, the deltas are a whole wav file
    assert rate == sample_rate_of(tiny_tts) and len(x) * 2 == len(plain)
    tokens = len(AutoTokenizer.from_pretrained(tiny_tts)(TEXT)["input_ids"])
    assert done == {"type": "speech.audio.done", "usage": {"input_tokens": tokens, "output_tokens": 0,
                                                           "total_tokens": tokens}}


def test_speech_events_cut_short_by_a_failure_have_no_done_event(media, monkeypatch):
    """A failure after the first piece ends the event stream early, without ``speech.audio.done``
    (so a client cannot take a cut stream for a whole one), and the server lives on."""
    from workers import audio as sound

    real = sound.encode_stream

    def failing(*args, **kw):
        pieces = real(*args, **kw)
        yield next(pieces)  # the wav header
        yield next(pieces)  # the first sentence
        raise RuntimeError("the encoder broke")

    monkeypatch.setattr(sound, "encode_stream", failing)
    with client(media).audio.speech.with_streaming_response.create(
            model="tiny-tts", input=TEXT, voice="ben", response_format="wav", stream_format="sse") as r:
        types = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: ")]
    assert types and set(types) == {"speech.audio.delta"}  # what was made before the failure, and no done
    monkeypatch.undo()
    assert client(media).audio.speech.create(model="tiny-tts", input="Hi.", voice="ben").content


@pytest.mark.skipif("mp3" not in supported_speech_formats(), reason="this libsndfile writes no mp3")
def test_speech_defaults_to_mp3(media):
    r = httpx.post(f"{media.base_url}/audio/speech", headers=auth(media),
                   json={"model": "tiny-tts", "input": "Hi there.", "voice": "nova"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    x, _ = sf.read(io.BytesIO(r.content))
    assert len(x) > 0


def test_speech_speed_changes_the_length(media):
    c = client(media)

    def seconds(speed: float) -> float:
        x, rate = sf.read(io.BytesIO(c.audio.speech.create(model="tiny-tts", input=TEXT, voice="cleo",
                                                          response_format="wav", speed=speed).content))
        return len(x) / rate

    assert seconds(2.0) < 0.75 * seconds(1.0)


SPEECH = {"model": "tiny-tts", "input": "Hello.", "voice": "alloy", "response_format": "wav"}


def test_empty_speech_instructions_are_no_instructions(media):
    """``instructions`` left empty (a client that always sends the field) asks nothing: spoken."""
    for extra in ({"instructions": ""}, {"instructions": "  "}):
        r = httpx.post(f"{media.base_url}/audio/speech", headers=auth(media), json={**SPEECH, **extra}, timeout=60)
        assert r.status_code == 200 and r.content.startswith(b"RIFF"), r.text


@pytest.mark.parametrize("change,param,needle", [
    ({"input": ""}, "input", None),
    ({"input": " \n "}, "input", None),
    ({"input": "x" * 20001}, "input", "20000"),
    ({"input": "?!"}, "input", None),  # nothing speakable
    ({"input": "¹ 💥"}, "input", "tokenizer"),  # no character the model's tokenizer knows (was a 500)
    ({"voice": "darth"}, "voice", "amy"),  # lists the model's voices
    ({"response_format": "wma"}, "response_format", "aac"),  # lists what is supported
    ({"speed": 4.5}, "speed", None),
    ({"stream_format": "events"}, "stream_format", None),
    ({"voice": None}, "voice", None),
    ({"model": "tiny-image"}, "model", None),
    ({"instructions": "Speak in a cheerful tone."}, "instructions", "cannot follow instructions"),
])
def test_bad_speech_requests_are_400_naming_the_param(media, change, param, needle):
    body = {k: v for k, v in {**SPEECH, **change}.items() if v is not None}
    err = error(httpx.post(f"{media.base_url}/audio/speech", headers=auth(media), json=body), 400, param)
    if needle:
        assert needle in err["message"]


# ---------------------------------------------------------------- transcriptions

SRT_CUE = re.compile(r"^\d+\n(\d\d:\d\d:\d\d,\d{3}) --> (\d\d:\d\d:\d\d,\d{3})\n", re.M)
VTT_CUE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) --> (\d\d:\d\d:\d\d\.\d{3})\n", re.M)


def _seconds(stamp: str) -> float:
    h, m, s = stamp.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_transcription_in_every_format(media):
    c = client(media)
    wav = tone_file(3.0, 44100, 2, "WAV")  # 44.1 kHz stereo, resampled to the model's 16 kHz mono

    def tr(fmt: str):
        return c.audio.transcriptions.create(model="tiny-stt", file=("tone.wav", wav, "audio/wav"),
                                             response_format=fmt, language="en", temperature=0)

    plain = tr("json").text
    assert isinstance(plain, str) and plain
    assert tr("text") == plain  # greedy decoding: the same words every time
    srt = tr("srt")
    cues = SRT_CUE.findall(srt)
    assert cues and all(0 <= _seconds(a) <= _seconds(b) <= 3.0 for a, b in cues)
    vtt = tr("vtt")
    assert vtt.startswith("WEBVTT") and len(VTT_CUE.findall(vtt)) == len(cues)
    verbose = tr("verbose_json")
    assert verbose.task == "transcribe" and verbose.language == "english"
    assert verbose.duration == pytest.approx(3.0, abs=0.01)
    assert verbose.text == plain and verbose.segments
    assert [s.id for s in verbose.segments] == list(range(len(verbose.segments)))
    assert all(0 <= s.start <= s.end <= 3.0 for s in verbose.segments)
    for s in verbose.segments:  # openai-whisper's confidence figures (the worker's tests check their values)
        assert s.avg_logprob < 0 and 0 < s.no_speech_prob < 1 and s.compression_ratio > 0 and s.seek == 0
        assert s.tokens and all(isinstance(i, int) for i in s.tokens)
    TranscriptionVerbose.model_validate(verbose.model_dump())  # every field OpenAI's type requires


def test_word_timestamps_through_the_sdk(media):
    """``timestamp_granularities=["word"]`` with verbose_json: ``words`` in OpenAI's shape (the
    SDK's ``TranscriptionVerbose.words``), spelling the text, in order and inside the audio; the
    text and segments are those of the same request without them, which has no ``words``."""
    c = client(media)
    wav = tone_file(6.0, 16000, 1, "WAV")

    def tr(granularities):
        return c.audio.transcriptions.create(model="tiny-stt", file=("tone.wav", wav, "audio/wav"), language="en",
                                             response_format="verbose_json", temperature=0,
                                             timestamp_granularities=granularities)

    plain, timed, both = tr(["segment"]), tr(["word"]), tr(["word", "segment"])
    assert plain.words is None and timed.words
    assert timed.text == both.text == plain.text and timed.segments == both.segments == plain.segments
    assert timed.words == both.words
    assert "".join(w.word for w in timed.words) == "".join(timed.text.split())
    assert all(0 <= w.start <= w.end <= 6.0 for w in timed.words)
    assert all(a.end <= b.start for a, b in zip(timed.words, timed.words[1:]))


def test_transcription_token_logprobs_through_the_sdk(media):
    """``include=["logprobs"]`` (OpenAI's ``include[]`` form field) with ``response_format`` json:
    ``logprobs`` in OpenAI's shape (the SDK's ``Transcription.logprobs``), one per text token
    (the worker's tests check the values), the bytes the token's own; the text is the same as
    without them, which has none. Streamed, the done event carries the same entries (greedy), and
    each delta those of its own tokens, which join to them.
    Any other response_format is a 400 naming ``include``; translations have no such field."""
    c = client(media)
    wav = tone_file(3.0, 16000, 1, "WAV")
    ask = dict(model="tiny-stt", file=("tone.wav", wav, "audio/wav"), language="en", temperature=0)
    plain = c.audio.transcriptions.create(**ask)
    got = c.audio.transcriptions.create(**ask, include=["logprobs"])
    assert got.text == plain.text and plain.logprobs is None and got.logprobs
    own = [bytes(map(int, e.bytes)) for e in got.logprobs]  # the SDK reads them as floats
    assert all(e.logprob <= 0 and raw.decode("utf-8", "replace") == e.token for e, raw in zip(got.logprobs, own))
    # a token that is a piece of a character (its text alone U+FFFD) has that piece's bytes
    assert all(raw != "\ufffd".encode() for e, raw in zip(got.logprobs, own) if e.token == "\ufffd")
    events = list(c.audio.transcriptions.create(**ask, include=["logprobs"], stream=True))
    done, deltas = events[-1], events[:-1]
    assert done.type == "transcript.text.done" and done.text == got.text
    assert [(e.token, e.logprob) for e in done.logprobs] == [(e.token, e.logprob) for e in got.logprobs]
    # each delta carries its own tokens (the SDK's TranscriptionTextDeltaEvent.logprobs): together, the done event's
    assert deltas and all(d.type == "transcript.text.delta" and d.logprobs is not None for d in deltas)
    joined = [e for d in deltas for e in d.logprobs]
    assert [e.token for e in joined] == [e.token for e in done.logprobs]
    assert [e.logprob for e in joined] == pytest.approx([e.logprob for e in done.logprobs], abs=1e-5)
    assert all(d.logprobs is None for d in c.audio.transcriptions.create(**ask, stream=True)
               if d.type == "transcript.text.delta")  # not asked for: none
    for fmt in ("text", "verbose_json", "srt"):
        r = _transcribe(media, {"file": ("a.wav", WAV)}, {"include[]": "logprobs", "response_format": fmt})
        err = error(r, 400, "include", "invalid_value")
        assert "response_format json" in err["message"]
    r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media), files={"file": ("a.wav", WAV)},
                   data={"model": "tiny-stt", "include[]": "logprobs"})
    error(r, 400, "include", "unknown_parameter")


@pytest.mark.parametrize("name, fmt, codec, mime", [("note.webm", "webm", "libopus", "audio/webm"),
                                                     ("memo.m4a", "ipod", "aac", "audio/mp4")])
def test_a_browser_or_phone_recording_is_transcribed(media, name, fmt, codec, mime):
    """What MediaRecorder (WebM/Opus) and phones (M4A/AAC) upload, through the SDK: transcribed,
    its duration read from the stream; a long one (a small file of 30 s of silence here) is the
    same 400 ``audio_too_long`` as a long wav, decoded only a second past the limit."""
    c = client(media)
    verbose = c.audio.transcriptions.create(model="tiny-stt", file=(name, recorded(fmt, codec, 3.0), mime),
                                            response_format="verbose_json", language="en")
    assert abs(verbose.duration - 3.0) < 0.1 and verbose.segments
    long = recorded(fmt, codec, 30.0, rate=16000, freq=0.0, channels=1)
    assert len(long) < 1_000_000  # under transcription_max_bytes (1 MiB): only the duration refuses it
    err = error(_transcribe(media, {"file": (name, long)}), 400, "file", "audio_too_long")
    assert "longer than this server's limit of 20 s" in err["message"]


def test_chunking_strategy_auto_is_the_servers_own_cutting(media):
    """``chunking_strategy="auto"`` (the server chooses the cuts): the same transcript as without
    it; translations have no such field."""
    c = client(media)
    wav = tone_file(3.0, 16000, 1, "WAV")
    ask = dict(model="tiny-stt", file=("tone.wav", wav, "audio/wav"), language="en", temperature=0)
    assert c.audio.transcriptions.create(**ask, chunking_strategy="auto").text == c.audio.transcriptions.create(**ask).text
    for name, value in (("chunking_strategy", "auto"), ("chunking_strategy[type]", "server_vad")):
        r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media), files={"file": ("a.wav", WAV)},
                       data={"model": "tiny-stt", name: value})
        error(r, 400, name, "unknown_parameter")


def _wav(x: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV")
    return buf.getvalue()


def test_chunking_strategy_server_vad_transcribes_only_the_speech(media):
    """A ``server_vad`` object, as the SDK sends it (``chunking_strategy[...]`` fields) or as one
    JSON field: the one window starts at the speech (1.5 s of silence, then espeak-ng's sentence;
    verbose_json's ``seek`` is the window's start in 10 ms frames), where without it the window
    starts at 0; audio with no speech is an empty transcript of its full duration, whole or
    streamed."""
    c = client(media)
    speech = _wav(np.concatenate([np.zeros(24000, np.float32), spoken("Testing the voice detector."),
                                  np.zeros(16000, np.float32)]))
    ask = dict(model="tiny-stt", file=("speech.wav", speech, "audio/wav"), language="en", temperature=0,
               response_format="verbose_json")
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 200}
    heard = c.audio.transcriptions.create(**ask, chunking_strategy=vad)
    assert heard.segments and all(115 <= s.seek <= 135 for s in heard.segments), [s.seek for s in heard.segments]
    assert heard.segments[0].start >= 1.15
    assert {s.seek for s in c.audio.transcriptions.create(**ask).segments} == {0}
    as_json = _transcribe(media, {"file": ("speech.wav", speech)},
                          {"language": "en", "temperature": "0", "response_format": "verbose_json",
                           "chunking_strategy": json.dumps({"type": "server_vad"})})
    assert as_json.status_code == 200 and as_json.json()["text"] == heard.text
    assert [s["seek"] for s in as_json.json()["segments"]] == [s.seek for s in heard.segments]

    silence = ("silence.wav", _wav(np.zeros(4 * 16000, np.float32)), "audio/wav")
    quiet = c.audio.transcriptions.create(model="tiny-stt", file=silence, response_format="verbose_json",
                                          chunking_strategy={"type": "server_vad"})
    assert (quiet.text, quiet.segments, quiet.duration) == ("", [], 4.0)
    assert c.audio.transcriptions.create(model="tiny-stt", file=silence, chunking_strategy={"type": "server_vad"}).text == ""
    events = list(c.audio.transcriptions.create(model="tiny-stt", file=silence, stream=True,
                                                chunking_strategy={"type": "server_vad"}))
    assert [(e.type, e.text) for e in events] == [("transcript.text.done", "")]
    assert c.audio.transcriptions.create(model="tiny-stt", file=silence).text != ""  # the random model, without VAD


@pytest.mark.parametrize("data, param, code", [
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "2"}, "chunking_strategy.threshold",
     "invalid_value"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "-1"},
     "chunking_strategy.prefix_padding_ms", "invalid_value"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[silence_duration_ms]": "soon"},
     "chunking_strategy.silence_duration_ms", None),
    ({"chunking_strategy[type]": "semantic_vad"}, "chunking_strategy.type", "invalid_value"),
    ({"chunking_strategy[threshold]": "0.5"}, "chunking_strategy.type", "missing_required_parameter"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[eagerness]": "low"}, "chunking_strategy.eagerness",
     "unknown_parameter"),
    ({"chunking_strategy": '{"type": "server_vad", "threshold": -0.1}'}, "chunking_strategy.threshold", "invalid_value"),
    ({"chunking_strategy": "{not json"}, "chunking_strategy", "invalid_value"),
    ({"chunking_strategy": "auto", "chunking_strategy[type]": "server_vad"}, "chunking_strategy", None),
])
def test_a_bad_server_vad_names_its_field(media, data, param, code):
    error(_transcribe(media, {"file": ("a.wav", WAV)}, data), 400, param, code)


def test_concurrent_transcriptions_share_the_models_decodes(media):
    """Four transcriptions sent at once through the SDK, one of them streamed, while a decode is
    held running (the worker's lane marked as led, so that on a loaded machine none comes after
    the decode it could share): once let go, the worker decodes all four in one ``generate``,
    and each answer is what it is alone."""
    import asyncio

    sync = client(media)
    clips = [tone_file(1.0 + n, 16000, 1, "WAV") for n in range(4)]
    ask = dict(model="tiny-stt", language="en", temperature=0)
    alone = [sync.audio.transcriptions.create(file=("t.wav", wav, "audio/wav"), **ask).text for wav in clips]
    worker = media.services.arbiter.workers["tiny-stt"]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=media.base_url, api_key=media.keys["paid"], max_retries=0) as c:
            async def streamed(wav: bytes) -> str:
                events = [e async for e in await c.audio.transcriptions.create(file=("t.wav", wav, "audio/wav"), stream=True, **ask)]
                return events[-1].text

            with worker.shared.held():
                calls = [asyncio.ensure_future(c.audio.transcriptions.create(file=("t.wav", wav, "audio/wav"), **ask))
                         for wav in clips[:3]] + [asyncio.ensure_future(streamed(clips[3]))]
                deadline = time.monotonic() + 60
                while len(worker.shared.interactive.queued()) < 4:
                    assert time.monotonic() < deadline, "the four requests did not all reach the worker"
                    await asyncio.sleep(0.01)
            done = await asyncio.gather(*calls)
            return [t.text for t in done[:3]] + [done[3]]

    before = worker.decodes
    got = asyncio.run(together())
    assert got == alone
    assert worker.decodes - before == 1, worker.decodes - before


def test_a_streamed_transcription_sends_the_text_as_it_is_decoded(media):
    """``stream: true`` through the SDK: ``transcript.text.delta`` events whose pieces join to
    the ``transcript.text.done`` text, the same text as the unstreamed answer (greedy); a request
    refused before any text is an HTTP error, not an event."""
    c = client(media)
    wav = tone_file(3.0, 16000, 1, "WAV")
    ask = dict(model="tiny-stt", file=("tone.wav", wav, "audio/wav"), language="en", temperature=0)
    plain = c.audio.transcriptions.create(**ask)
    worker = media.services.arbiter.workers["tiny-stt"]
    worker.stream_every_s = 0.0  # the text read at every token (the demo decodes a window in ~20 ms)
    try:
        events = list(c.audio.transcriptions.create(**ask, stream=True))
    finally:
        del worker.stream_every_s  # the class's default again
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert len(deltas) >= 2 and len(events) == len(deltas) + 1  # more than one piece: streamed as decoded
    assert done.type == "transcript.text.done" and "".join(deltas) == done.text == plain.text
    assert (done.usage.type, done.usage.model_extra["seconds"]) == ("duration", 3)
    assert c.audio.transcriptions.create(**ask, stream=True, response_format="text") is not None
    error(_transcribe(media, {"file": ("a.wav", WAV)}, {"stream": "true", "language": "klingon"}), 400, "language", None)
    error(_transcribe(media, {"file": ("a.wav", WAV)}, {"stream": "true", "response_format": "srt"}), 400,
          "response_format", None)
    error(_transcribe(media, {"file": ("a.wav", WAV)}, {"stream": "maybe"}), 400, "stream", None)
    r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media), files={"file": ("a.wav", WAV)},
                   data={"model": "tiny-stt", "stream": "true"})
    error(r, 400, "stream", "unknown_parameter")  # translations do not stream (OpenAI's have no such field)


def test_leaving_a_streamed_transcription_stops_the_decoding_and_frees_the_slot(media):
    c = client(media)
    wav = tone_file(3.0, 16000, 1, "WAV")
    c.audio.transcriptions.create(model="tiny-stt", file=("w.wav", wav, "audio/wav"), language="en")  # loaded
    worker = media.services.arbiter.workers["tiny-stt"]
    decoder = worker.model.get_decoder()
    with _Counter(decoder) as full:  # counting from before the request: it may decode before create() returns
        list(c.audio.transcriptions.create(model="tiny-stt", file=("w.wav", wav, "audio/wav"), language="en",
                                           stream=True))
    slow = decoder.register_forward_pre_hook(lambda *_: time.sleep(0.05))  # a token every 50 ms
    try:
        with _Counter(decoder) as decoded:
            at_release, after = _leave_at_first_event(
                media, "/audio/transcriptions", "transcript.text.delta", decoded,
                files={"file": ("w.wav", wav)}, data={"model": "tiny-stt", "language": "en", "stream": "true"})
    finally:
        slow.remove()
    print(f"transcription: {full.n} decoder calls in all; {at_release} by release after the client left, {after} after 0.3 s")
    assert after == at_release and at_release < full.n - 5  # stopped at the next token, not at the window's end


def test_translation_through_the_sdk(media):
    """``/v1/audio/translations`` with the SDK: English text in OpenAI's shapes (the verbose one says
    ``task: translate`` and ``language: english`` whatever was spoken); no ``language`` field."""
    c = client(media)
    wav = tone_file(2.0, 16000, 1, "WAV")
    plain = c.audio.translations.create(model="tiny-stt", file=("tone.wav", wav, "audio/wav"), temperature=0)
    assert isinstance(plain.text, str) and plain.text
    verbose = c.audio.translations.create(model="tiny-stt", file=("tone.wav", wav, "audio/wav"),
                                          response_format="verbose_json", temperature=0)
    assert verbose.language == "english" and verbose.text == plain.text and verbose.segments
    assert verbose.model_extra["task"] == "translate" and verbose.duration == pytest.approx(2.0, abs=0.01)
    assert c.audio.translations.create(model="tiny-stt", file=("tone.wav", wav, "audio/wav"),
                                       response_format="text", temperature=0) == plain.text
    r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media), files={"file": ("a.wav", WAV)},
                   data={"model": "tiny-stt", "language": "fr"})
    error(r, 400, "language", "unknown_parameter")
    r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media), files={"file": ("a.wav", WAV)},
                   data={"model": "tiny-tts"})
    error(r, 400, "model", "model_not_supported")
    r = httpx.post(f"{media.base_url}/audio/translations", headers=auth(media),
                   files={"file": (None, "not a file part")}, data={"model": "tiny-stt"})
    error(r, 400, "file", "invalid_value")  # a text field named file, as for transcriptions


@pytest.mark.parametrize("fmt,rate,channels,seconds", [("FLAC", 22050, 1, 2.5), ("OGG", 48000, 2, 1.5)])
def test_transcription_decodes_flac_and_ogg_at_any_rate(media, fmt, rate, channels, seconds):
    data = tone_file(seconds, rate, channels, fmt)
    r = httpx.post(f"{media.base_url}/audio/transcriptions", headers=auth(media),
                   files={"file": (f"tone.{fmt.lower()}", data)},
                   data={"model": "tiny-stt", "response_format": "verbose_json", "language": "en"})
    assert r.status_code == 200, r.text
    assert r.json()["duration"] == pytest.approx(seconds, abs=0.01)


def _transcribe(server, files=None, data=None, **kw) -> httpx.Response:
    fields = {"model": "tiny-stt", **(data or {})}
    return httpx.post(f"{server.base_url}/audio/transcriptions", headers=auth(server), files=files,
                      data=fields, **kw)


WAV = tone_file(1.0, 16000, 1, "WAV")


def wav_claiming(rate: int, samples: int = 100) -> bytes:
    """A 16-bit mono WAV of ``samples`` samples whose header says ``rate`` (any number, as a hand-made
    file can)."""
    data = np.full(samples, 1000, "<i2").tobytes()
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    return (struct.pack("<4sI4s", b"RIFF", 36 + len(data), b"WAVE") + fmt
            + struct.pack("<4sI", b"data", len(data)) + data)


@pytest.mark.parametrize("endpoint", ["transcriptions", "translations"])
@pytest.mark.parametrize("rate", [2**31 - 1, 999])
def test_an_upload_claiming_a_rate_no_audio_has_is_refused_before_it_is_resampled(media, endpoint, rate):
    """The sample rate is the file's header's word: one outside 1 kHz..384 kHz is a 400 ``invalid_file``
    saying so (2**31-1 Hz was a 500, the resampling filter of 320 GiB; 4,000,037 Hz took 30 s and
    GBs; 999 Hz was resampled 16-fold). 1 kHz and 384 kHz are taken."""
    r = httpx.post(f"{media.base_url}/audio/{endpoint}", headers=auth(media), data={"model": "tiny-stt"},
                   files={"file": ("odd.wav", wav_claiming(rate))})
    assert f"{rate} Hz" in error(r, 400, "file", "invalid_file")["message"]
    for taken in (1_000, 384_000):
        r = httpx.post(f"{media.base_url}/audio/{endpoint}", headers=auth(media),
                       data={"model": "tiny-stt", "response_format": "verbose_json"},
                       files={"file": ("ok.wav", wav_claiming(taken, taken // 10))})
        assert r.status_code == 200 and r.json()["duration"] == pytest.approx(0.1, abs=0.001), r.text


@pytest.mark.parametrize("files,data,status,param,code", [
    ({"file": ("a.wav", b"this is not audio at all")}, {}, 400, "file", "invalid_file"),
    ({"file": ("a.wav", WAV[:30])}, {}, 400, "file", "invalid_file"),  # a cut-off header
    ({"file": ("a.wav", b"")}, {}, 400, "file", "invalid_file"),
    ({"file": ("long.wav", tone_file(25.0, 8000, 1, "WAV"))}, {}, 400, "file", "audio_too_long"),
    ({"file": ("big.wav", tone_file(40.0, 16000, 1, "WAV"))}, {}, 413, "file", "request_too_large"),
    ({"file": ("a.wav", WAV)}, {"response_format": "mp3"}, 400, "response_format", None),
    ({"file": ("a.wav", WAV)}, {"temperature": "2"}, 400, "temperature", None),
    ({"file": ("a.wav", WAV)}, {"language": "klingon"}, 400, "language", None),
    ({"file": ("a.wav", WAV)}, {"prompt": "p" * 201}, 400, "prompt", None),
    ({"file": ("a.wav", WAV)}, {"timestamp_granularities[]": "char"}, 400, "timestamp_granularities[0]", None),
    ({"file": ("a.wav", WAV)}, {"timestamp_granularities[]": "word"}, 400, "timestamp_granularities", None),  # json
    ({"file": ("a.wav", WAV)}, {"include[]": "segments"}, 400, "include[0]", "invalid_value"),
    ({"file": ("a.wav", WAV)}, {"chunking_strategy": "semantic"}, 400, "chunking_strategy", "invalid_value"),
    ({"file": ("a.wav", WAV)}, {"model": "tiny-tts"}, 400, "model", "model_not_supported"),
    ({"file": (None, "not a file part")}, {}, 400, "file", "invalid_value"),  # a text field named file
    ({"language": (None, "en")}, {}, 400, "file", "missing_required_parameter"),  # multipart, no file
    ({"file": ("a.wav", WAV)}, {"bogus": "1"}, 400, "bogus", "unknown_parameter"),
])
def test_bad_transcription_requests_name_the_param(media, files, data, status, param, code):
    err = error(_transcribe(media, files, data), status, param, code)
    assert " at 0x" not in err["message"]  # libsndfile's reason, without the repr of our buffer


def test_a_refused_transcription_or_speech_is_not_usage(media, monkeypatch):
    """A request refused with a 400 is not usage (docs/ACCOUNTS.md) and spends none of its key's
    minute limits: a 15 s file in a language the model does not know and speech with nothing the
    model can say, both checked from the model's folder before the slot (no request is served: none
    in /metrics), and past that check the worker's own refusal in the slot is not metered either.
    They were metered a request each and the file's seconds, so a key's next valid 15 s file against
    ``audio_seconds_per_min: 20`` was a 429."""
    import gateway.audio

    def served() -> float:  # paid-tier speech and transcription requests that held a slot
        found = re.findall(r'^tiergate_request_seconds_count\{(?=[^}]*tier="paid")(?=[^}]*endpoint="(?:speech|'
                           r'transcriptions)")[^}]*\} (\S+)$', httpx.get(f"{media.url}/metrics").text, re.M)
        return sum(map(float, found))

    admin = {"Authorization": f"Bearer {media.keys['admin']}"}
    made = httpx.post(f"{media.url}/admin/keys", headers=admin,
                      json={"name": "refused", "tier": "paid", "limits": {"audio_seconds_per_min": 20}})
    assert made.status_code == 201, made.text
    key = {"Authorization": f"Bearer {made.json()['value']}"}
    fifteen = tone_file(15.0, 16000, 1, "WAV")

    def transcribe(language: str) -> httpx.Response:
        return httpx.post(f"{media.base_url}/audio/transcriptions", headers=key, timeout=60,
                          data={"model": "tiny-stt", "language": language}, files={"file": ("a.wav", fifteen)})

    before = served()
    error(transcribe("xx"), 400, "language", "invalid_value")
    error(httpx.post(f"{media.base_url}/audio/speech", headers=key, timeout=60,
                     json={"model": "tiny-tts", "voice": "alloy", "input": "😀 🎉"}), 400, "input")
    assert served() == before
    with monkeypatch.context() as patched:  # as if the gateway had not known: the worker refuses it in the slot

        async def unchecked(svc, job) -> None:
            return None

        patched.setattr(gateway.audio, "check_transcription", unchecked)
        error(transcribe("xx"), 400, "language", "invalid_value")
    assert httpx.get(f"{media.base_url}/usage", headers=key).json()["data"] == []
    assert transcribe("en").status_code == 200
    row = httpx.get(f"{media.base_url}/usage", headers=key).json()["data"][0]
    assert (row["requests"], row["audio_in_seconds"]) == (1, 15.0)


def test_transcription_needs_multipart(media):
    r = httpx.post(f"{media.base_url}/audio/transcriptions", headers=auth(media),
                   json={"model": "tiny-stt", "file": base64.b64encode(WAV).decode()})
    err = error(r, 415, None, "unsupported_media_type")
    assert "multipart/form-data" in err["message"]


def test_transcription_upload_without_length_is_capped(media):
    boundary = "b0undary"
    big = tone_file(40.0, 16000, 1, "WAV")

    def body():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny-stt\r\n"
               f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
               "Content-Type: audio/wav\r\n\r\n").encode()
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
        yield f"\r\n--{boundary}--\r\n".encode()

    r = httpx.post(f"{media.base_url}/audio/transcriptions", content=body(),
                   headers={**auth(media), "content-type": f"multipart/form-data; boundary={boundary}"})
    assert "content-length" not in r.request.headers  # chunked: only the streamed count can stop it
    error(r, 413, "file", "request_too_large")


CUT_UPLOADS = {  # path: (text fields, the file part), each a whole upload the server takes
    "/audio/transcriptions": ({"model": "tiny-stt"}, {"file": ("a.wav", WAV, "audio/wav")}),
    "/images/edits": ({"model": "tiny-image", "prompt": "a cat"}, {"image": ("a.png", SRC, "image/png")}),
    "/files": ({"purpose": "batch"}, {"file": ("in.jsonl", b'{"custom_id": "a"}\n' * 2000, "application/jsonl")}),
}


@pytest.mark.parametrize("path", list(CUT_UPLOADS))
def test_an_upload_cut_short_is_a_malformed_body_and_a_whole_one_in_small_chunks_is_not(media, path):
    """A body that ends before its closing boundary (a client cut off with its Content-Length
    honest about what it sent) is a 400 ``invalid_multipart`` saying so: Starlette's parser keeps
    the parts that ended and says nothing, so the answer was "missing required parameter" for the
    part that was cut. The same body whole, sent in 7-byte chunks, is taken (how the server's
    reads join them depends on the packets; the next test splits the boundary deterministically)."""
    data, files = CUT_UPLOADS[path]
    whole = httpx.Request("POST", f"{media.base_url}{path}", data=data, files=files)
    body, headers = whole.read(), {**auth(media), "content-type": whole.headers["content-type"]}
    end = body.rindex(b"--\r\n")  # the closing boundary's end
    for cut in (body[:end], body[:len(body) // 2]):  # no closing "--", and half the file
        err = error(httpx.post(f"{media.base_url}{path}", content=cut, headers=headers, timeout=60), 400, None,
                    "invalid_multipart")
        assert "closing boundary" in err["message"], err

    def chunks():
        for i in range(0, len(body), 7):
            yield body[i:i + 7]

    r = httpx.post(f"{media.base_url}{path}", content=chunks(), headers=headers, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("size", [1, 2, 7, 13])
def test_the_closing_boundary_is_seen_across_any_chunk_edges(size):
    """``Multipart`` reads the body as it streams: the closing boundary split over chunks of any
    size (each offset of it at a chunk edge, for 1, 2, 7 and 13 bytes) is seen, and the body
    without it is refused. Deterministic, where over HTTP the server's reads join the chunks as
    the packets come."""
    import asyncio

    from starlette.requests import Request

    from gateway.errors import APIError
    from gateway.multipart import Multipart

    made = httpx.Request("POST", "http://t/", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 50)})
    body, kind = made.read(), made.headers["content-type"]

    def parsed(content: bytes):
        pieces = [content[i:i + size] for i in range(0, len(content), size)]

        async def receive():
            return {"type": "http.request", "body": pieces.pop(0), "more_body": bool(pieces)} if pieces \
                else {"type": "http.disconnect"}

        async def read():
            request = Request({"type": "http", "method": "POST", "headers": [(b"content-type", kind.encode())]}, receive)
            async with Multipart(request, 1000, "a file", "file", max_fields=8) as form:
                return form["purpose"], await form["file"].read()

        return asyncio.run(read())

    assert parsed(body) == ("batch", b"x" * 50)
    with pytest.raises(APIError) as cut:
        parsed(body[:body.rindex(b"--\r\n")])
    assert cut.value.code == "invalid_multipart" and "closing boundary" in cut.value.message


# ---------------------------------------------------------------- the client leaves


def _raw_post(server: RunningServer, path: str, body: dict) -> socket.socket:
    """A POST on a raw socket, so the test decides exactly when the connection goes away."""
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (f"POST /v1{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.keys['paid']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _idle(server: RunningServer, model: str) -> bool:
    def check() -> bool:
        state = server.services.arbiter.states[model]
        return server.services.gate.inflight["paid"] == 0 and state.running_nonbatch == 0

    return server.call(check)


class _Counter:
    """Counts forward calls of a torch module (a hook, removed on exit)."""

    def __init__(self, module) -> None:
        self.n = 0
        self._handle = module.register_forward_hook(self._hit)

    def _hit(self, *_) -> None:
        self.n += 1

    def __enter__(self) -> "_Counter":
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def test_leaving_mid_image_stops_the_denoising_and_frees_the_slot(media, record_property):
    c = client(media)
    c.images.generate(model="tiny-image", prompt="warm up", size="32x32", extra_body={"num_inference_steps": 1})
    worker = media.services.arbiter.workers["tiny-image"]
    asked = 400
    with _Counter(worker.pipe.unet) as steps:  # one UNet call per denoising step
        sock = _raw_post(media, "/images/generations", {**IMAGE, "size": "64x64", "num_inference_steps": asked})
        _wait(lambda: steps.n >= 3)
        started = time.monotonic()
        assert httpx.get(f"{media.url}/healthz").status_code == 200  # the loop is free while it denoises
        assert time.monotonic() - started < 1.0 and steps.n < asked
        sock.close()
        _wait(lambda: _idle(media, "tiny-image"), timeout=10)
        at_release = steps.n
        time.sleep(0.3)
        after = steps.n
    record_property("image_steps", f"asked {asked}, ran {at_release} by release, {after} after")
    print(f"image: asked {asked} steps, {at_release} ran before the slot was released, {after} after 0.3 s")
    assert after == at_release  # the worker had stopped before the slot was released
    assert at_release < asked // 10
    r = c.images.generate(model="tiny-image", prompt="after", size="32x32", extra_body={"num_inference_steps": 1})
    assert len(r.data) == 1
    metrics = httpx.get(f"{media.url}/metrics").text
    assert 'tiergate_in_flight{tier="paid"} 0.0' in metrics


def test_leaving_mid_speech_stops_the_sentences_and_frees_the_slot(media):
    c = client(media)
    c.audio.speech.create(model="tiny-tts", input="warm up.", voice="alloy", response_format="wav")
    worker = media.services.arbiter.workers["tiny-tts"]
    sentences = 300
    text = " ".join(f"this is sentence number {i}." for i in range(sentences))
    with _Counter(worker.model) as spoken:  # one model call per sentence
        sock = _raw_post(media, "/audio/speech", {**SPEECH, "input": text})
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < 200:
            received += sock.recv(65536)
        at_first_audio = spoken.n
        sock.close()
        _wait(lambda: _idle(media, "tiny-tts"), timeout=10)
        at_release = spoken.n
        time.sleep(0.3)
        after = spoken.n
    print(f"speech: {sentences} sentences; first audio after {at_first_audio}, "
          f"{at_release} spoken by release, {after} after 0.3 s")
    assert received.startswith(b"HTTP/1.1 200") and b"audio/wav" in received
    assert at_first_audio < sentences // 2  # streamed: audio arrived long before the text was all spoken
    assert after == at_release and at_release < sentences // 2
    out = c.audio.speech.create(model="tiny-tts", input="after.", voice="alloy", response_format="wav")
    assert len(out.content) > 44
